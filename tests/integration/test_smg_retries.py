"""What smg does in front of P and D, found by test: what docs/smg.md says about it, held to smg.

The sidecar must never release blocks another decode server may still read,
so ``--retried-statuses`` behind smg has to hold every status smg retries on
another D with P's same parameters; a retry that runs the prefill again pins
new blocks and makes releasing safe. docs/smg.md sets ``--retried-statuses
none`` from what this module finds with smg 1.13.0 (requirements/smg.txt):

* smg uses the NIXL flow only for a prefill worker registered with
  ``kv_connector: NixlConnector`` (here a discovery file); with ``--prefill`` and
  ``--decode`` alone it sends both legs at once, without ``kv_transfer_params``
  (``smg_pd_kv_connector_mode_total{mode="passthrough"}``).
* A non-streaming decode leg that D answers 401, 403, 408, 413, 422, 429 or
  a 5xx is retried as a whole pair, five attempts in all: each attempt is a
  new prefill on P and a decode leg with that prefill's parameters, never
  P's same parameters twice, on one D or on two; 400 and 404 are not retried,
  nor a streamed request.
* What smg sends: to P the request rebuilt (``max_tokens`` 1, not streamed,
  no ``stream_options``, the client's ``kv_transfer_params`` replaced), to D
  the request with P's parameters; of the headers only ``authorization``,
  ``traceparent`` and a client's ``x-request-id`` pass.
* D with an API key answers smg's ``/v1/models`` probe 401: its model is
  unknown, and smg refuses every request without a prefill, unless the
  discovery file names ``model_id``.
* Without the sidecar, every one of a request's retried prefills stays pinned
  until P's lease; with it, each is released at once.

P is the prefill simulator (real NIXL agents; its lease 0 keeps every prefill
pinned until notified, except in the lease test); the decode servers are
decode simulators that log each request's ``kv_transfer_params``. A status is
asked for with the simulator's ``[[reject:N]]`` prompt marker, which both
decode servers honour. If a later smg retries the decode leg with the same
parameters, this module fails and names the status.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.deploy.manifests import ROOT
from tests.integration.guides import in_own_group
from tests.support.ports import free_port
from tests.support.runner import NONE, SHIPPED, run_sidecar
from tests.support.sims import p_stats, wait_stats

pytestmark = pytest.mark.nixl

SMG = ROOT / ".tools" / "smg" / "bin" / "smg"
MODEL = "sim-model"
RETRIES = 5  # --retry-max-retries, smg's default: attempts per request
RETRIED = (401, 403, 408, 413, 422, 429, 500, 501, 502, 503, 504)
NOT_RETRIED = (400, 404)
#: Retries without waiting, and no breaker: every status below reaches D, whatever came before.
FAST = ("--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5", "--disable-circuit-breaker")

ASGI = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[..., Awaitable[None]]], Awaitable[None]
]


@dataclass
class Seen:
    """What one server was sent: (path, headers, body) per request, completion routes only."""

    requests: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)

    def wrap(self, app: Any) -> ASGI:
        async def recorded(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
                await app(scope, receive, send)
                return
            chunks: list[bytes] = []
            more = True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            body = b"".join(chunks)
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            self.requests.append((scope["path"], headers, json.loads(body)))
            sent = False

            async def replay() -> dict[str, Any]:
                nonlocal sent
                if sent:
                    return await receive()
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}

            await app(scope, replay, send)

        return recorded


@contextmanager
def smg(args: list[str], log: Path) -> Iterator[str]:
    """smg on a free port, in its own process group; its URL once every worker is ready."""
    if not SMG.exists():
        pytest.fail(f"{SMG.relative_to(ROOT)} is missing: make test creates it")
    port = free_port()
    command = [str(SMG), "launch", "--pd-disaggregation", *args, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *FAST]
    url = f"http://127.0.0.1:{port}"
    with in_own_group(command, log, lambda: _ready(url)):
        yield url


def _ready(url: str) -> bool:
    try:
        workers = httpx.get(url + "/workers", timeout=1).json()["workers"]
    except (httpx.TransportError, ValueError, KeyError):
        return False
    return len(workers) >= 2 and all(w["status"] == "ready" for w in workers)


def manifest(tmp_path: Path, prefill: str, decoders: list[str], model_id: str | None = None) -> list[str]:
    """A discovery file with P as a NIXL prefill worker; smg's flags to read it."""
    named = {"model_id": model_id} if model_id else {}
    workers = [{"url": prefill, "worker_type": "prefill", "kv_connector": "NixlConnector", **named}]
    workers += [{"url": url, "worker_type": "decode", **named} for url in decoders]
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"version": 1, "workers": workers}))
    return ["--discovery-provider", "file", "--discovery-file", str(path)]


