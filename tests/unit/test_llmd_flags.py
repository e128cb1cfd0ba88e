"""llm-d's command line onto the config: mappings, one-line refusals, the docs table, pool entries."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar.config import ConfigError
from sidecar.k8s.members import Members
from sidecar.llmd.command import load, recognises
from sidecar.llmd.flags import MAPPING, duration

DOC = Path(__file__).resolve().parents[2] / "docs" / "llm-d.md"


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--vllm-port=9000"], "decode_url", "http://localhost:9000"),
        (["--model-server-port", "9001", "--enable-tls=decoder"], "decode_url", "https://localhost:9001"),
        (["--secure-proxy=false"], "tls", False),
        (["--enable-prefiller-sampling"], "prefill_policy", "random"),
        (["--inference-pool=pool", "--enable-ssrf-protection"], "inference_pool", "default/pool"),
        (["--prefill-retry-backoff=1m30s"], "prefill_retry_backoff", 90.0),
        (["--tls-min-version=VersionTLS13"], "tls_min_version", "1.3"),
        (["--zap-encoder=console"], "log_format", "text"),
        ([], "release", "nixl"),
    ],
)
def test_flags_map_onto_the_config(argv: list[str], field: str, value: object) -> None:
    config, _ = load(argv, {})
    assert getattr(config, field) == value


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--kv-connector=mooncake"], "kv-connector"),
        (["--ec-connector=nixl"], "ec-connector"),
        (["--decode-chunk-size=64"], "decode-chunk-size"),
        (["--moriio-write-mode"], "moriio-write-mode"),
        (["--enable-ssrf-protection"], "enable-ssrf-protection"),
        (["--tls-min-version=VersionTLS11"], "tls-min-version"),
        (["--connector=nixlv2"], "connector"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(argv: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(argv, {})
    assert f"--{named}" in str(caught.value) and "\n" not in str(caught.value)


def test_kvr_variables_change_the_drop_in_s_defaults_but_not_llm_d_flags() -> None:
    config, _ = load(["--port=8100"], {"KVR_RELEASE": "dry-run", "KVR_PORT": "9999"})
    assert config.release == "dry-run" and config.port == 8100


def test_serve_recognises_llm_d_flags_only() -> None:
    assert recognises(["--port=8000", "--vllm-port=8200"]) and not recognises(
        ["--port=8000", "--config", "x"]
    )


def test_go_durations() -> None:
    assert duration("f", "200ms") == pytest.approx(0.2) and duration("f", "1h") == 3600
    with pytest.raises(ConfigError):
        duration("f", "2 seconds")


def test_the_docs_table_names_every_flag() -> None:
    documented = set(re.findall(r"`--([a-z0-9-]+)`", DOC.read_text()))
    assert set(MAPPING) <= documented, set(MAPPING) - documented


def test_pool_members_become_entries_finished_pods_leave() -> None:
    members = Members()
    members.apply_pool({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}})
    members.apply_pod(
        "ADDED", {"metadata": {"name": "p0"}, "status": {"phase": "Running", "podIP": "10.0.0.5"}}
    )
    members.apply_pod(
        "ADDED", {"metadata": {"name": "p1"}, "status": {"phase": "Failed", "podIP": "10.0.0.6"}}
    )
    assert members.entries("5600-5663") == (["10.0.0.5:8000"], ["10.0.0.5:5600-5663"])
    members.apply_pod("DELETED", {"metadata": {"name": "p0"}})
    assert members.entries("5600-5663") == ([], [])
