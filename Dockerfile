# syntax=docker/dockerfile:1
# kv-release-sidecar: `make image`. Two images from one file:
#   docker build .                    the sidecar (the default, last stage): core + the nixl, llm-d and otel extras
#   docker build --target loadtest .  the load generator Job: core + the loadtest extra
# Build stages resolve the locked environment with uv; each runtime image receives only its virtual
# environment (no uv, no compilers, no torch) and runs as a numeric non-root user. All stages start
# from the same base image, so the venv's interpreter link (/usr/local/bin/python3.11) stays valid.

FROM python:3.11-slim-bookworm AS build
# The extras of the sidecar image, separated by spaces: nixl (releases over NIXL), llm-d (the
# InferencePool watch, the self-signed certificate, llm-d's YAML configuration) and otel
# (OpenTelemetry tracing: serve's otlp_traces_endpoint, llm-d's --tracing). Everything llm-d's
# flags need is in by default; `--build-arg EXTRAS="nixl llm-d"` leaves tracing out.
ARG EXTRAS="nixl llm-d otel"
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/opt/venv
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /src
COPY pyproject.toml uv.lock README.md ./
# Dependencies first, cached while only the source changes. nixl-cu12 declares torch but never
# imports it; pyproject's [tool.uv] override-dependencies keeps it out of uv.lock, and --frozen
# installs exactly the lock. $EXTRAS is left unquoted on purpose: one --extra per word.
# hadolint ignore=SC2046
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-project $(printf -- '--extra %s ' $EXTRAS)
COPY sidecar ./sidecar
# hadolint ignore=SC2046
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable $(printf -- '--extra %s ' $EXTRAS)
# nixl-cu12's wheel also carries nixl_ep_cu12: 104 MB of extension modules built against torch,
# which cannot be imported without it and which nothing here imports. Removed with its lines in
# the wheel's RECORD, so the installed metadata still lists exactly what is on disk.
RUN rm -rf /opt/venv/lib/python3.11/site-packages/nixl_ep_cu12 \
 && for record in /opt/venv/lib/python3.11/site-packages/nixl_cu12-*.dist-info/RECORD; do \
      if [ -f "$record" ]; then sed -i '/^nixl_ep_cu12\//d' "$record"; fi; \
    done
# What the image was built with, for the one-line error that names the build argument when a
# command needs an extra that is not in (sidecar/extras.py, IMAGE_MARKER).
RUN echo "$EXTRAS" > /opt/venv/kv-release-sidecar-extras
# Fail the build, not the pod: no torch, no torch extension, no plotting or load-generator
# stack, and, with the nixl extra, NIXL with its bundled UCX makes an agent.
RUN /opt/venv/bin/python -c "import importlib.util as u, sys; sys.exit([m for m in ('torch', 'nixl_ep_cu12', 'matplotlib', 'aiohttp') if u.find_spec(m)] or 0)" \
 && case " $EXTRAS " in \
      *" nixl "*) /opt/venv/bin/python -c "from nixl_cu12._api import nixl_agent as a, nixl_agent_config as c; a('image-check', c(backends=['UCX']))" ;; \
    esac

FROM build AS build-loadtest
# The same venv re-synced to core + loadtest: uv sync removes NIXL and adds aiohttp and matplotlib.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --extra loadtest \
 && echo loadtest > /opt/venv/kv-release-sidecar-extras
RUN /opt/venv/bin/python -c "import importlib.util as u, sys; sys.exit([m for m in ('torch', 'nixl_cu12') if u.find_spec(m)] or 0)"

FROM python:3.11-slim-bookworm AS runtime
# What both runtime images share. A passwd entry for the numeric user, so UCX and getpass can
# name it; no home, no shell.
RUN groupadd --gid 10001 kvr \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvr
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

FROM runtime AS loadtest
LABEL org.opencontainers.image.title="kv-release-loadtest" \
      org.opencontainers.image.description="kv-release-sidecar loadtest: P/D load with a release verdict." \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build-loadtest /opt/venv /opt/venv
# matplotlib's cache, on the Job's writable /tmp (the root filesystem is read-only).
ENV MPLCONFIGDIR=/tmp/matplotlib
USER 10001:10001
ENTRYPOINT ["kv-release-sidecar", "loadtest"]

FROM runtime AS sidecar
LABEL org.opencontainers.image.title="kv-release-sidecar" \
      org.opencontainers.image.description="Releases a vLLM prefill node's pinned KV blocks when the decode node rejects a P/D request." \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
# KServe's LLMInferenceService runs llm-d's sidecar as `command: ["/app/pd-sidecar", ...]`.
RUN mkdir /app && ln -s /opt/venv/bin/pd-sidecar /app/pd-sidecar
USER 10001:10001
# The proxy port and the admin port (/healthz, /readyz, /metrics): Config.port, Config.admin_port.
EXPOSE 8000 9100
# Docker only (Kubernetes ignores it and uses the probes in deploy/). Follows KVR_ADMIN_PORT.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVR_ADMIN_PORT', '9100') + '/healthz', timeout=2)"]
ENTRYPOINT ["kv-release-sidecar", "serve"]
