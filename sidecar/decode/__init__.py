"""D as the sidecar knows it: one ``DecodeState`` per D (``state``: engine alive, shutting down,
KV connector, vLLM release), kept by one-shot reads of D's own endpoints (``probes``) on the
upstream client."""
