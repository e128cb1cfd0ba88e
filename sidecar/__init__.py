"""kv-release-sidecar: frees a vLLM prefill node's KV blocks when its decode node rejects."""

__version__ = "0.1.0"
