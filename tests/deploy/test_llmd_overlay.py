"""deploy/llm-d swaps the routing sidecar's image in llm-d's own manifests and changes nothing else.

The fixtures (tests/deploy/fixtures/llm-d) are llm-d's guides as their users
render them, each file headed by the upstream commit and path it came from:
the decode Deployment of the P/D recipe, and the guide's DisaggregatedSet (a
custom resource) in its two revisions (``--secure-serving=false``, and the
deprecated ``--secure-proxy=false``); and KServe's LLMInferenceService decode
template and its data-parallel worker template (tests.deploy.kserve). Each is
rendered the way a user adds this project to a guide: a kustomization holding the guide's render and the
``deploy/llm-d`` component (plus ``deploy/llm-d/ssrf-protection`` for SSRF
protection).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sidecar.llmd.command import load, recognises
from tests.deploy import kserve
from tests.deploy.manifests import (
    COMPONENT,
    FIXTURES,
    KUBERNETES_VERSIONS,
    ROOT,
    SIDECAR,
    SIDECAR_IMAGE,
    pod_specs,
    relative,
    render,
    sidecars,
    validate,
)
from tests.deploy.render import Resource, build

SSRF_PROTECTION = COMPONENT / "ssrf-protection"
SHAPES = ("deployment", "disaggregatedset", "disaggregatedset-secure-proxy")
# The guides' routing-sidecar image component, and KServe's templates: the same tag.
UPSTREAM_IMAGE = KSERVE_IMAGE = "ghcr.io/llm-d/llm-d-router-disagg-sidecar:v0.10.0"
GUIDES_ACCOUNT = "pd-disagg-vllm"


def decode_pods(resources: list[Resource]) -> list[dict[str, Any]]:
    return [
        pod
        for r in resources
        for pod in pod_specs(r)
        if any(c["name"] == SIDECAR for c in pod.get("initContainers", []))
    ]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_component_swaps_the_image_and_nothing_else(tmp_path: Path, shape: str) -> None:
    before = build(FIXTURES / shape)
    after = render(tmp_path, shape, COMPONENT)
    [old], [new] = sidecars(before), sidecars(after)
    assert old["image"] == UPSTREAM_IMAGE
    assert SIDECAR_IMAGE in new["image"]
    assert new["restartPolicy"] == "Always"  # still llm-d's native sidecar (an init container)
    assert new["ports"] == [{"containerPort": 8000, "name": "sidecar", "protocol": "TCP"}]
    assert new.get("command") is None  # the image's entry point reads llm-d's args
    restored = copy.deepcopy(after)
    for container in sidecars(restored):
        container["image"] = UPSTREAM_IMAGE
    assert restored == before  # args, ports, names, vLLM, service account: all as the guide has them


@pytest.mark.parametrize("shape", SHAPES)
def test_the_guides_args_run_pd_sidecar_with_releases_on(shape: str) -> None:
    [container] = sidecars(build(FIXTURES / shape))
    assert recognises(container["args"])
    config, _ = load(container["args"], {})
    assert config.release == "nixl" and config.answers == "llm-d"
    assert not config.tls  # --secure-serving=false / --secure-proxy=false
    assert config.port == 8000 and config.decode_url == "http://localhost:8200"
    assert config.inference_pool == ""  # no SSRF protection in the guides: no API access needed


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("components", [(COMPONENT,), (COMPONENT, SSRF_PROTECTION)])
def test_no_network_policy_narrows_llm_ds_ports(
    tmp_path: Path, shape: str, components: tuple[Path, ...]
) -> None:
    # A NetworkPolicy selecting the decode pod closes every port it does not list: vLLM's 8200,
    # NIXL's 5600 and UCX's transfer ports, which llm-d leaves open. The component adds none.
    resources = render(tmp_path, shape, *components)
    assert [r["metadata"]["name"] for r in resources if r["kind"] == "NetworkPolicy"] == []
    [pod] = decode_pods(resources)
    ports = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    assert {8200, 5600} <= ports  # llm-d's ports are still declared


def test_the_component_changes_only_images() -> None:
    spec = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert spec["kind"] == "Component" and set(spec) == {"apiVersion", "kind", "images"}
    names = {entry["name"] for entry in spec["images"]}
    assert UPSTREAM_IMAGE.split(":")[0] in names
    assert {"ghcr.io/llm-d/llm-d-routing-sidecar", "REPLACE_ROUTING_SIDECAR_IMAGE"} <= names
    assert all(SIDECAR_IMAGE in entry["newName"] for entry in spec["images"])


@pytest.mark.parametrize("shape", SHAPES)
def test_ssrf_protection_binds_the_account_the_decode_pods_run_as_and_mounts_its_token(
    tmp_path: Path, shape: str
) -> None:
    """Whatever account the guide's decode pods ran as (the recipe's ``sa``, the guide's
    ``pd-disagg-vllm``), the Role is bound to the one they run as after the component, and only
    they get a token: the guide's own account and its prefill pods stay as they were."""
    plain = render(tmp_path, shape, COMPONENT)
    assert not [r for r in plain if r["kind"] in ("Role", "RoleBinding")]
    accounts_before = [r for r in plain if r["kind"] == "ServiceAccount"]
    [decode_before] = decode_pods(plain)
    assert decode_before["serviceAccountName"] in ("sa", GUIDES_ACCOUNT)

    resources = render(tmp_path, shape, COMPONENT, SSRF_PROTECTION)
    [binding] = [r for r in resources if r["kind"] == "RoleBinding"]
    [role] = [r for r in resources if r["kind"] == "Role"]
    [pod] = decode_pods(resources)
    accounts = {r["metadata"]["name"]: r for r in resources if r["kind"] == "ServiceAccount"}
    [subject] = binding["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": pod["serviceAccountName"]}
    assert accounts[pod["serviceAccountName"]]["automountServiceAccountToken"] is True
    assert pod["automountServiceAccountToken"] is True
    for account in accounts_before:  # the guide's account, shared with the prefill pods: untouched
        assert accounts[account["metadata"]["name"]] == account
    others = [spec for spec in pod_specs(resources) if spec is not pod]
    assert [spec.get("serviceAccountName") for spec in others] == [
        spec.get("serviceAccountName") for spec in pod_specs(plain) if spec is not decode_before
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {tuple(rule["resources"]) for rule in role["rules"]} == {("inferencepools",), ("pods",)}
    assert all(rule["verbs"] == ["get", "list", "watch"] for rule in role["rules"])
    groups = {group for rule in role["rules"] for group in rule["apiGroups"]}
    assert groups == {"", "inference.networking.k8s.io", "inference.networking.x-k8s.io"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_rendered_manifests_validate_strictly(tmp_path: Path, shape: str, version: str) -> None:
    for resource in render(tmp_path, shape, COMPONENT, SSRF_PROTECTION):
        if resource["kind"] == "DisaggregatedSet":  # no schema here: its pod templates, as Pods
            for pod in pod_specs(resource):
                validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod}, version)
        else:
            validate(resource, version)


