"""``python -m bench.nixl_release [--tp N] [--version X] [--seconds S]``: the ``nixl`` strategy's
release latency (warm and cold) and throughput against real NIXL agents on loopback; ``run`` holds
the bench and P's child process (``python -m bench.nixl_release --serve-p``).
"""
