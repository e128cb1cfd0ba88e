# vLLM with the kv_release plugin (D's control endpoint, used by --release http and auto).
# Build it from the same vLLM release as every other P and D of the deployment, from the wheel
# of this checkout (never a package index: this image runs D as root on the GPU node):
#   uv build --wheel --out-dir dist
#   docker build -f deploy/vllm-plugin.Dockerfile -t registry.example.com/vllm-openai-kvr:v0.34.0 .
# (make image does both.)
# Enable the plugin in the decode container with VLLM_PLUGINS=kv_release (vLLM 0.26.0+; the
# variable lists every plugin vLLM may load, so name the others you use too) or, on any
# release, with the flag --middleware sidecar.vllm_plugin.KVReleaseMiddleware.
FROM vllm/vllm-openai:v0.34.0
# --no-deps: the plugin imports starlette, msgspec and sidecar.wire, all in this image or the
# wheel; pip must not replace the torch, NIXL or FastAPI this vLLM was built against.
COPY dist/kv_release_sidecar-0.1.0-py3-none-any.whl /tmp/
RUN pip install --no-cache-dir --no-deps /tmp/kv_release_sidecar-0.1.0-py3-none-any.whl \
    && rm /tmp/kv_release_sidecar-0.1.0-py3-none-any.whl
