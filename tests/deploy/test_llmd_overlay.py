"""deploy/llm-d renders, validates strictly, and changes only what the drop-in needs.

The overlay patches llm-d's decode Deployment (``decode.yaml`` stands for it):
the routing sidecar's image becomes this one, with llm-d's args unchanged, and
those args load as ``pd-sidecar`` settings with releases on and no Secret anywhere.
"""

from __future__ import annotations

import kubernetes_validate
import pytest

from sidecar.llmd.command import load, recognises
from tests.deploy.kustomize import build, load_documents
from tests.deploy.manifests import DEPLOY, SIDECAR_IMAGE
from tests.deploy.test_schemas import KUBERNETES_VERSIONS, validate

OVERLAY = DEPLOY / "llm-d"


def _decode(resources: list[dict]) -> dict:  # type: ignore[type-arg]
    [deployment] = [r for r in resources if r["kind"] == "Deployment"]
    return deployment


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_overlay_validates_strictly(version: str) -> None:
    for resource in build(OVERLAY):
        validate(resource, version)


def test_only_the_image_and_what_the_drop_in_needs_change() -> None:
    before = _decode(load_documents(OVERLAY / "decode.yaml"))["spec"]["template"]["spec"]
    after = _decode(build(OVERLAY))["spec"]["template"]["spec"]
    [old], [new] = before["initContainers"], after["initContainers"]
    assert SIDECAR_IMAGE in new["image"] and SIDECAR_IMAGE not in old["image"]
    assert new["args"] == old["args"] and new.get("command") is None  # llm-d's args, the image's entry
    assert new["restartPolicy"] == "Always"
    assert after["containers"] == before["containers"]  # vLLM untouched
    assert {p["containerPort"] for p in new["ports"]} == {8000, 9100}
    assert not [v for v in after["volumes"] if "secret" in v]  # no Secret is required


def test_the_args_run_pd_sidecar_with_releases_on() -> None:
    [container] = _decode(build(OVERLAY))["spec"]["template"]["spec"]["initContainers"]
    assert recognises(container["args"])
    config, _ = load(container["args"], {})
    assert config.release == "nixl" and config.answers == "llm-d" and config.tls
    assert config.inference_pool == "llm/pool" and config.decode_url == "http://localhost:8200"


def test_the_role_reads_only_pools_and_pods() -> None:
    [role] = [r for r in build(OVERLAY) if r["kind"] == "Role"]
    assert {tuple(rule["resources"]) for rule in role["rules"]} == {("inferencepools",), ("pods",)}
    assert all(rule["verbs"] == ["get", "list", "watch"] for rule in role["rules"])


def test_strict_validation_is_on() -> None:
    deployment = _decode(build(OVERLAY))
    deployment["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, KUBERNETES_VERSIONS[-1])
