"""The sidecar in front of D, against vLLM's own P code of the newest known release (or of
``$KVR_CONFORMANCE_RELEASE_DAY_VLLM``, as ``make vllm-release`` sets it), D reporting it or a release
no one has made yet.

P is vLLM's P-side NIXL code read out of the wheel (``vllm_p.PProcess``, TP 2, real NIXL
agents); D is the decode simulator reporting ``reported`` on ``GET /version`` (it never reads or
notifies P itself, so whatever P frees was freed by the sidecar); the sidecar runs as ``serve``
ships it, with the nixl strategy. What a release day must keep:

* D down, with nothing in front that retries (``--retried-statuses none``): freed on every rank;
* a fresh sidecar's first release (a validation 400, before D's handler): freed on every rank;
* a handler 400 (a prompt over the context): left to D's own release (counted as covered);
* an admitted request: never released;
* and P logs no unknown id in any of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sidecar.nixl.versions import NEWEST, WireProfile
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.conformance.vllm_p import PProcess, p_request_id
from tests.conformance.wheels import fetch_wheel
from tests.support.runner import NONE, SHIPPED, Sidecar, run_sidecar

pytestmark = pytest.mark.nixl

NEWEST_KNOWN = ".".join(map(str, NEWEST))
VERSION = os.environ.get("KVR_CONFORMANCE_RELEASE_DAY_VLLM", NEWEST_KNOWN)
#: The release whose parameters P emits (a release the sidecar does not know: the newest known).
WIRE = VERSION if WireProfile.for_version(VERSION) else NEWEST_KNOWN
REPORTED = [VERSION, "99.0.0"]  # P's release, and one newer than any
TP = 2
RANKS = [(0, 0), (0, 1)]


@pytest.fixture(scope="module")
def p() -> Iterator[PProcess]:
    process = PProcess(fetch_wheel(VERSION), TP, 1)
    yield process
    process.stop()


@contextmanager
def decode(reported: str) -> Iterator[ServerThread]:
    config = DecodeSimConfig(port=0, version=reported, max_model_len=40, model="sim-prefill")
    with serve(create_decode_app(config)) as d:
        yield d


def params(p: PProcess, rid: str) -> dict[str, Any]:
    """``kv_transfer_params`` as P of the newest known release emits them."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        "remote_request_id": p_request_id(WIRE, rid),
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "remote_block_ids": [[1, 2]],
        "remote_num_tokens": 2,
        "tp_size": TP,
        "transfer_mode": "pull",
        "pp_size": 1,
        "dcp_size": 1,
        "remote_registration_generation": 1,
    }


def ask(sc: Sidecar, p: PProcess, rid: str, prompt_words: int = 5, **body: Any) -> httpx.Response:
    request = {
        "model": "sim-prefill",
        "prompt": " ".join(["tok"] * prompt_words),
        "max_tokens": 2,
        "kv_transfer_params": params(p, rid),
        **body,
    }
    return httpx.post(sc.url + "/v1/completions", json=request, headers={"x-request-id": rid}, timeout=10)


def sidecar(decode_url: str, **settings: Any) -> Any:
    """The sidecar with the nixl strategy and, unless said, the shipped ``retried_statuses``."""
    settings = {"retried_statuses": SHIPPED, **settings}
    return run_sidecar(decode_url, release="nixl", prefill_allow=("127.0.0.1",), **settings)


async def held(p: PProcess, *rids: str) -> list[str]:
    ids = [p_request_id(WIRE, rid) for rid in rids]
    for rid in ids:
        await p.hold(rid)
    return ids


async def no_unknown_ids(p: PProcess) -> None:
    await p.settle()
    assert not p.logs("unrecognized request"), p.logs("unrecognized request")
    assert not [e for e in p.events if "error" in e]


@pytest.mark.parametrize("reported", REPORTED)
async def test_d_down_under_none_is_freed_on_every_rank(p: PProcess, reported: str) -> None:
    rid = f"down-{reported}"
    (pid,) = await held(p, rid)
    with decode(reported) as d, sidecar(d.url, release_deadline=20.0, retried_statuses=NONE) as sc:
        assert sc.server.call(sc.app.runtime.decode.decode_version()) == reported  # type: ignore[union-attr]
        d.stop()  # D goes down after the sidecar learnt its release
        response = ask(sc, p, rid)
        assert response.status_code == 503
        await p.await_(lambda: p.finished(pid) == RANKS, f"{pid} freed on every rank")
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
    await no_unknown_ids(p)


@pytest.mark.parametrize("reported", REPORTED)
async def test_a_fresh_sidecars_first_release_is_freed_on_every_rank(p: PProcess, reported: str) -> None:
    rid = f"first-{reported}"
    (pid,) = await held(p, rid)
    with decode(reported) as d, sidecar(d.url) as sc:
        response = ask(sc, p, rid, max_tokens="two")  # body validation: before D's handler
        assert response.status_code == 400
        await p.await_(lambda: p.finished(pid) == RANKS, f"{pid} freed on every rank")
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        newer = 1.0 if WireProfile.for_version(reported) is None else 0.0
        assert sc.sample("kvr_vllm_unknown_version_info", version=reported) == newer
    await no_unknown_ids(p)


@pytest.mark.parametrize("reported", REPORTED)
async def test_a_handler_400_is_left_to_d_and_an_admitted_request_is_never_released(
    p: PProcess, reported: str
) -> None:
    left, admitted = f"left-{reported}", f"admitted-{reported}"
    ids = await held(p, left, admitted)
    with decode(reported) as d, sidecar(d.url) as sc:
        assert ask(sc, p, left, prompt_words=80).status_code == 400  # over max_model_len: D's handler
        assert ask(sc, p, admitted).status_code == 200
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="covered_by_engine") == 1
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0
        assert sc.sample("kvr_not_released_total", outcome="no_release", cause="admitted") == 1
    await no_unknown_ids(p)
    assert [p.finished(pid) for pid in ids] == [[], []]  # the sidecar freed neither
    assert not [e for e in p.events if e.get("notif", "").startswith(tuple(ids))]
