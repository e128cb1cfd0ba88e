"""``python -m bench.tracing [--quick] [--json PATH]``: what OpenTelemetry tracing costs the sidecar,
off and on, beside the direct path; ``run`` holds the phases and the local OTLP sink
(``python -m bench.tracing --sink PORT``).
"""