def test_strict_validation_is_on() -> None:
    [deployment] = build(FIXTURES / "deployment")
    deployment["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, KUBERNETES_VERSIONS[-1])


def test_every_fixture_names_its_upstream_source() -> None:
    for path in sorted(FIXTURES.rglob("*.yaml")):
        head = path.read_text().split("\n", 6)[:6]
        if head[0].startswith("# Vendored"):
            assert head[1].startswith("# Source: ") and "@" in head[1], path
            commit = head[1].split("@", 1)[1].split()[0]
            assert len(commit) == 40 and int(commit, 16) >= 0, path
        else:
            assert head[0].startswith("# Not vendored:"), path


def test_the_helm_values_set_only_the_routing_sidecars_image() -> None:
    values = yaml.safe_load((COMPONENT / "llm-d-modelservice-values.yaml").read_text())
    assert values == {"routing": {"proxy": {"image": values["routing"]["proxy"]["image"]}}}
    assert SIDECAR_IMAGE in values["routing"]["proxy"]["image"]


@pytest.mark.parametrize("template", kserve.TEMPLATES)
def test_kserves_decode_templates_get_the_image_and_their_command_loads(
    tmp_path: Path, template: str
) -> None:
    # KServe's LLMInferenceServiceConfigs (custom resources): the component's image reaches the
    # routing sidecar's init container and nothing else changes; its command (/app/pd-sidecar,
    # the image's llm-d binary name) loads as KServe's controller renders it, TLS on and off.
    before, after = build(FIXTURES / "kserve"), render(tmp_path, "kserve", COMPONENT)
    [old] = [c for r in before for c in r["spec"]["template"]["initContainers"] if template_of(r, template)]
    [new] = [c for r in after for c in r["spec"]["template"]["initContainers"] if template_of(r, template)]
    assert old["image"] == KSERVE_IMAGE and SIDECAR_IMAGE in new["image"]
    assert {k: v for k, v in new.items() if k != "image"} == {k: v for k, v in old.items() if k != "image"}
    assert new["command"][0] == "/app/pd-sidecar" and "args" not in new
    env = kserve.environment(new, "llm")
    assert env["SSL_CERT_DIR"].split(":")[0] == kserve.CERT_DIR  # KServe's certificate is trusted so
    config, sources = load(kserve.command(new, "llm/pool")[1:], env)
    assert config.tls and config.tls_cert_dir == kserve.CERT_DIR
    assert config.decode_url == "https://localhost:8001" and not config.decode_tls_insecure
    assert config.prefill_tls and not config.prefill_tls_insecure  # verified: no skip-verify flag
    assert config.ssl_cert_dir[0] == kserve.CERT_DIR and sources["ssl_cert_dir"] == "SSL_CERT_DIR"
    assert config.inference_pool == "llm/pool" and config.pool_group == "inference.networking.x-k8s.io"
    assert config.release == "nixl" and config.port == 8000
    plain, _ = load(kserve.command(new, "llm/pool", enable_tls=False)[1:], env)
    assert not plain.tls and plain.decode_url == "http://localhost:8001" and not plain.prefill_tls


def template_of(resource: Resource, template: str) -> bool:
    """``resource`` is the LLMInferenceServiceConfig of the fixture file ``template``."""
    return bool(resource["metadata"]["name"] == "kserve-" + template.removesuffix(".yaml"))


@pytest.mark.parametrize("shape", ["deployment", "disaggregatedset"])
def test_docs_llm_d_quotes_the_current_guides_args(shape: str) -> None:
    """docs/llm-d.md says which args llm-d's guides run the routing sidecar with: the current
    guides' (the recipe's Deployment and the guide's DisaggregatedSet, as vendored)."""
    text = " ".join((ROOT / "docs" / "llm-d.md").read_text().split())
    quoted = text.split("llm-d's guides run the routing sidecar without `--enable-ssrf-protection` (`")[1]
    [sidecar] = sidecars(build(FIXTURES / shape))
    assert quoted.split("`", 1)[0].split() == sidecar["args"]


# llm-d's GKE P/D guide (llm-d/llm-d guides/pd-disaggregation/modelserver/gpu/vllm/gke/base, used
# by its A4X (GB200) and A4X Max (GB300) variants: Grace, arm64) lets both roles onto nodes
# tainted by kubernetes.io/arch; a guide may also pin them with a nodeSelector on it.
GRACE_PLACEMENT = {
    "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "kubernetes.io/arch", "operator": "Exists", "effect": "NoSchedule"},
    ],
    "nodeSelector": {"kubernetes.io/arch": "arm64"},
}


