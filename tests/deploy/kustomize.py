"""A small, offline subset of ``kustomize build``, enough for the overlays in deploy/.

Supported kustomization keys: ``resources`` (files, or directories holding a
kustomization), ``components`` (directories holding a ``kind: Component``
kustomization, built on top of the resources accumulated so far),
``namespace``, ``labels`` (``pairs``, ``includeSelectors``,
``includeTemplates``; the deprecated ``commonLabels`` is refused), ``configMapGenerator``
(``files`` and ``literals``, name hash suffix as kustomize computes it, and
the references in pod specs rewritten), ``patches`` (strategic merge
patches from ``path`` or ``patch``, matched by kind and name; JSON6902
``add``/``replace``/``remove`` lists with a ``target`` of kind and name) and ``images``
(``name`` to ``newName``/``newTag``/``digest`` in every ``containers`` and
``initContainers`` list at any depth of any kind, as kustomize's image
transformer does without field specs, so a custom resource's pod templates are
reached too). Anything else, a
``$patch`` directive or another JSON6902 operation, raises ``Unsupported``: a
manifest that needs more than this subset fails the tests instead of
rendering differently from kustomize. Transformers run in kustomize's order:
components first (each with its own resources and transformers), then patches,
namespace, labels, images; generated names get their hash suffix last.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

KUSTOMIZATION = "kustomization.yaml"
SUPPORTED_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "labels",
    "configMapGenerator",
    "patches",
    "components",
    "images",
}
COMPONENT_KIND = "Component"
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PriorityClass",
}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}

# Strategic-merge keys of the lists the patches here touch (k8s.io/api patchMergeKey tags).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}

# Where labels go (kustomize's builtin label field specs for these kinds):
# (kind or "*", path, create the path when missing, "metadata" | "template" | "selector").
LABEL_FIELDS = [
    ("*", ("metadata", "labels"), True, "metadata"),
    ("Service", ("spec", "selector"), True, "selector"),
    ("Deployment", ("spec", "selector", "matchLabels"), True, "selector"),
    ("Deployment", ("spec", "template", "metadata", "labels"), True, "template"),
    ("StatefulSet", ("spec", "selector", "matchLabels"), True, "selector"),
    ("StatefulSet", ("spec", "template", "metadata", "labels"), True, "template"),
    ("DaemonSet", ("spec", "selector", "matchLabels"), True, "selector"),
    ("DaemonSet", ("spec", "template", "metadata", "labels"), True, "template"),
    ("Job", ("spec", "selector", "matchLabels"), False, "selector"),
    ("Job", ("spec", "template", "metadata", "labels"), True, "template"),
    ("PodDisruptionBudget", ("spec", "selector", "matchLabels"), False, "selector"),
    ("NetworkPolicy", ("spec", "podSelector", "matchLabels"), False, "selector"),
    (
        "NetworkPolicy",
        ("spec", "ingress", "[]", "from", "[]", "podSelector", "matchLabels"),
        False,
        "selector",
    ),
    ("NetworkPolicy", ("spec", "egress", "[]", "to", "[]", "podSelector", "matchLabels"), False, "selector"),
]
LABEL_KEYS = {"pairs", "includeSelectors", "includeTemplates"}
IMAGE_KEYS = {"name", "newName", "newTag", "digest"}
CONTAINER_LISTS = ("containers", "initContainers")


class Unsupported(Exception):
    """The kustomization uses something this subset does not render."""


def build(directory: Path) -> list[Resource]:
    """Render the kustomization in ``directory`` like ``kustomize build``."""
    spec = _kustomization(directory)
    if spec.get("kind") == COMPONENT_KIND:
        raise Unsupported(f"{directory}: a Component is built only from a kustomization's components")
    return _build(directory, spec, [])


def _kustomization(directory: Path) -> dict[str, Any]:
    spec = yaml.safe_load((directory / KUSTOMIZATION).read_text()) or {}
    unknown = set(spec) - SUPPORTED_KEYS
    if unknown:
        raise Unsupported(f"{directory}: kustomization keys {sorted(unknown)}")
    return dict(spec)


def _build(directory: Path, spec: dict[str, Any], resources: list[Resource]) -> list[Resource]:
    """Add ``spec``'s resources to ``resources`` (a component's input), then run its transformers."""
    for entry in spec.get("resources", []):
        path = directory / entry
        resources.extend(build(path) if path.is_dir() else load_documents(path))
    for entry in spec.get("components", []):
        component = _kustomization(directory / entry)
        if component.get("kind") != COMPONENT_KIND:
            raise Unsupported(f"{directory / entry}: components must be kind {COMPONENT_KIND}")
        resources = _build(directory / entry, component, resources)
    generated = [_generate(directory, item) for item in spec.get("configMapGenerator", [])]
    resources.extend(generated)
    _check_unique(resources)
    for patch in spec.get("patches", []):
        _apply_patch(resources, _patch_document(directory, patch), patch.get("target"))
    if "namespace" in spec:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED:
                resource["metadata"]["namespace"] = spec["namespace"]
    for entry in spec.get("labels", []):
        if set(entry) - LABEL_KEYS:
            raise Unsupported(f"labels fields {sorted(entry)}")
        selectors = bool(entry.get("includeSelectors", False))
        templates = selectors or bool(entry.get("includeTemplates", False))  # selectors imply templates
        for resource in resources:
            add_labels(resource, entry.get("pairs", {}), selectors=selectors, templates=templates)
    for image in spec.get("images", []):
        if set(image) - IMAGE_KEYS or "name" not in image:
            raise Unsupported(f"images fields {sorted(image)}")
        for resource in resources:
            set_image(resource, image)
    for config_map in generated:
        _add_hash_suffix(config_map, resources)
    return resources


def split_image(image: str) -> tuple[str, str, str]:
    """``name``, ``tag`` and ``digest`` of an image reference (a registry port is not a tag)."""
    name, _, digest = image.partition("@")
    head, colon, tag = name.rpartition(":")
    if colon and "/" not in tag:
        return head, tag, digest
    return name, "", digest


def set_image(node: Any, image: dict[str, str]) -> None:
    """One ``images`` entry on every container list at any depth of ``node``."""
    if isinstance(node, list):
        for item in node:
            set_image(item, image)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in CONTAINER_LISTS and isinstance(value, list):
            for container in value:
                if isinstance(container, dict) and isinstance(container.get("image"), str):
                    container["image"] = _new_image(container["image"], image)
        set_image(value, image)


def _new_image(current: str, image: dict[str, str]) -> str:
    name, tag, digest = split_image(current)
    if name != image["name"]:
        return current
    name = image.get("newName", name)
    if "digest" in image:
        return f"{name}@{image['digest']}"
    if "newTag" in image:
        tag, digest = image["newTag"], ""
    return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _check_unique(resources: list[Resource]) -> None:
    seen: set[tuple[str, str, str]] = set()
    for resource in resources:
        ident = (resource["kind"], resource["metadata"].get("namespace", ""), resource["metadata"]["name"])
        if ident in seen:
            raise Unsupported(f"resource {ident} is defined twice")  # kustomize refuses it too
        seen.add(ident)


def load_documents(path: Path) -> list[Resource]:
    """The non-empty YAML documents of one file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def config_map_hash(config_map: Resource) -> str:
    """kustomize's name suffix: sha256 of the JSON of kind, name, data (and binaryData), 10 chars."""
    encoded: dict[str, Any] = {
        "kind": "ConfigMap",
        "name": config_map.get("metadata", {}).get("name", ""),
        "data": config_map.get("data", ""),
    }
    if isinstance(config_map.get("binaryData"), dict):
        encoded["binaryData"] = config_map["binaryData"]
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # Go's encoding/json escapes these three; the hash is over Go's bytes.
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def add_labels(
    resource: Resource, labels: dict[str, str], *, selectors: bool = True, templates: bool = True
) -> None:
    """Apply one ``labels`` entry to ``resource`` at kustomize's field specs (default: with selectors)."""
    if not labels:
        return
    wanted = {"metadata"} | ({"selector"} if selectors else set()) | ({"template"} if templates else set())
    for kind, path, create, role in LABEL_FIELDS:
        if kind in ("*", resource["kind"]) and role in wanted:
            for target in _walk(resource, path, create):
                target.update(labels)


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Merge ``patch`` into ``base``: maps recursively, keyed lists by key, other values replaced."""
    if isinstance(patch, dict):
        if "$patch" in patch or any(k.startswith("$") for k in patch):
            raise Unsupported(f"strategic-merge directive in {sorted(patch)}")
        if not isinstance(base, dict):
            return copy.deepcopy(patch)
        merged = dict(base)
        for name, value in patch.items():
            if value is None:
                merged.pop(name, None)
            else:
                merged[name] = strategic_merge(base.get(name), value, name)
        return merged
    if isinstance(patch, list) and key in MERGE_KEYS and isinstance(base, list):
        return _merge_list(base, patch, MERGE_KEYS[key])
    return copy.deepcopy(patch)


def _merge_list(base: list[Any], patch: list[Any], merge_key: str) -> list[Any]:
    merged = list(base)
    for item in patch:
        index = next((i for i, old in enumerate(merged) if old.get(merge_key) == item[merge_key]), None)
        if index is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[index] = strategic_merge(merged[index], item)
    return merged


def _generate(directory: Path, item: dict[str, Any]) -> Resource:
    if set(item) - {"name", "files", "literals"}:
        raise Unsupported(f"configMapGenerator fields {sorted(item)}")
    data: dict[str, str] = {}
    for entry in item.get("files", []):
        key, _, name = entry.rpartition("=")
        data[key or Path(name).name] = (directory / name).read_text()
    for literal in item.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": item["name"]}, "data": data}


def _add_hash_suffix(config_map: Resource, resources: list[Resource]) -> None:
    old = config_map["metadata"]["name"]
    new = f"{old}-{config_map_hash(config_map)}"
    config_map["metadata"]["name"] = new
    namespace = config_map["metadata"].get("namespace")
    for resource in resources:
        if resource["kind"] in POD_TEMPLATE_KINDS and resource["metadata"].get("namespace") == namespace:
            _rename_config_map_refs(resource["spec"]["template"]["spec"], old, new)


def _rename_config_map_refs(pod: Resource, old: str, new: str) -> None:
    refs: list[dict[str, Any]] = []
    for volume in pod.get("volumes", []):
        refs.append(volume.get("configMap") or {})
        refs.extend(
            source.get("configMap") or {} for source in volume.get("projected", {}).get("sources", [])
        )
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        refs.extend(source.get("configMapRef") or {} for source in container.get("envFrom", []))
        refs.extend(env.get("valueFrom", {}).get("configMapKeyRef") or {} for env in container.get("env", []))
    for ref in refs:
        if ref.get("name") == old:
            ref["name"] = new


def _patch_document(directory: Path, entry: dict[str, Any]) -> Resource | list[dict[str, Any]]:
    if set(entry) - {"path", "patch", "target"}:
        raise Unsupported(f"patch fields {sorted(entry)}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    document = yaml.safe_load(text)
    if isinstance(document, list):
        if not entry.get("target"):
            raise Unsupported("a JSON6902 patch without a target")
        return document
    return dict(document)


def _apply_patch(
    resources: list[Resource], patch: Resource | list[dict[str, Any]], target: dict[str, str] | None
) -> None:
    if target and set(target) - {"kind", "name"}:
        raise Unsupported(f"patch target fields {sorted(target)}")
    if isinstance(patch, list):
        assert target is not None  # _patch_document refuses a JSON6902 patch without one
        kind, name = target.get("kind"), target.get("name")
    else:
        kind = (target or {}).get("kind") or patch["kind"]
        name = (target or {}).get("name") or patch["metadata"]["name"]
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    if not matches and not target:
        raise Unsupported(f"patch target {kind}/{name} not found")  # a target selecting nothing is a no-op
    for resource in matches:
        if isinstance(patch, list):
            for operation in patch:
                json_patch(resource, operation)
        else:
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
            resource.update(strategic_merge(resource, body))


def json_patch(resource: Resource, operation: dict[str, Any]) -> None:
    """One RFC 6902 ``add``, ``replace`` or ``remove`` (``-`` appends to a list)."""
    op, path = operation.get("op"), operation.get("path", "")
    if op not in ("add", "replace", "remove") or not path.startswith("/"):
        raise Unsupported(f"JSON6902 operation {operation}")
    steps = [step.replace("~1", "/").replace("~0", "~") for step in path[1:].split("/")]
    parent: Any = resource
    for step in steps[:-1]:
        parent = parent[int(step)] if isinstance(parent, list) else parent[step]
    last = steps[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op == "add":
            parent.insert(index, copy.deepcopy(operation["value"]))
        elif op == "replace":
            parent[index] = copy.deepcopy(operation["value"])
        else:
            del parent[index]
    elif op == "remove":
        del parent[last]
    else:
        if op == "replace" and last not in parent:
            raise Unsupported(f"JSON6902 replace of a missing {path}")
        parent[last] = copy.deepcopy(operation["value"])


def _walk(node: Any, path: tuple[str, ...], create: bool) -> list[dict[str, Any]]:
    """The maps at ``path`` ("[]" steps into every list item); created when ``create``."""
    if not path:
        return [node] if isinstance(node, dict) else []
    step, rest = path[0], path[1:]
    if step == "[]":
        return [found for item in node or [] for found in _walk(item, rest, create)]
    if not isinstance(node, dict):
        return []
    if step not in node or node[step] is None:
        if not create:
            return []
        node[step] = {}
    return _walk(node[step], rest, create)