@dataclass
class Cluster:
    p: ServerThread
    decoders: list[ServerThread]
    front: str
    p_seen: Seen
    d_seen: list[Seen]

    def prefills(self) -> int:
        """Prefills P has run (each pins the prompt's blocks)."""
        return int(httpx.get(self.p.url + "/stats", timeout=5).json()["requests_pinned"])

    def attempts(self) -> list[dict[str, Any]]:
        """Every decode leg the decode servers got."""
        return [entry for d in self.decoders for entry in httpx.get(d.url + "/sim/log", timeout=5).json()]


@contextmanager
def cluster(
    tmp_path: Path,
    decoders: int = 1,
    *,
    fail_first: tuple[int, ...] = (),
    nixl: bool = True,
    policy: str = "round_robin",
) -> Iterator[Cluster]:
    """P, ``decoders`` decode servers (the first ``fail_first[i]`` requests of server i answered
    503) and smg in front: NIXL through a discovery file, or with ``nixl`` False the flags alone."""
    p_seen, d_seen = Seen(), [Seen() for _ in range(decoders)]
    p_config = PrefillSimConfig(port=0, lease=0, side_channel_port=0, model=MODEL)
    with ExitStack() as stack:
        p = stack.enter_context(serve(p_seen.wrap(create_prefill_app(p_config))))
        servers = []
        for i in range(decoders):
            failing = fail_first[i] if i < len(fail_first) else 0
            config = DecodeSimConfig(
                port=0, model=MODEL, log_params=True, fail_first=failing, fail_origin="handler"
            )
            servers.append(stack.enter_context(serve(d_seen[i].wrap(create_decode_app(config)))))
        if nixl:
            args = manifest(tmp_path, p.url, [d.url for d in servers])
        else:
            args = ["--prefill", p.url, *(arg for d in servers for arg in ("--decode", d.url))]
        args += ["--decode-policy", policy]
        front = stack.enter_context(smg(args, tmp_path / "smg.log"))
        yield Cluster(p, servers, front, p_seen, d_seen)


