"""What the sidecar tells its operator: Prometheus collectors (``metrics``), the JSON log set-up
(``logs``) and OpenTelemetry tracing (``tracing``; the SDK-backed ``otel`` only with the extra)."""
