"""The manifests speak the sidecar's own config: flags, KVR_* variables, TOML keys, ports.

Every sidecar container in every rendered overlay is loaded with the
sidecar's real parser and loader (``sidecar.cli.build_parser``,
``sidecar.config.load``), so a renamed flag, variable or key, or a value the
sidecar would refuse at start-up, fails here. Ports, probes, Services,
NetworkPolicies and the PodMonitor are then compared with the effective
config of the pods they point at.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import tomllib
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest

from sidecar import cli
from sidecar.config import Config, env_names
from sidecar.network.allowlist import parse_entry
from tests.deploy.manifests import (
    DOCKERFILE,
    OVERLAYS,
    Pod,
    argv,
    config_file_path,
    config_file_text,
    container_ports,
    dockerfile_instructions,
    effective_config,
    env_map,
    flags,
    of_kind,
    parser_flags,
    pods,
    prestop_sleep,
    probe_port,
    rendered,
    selects,
    serve_parser,
    toml_keys,
)
from tests.deploy.render import Resource

CONFIG_FIELDS = {f.name for f in msgspec.structs.fields(Config)}
SIDECAR_OVERLAYS = ("sidecar", "router", "loadtest")
# The window between readiness turning off and the listener closing must hold the
# kubelet's detection and the endpoint update (seconds beyond the probe's own window).
GRACE_MARGIN = 10.0


def sidecar_cases() -> list[tuple[str, Pod, dict[str, Any]]]:
    return [
        (overlay, pod, container)
        for overlay in OVERLAYS
        for pod in pods(rendered(overlay))
        for container in pod.sidecars()
    ]


def case_id(case: tuple[str, Pod, dict[str, Any]]) -> str:
    return f"{case[0]}:{case[1].name}"


CASES = sidecar_cases()


def test_every_sidecar_overlay_runs_the_sidecar() -> None:
    assert {overlay for overlay, _, _ in CASES} == set(SIDECAR_OVERLAYS)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_flags_env_and_toml_keys_exist_in_the_config(case: tuple[str, Pod, dict[str, Any]]) -> None:
    overlay, pod, container = case
    known_flags = parser_flags(serve_parser())
    assert set(flags(argv(container))) <= known_flags
    kvr_env = {name for name in env_map(container) if name.startswith("KVR_")}
    assert kvr_env <= set(env_names()), f"unknown KVR_* variables {kvr_env - set(env_names())}"
    assert config_file_path(container), "the sidecar should read its settings from a mounted TOML file"
    assert config_file_text(rendered(overlay), pod, container) is not None, "the TOML file is not mounted"
    keys = toml_keys(rendered(overlay), pod, container)
    assert keys, "empty config file"
    assert keys <= CONFIG_FIELDS, f"unknown TOML keys {keys - CONFIG_FIELDS}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_sidecar_would_start_with_this_config(case: tuple[str, Pod, dict[str, Any]]) -> None:
    overlay, pod, container = case
    config = effective_config(rendered(overlay), pod, container)  # raises ConfigError like start-up
    assert config.release in ("nixl", "http", "auto"), "a deployed sidecar should release"
    assert config.prefill_allow, "release with an empty prefill_allow contacts no P"
    for entry in map(parse_entry, config.prefill_allow):
        assert entry.ports != (0, 65535), "allow P's side-channel ports only"
        assert entry.port_ok(side_channel_port(overlay) or 5600)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ports_and_probes_follow_the_config(case: tuple[str, Pod, dict[str, Any]]) -> None:
    overlay, pod, container = case
    config = effective_config(rendered(overlay), pod, container)
    assert container_ports(container) == {"http": config.port, "admin": config.admin_port}
    assert container in pod.serving_containers(), "an init container without restartPolicy: Always"
    for probe_name, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        probe = container[probe_name]
        assert (probe["httpGet"]["path"], probe_port(container, probe)) == (path, config.admin_port)
    startup = container.get("startupProbe")
    if startup is not None:  # /readyz waits for D, and D starts only after this probe passes
        assert startup["httpGet"]["path"] == "/healthz"
        assert probe_port(container, startup) == config.admin_port


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_shutdown_fits_the_grace_period_and_readiness_drops_first(
    case: tuple[str, Pod, dict[str, Any]],
) -> None:
    overlay, pod, container = case
    config = effective_config(rendered(overlay), pod, container)
    readiness = container["readinessProbe"]
    noticed = readiness.get("periodSeconds", 10) * readiness.get("failureThreshold", 3)
    assert 0 < noticed <= config.shutdown_delay, "endpoints must update before the proxy stops listening"
    # Native sidecars stop after the main containers: their preStop hooks come first.
    main_stop = max(
        (prestop_sleep(c) for c in pod.spec.get("containers", []) if c is not container), default=0
    )
    needed = main_stop + config.shutdown_delay + config.drain_timeout + config.flush_timeout + GRACE_MARGIN
    assert pod.spec["terminationGracePeriodSeconds"] >= needed


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_container_hardening(case: tuple[str, Pod, dict[str, Any]]) -> None:
    container = case[2]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == dockerfile_uid() != 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/tmp" in mounts, "a read-only root needs a writable /tmp (UCX, Python)"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_sidecar_can_read_its_mounted_secrets(case: tuple[str, Pod, dict[str, Any]]) -> None:
    # Secret files belong to root: the sidecar (a non-root uid) reads them through the "other"
    # bits, or the group bits when the pod's fsGroup is its group. Unreadable, it exits 2 at
    # start-up (the trust key, the control token) and the decode pod never starts.
    _, pod, container = case
    uid = container["securityContext"]["runAsUser"]
    groups = {container["securityContext"].get("runAsGroup", uid)}
    fs_group = pod.spec.get("securityContext", {}).get("fsGroup")
    mounted = {m["name"] for m in container.get("volumeMounts", [])}
    secrets = [v for v in pod.spec.get("volumes", []) if "secret" in v and v["name"] in mounted]
    for volume in secrets:
        secret = volume["secret"]
        modes = [item["mode"] for item in secret.get("items", []) if "mode" in item]
        for mode in modes or [secret.get("defaultMode", 0o644)]:
            readable = bool(mode & 0o004) or (bool(mode & 0o040) and fs_group in groups)
            assert readable, f"{pod.name}: {volume['name']} mode {mode:o} is not readable by uid {uid}"


def dockerfile_uid() -> int:
    users = [rest for name, rest in dockerfile_instructions(DOCKERFILE) if name == "USER"]
    return int(users[-1].split(":")[0])


def side_channel_port(overlay: str) -> int | None:
    """P's VLLM_NIXL_SIDE_CHANNEL_PORT in this overlay, or in example-prefill."""
    for name in (overlay, "example-prefill"):
        for pod in pods(rendered(name)):
            for container in pod.vllm():
                value = env_map(container).get("VLLM_NIXL_SIDE_CHANNEL_PORT")
                if value and pod.labels.get("app.kubernetes.io/component") == "prefill":
                    return int(value)
    return None


