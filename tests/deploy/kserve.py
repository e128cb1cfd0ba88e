"""KServe's routing sidecar as its LLMInferenceService templates run it: the command and the env.

The templates (tests/deploy/fixtures/llm-d/kserve, vendored from kserve/kserve)
hold Go template actions that KServe's controller renders per service:
``{{ if .GlobalConfig.EnableTLS }}A{{else}}B{{- end }}`` and
``{{ .GlobalConfig.InferencePoolNamespacedName }}``. ``render`` renders those
two forms and refuses any other, so a template that grows a new action fails
the tests that read it instead of being half-rendered. ``command`` and
``environment`` give the routing sidecar's exact command line and variables,
read from the fixture, never retyped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.manifests import ROOT

FIXTURE = ROOT / "tests" / "deploy" / "fixtures" / "llm-d" / "kserve"
TEMPLATES = ("config-llm-decode-template.yaml", "config-llm-decode-worker-data-parallel.yaml")
SIDECAR = "llm-d-routing-sidecar"  # KServe's name for the init container
CERT_DIR = "/var/run/kserve/tls"  # where KServe mounts its self-signed certificate's Secret

_IF = re.compile(
    r"\{\{-?\s*if\s+\.GlobalConfig\.EnableTLS\s*-?\}\}(.*?)"
    r"(?:\{\{-?\s*else\s*-?\}\}(.*?))?\{\{-?\s*end\s*-?\}\}"
)
_VALUE = re.compile(r"\{\{-?\s*\.GlobalConfig\.(\w+)\s*-?\}\}")


def render(text: str, enable_tls: bool, values: dict[str, str]) -> str:
    """``text`` with KServe's TLS conditionals and ``.GlobalConfig`` values rendered."""
    text = _IF.sub(lambda m: m.group(1) if enable_tls else (m.group(2) or ""), text)
    text = _VALUE.sub(lambda m: values[m.group(1)], text)
    if "{{" in text:
        raise ValueError(f"a Go template action these tests do not render: {text!r}")
    return text


def sidecar(template: str) -> dict[str, Any]:
    """The routing sidecar's init container in ``template`` (a file of the fixture), unrendered."""
    resource = yaml.safe_load(Path(FIXTURE / template).read_text())
    [container] = [c for c in resource["spec"]["template"]["initContainers"] if c["name"] == SIDECAR]
    return dict(container)


def command(container: dict[str, Any], pool: str, enable_tls: bool = True) -> list[str]:
    """The container's command as KServe's controller renders it for InferencePool ``pool``."""
    values = {"InferencePoolNamespacedName": pool}
    return [render(str(item), enable_tls, values) for item in container["command"]]


def environment(container: dict[str, Any], namespace: str) -> dict[str, str]:
    """The container's variables; a ``fieldRef`` to ``metadata.namespace`` is ``namespace``."""
    found: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            found[entry["name"]] = str(entry["value"])
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            found[entry["name"]] = namespace
        else:
            raise ValueError(f"a variable these tests do not resolve: {entry!r}")
    return found
