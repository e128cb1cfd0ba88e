"""Read-only views of the rendered overlays, the Dockerfiles and the sidecar's own config.

Everything the deploy tests compare comes from here: the rendered resources
of each overlay (``rendered``), the pods and containers in them, the argv a
container runs (its ``command``, or the image's ENTRYPOINT, plus ``args``)
and the effective ``sidecar.config.Config`` of a sidecar container, loaded
with the sidecar's own loader from its flags, its ``KVR_*`` variables and the
TOML file it mounts from a ConfigMap.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

from sidecar import cli
from sidecar.config import Config, load
from tests.deploy.render import POD_TEMPLATE_KINDS, Resource, build

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = (
    ROOT / "tests" / "deploy" / "fixtures" / "llm-d"
)  # llm-d's own manifests, as its guides render them
DEPLOY = ROOT / "deploy"
DOCS = ROOT / "docs"
DOCKERFILE = ROOT / "Dockerfile"
PLUGIN_DOCKERFILE = DEPLOY / "vllm-plugin.Dockerfile"
OVERLAYS = ("sidecar", "router", "loadtest", "example-prefill", "mesh/istio")
SIDECAR_IMAGE = "kv-release-sidecar"
VLLM_IMAGE = "vllm/vllm-openai"
# Pod-level env a manifest fills from the downward API or a Secret: stand-ins for loading.
VALUE_FROM_PLACEHOLDER = "placeholder"


@cache
def _rendered(overlay: str) -> tuple[Resource, ...]:
    return tuple(build(DEPLOY / overlay))


def rendered(overlay: str) -> list[Resource]:
    """The overlay's resources, as ``kustomize build`` gives them (do not mutate)."""
    return list(_rendered(overlay))


def all_rendered() -> Iterator[tuple[str, Resource]]:
    for overlay in OVERLAYS:
        for resource in rendered(overlay):
            yield overlay, resource


