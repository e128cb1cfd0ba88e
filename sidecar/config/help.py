"""The ``--help`` line of every ``serve`` setting: what it does and its unit.

``sidecar.config.build_parser`` adds the default and the ``KVR_*`` variable.
"""

from __future__ import annotations

# The --help line of every field: (what it does, its unit or "" for text, choices and switches).
# build_parser adds the default and the KVR_* variable. A field without a line here, or a number
# without a unit, fails tests/unit/test_config_help.py: add the line with the field.
HELP: dict[str, tuple[str, str]] = {
    "host": ("address the proxy port listens on", ""),
    "port": ("proxy port: clients and routers send requests here", "TCP port; 0 picks a free one"),
    "admin_host": ("address the admin port listens on", ""),
    "admin_port": ("admin port: /healthz, /readyz and /metrics", "TCP port"),
    "decode_url": ("vLLM decode server (D) as scheme://host:port, without a path", "URL"),
    "max_body_bytes": ("largest inspected request body; above it: 413, released if trusted", "bytes"),
    "connect_timeout": (
        "connecting to D; a failure is answered 503 (released if 503 is not retried)",
        "seconds",
    ),
    "pool_timeout": (
        "waiting for a free connection to D; a failure is answered 503 (released if 503 is not retried)",
        "seconds",
    ),
    "header_timeout": ("D's response headers (non-streaming answers send them at the end)", "seconds"),
    "read_timeout": ("largest gap between two body chunks from D; 0 disables", "seconds"),
    "pool_size": ("connections to D at most", "connections"),
    "release": ("what happens when D rejects a P/D request: off, dry-run, nixl, http or auto", ""),
    "dry_run": (
        "with --release nixl, http or auto: decide and check each release as that strategy would, "
        "and send nothing (result would_send)",
        "",
    ),
    "release_queue_size": ("release jobs waiting at most; the oldest is dropped when full", "jobs"),
    "release_workers": ("release jobs running at once", "jobs"),
    "release_deadline": ("give up a release after this (P's lease frees the blocks then)", "seconds"),
    "release_retry_initial": ("first retry delay of a failed release, doubled each time", "seconds"),
    "release_retry_max": ("largest retry delay of a failed release", "seconds"),
    "release_target_share": (
        "share of release_workers one target (a P side channel, D's control endpoint) may use at once",
        "fraction, above 0 up to 1",
    ),
    "release_target_failures": (
        "consecutive connect failures that open a target's breaker (its jobs wait, no attempt)",
        "failures",
    ),
    "ledger_size": ("released requests remembered to refuse replays and duplicates", "entries"),
    "ledger_ttl": ("how long a released request is remembered", "seconds"),
    "release_ambiguous": (
        "also release when D may have admitted the request (timeouts, resets, a stream's 5xx event), "
        "unless its status is in retried_statuses",
        "",
    ),
    "retried_statuses": (
        "statuses a gateway or mesh in front of the decode pods may retry on another pod: answers "
        "with them are never released behind (that pod reads P's blocks); none when nothing retries",
        "comma-separated list of HTTP statuses, 4xx, 5xx or none",
    ),
    "shutdown_delay": ("after SIGTERM, keep serving this long with /readyz at 503", "seconds"),
    "drain_timeout": ("after that, wait this long for requests in flight", "seconds"),
    "flush_timeout": ("then wait this long for queued releases", "seconds"),
    "vllm_version": ("P's vLLM release (the side-channel wire format); empty: read D's /version", ""),
    "prefill_allow": (
        "P endpoints releases may reach: CIDR, IP or name, :port or :lo-hi; if empty, prefill_allow_default",
        "comma-separated list",
    ),
    "prefill_allow_default": (
        "with prefill_allow empty and no inference_pool: none (no P) or routable (any P address but "
        "loopback, link-local, cloud metadata, unspecified, multicast)",
        "",
    ),
    "handshake_timeout": ("one side-channel handshake with P (nixl)", "seconds"),
    "handshake_cache_size": ("P engines whose handshake is kept (nixl)", "engines"),
    "handshake_cache_ttl": ("how long a P engine's handshake is kept (nixl)", "seconds"),
    "allow_unsafe_vllm": ("release to vLLM 0.9.x/0.10.0 (a late notification can crash their P engine)", ""),
    "unknown_vllm": (
        "a vLLM newer than every known release: newest (release with the newest known wire, once P's "
        "handshake reply decodes under it) or refuse (nixl refuses its releases)",
        "",
    ),
    "log_level": ("log level: debug, info, warning or error", ""),
    "access_log": ("log one line per request answered on the proxy port (logger uvicorn.access)", ""),
    "log_format": ("log format: json (one object per line) or text", ""),
    "control_url": ("vLLM plugin's control endpoint; empty: decode-url + /kv_release/v1/release", "URL"),
    "control_token": ("control endpoint's bearer token; prefer the file or variable (ps shows flags)", ""),
    "control_token_file": ("file holding the control endpoint's bearer token", "path"),
    "control_timeout": ("one request to the control endpoint", "seconds"),
    "auto_probe_interval": ("auto: how often D's control endpoint is probed", "seconds"),
    "decode_health_interval": (
        "how often D's /health is polled to know whether D can release P's blocks itself; "
        "0: never polled, /readyz asks D when read (D's state stays unknown between, so the "
        "sidecar also sends what D's engine would release)",
        "seconds",
    ),
    "decode_kv_connector": (
        "whether D runs a NIXL KV connector: auto (from D's /metrics), yes or no",
        "",
    ),
    "prefill": ("router mode: P servers for the prefill leg, scheme://host:port", "comma-separated list"),
    "prefill_policy": (
        "router mode: how P is picked: least-outstanding, round-robin, first (of a list) or random",
        "",
    ),
    "prefill_timeout": ("router mode: the prefill leg on P, to its answer", "seconds"),
    "prefill_answer_limit": (
        "router mode: largest answer P may give the prefill leg (prompt_logprobs grow it); above: 502",
        "bytes",
    ),
    "prefill_backoff": ("router mode: a failing P is skipped this long", "seconds"),
    "decode_only_fallback": ("router mode: with no P left (or n > 1), D prefills itself", ""),
    "decode_releases": ("router mode: decode-url is a sidecar (trust hmac) releasing D's answers", ""),
    "trust": ("which kv_transfer_params may trigger a release: any, token or hmac (docs/security.md)", ""),
    "trust_token": ("the router token for trust token; prefer the file", ""),
    "trust_token_file": ("file holding the router token", "path"),
    "trust_key": ("HMAC key shared with the router for trust hmac; prefer the file", ""),
    "trust_key_file": ("file holding the HMAC key", "path"),
    "release_client_params": (
        "sidecar mode: release the kv_transfer_params a client sends (off: forwarded, never released; "
        "pd-sidecar's default, docs/llm-d.md)",
        "",
    ),
    "inject_rate": ("load tests only: share of releasable requests rejected by the sidecar", "0 to 1"),
    "inject_seed": ("load tests only: seed of the injection, for reproducible runs", "integer"),
    "inject_statuses": ("load tests only: statuses injected", "comma-separated list of HTTP statuses"),
    "inject_routes": ("load tests only: routes injected; empty: all three", "comma-separated list"),
    "inject_header": ("load tests only: honour x-kvr-inject-reject: <status>", ""),
    "limit_concurrency": ("requests in flight on the proxy port; above it: 503; 0: unlimited", "requests"),
    "timeout_keep_alive": ("idle keep-alive connection closed after this", "seconds"),
    "max_header_bytes": ("request line and headers; above it: 431 and close", "bytes"),
    "client_header_timeout": ("a complete header block within this; else 408 and close", "seconds"),
    "client_body_timeout": ("largest gap between two reads of a request body; else 408", "seconds"),
    "otlp_traces_endpoint": ("OTLP/HTTP collector for traces (the otel extra); empty: tracing off", "URL"),
    "trace_sample_ratio": ("share of new traces sampled (a sampled traceparent is always kept)", "0 to 1"),
    "trace_service_name": ("service.name of the spans", ""),
    "trace_resource_attributes": (
        "more resource attributes of the spans, key=value (values percent-encoded, as OpenTelemetry's)",
        "comma-separated list",
    ),
    "may_cover_delay": (
        "wait before releasing a rejection D's engine may have released too (a 500 or 501 from D)",
        "seconds",
    ),
    "p_hold_seconds": ("P's hold of unreleased blocks (saved-time metric); 0: from P's release", "seconds"),
    "tls": ("serve TLS on the proxy port(s): tls_cert_dir's certificate, else a self-signed one", ""),
    "tls_cert_dir": ("directory with tls.crt and tls.key, reloaded when they change", "path"),
    "tls_min_version": ("oldest TLS version the proxy port accepts: 1.2 or 1.3", ""),
    "tls_ciphers": (
        "TLS 1.2 cipher suites by IANA name (TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, ...); "
        "TLS 1.3 names only: TLS 1.3 alone is served",
        "comma-separated list",
    ),
    "admin_tls_cert_dir": ("serve TLS on the admin port with this directory's tls.crt and tls.key", "path"),
    "tls_ca_file": ("CA bundle that verifies D and P over https, beside the system's store", "path"),
    "ssl_cert_file": ("a PEM file whose certificates verify D and P, beside the system's store", "path"),
    "ssl_cert_dir": (
        "folders whose every PEM file's certificates verify D and P (as Go reads SSL_CERT_DIR, "
        "not only OpenSSL's hashed names); missing folders and non-PEM files are skipped",
        "colon-separated list of paths",
    ),
    "decode_tls_insecure": ("do not verify D's certificate (an https decode_url)", ""),
    "prefill_tls": ("reach P named by x-prefiller-host-port over https", ""),
    "prefill_tls_insecure": ("do not verify P's certificate", ""),
    "data_parallel_size": (
        "data-parallel ranks: listeners on port..port+N-1, rank r forwarding to decode_url's port + r",
        "ranks",
    ),
    "workers": (
        "serving processes sharing the ports, the ledger and the admin port; auto: the CPU quota's cores",
        "processes, or auto",
    ),
    "pod_ip": (
        "this pod's address in x-data-parallel-host-port (POD_IP:port picks the rank on that port)",
        "",
    ),
    "inference_pool": (
        "namespace/name of the InferencePool whose pods are the allowed P hosts (watched)",
        "",
    ),
    "pool_group": ("API group of the InferencePool", ""),
    "pool_side_channel_ports": (
        "P side-channel ports releases may reach on the pool's pods",
        "port range lo-hi",
    ),
    "kube_service_account": ("where the pod's service-account token and CA are mounted", "path"),
    "prefill_max_retries": ("retries of a prefill leg answered 502, 503 or 504, on the same P", "retries"),
    "prefill_retry_backoff": ("wait between two prefill leg attempts", "seconds"),
    "prefill_leg": (
        "router mode's leg to a header-named P: nixlv2, skip (D alone prefills) or refuse (501)",
        "",
    ),
    "releases_off_for": (
        "why releases are off: kv_connector, ec_connector or moriio (set by pd-sidecar; needs release off)",
        "",
    ),
    "answers": ("the sidecar's own error answers: vllm or llm-d (llm-d's routing sidecar's)", ""),
}
