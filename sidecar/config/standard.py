"""Settings that also come from variables other programs read: TLS trust and OpenTelemetry's.

llm-d's sidecar (Go's ``crypto/x509``) reads ``SSL_CERT_FILE`` and
``SSL_CERT_DIR``, OpenTelemetry SDKs ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, and deployments set them for it (KServe's
LLMInferenceService sets ``SSL_CERT_DIR``). ``sidecar.config.settings`` reads
them with the other sources: below the ``KVR_*`` variables, above the TOML file.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import unquote

# Setting -> the variable that sets it when its KVR_* variable and flag do not.
STANDARD_ENV = {
    "ssl_cert_file": "SSL_CERT_FILE",
    "ssl_cert_dir": "SSL_CERT_DIR",
    "trace_service_name": "OTEL_SERVICE_NAME",
    "trace_resource_attributes": "OTEL_RESOURCE_ATTRIBUTES",
}
# Lists of paths, split at colons as SSL_CERT_DIR and PATH are (a path may hold a comma).
PATH_LISTS = frozenset({"ssl_cert_dir"})


def standard_env(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The settings ``STANDARD_ENV``'s variables give (field -> value, variable); an empty one is
    unset. OTEL_SERVICE_NAME wins over a ``service.name`` in OTEL_RESOURCE_ATTRIBUTES, as the
    OpenTelemetry specification has it."""
    found = {
        name: (environ[variable], variable)
        for name, variable in STANDARD_ENV.items()
        if environ.get(variable, "").strip()
    }
    if "trace_service_name" not in found and "trace_resource_attributes" in found:
        for item in found["trace_resource_attributes"][0].split(","):
            key, _, value = item.partition("=")
            if key.strip() == "service.name" and value.strip():
                found["trace_service_name"] = (unquote(value.strip()), "OTEL_RESOURCE_ATTRIBUTES")
    return found