@dataclass(frozen=True)
class Pod:
    """A pod template and the workload holding it."""

    owner: Resource

    @property
    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.owner["spec"]["template"]["spec"]
        return spec

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.owner["spec"]["template"]["metadata"].get("labels", {})
        return labels

    @property
    def name(self) -> str:
        return f"{self.owner['kind']}/{self.owner['metadata']['name']}"

    def containers(self) -> list[dict[str, Any]]:
        """Main containers, then init containers."""
        return list(self.spec.get("containers", [])) + list(self.spec.get("initContainers", []))

    def serving_containers(self) -> list[dict[str, Any]]:
        """Containers that run for the pod's life: main ones and native sidecars."""
        natives = [c for c in self.spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        return list(self.spec.get("containers", [])) + natives

    def sidecars(self) -> list[dict[str, Any]]:
        """Containers running ``kv-release-sidecar serve``."""
        return [c for c in self.containers() if is_sidecar_image(c) and argv(c)[1:2] == ["serve"]]

    def vllm(self) -> list[dict[str, Any]]:
        return [c for c in self.containers() if c["image"].split(":")[0] == VLLM_IMAGE]


def pods(resources: list[Resource]) -> list[Pod]:
    return [Pod(r) for r in resources if r["kind"] in POD_TEMPLATE_KINDS]


def of_kind(resources: list[Resource], kind: str) -> list[Resource]:
    return [r for r in resources if r["kind"] == kind]


def is_sidecar_image(container: dict[str, Any]) -> bool:
    return image_name(container["image"]).rsplit("/", 1)[-1] == SIDECAR_IMAGE


def image_name(image: str) -> str:
    return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image


def image_tag(image: str) -> str:
    return image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else "latest"


def argv(container: dict[str, Any]) -> list[str]:
    """What the container runs: ``command`` (else the image's ENTRYPOINT) plus ``args``."""
    head = container.get("command")
    if head is None and is_sidecar_image(container):
        head = dockerfile_instruction_json(DOCKERFILE, "ENTRYPOINT")
    return [str(part) for part in (head or [])] + [str(part) for part in container.get("args", [])]


def flags(tokens: list[str]) -> list[str]:
    """Every ``--flag`` in an argv (``--a=b`` counts as ``--a``)."""
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--")]


def flag_value(tokens: list[str], flag: str) -> str | None:
    for index, token in enumerate(tokens):
        if token == flag and index + 1 < len(tokens):
            return tokens[index + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def serve_parser() -> argparse.ArgumentParser:
    return cli.build_parser("serve")


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for action in parser._actions:  # argparse keeps no public list of options
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.update(parser_flags(sub))
    return found


def env_map(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal env, with ``valueFrom`` entries as placeholders."""
    return {e["name"]: str(e.get("value", VALUE_FROM_PLACEHOLDER)) for e in container.get("env", [])}


def mounted_file(resources: list[Resource], pod: Pod, container: dict[str, Any], path: str) -> str | None:
    """The content of ``path`` inside ``container`` when it comes from a ConfigMap in ``resources``."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        source = volumes[mount["name"]].get("configMap")
        if source is None:
            return None
        config_map = find(resources, "ConfigMap", source["name"])
        return str(config_map["data"][path[len(prefix) :]]) if config_map else None
    return None


def config_file_path(container: dict[str, Any]) -> str | None:
    return flag_value(argv(container), "--config") or env_map(container).get("KVR_CONFIG")


def config_file_text(resources: list[Resource], pod: Pod, container: dict[str, Any]) -> str | None:
    path = config_file_path(container)
    return mounted_file(resources, pod, container, path) if path else None


def toml_keys(resources: list[Resource], pod: Pod, container: dict[str, Any]) -> set[str]:
    text = config_file_text(resources, pod, container)
    return set(tomllib.loads(text)) if text else set()


def effective_config(resources: list[Resource], pod: Pod, container: dict[str, Any]) -> Config:
    """The Config the sidecar container would start with (raises ConfigError like the sidecar)."""
    args = serve_parser().parse_args(argv(container)[1:])
    fields = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("config", "command")}
    return load(fields, env_map(container), config_file_text(resources, pod, container))


def find(resources: list[Resource], kind: str, name: str) -> Resource | None:
    return next((r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name), None)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (plain map, or matchLabels/matchExpressions) against pod labels."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        match_labels, expressions = selector, []
    else:
        match_labels, expressions = selector.get("matchLabels", {}), selector.get("matchExpressions", [])
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expr in expressions:
        value, present = labels.get(expr["key"]), expr["key"] in labels
        ok = {
            "In": present and value in expr.get("values", []),
            "NotIn": not present or value not in expr.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[expr["operator"]]
        if not ok:
            return False
    return True


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {
        p.get("name", str(p["containerPort"])): int(p["containerPort"]) for p in container.get("ports", [])
    }


def probe_port(container: dict[str, Any], probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    return container_ports(container)[port] if isinstance(port, str) else int(port)


def prestop_sleep(container: dict[str, Any]) -> float:
    """Seconds a preStop hook holds the container before SIGTERM (sleep action or `sleep N`)."""
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] and len(command) == 2 else 0.0


# Dockerfiles -----------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    pairs = []
    for text in logical:
        instruction, _, rest = text.partition(" ")
        pairs.append((instruction.upper(), rest.strip()))
    return pairs


def dockerfile_stages(path: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction, rest in dockerfile_instructions(path):
        if instruction == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction, rest))
    return stages


def dockerfile_instruction_json(path: Path, instruction: str) -> list[str]:
    """The exec-form (JSON) arguments of the last ``instruction`` in the final stage."""
    found = [rest for name, rest in dockerfile_stages(path)[-1] if name == instruction]
    value = json.loads(found[-1])
    assert isinstance(value, list)
    return [str(v) for v in value]


def from_image(rest: str) -> str:
    """The image of a FROM line (flags and ``AS name`` removed)."""
    words = [w for w in shlex.split(rest) if not w.startswith("--")]
    return words[0]


KUBERNETES_VERSIONS = ("1.29.0", "1.33.0", kubernetes_validate.utils.latest_version())


_SELECTOR: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}


# The fields of monitoring.coreos.com/v1 PodMonitor the manifests may use.
PODMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}


_STRINGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}