# Decode pods: D behind the native sidecar ------------------------------------------------


def decode_pods(overlay: str) -> list[Pod]:
    return [p for p in pods(rendered(overlay)) if p.vllm() and p.sidecars()]


@pytest.mark.parametrize("overlay", ["sidecar", "loadtest"])
def test_d_listens_on_localhost_behind_a_native_sidecar(overlay: str) -> None:
    assert decode_pods(overlay)
    for pod in decode_pods(overlay):
        (sidecar,) = pod.sidecars()
        assert sidecar in pod.spec["initContainers"] and sidecar["restartPolicy"] == "Always"
        config = effective_config(rendered(overlay), pod, sidecar)
        decode = urlsplit(config.decode_url)
        (vllm,) = pod.vllm()
        tokens = argv(vllm)
        assert decode.hostname in ("127.0.0.1", "localhost")
        assert tokens[tokens.index("--host") + 1] == "127.0.0.1", "D must not be reachable around the sidecar"
        assert int(tokens[tokens.index("--port") + 1]) == decode.port
        assert decode.port not in container_ports(vllm).values()


@pytest.mark.parametrize("overlay", ["sidecar", "loadtest"])
def test_injection_only_in_the_loadtest(overlay: str) -> None:
    for pod in decode_pods(overlay):
        config = effective_config(rendered(overlay), pod, pod.sidecars()[0])
        if overlay == "loadtest":
            assert config.inject_rate > 0 and config.inject_seed is not None
        else:
            assert config.inject_rate == 0 and not config.inject_header


