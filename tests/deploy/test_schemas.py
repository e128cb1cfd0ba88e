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

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.manifests import (
    KUBERNETES_VERSIONS,
    OVERLAYS,
    of_kind,
    rendered,
    validate,
)
from tests.deploy.render import Resource


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