# The fields of networking.istio.io/v1 VirtualService the manifests may use (Istio's reference,
# "Virtual Service": HTTPRoute, HTTPRouteDestination, Destination, PortSelector, HTTPRetry).
VIRTUALSERVICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "networking.istio.io/v1"},
        "kind": {"const": "VirtualService"},
        "metadata": PODMONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["hosts", "http"],
            "properties": {
                "hosts": _STRINGS,
                "gateways": _STRINGS,
                "http": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["route"],
                        "properties": {
                            "name": {"type": "string"},
                            "timeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "route": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["destination"],
                                    "properties": {
                                        "weight": {"type": "integer"},
                                        "destination": {
                                            "type": "object",
                                            "additionalProperties": False,
                                            "required": ["host"],
                                            "properties": {
                                                "host": {"type": "string"},
                                                "subset": {"type": "string"},
                                                "port": {
                                                    "type": "object",
                                                    "additionalProperties": False,
                                                    "properties": {"number": {"type": "integer"}},
                                                },
                                            },
                                        },
                                    },
                                },
                            },
                            "retries": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "attempts": {"type": "integer", "minimum": 0},
                                    "perTryTimeout": {"type": "string"},
                                    "retryOn": {"type": "string"},
                                    "retryRemoteLocalities": {"type": "boolean"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): PODMONITOR_SCHEMA,
    ("networking.istio.io/v1", "VirtualService"): VIRTUALSERVICE_SCHEMA,
}


def validate(resource: Resource, version: str) -> None:
    """Raise when ``resource`` does not validate (strict) for Kubernetes ``version``."""
    crd = CRD_SCHEMAS.get((resource["apiVersion"], resource["kind"]))
    if crd is not None:
        jsonschema.Draft202012Validator(crd).validate(resource)
        return
    kubernetes_validate.validate(resource, version, strict=True)


PAGE = DOCS / "llm-d-swap.md"


SHAPES = ("deployment", "disaggregatedset", "disaggregatedset-secure-proxy")


SIDECAR = "routing-proxy"


DRY_RUN_COMPONENT = "deploy/llm-d/dry-run"


def blocks(lang: str) -> list[str]:
    """The page's fenced blocks of one language, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def swap_kustomization() -> str:
    [text] = [b for b in blocks("yaml") if "kind: Kustomization" in b]
    return text


@dataclass(frozen=True)
class Layout:
    """The page's three directories side by side; ``run`` runs one of its kustomize commands there."""

    root: Path

    def run(self, words: list[str]) -> list[Resource]:
        [target] = words[2:]
        return build(self.root / target)


def lay_out(tmp_path: Path, shape: str, kustomization: str) -> Layout:
    (tmp_path / "guide").symlink_to(FIXTURES / shape)
    (tmp_path / "kv-release-sidecar").symlink_to(ROOT)
    (tmp_path / "swap").mkdir()
    (tmp_path / "swap" / "kustomization.yaml").write_text(kustomization)
    return Layout(tmp_path)


def pod_templates(node: Any) -> Iterator[dict[str, Any]]:
    """Every pod template (``metadata`` + ``spec.containers``) at any depth of any kind."""
    if isinstance(node, dict):
        spec = node.get("spec")
        if isinstance(spec, dict) and isinstance(spec.get("containers"), list):
            yield node
        for value in node.values():
            yield from pod_templates(value)
    elif isinstance(node, list):
        for item in node:
            yield from pod_templates(item)


def decode_pod(resources: list[Resource]) -> tuple[dict[str, str], dict[str, Any]]:
    """(labels, routing sidecar container) of the one pod template running the routing sidecar."""
    found = [
        (template.get("metadata", {}).get("labels", {}), container)
        for resource in resources
        for template in pod_templates(resource)
        for container in template["spec"].get("initContainers", [])
        if container["name"] == SIDECAR
    ]
    assert len(found) == 1, found
    return found[0]


COMPONENT = DEPLOY / "llm-d"


def render(tmp_path: Path, shape: str, *components: Path) -> list[Resource]:
    """The user's kustomization: the guide's render, then this project's components."""
    lines = ["resources:", f"  - {relative(FIXTURES / shape, tmp_path)}", "components:"]
    lines += [f"  - {relative(component, tmp_path)}" for component in components]
    (tmp_path / "kustomization.yaml").write_text("\n".join(lines) + "\n")
    return build(tmp_path)


def relative(path: Path, start: Path) -> str:
    """``path`` as seen from ``start``: kustomize takes no absolute root for a resource or component."""
    return os.path.relpath(path, start)


def pod_specs(node: Any) -> Iterator[dict[str, Any]]:
    """Every pod spec (a map holding ``containers``) at any depth: a Deployment's, a custom resource's."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield node
        for value in node.values():
            yield from pod_specs(value)
    elif isinstance(node, list):
        for item in node:
            yield from pod_specs(item)


def sidecars(resources: list[Resource]) -> list[dict[str, Any]]:
    return [
        c
        for r in resources
        for pod in pod_specs(r)
        for c in pod.get("initContainers", [])
        if c["name"] == SIDECAR
    ]