def test_a_guide_placed_on_grace_nodes_keeps_its_placement(tmp_path: Path) -> None:
    # The image is multi-arch (linux/arm64 beside linux/amd64), and the component changes the image
    # alone: the arch toleration and selector the guide renders reach the decode pod unchanged.
    guide = tmp_path / "guide"
    guide.mkdir()
    patch = [
        {
            "op": "add",
            "path": f"/spec/roles/{role}/spec/leaderWorkerTemplate/workerTemplate/spec/{field}",
            "value": value,
        }
        for role in (0, 1)
        for field, value in GRACE_PLACEMENT.items()
    ]
    spec = {
        "resources": [relative(FIXTURES / "disaggregatedset", guide)],
        "patches": [{"target": {"kind": "DisaggregatedSet"}, "patch": json.dumps(patch)}],
    }
    (guide / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    swap = tmp_path / "swap"
    swap.mkdir()
    spec = {"resources": ["../guide"], "components": [relative(COMPONENT, swap)]}
    (swap / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    [pod] = decode_pods(build(swap))
    assert {key: pod[key] for key in GRACE_PLACEMENT} == GRACE_PLACEMENT
    [sidecar] = [c for c in pod["initContainers"] if c["name"] == SIDECAR]
    assert SIDECAR_IMAGE in sidecar["image"]
