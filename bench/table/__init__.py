"""``python -m bench.table [--against FILE] [--requests N] [--rounds N]``: what the workers' shared
table costs a request beside one process's tables and another implementation's; ``run`` holds it.
"""
