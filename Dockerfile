# syntax=docker/dockerfile:1
# Build stage: resolve the locked environment without torch (nixl-cu12 declares it, never imports it).
FROM python:3.11-slim AS build
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /app
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project
COPY sidecar ./sidecar
RUN uv sync --frozen --no-dev

# Runtime stage: no compilers, no torch, a numeric non-root user.
FROM python:3.11-slim
COPY --from=build /app /app
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000 9100
HEALTHCHECK --interval=10s --timeout=2s --retries=3 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:9100/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["kv-release-sidecar", "serve"]