# vLLM containers: NIXL settings -----------------------------------------------------------


def vllm_cases() -> list[tuple[str, Pod, dict[str, Any]]]:
    return [(o, p, c) for o in OVERLAYS for p in pods(rendered(o)) for c in p.vllm()]


@pytest.mark.parametrize("case", vllm_cases(), ids=case_id)
def test_vllm_nixl_settings(case: tuple[str, Pod, dict[str, Any]]) -> None:
    _, pod, container = case
    env = {e["name"]: e for e in container["env"]}
    host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]
    assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", "vLLM defaults it to localhost"
    port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
    assert container_ports(container)["nixl-side"] == port
    tokens = argv(container)
    transfer = json.loads(tokens[tokens.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "NixlConnector" and transfer["kv_role"] == "kv_both"
    assert pod.spec["enableServiceLinks"] is False


def test_p_and_d_run_one_vllm_release_and_one_model() -> None:
    cases = vllm_cases()
    assert {case[1].labels["app.kubernetes.io/component"] for case in cases} == {"prefill", "decode"}
    assert len({c["image"] for _, _, c in cases}) == 1
    assert len({argv(c)[0] for _, _, c in cases}) == 1  # the model, first of vllm serve's args


# Services, PodMonitor, NetworkPolicy -----------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_and_target_their_ports(overlay: str) -> None:
    resources = rendered(overlay)
    for service in of_kind(resources, "Service"):
        selected = [p for p in pods(resources) if selects(service["spec"]["selector"], p.labels)]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for pod in selected:
            served = set(
                itertools.chain.from_iterable(container_ports(c).values() for c in pod.serving_containers())
            )
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in served


def test_decode_service_targets_the_sidecar_not_d() -> None:
    resources = rendered("sidecar")
    (pod,) = decode_pods("sidecar")
    config = effective_config(resources, pod, pod.sidecars()[0])
    (service,) = [s for s in of_kind(resources, "Service") if selects(s["spec"]["selector"], pod.labels)]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [config.port]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_service_name_turns_into_a_setting(overlay: str) -> None:
    """Service links inject <NAME>_PORT etc.; a Service named kvr-admin would set KVR_ADMIN_PORT."""
    for service in of_kind(rendered(overlay), "Service"):
        prefix = service["metadata"]["name"].upper().replace("-", "_")
        injected = {prefix + "_PORT", prefix + "_SERVICE_HOST", prefix + "_SERVICE_PORT"}
        assert not injected & (set(env_names()) | {"VLLM_PORT", "VLLM_HOST_IP"})
    for pod in pods(rendered(overlay)):
        assert pod.spec["enableServiceLinks"] is False


@pytest.mark.parametrize("overlay", SIDECAR_OVERLAYS)
def test_podmonitor_scrapes_every_sidecar(overlay: str) -> None:
    resources = rendered(overlay)
    (monitor,) = of_kind(resources, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for pod in pods(resources):
        for container in pod.sidecars():
            config = effective_config(resources, pod, container)
            assert selects(monitor["spec"]["selector"], pod.labels), pod.name
            assert container_ports(container)[endpoint["port"]] == config.admin_port


def _rules_covering(policy: Resource, port: int) -> list[dict[str, Any]]:
    return [
        rule
        for rule in policy["spec"].get("ingress", [])
        if not rule.get("ports") or any(p.get("port") == port for p in rule["ports"])
    ]


@pytest.mark.parametrize("overlay", SIDECAR_OVERLAYS)
def test_admin_port_stays_in_the_namespace_proxy_port_is_open(overlay: str) -> None:
    resources = rendered(overlay)
    for pod in pods(resources):
        for container in pod.sidecars():
            config = effective_config(resources, pod, container)
            policies = [
                p
                for p in of_kind(resources, "NetworkPolicy")
                if selects(p["spec"]["podSelector"], pod.labels)
            ]
            assert any("Ingress" in p["spec"]["policyTypes"] for p in policies), f"{pod.name} is not isolated"
            admin_rules = [r for p in policies for r in _rules_covering(p, config.admin_port)]
            assert admin_rules
            for rule in admin_rules:
                assert rule.get("from"), "the admin port is open to every source"
                for peer in rule["from"]:
                    assert "ipBlock" not in peer
                    names = peer.get("namespaceSelector", {}).get("matchLabels", {})
                    assert "namespaceSelector" not in peer or "kubernetes.io/metadata.name" in names
            proxy_rules = [r for p in policies for r in _rules_covering(p, config.port)]
            assert any(not r.get("from") for r in proxy_rules), "clients cannot reach the proxy port"


def test_decode_pods_accept_nixl_from_prefill_pods() -> None:
    resources = rendered("loadtest")  # holds both P and D
    prefill = [p for p in pods(resources) if p.labels.get("app.kubernetes.io/component") == "prefill"]
    assert prefill
    for pod in decode_pods("loadtest"):
        policies = [
            p for p in of_kind(resources, "NetworkPolicy") if selects(p["spec"]["podSelector"], pod.labels)
        ]
        open_to_p = [
            rule
            for policy in policies
            for rule in policy["spec"]["ingress"]
            if not rule.get("ports")
            and any(selects(peer.get("podSelector", {}), prefill[0].labels) for peer in rule.get("from", []))
        ]
        assert open_to_p, "UCX ports are chosen at run time: P needs every port of D"


# Router mode -------------------------------------------------------------------------------


def test_router_sends_decode_legs_to_a_d_without_a_sidecar() -> None:
    resources = rendered("router")
    (router,) = [p for p in pods(resources) if p.sidecars() and not p.vllm()]
    config = effective_config(resources, router, router.sidecars()[0])
    assert config.prefill, "router mode needs a P pool"
    decode = urlsplit(config.decode_url)
    service = next(s for s in of_kind(resources, "Service") if s["metadata"]["name"] == decode.hostname)
    assert decode.port in [p["port"] for p in service["spec"]["ports"]]
    targets = [p for p in pods(resources) if selects(service["spec"]["selector"], p.labels)]
    assert targets and all(p.vllm() and not p.sidecars() for p in targets), "two sidecars would release twice"
    prefill_services = {s["metadata"]["name"]: s for s in of_kind(rendered("example-prefill"), "Service")}
    for url in config.prefill:
        parts = urlsplit(url)
        assert parts.port in [p["port"] for p in prefill_services[str(parts.hostname)]["spec"]["ports"]]


# Load test Job -----------------------------------------------------------------------------


def parse_loadtest(tokens: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The loadtest command's own parser: the CLI's once registered, else its flag module."""
    if "loadtest" in cli.COMMANDS:
        parser = cli.build_parser("loadtest")
        return parser, parser.parse_args(tokens[1:])
    module = pytest.importorskip("sidecar.loadtest.config", reason="no loadtest command in this build")
    parser = argparse.ArgumentParser(prog="kv-release-sidecar loadtest")
    module.add_arguments(parser)
    return parser, parser.parse_args(tokens[2:])


def test_loadtest_job_uses_real_flags_and_the_overlay_services() -> None:
    resources = rendered("loadtest")
    (job,) = of_kind(resources, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    tokens = argv(container)
    assert tokens[:2] == ["kv-release-sidecar", "loadtest"]
    parser, args = parse_loadtest(tokens)
    known = parser_flags(parser)
    assert set(flags(tokens)) <= known, f"unknown loadtest flags {set(flags(tokens)) - known}"
    config = importlib.import_module("sidecar.loadtest.config").config_from_args(args)
    services = {s["metadata"]["name"]: s for s in of_kind(resources, "Service")}
    for url in (config.prefill_url, config.decode_url, config.sidecar_admin_url):
        parts = urlsplit(url)
        assert parts.port in [p["port"] for p in services[str(parts.hostname)]["spec"]["ports"]], url
    assert job["spec"]["activeDeadlineSeconds"] > config.duration + config.drain_timeout + 60
    mounts = [m["mountPath"].rstrip("/") + "/" for m in container["volumeMounts"]]
    assert any(config.report.startswith(m) for m in mounts), "the report would land on a read-only root"


# Files mounted into the sidecars ------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_config_file_is_valid_toml(case: tuple[str, Pod, dict[str, Any]]) -> None:
    overlay, pod, container = case
    text = config_file_text(rendered(overlay), pod, container)
    assert text is not None
    assert isinstance(tomllib.loads(text), dict)
