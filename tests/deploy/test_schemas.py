"""Every rendered resource validates, strictly and offline, against the Kubernetes schemas.

``kubernetes-validate`` ships the OpenAPI-derived JSON schemas per Kubernetes
release; ``strict`` rejects unknown fields, so a misspelt or misplaced field
fails here instead of being dropped by the API server. The manifests use
native sidecar containers, so the oldest release they are checked against is
1.29 (an earlier one must reject them: see the control below). PodMonitor is a
CRD (prometheus-operator) without a bundled schema: it is checked against
the embedded subset below, which is strict about the fields it lists.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.manifests import OVERLAYS, of_kind, rendered
from tests.deploy.render import Resource

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


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay: str, version: str) -> None:
    resources = rendered(overlay)
    assert resources, f"{overlay} renders nothing"
    for resource in resources:
        try:
            validate(resource, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(
                f"{overlay}: {resource['kind']}/{resource['metadata']['name']} at {path}: {exc.message}"
            )


def _decode_deployment() -> Resource:
    return copy.deepcopy(next(r for r in of_kind(rendered("sidecar"), "Deployment")))


def test_control_strict_validation_rejects_an_unknown_field() -> None:
    deployment = _decode_deployment()
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # "resources" misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, KUBERNETES_VERSIONS[0])


def test_control_native_sidecars_need_kubernetes_1_29() -> None:
    deployment = _decode_deployment()
    validate(deployment, "1.29.0")
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        validate(deployment, "1.27.0")


def test_control_podmonitor_schema_is_strict() -> None:
    monitor = copy.deepcopy(next(r for r in of_kind(rendered("sidecar"), "PodMonitor")))
    validate(monitor, KUBERNETES_VERSIONS[0])
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")  # the usual typo
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor, KUBERNETES_VERSIONS[0])
