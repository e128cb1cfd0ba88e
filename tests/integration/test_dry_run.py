"""``--dry-run`` predicts its live strategy: the same request mix, the same decisions.

For each strategy (``nixl``; ``http`` with the right and with a wrong token;
``auto``) one cluster runs it live and another runs it with ``--dry-run``: a
real P (the prefill simulator over NIXL, vLLM 0.33.0, pins that never expire),
a "vLLM D" simulator that releases its own handler rejections as vLLM 0.33
does, with the control-endpoint plugin mounted (its engine records the
releases it is asked for), and a sidecar in front. Every request in the mix
is rejected in a different way; each one's "release decision" log line is
compared. A live ``sent`` is a dry-run ``would_send``; the only other
difference allowed is one that needs P's answer: a P that is not there
fails the live NIXL release at its deadline, while the dry run, which never
contacts P, says ``would_send``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sidecar.release.auto import AutoReleaser
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from sidecar.vllm_plugin import KVReleaseMiddleware, PluginSettings
from tests.support.fake_engine import NotifyEngine, sampling_params
from tests.support.ports import free_port
from tests.support.runner import Sidecar, run_sidecar
from tests.support.sims import prefill
from tests.support.until import until

pytestmark = pytest.mark.nixl

VERSION = "0.33.0"
MODEL = "sim-prefill"
TOKEN = "dry-run-token-0123456789"
#: What each request of the mix does to P's parameters or to the request itself.
MIX = ("admitted", "validation", "handler", "old_shape", "not_allowed", "unresolvable", "p_gone")
STRATEGIES: dict[str, dict[str, Any]] = {
    "nixl": {"release": "nixl"},
    "http": {"release": "http", "control_token": TOKEN},
    "http_wrong_token": {"release": "http", "control_token": "not-the-token-0123456789"},
    "auto": {"release": "auto", "control_token": TOKEN},
}
COMMON: dict[str, Any] = {
    "prefill_allow": ("127.0.0.1", "p.invalid"),
    "decode_health_interval": 0.05,
    "release_deadline": 1.5,
    "release_retry_max": 0.2,
    "handshake_timeout": 0.3,
}


class Decisions(logging.Handler):
    """The pipeline's "release decision" lines, by request id: (result, reason)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: dict[str, tuple[str, str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "release decision":
            fields = record.__dict__
            self.seen[fields["request_id"]] = (fields["result"], fields["reason"])


@contextmanager
def recording() -> Iterator[Decisions]:
    logger, handler = logging.getLogger("sidecar.release"), Decisions()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextmanager
def cluster(settings: dict[str, Any]) -> Iterator[tuple[ServerThread, Sidecar]]:
    p_config = PrefillSimConfig(
        port=0, vllm_version=VERSION, tp=2, num_blocks=512, lease=0, side_channel_port=0, model=MODEL
    )
    d_config = DecodeSimConfig(port=0, version=VERSION, max_model_len=40, model=MODEL, vllm_d=True)
    d_app = create_decode_app(d_config, VllmDHooks(VERSION))
    plugin = PluginSettings(token=TOKEN, emulate_grace=0.05, emulate_settle=0.05)
    d_app.add_middleware(KVReleaseMiddleware, settings=plugin, sampling_params=sampling_params)
    d_app.state.engine_client = NotifyEngine()  # records; D's connector is not what is compared
    with (
        serve(create_prefill_app(p_config)) as p,
        serve(d_app) as d,
        run_sidecar(d.url, **COMMON, **settings) as sc,
    ):
        yield p, sc


def send(sc: Sidecar, p: ServerThread, kind: str, rid: str) -> int:
    params = prefill(p, rid)
    body: dict[str, Any] = {"model": MODEL, "prompt": "tok tok", "max_tokens": 2}
    if kind == "handler":
        body["model"] = "no-such-model"  # 404 from D's handler: D's own fix releases it
    elif kind != "admitted":
        body["max_tokens"] = "x"  # 400 before D's handler: D never releases it
    if kind == "old_shape":
        del params["remote_registration_generation"]  # what P sends before 0.33.0
    elif kind == "not_allowed":
        params["remote_host"] = "192.0.2.1"  # outside --prefill-allow
    elif kind == "unresolvable":
        params["remote_host"] = "p.invalid"  # allowed by name; DNS never resolves it
    elif kind == "p_gone":
        params["remote_port"] = free_port()  # allowed; nothing listens there
    body["kv_transfer_params"] = params
    answer = httpx.post(sc.url + "/v1/completions", json=body, headers={"x-request-id": rid}, timeout=10)
    return answer.status_code


def run_mix(settings: dict[str, Any]) -> tuple[dict[str, int], dict[str, tuple[str, str]]]:
    """Each request of the mix once; D's answers and the decisions, by kind."""
    with recording() as decisions, cluster(settings) as (p, sc):
        seen_alive = "kvr_decode_can_notify 1.0"
        until(lambda: seen_alive in httpx.get(sc.admin_url + "/metrics").text, "D seen alive")
        releaser = sc.app.runtime.releaser if sc.app.runtime else None
        if isinstance(releaser, AutoReleaser) and settings.get("control_token") == TOKEN:
            until(lambda: releaser.path == "control", "auto finding D's control endpoint")
        statuses = {kind: send(sc, p, kind, f"{kind}-1") for kind in MIX}
        until(lambda: sc.wait_idle() and len(decisions.seen) >= len(MIX) - 1, "every decision")
        sc.settle()
        return statuses, {rid.removesuffix("-1"): seen for rid, seen in decisions.seen.items()}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_dry_run_decides_as_its_live_strategy(strategy: str) -> None:
    live_statuses, live = run_mix(STRATEGIES[strategy])
    dry_statuses, dry = run_mix({**STRATEGIES[strategy], "dry_run": True})
    assert live_statuses == dry_statuses  # the dry run never changes an answer
    assert live_statuses["admitted"] == 200 and "admitted" not in live and "admitted" not in dry
    assert live["handler"] == dry["handler"] == ("covered_by_engine", "")
    predicted = {
        kind: ("would_send", reason) if result == "sent" else (result, reason)
        for kind, (result, reason) in live.items()
    }
    if strategy in ("nixl",):
        # Only P could say it is gone: the live release fails at its deadline.
        assert live["p_gone"][0] == "failed" and dry["p_gone"] == ("would_send", "")
        predicted["p_gone"] = dry["p_gone"]
    assert dry == predicted, (live, dry)
    # Not vacuous: each strategy's own refusals show in both.
    if strategy == "nixl":
        assert dry["old_shape"] == ("refused", "inconsistent_version")
        assert dry["not_allowed"] == ("refused", "not_allowed")
        assert dry["unresolvable"] == ("refused", "unresolvable")
        assert dry["validation"] == ("would_send", "")
    elif strategy == "http_wrong_token":
        assert dry["validation"] == ("refused", "forbidden")  # a token, not the one D holds
    else:
        assert dry["validation"] == dry["not_allowed"] == ("would_send", "")
