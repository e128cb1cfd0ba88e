# syntax=docker/dockerfile:1
# kv-release-sidecar: `make image`. The build stage resolves the locked environment with uv;
# the runtime stage receives only that virtual environment (no uv, no compilers, no torch)
# and runs as a numeric non-root user. Both stages use the same base image, so the venv's
# interpreter link (/usr/local/bin/python3.11) is valid in the runtime stage.

FROM python:3.11-slim-bookworm AS build
# Optional extras: `docker build --build-arg EXTRAS=otel .` adds OpenTelemetry tracing
# (docs/operations.md, "Tracing"). Empty by default: the default image is unchanged.
ARG EXTRAS=""
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/opt/venv
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /src
COPY pyproject.toml uv.lock README.md ./
# Dependencies first, cached while only the source changes. nixl-cu12 declares torch but never
# imports it; pyproject's [tool.uv] override-dependencies keeps it out of uv.lock, and --frozen
# installs exactly the lock.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-project ${EXTRAS:+--extra "$EXTRAS"}
COPY sidecar ./sidecar
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable ${EXTRAS:+--extra "$EXTRAS"}
# Fail the build, not the pod: no torch, and NIXL with its bundled UCX makes an agent.
RUN /opt/venv/bin/python -c "import importlib.util as u, sys; sys.exit('torch is in the image' if u.find_spec('torch') else 0)" \
 && /opt/venv/bin/python -c "from nixl_cu12._api import nixl_agent as a, nixl_agent_config as c; a('image-check', c(backends=['UCX']))"

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="kv-release-sidecar" \
      org.opencontainers.image.description="Releases a vLLM prefill node's pinned KV blocks when the decode node rejects a P/D request." \
      org.opencontainers.image.licenses="Apache-2.0"
# A passwd entry for the numeric user, so UCX and getpass can name it; no home, no shell.
RUN groupadd --gid 10001 kvr \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvr
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# The proxy port and the admin port (/healthz, /readyz, /metrics): Config.port, Config.admin_port.
EXPOSE 8000 9100
# Docker only (Kubernetes ignores it and uses the probes in deploy/). Follows KVR_ADMIN_PORT.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVR_ADMIN_PORT', '9100') + '/healthz', timeout=2)"]
ENTRYPOINT ["kv-release-sidecar", "serve"]