def ask(url: str, text: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": text, "max_tokens": 4, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_smg_reruns_the_whole_pair_and_never_sends_ps_parameters_twice(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        for status in (*RETRIED, *NOT_RETRIED):
            prefills, attempts = c.prefills(), len(c.attempts())
            answer = ask(c.front, f"asked {status} [[reject:{status}]]")
            assert answer.status_code >= 400, (status, answer.text)
            tries = RETRIES if status in RETRIED else 1
            assert c.prefills() - prefills == tries, f"{status}: {c.prefills() - prefills} prefills"
            assert len(c.attempts()) - attempts == tries, f"{status}: decode legs"
        params = [entry["kv_transfer_params"] for entry in c.attempts()]
        assert all(p and p["do_remote_prefill"] for p in params)  # every decode leg carried P's
        ids = [p["remote_request_id"] for p in params]
        assert len(ids) == len(set(ids)) == RETRIES * len(RETRIED) + len(NOT_RETRIED)
        # A streamed request gets D's refusal at once: one prefill, one decode leg.
        prefills, attempts = c.prefills(), len(c.attempts())
        answer = ask(c.front, "streamed [[reject:401]]", stream=True)
        assert answer.status_code == 401
        assert (c.prefills() - prefills, len(c.attempts()) - attempts) == (1, 1)


def test_a_retry_goes_on_with_a_new_prefill_on_another_decode_server(tmp_path: Path) -> None:
    # The first decode server answers every request 503; smg retries on the other, after a new prefill.
    with cluster(tmp_path, 2, fail_first=(1000,)) as c:
        for n in range(4):
            assert ask(c.front, f"two decoders {n}").status_code == 200
        refused, served = (httpx.get(d.url + "/sim/log").json() for d in c.decoders)
        assert refused and all(entry["status"] == 503 for entry in refused)
        assert len(served) == 4 and all(entry["status"] == 200 for entry in served)
        assert c.prefills() == len(refused) + len(served)  # each attempt its own prefill
        ids = [entry["kv_transfer_params"]["remote_request_id"] for entry in refused + served]
        assert len(set(ids)) == len(ids)  # no parameters reached a second decode server


def test_what_smg_sends_to_p_and_to_d(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        headers = {
            "authorization": "Bearer k",
            "x-request-id": "client-id-1",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "x-data-parallel-rank": "1",
            "x-custom": "yes",
        }
        theirs = {"do_remote_prefill": True, "remote_engine_id": "client's"}
        body = {"model": MODEL, "prompt": "what is sent", "max_tokens": 4, "stream": True}
        body |= {"stream_options": {"include_usage": True}, "kv_transfer_params": theirs}
        with httpx.stream("POST", c.front + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200 and b"data:" in r.read()
        [(_, p_headers, p_body)] = c.p_seen.requests
        [(_, d_headers, d_body)] = c.d_seen[0].requests
        assert (p_body["max_tokens"], p_body["stream"], "stream_options" in p_body) == (1, False, False)
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
        assert d_body["stream"] is True and d_body["stream_options"] == body["stream_options"]
        assert d_body["max_tokens"] == 4 and d_body["kv_transfer_params"]["do_remote_prefill"] is True
        assert d_body["kv_transfer_params"]["remote_engine_id"] != "client's"
        for sent in (p_headers, d_headers):
            passed = {name: sent[name] for name in headers if name in sent}
            assert passed == {k: headers[k] for k in ("authorization", "x-request-id", "traceparent")}
        without_id = ask(c.front, "no id of its own")
        assert without_id.status_code == 200
        assert "x-request-id" not in c.p_seen.requests[-1][1]  # smg makes up none
        assert "x-request-id" not in c.d_seen[0].requests[-1][1]


def test_without_a_kv_connector_smg_sends_both_legs_at_once(tmp_path: Path) -> None:
    with cluster(tmp_path, nixl=False) as c:
        assert ask(c.front, "passthrough").status_code == 200
        [(_, _, p_body)] = c.p_seen.requests
        [(_, _, d_body)] = c.d_seen[0].requests
        assert "kv_transfer_params" not in p_body and "kv_transfer_params" not in d_body
        assert c.prefills() == 0  # P pinned nothing: D computed the prompt itself


@pytest.mark.parametrize("model_id", [None, MODEL])
def test_d_with_an_api_key_needs_model_id_in_the_discovery_file(tmp_path: Path, model_id: str | None) -> None:
    p_config = PrefillSimConfig(port=0, lease=0, side_channel_port=0, model=MODEL)
    d_config = DecodeSimConfig(port=0, model=MODEL, api_key="d-key")
    with serve(create_prefill_app(p_config)) as p, serve(create_decode_app(d_config)) as d:
        args = manifest(tmp_path, p.url, [d.url], model_id)
        with smg(args, tmp_path / "smg.log") as front:
            listed = {
                w["worker_type"]: w["model_id"] for w in httpx.get(front + "/workers").json()["workers"]
            }
            assert listed == {"prefill": MODEL, "decode": model_id or "unknown"}
            answer = httpx.post(
                front + "/v1/completions",
                json={"model": MODEL, "prompt": "keyed", "max_tokens": 4},
                headers={"authorization": "Bearer d-key"},
                timeout=60,
            )
            pinned = int(httpx.get(p.url + "/stats").json()["requests_pinned"])
            if model_id is None:
                assert answer.status_code == 503 and "decode workers" in answer.text
                assert pinned == 0  # refused before P: nothing pinned
            else:
                assert answer.status_code == 200 and pinned == 1


LEASE = 2.0


# D's refusal, the sidecar's retried_statuses (None: no sidecar), whether the sidecar releases.
# A 401 is no status a proxy retries on another D: released under either setting. A 503 is, under
# the shipped default (502, 503, 504): the sidecar leaves it to P's lease, as it must in front of a
# proxy that could send the same parameters to another D; smg never does, so docs/smg.md sets none.
HELD: dict[str, tuple[int, Any, bool]] = {
    "401-without-sidecar": (401, None, False),
    "401-retried-none": (401, NONE, True),
    "401-retried-default": (401, SHIPPED, True),
    "503-retried-none": (503, NONE, True),
    "503-retried-default": (503, SHIPPED, False),
}


@pytest.mark.parametrize("case", list(HELD))
def test_each_retried_prefill_is_held_to_ps_lease_unless_the_sidecar_releases_it(
    tmp_path: Path, case: str
) -> None:
    """D refuses every attempt (401: it requires an API key the client does not send; 503: its
    admission answers before the handler): five prefills."""
    status, retried, released = HELD[case]
    p_config = PrefillSimConfig(port=0, lease=LEASE, side_channel_port=0, model=MODEL)
    if status == 401:
        d_config = DecodeSimConfig(port=0, model=MODEL, api_key="d-key")
    else:
        d_config = DecodeSimConfig(port=0, model=MODEL, fail_first=1000, fail_status=status)
    with ExitStack() as stack:
        p = stack.enter_context(serve(create_prefill_app(p_config)))
        d = stack.enter_context(serve(create_decode_app(d_config, VllmDHooks("0.34.0"))))
        decode_url = d.url
        if retried is not None:
            settings = {"release": "nixl", "prefill_allow": ("127.0.0.1",), "retried_statuses": retried}
            decode_url = stack.enter_context(run_sidecar(d.url, **settings)).url
        front = stack.enter_context(smg(manifest(tmp_path, p.url, [decode_url], MODEL), tmp_path / "smg.log"))
        answer = ask(front, "no key")
        if status == 401:
            assert answer.status_code == 500 and "Unauthorized" in answer.text
        else:
            assert answer.status_code == status, answer.text
        stats = p_stats(p)
        assert stats["requests_pinned"] == RETRIES
        if released:  # well before the lease: the releases freed them
            stats = wait_stats(p, lambda s: s["freed_by_notification"] >= RETRIES, LEASE / 4, 0.02)
            assert stats["freed_by_expiry"] == 0
        else:
            assert stats["pinned_requests"] == RETRIES  # pinned after smg answered
            stats = wait_stats(p, lambda s: s["freed_by_expiry"] >= RETRIES, LEASE * 5, 0.05)
            assert stats["freed_by_notification"] == 0
