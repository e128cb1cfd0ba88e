"""The ``nixl`` strategy against real NIXL agents and real ZMQ ROUTER listeners on loopback.

``FakePrefill`` plays P of one vLLM release: one NIXL agent per (PP, TP)
worker and the side-channel listener(s) in that release's framing, strict in
the way vLLM's is (a request of the wrong shape or for a rank P lacks ends
the listener thread: vLLM's listener loop catches only its receive timeout).
The listeners run in a thread; the test polls the workers' notifications
(readiness polled, never slept on).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.nixl import BadReply, EngineMismatch, HandshakeTimeout, PeerUnreachable
from sidecar.nixl.versions import WireProfile
from sidecar.release.base import JobResult, PermanentReleaseError
from sidecar.release.nixl import NixlReleaser
from tests.support.emulation import quick
from tests.support.fake_p import FakePrefill, Rank, make_job, params_for
from tests.support.nixl_layouts import agent_metadata_layout

pytestmark = pytest.mark.nixl


def config(**settings: Any) -> Config:
    base: dict[str, Any] = {"prefill_allow": ("127.0.0.0/8",), "handshake_timeout": 2.0}
    base.update(settings)
    return Config(**base)


@pytest.fixture
def prefills() -> Iterator[list[FakePrefill]]:
    started: list[FakePrefill] = []
    yield started
    for p in started:
        p.stop()


def start(prefills: list[FakePrefill], *args: Any, **kwargs: Any) -> FakePrefill:
    p = FakePrefill(*args, **kwargs)
    prefills.append(p)
    return p


async def no_version() -> str | None:
    return None


@pytest.fixture
async def releaser_factory() -> AsyncIterator[Callable[..., Any]]:
    made: list[NixlReleaser] = []

    async def make(cfg: Config, decode_version: Callable[[], Any] = no_version) -> NixlReleaser:
        releaser = NixlReleaser(cfg, decode_version, CollectorRegistry())
        await releaser.start()
        made.append(releaser)
        return releaser

    yield make
    for releaser in made:
        await releaser.close()


def sample(releaser: NixlReleaser, name: str, **labels: str) -> float:
    return releaser.metrics.registry.get_sample_value(name, labels) or 0.0


# --- every rank freed exactly once, per release ------------------------------------------------

TOPOLOGIES = [
    ("0.34.0", 2, 1),
    ("0.33.0", 1, 1),
    ("0.33.0", 2, 2),
    ("0.29.0", 4, 1),
    ("0.29.0", 1, 2),
    ("0.26.0", 2, 1),
    ("0.21.0", 2, 1),
    ("0.13.0", 1, 1),
    ("0.12.0", 2, 1),
    ("0.11.0", 4, 1),
    ("0.10.1", 1, 1),
]


@pytest.mark.parametrize(("version", "tp", "pp"), TOPOLOGIES)
async def test_release_notifies_every_rank_exactly_once(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any], version: str, tp: int, pp: int
) -> None:
    p = start(prefills, version, tp, pp)
    releaser = await releaser_factory(config(vllm_version=version))
    route = "/v1/completions"
    first = await releaser.release(make_job(p.params("req-1"), "req-1", route))
    second = await releaser.release(make_job(p.params("req-2"), "req-2", route))
    assert (first, second) == (JobResult.SENT, JobResult.SENT)
    wire_id = "req-{}" if p.profile.wire.has_remote_request_id else "cmpl-req-{}-0"
    # req-2 arrives after req-1 on every rank, so req-1's count is final once req-2 is seen.
    await p.received(f"{wire_id.format(2)}:1".encode())
    counts = await p.received(f"{wire_id.format(1)}:1".encode())
    assert counts == {rank: 1 for rank in p.ranks}
    assert sum(len(v) for v in p.notifs.values()) == 2 * len(p.ranks)
    assert p.dead == []
    assert p.requests == len(p.ranks)  # one handshake per worker; the second release used the cache


async def test_pp_ranks_beyond_rank_zero_are_not_queried_before_029(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    # 0.26.0-0.28.x pull: D reads no pp_size and queries PP rank 0 only (vLLM's rank addressing).
    p = start(prefills, "0.28.0", 1, 2)
    releaser = await releaser_factory(config(vllm_version="0.28.0"))
    assert await releaser.release(make_job(p.params("r"), "r")) is JobResult.SENT
    await p.wait(lambda: b"r:1" in p.notifs[(0, 0)])
    assert p.notifs[(1, 0)] == [] and p.requests == 1 and p.dead == []


async def test_cached_handshake_is_reused(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    p = start(prefills, "0.33.0", 2, 1)
    releaser = await releaser_factory(config(vllm_version="0.33.0"))
    for i in range(5):
        assert await releaser.release(make_job(p.params(f"r{i}"), f"r{i}")) is JobResult.SENT
    await p.received(b"r4:1")
    assert p.requests == 2
    assert sample(releaser, "kvr_nixl_handshakes_total", result="ok") == 1
    assert sample(releaser, "kvr_nixl_handshake_cache_total", result="hit") == 4


async def test_concurrent_first_contact_handshakes_once(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    p = start(prefills, "0.33.0", 2, 1)
    releaser = await releaser_factory(config(vllm_version="0.33.0"))
    results = await asyncio.gather(
        *(releaser.release(make_job(p.params(f"c{i}"), f"c{i}")) for i in range(8))
    )
    assert results == [JobResult.SENT] * 8
    await p.wait(lambda: all(len(v) == 8 for v in p.notifs.values()))
    assert p.requests == 2


async def test_new_registration_generation_handshakes_again(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    p = start(prefills, "0.33.0")
    releaser = await releaser_factory(config(vllm_version="0.33.0"))
    await releaser.release(make_job(p.params("g0"), "g0"))
    p.generation = 1
    await releaser.release(make_job(p.params("g1"), "g1"))
    await releaser.release(make_job(p.params("g1b"), "g1b"))
    await releaser.release(make_job(p.params("old", remote_registration_generation=0), "old"))
    await p.received(b"old:1")
    assert p.requests == 2
    assert sample(releaser, "kvr_nixl_handshake_cache_evictions_total", reason="generation") == 1


# --- refusals: nothing is sent, nothing connects -----------------------------------------------


async def test_target_outside_allowlist_is_refused_without_connecting(
    releaser_factory: Callable[..., Any],
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        releaser = await releaser_factory(config(vllm_version="0.33.0", prefill_allow=("10.0.0.0/8",)))
        job = make_job(params_for("0.33.0", "e", port, "x"), "x")
        with pytest.raises(PermanentReleaseError) as info:
            await releaser.release(job)
        assert info.value.reason == "not_allowed"
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
        assert sample(releaser, "kvr_nixl_refused_total", reason="not_allowed") == 1
    finally:
        listener.close()


async def test_empty_allowlist_warns_at_start(
    releaser_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="sidecar.release.nixl")
    await releaser_factory(config(prefill_allow=()))
    assert "releases nothing" in caplog.text


LOOPBACK_WARNING = "is a loopback address"


@pytest.mark.parametrize(
    ("allow", "warned"),
    [
        (("127.0.0.0/8",), False),  # loopback named: P runs on this machine, and said so
        (("127.0.0.1:{port}",), False),
        (("0.0.0.0/0",), True),  # loopback merely contained: P may have left its host at localhost
        (("127.0.0.1:{other}", "0.0.0.0/0"), True),  # the loopback entry names another port
    ],
)
async def test_a_loopback_p_is_warned_about_unless_the_allowlist_names_it(
    prefills: list[FakePrefill],
    releaser_factory: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    allow: tuple[str, ...],
    warned: bool,
) -> None:
    """The warning and ``kvr_nixl_loopback_targets_total`` (alert ``KVReleasePrefillOnLocalhost``)
    are for a P that announces loopback where nobody said P runs; the release is sent either way."""
    caplog.set_level("WARNING", logger="sidecar.release.nixl")
    p = start(prefills, "0.34.0")
    entries = tuple(e.format(port=p.port, other=p.port + 1) for e in allow)
    releaser = await releaser_factory(config(vllm_version="0.34.0", prefill_allow=entries))
    assert await releaser.release(make_job(p.params("lo"), "lo")) is JobResult.SENT
    await p.received(b"lo:1")
    assert sample(releaser, "kvr_nixl_loopback_targets_total") == (1 if warned else 0)
    assert (LOOPBACK_WARNING in caplog.text) is warned


@pytest.mark.parametrize(
    ("answer", "unknown"),
    [(None, "newest"), ("0.26.0rc1", "newest"), ("not-a-version", "newest"), ("0.35.0", "refuse")],
)
async def test_unknown_version_sends_nothing(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any], answer: str | None, unknown: str
) -> None:
    p = start(prefills, "0.33.0")

    async def version() -> str | None:
        return answer

    releaser = await releaser_factory(config(unknown_vllm=unknown), version)
    with pytest.raises(PermanentReleaseError) as info:
        await releaser.release(make_job(p.params("u"), "u"))
    assert info.value.reason == "unknown_version"
    assert p.requests == 0 and all(not v for v in p.notifs.values())


async def test_inconsistent_version_sends_nothing(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    p = start(prefills, "0.21.0", 2, 1)  # a 0.21.0 P: a 3-element request would kill its listener
    releaser = await releaser_factory(config(vllm_version="0.33.0"))
    with pytest.raises(PermanentReleaseError) as info:
        await releaser.release(make_job(p.params("i"), "i"))
    assert info.value.reason == "inconsistent_version"
    assert p.requests == 0 and p.dead == []


async def test_unsafe_release_refused_unless_allowed_then_sent_once(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    p = start(prefills, "0.10.0", 1, 1)
    strict = await releaser_factory(config(vllm_version="0.10.0"))
    with pytest.raises(PermanentReleaseError) as info:
        await strict.release(make_job(p.params("a"), "a"))
    assert info.value.reason == "unsafe_version" and p.requests == 0
    loose = await releaser_factory(config(vllm_version="0.10.0", allow_unsafe_vllm=True))
    assert await loose.release(make_job(p.params("a"), "a")) is JobResult.SENT
    assert await p.received(b"chatcmpl-a:1") == {(0, 0): 1}


# --- failures are typed and retryable --------------------------------------------------------------


async def test_p_down_fails_fast_and_retryably(releaser_factory: Callable[..., Any]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    # The monitor sees the refusal: the attempt fails as unreachable, not as a handshake timeout,
    # and well before the timeout (30 s here; half of it is the margin for a loaded machine).
    releaser = await releaser_factory(config(vllm_version="0.33.0", handshake_timeout=30.0))
    job = make_job(params_for("0.33.0", "e", port, "d"), "d")
    started = time.monotonic()
    with pytest.raises(PeerUnreachable):
        await releaser.release(job)
    assert quick(time.monotonic() - started, 15.0)
    assert sample(releaser, "kvr_nixl_errors_total", reason="unreachable") == 1


async def test_silent_listener_times_out(releaser_factory: Callable[..., Any]) -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        # 2.5 s, longer than the default (2 s): waiting at least that long shows the setting is
        # the one applied; the 30 s bound only catches a wait that never ends.
        releaser = await releaser_factory(config(vllm_version="0.33.0", handshake_timeout=2.5))
        job = make_job(params_for("0.33.0", "e", port, "t"), "t")
        started = time.monotonic()
        with pytest.raises(HandshakeTimeout):
            await asyncio.wait_for(releaser.release(job), 30.0)
        assert time.monotonic() - started >= 2.45  # a timer may fire a tick early
    finally:
        context.destroy(0)


async def test_engine_mismatch_is_refused_and_not_cached(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    p = start(prefills, "0.33.0")
    releaser = await releaser_factory(config(vllm_version="0.33.0"))
    job = make_job(p.params("m", remote_engine_id="someone-else"), "m")
    with pytest.raises(EngineMismatch) as info:
        await releaser.release(job)
    assert isinstance(info.value, PermanentReleaseError) and info.value.reason == "engine_mismatch"
    assert len(releaser.session.cache) == 0 and all(not v for v in p.notifs.values())


# --- forged parameters: never a handshake P cannot answer ---------------------------------------

#: One P of each handshake form: per-worker listeners (raw request), the 2-element request, the
#: 3-element request without and with PP ranks on pull.
FORMS = ["0.11.0", "0.21.0", "0.26.0", "0.34.0"]


def forgeries(version: str) -> dict[str, dict[str, Any]]:
    """What a client may change in a held request's parameters, by name, for P of ``version``."""
    forged = {
        "tp_size": {"tp_size": 2, "remote_engine_id": "bogus"},
        "engine_id": {"remote_engine_id": "bogus"},
    }
    profile = WireProfile.for_version(version)
    assert profile is not None
    if profile.wire.pp_on_pull:
        forged["pp_size"] = {"pp_size": 2, "remote_engine_id": "bogus"}
    return forged


@pytest.mark.parametrize("version", FORMS)
async def test_a_forged_engine_id_stops_at_rank_zero_and_p_keeps_its_listener(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any], version: str
) -> None:
    """A TP 1 P is asked for rank (0, 0) alone: its reply names another engine, so a forged
    ``tp_size`` or ``pp_size`` never reaches P as a request for a rank it lacks (which ends a
    0.11.1+ listener); a true release afterwards is freed."""
    p = start(prefills, version, 1, 1)
    releaser = await releaser_factory(config(vllm_version=version))
    route = "/v1/completions"
    for name, forged in forgeries(version).items():
        with pytest.raises(EngineMismatch):
            await releaser.release(make_job(p.params(f"forged-{name}", **forged), f"forged-{name}", route))
        assert p.dead == [], name
    assert p.requests == len(forgeries(version))  # one request each: rank (0, 0)
    assert sample(releaser, "kvr_nixl_refused_total", reason="engine_mismatch") == len(forgeries(version))
    assert await releaser.release(make_job(p.params("true"), "true", route)) is JobResult.SENT
    wire_id = "true" if p.profile.wire.has_remote_request_id else "cmpl-true-0"
    assert await p.received(f"{wire_id}:1".encode()) == {(0, 0): 1}
    assert p.dead == [] and sum(len(v) for v in p.notifs.values()) == 1


@pytest.mark.parametrize("version", ["0.21.0", "0.34.0"])
async def test_a_client_claiming_more_ranks_than_ps_own_parameters_named_is_refused(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any], version: str
) -> None:
    """P's own parameters (vouched: router mode, or a router hop's token or signature) proved
    P's ranks; a client's own claim of more, with P's true engine id, asks P nothing."""
    p = start(prefills, version, 2, 1)
    releaser = await releaser_factory(config(vllm_version=version))
    assert await releaser.release(make_job(p.params("own"), "own", vouched=True)) is JobResult.SENT
    forged = {"tp_size": 4}
    if p.profile.wire.pp_on_pull:
        forged = {"pp_size": 2}
    with pytest.raises(PermanentReleaseError) as info:
        await releaser.release(make_job(p.params("forged", **forged), "forged"))
    assert info.value.reason == "topology_mismatch" and "nothing is asked of P" in str(info.value)
    assert sample(releaser, "kvr_nixl_refused_total", reason="topology_mismatch") == 1
    with pytest.raises(PermanentReleaseError):  # the dry run refuses it too
        await releaser.rehearse(make_job(p.params("forged-2", **forged), "forged-2"))
    # The client's claim of P's true ranks goes, and so does a vouched claim of more (P restarted).
    assert await releaser.release(make_job(p.params("client"), "client")) is JobResult.SENT
    wire_id = "{}" if p.profile.wire.has_remote_request_id else "chatcmpl-{}"
    assert await p.received(f"{wire_id.format('client')}:1".encode()) == {(0, 0): 1, (0, 1): 1}
    assert p.requests == 2 and p.dead == []


async def test_without_ps_own_parameters_a_claim_within_what_answered_is_released(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    """No vouched parameters, no evidence: the claim stands once rank (0, 0) proved the engine
    (docs/security.md says what that leaves open); a smaller claim is no mismatch."""
    p = start(prefills, "0.34.0", 2, 1)
    releaser = await releaser_factory(config(vllm_version="0.34.0"))
    assert await releaser.release(make_job(p.params("two"), "two")) is JobResult.SENT
    assert await releaser.release(make_job(p.params("one", tp_size=1), "one")) is JobResult.SENT
    await p.wait(lambda: b"one:1" in p.notifs[(0, 0)])
    await p.received(b"two:1")
    assert b"one:1" not in p.notifs[(0, 1)] and p.requests == 2 and p.dead == []


async def test_per_worker_listeners_have_every_reply_checked(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    """Before 0.11.1 rank k listens on base + k, where another engine's worker may be (a
    neighbouring data-parallel engine): its reply ends the release, nothing is sent."""
    p = start(prefills, "0.11.0", 1, 1)
    neighbour = None
    for _ in range(20):  # the port after P's may be taken; try another P
        try:
            neighbour = start(prefills, "0.11.0", 1, 1, port=p.port + 1)
            break
        except zmq.ZMQError:
            p.stop()
            prefills.remove(p)
            p = start(prefills, "0.11.0", 1, 1)
    assert neighbour is not None
    releaser = await releaser_factory(config(vllm_version="0.11.0"))
    with pytest.raises(PermanentReleaseError) as info:
        await releaser.release(make_job(p.params("x", tp_size=2), "x"))
    assert info.value.reason == "topology_mismatch" and neighbour.engine_id in str(info.value)
    assert (p.requests, neighbour.requests) == (1, 1)
    for each in (p, neighbour):
        each.drain()
        assert all(not v for v in each.notifs.values())
    assert len(releaser.session.cache) == 0


async def test_p_restarted_with_new_agents_rehandshakes(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    first = start(prefills, "0.33.0", 2, 1)
    releaser = await releaser_factory(config(vllm_version="0.33.0"))
    assert await releaser.release(make_job(first.params("before"), "before")) is JobResult.SENT
    await first.received(b"before:1")
    port, engine = first.port, first.engine_id
    first.stop()
    prefills.remove(first)
    first.agents.clear()  # the old workers' agents die with them
    second = start(prefills, "0.33.0", 2, 1, engine_id=engine, port=port)
    assert await releaser.release(make_job(second.params("after"), "after")) is JobResult.SENT
    assert await second.received(b"after:1") == {(0, 0): 1, (0, 1): 1}
    assert second.requests == 2
    # The cached agents were the dead ones: the send failed and one re-handshake followed.
    assert sample(releaser, "kvr_nixl_handshake_cache_evictions_total", reason="send_failure") == 1


# --- a vLLM newer than every known release ---------------------------------------------------


class ChangedWirePrefill(FakePrefill):
    """P of a future vLLM whose handshake reply changed: the payload's field is renamed."""

    def encoded(self, rank: Rank) -> bytes:
        layout = agent_metadata_layout(self.profile.low)
        md = layout(engine_id=self.engine_id, agent_metadata=self.agents[rank].get_agent_metadata())
        return msgspec.msgpack.encode({"hash": "0" * 64, "metadata_v2": msgspec.msgpack.encode(md)})


@pytest.mark.parametrize("reported", ["0.35.0", "0.34.1", "1.0.0rc1"])
async def test_a_newer_vllm_is_released_with_the_newest_wire_on_every_rank(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any], reported: str
) -> None:
    """D reports a release no one has made yet; P speaks 0.34.0's wire: every rank is freed."""
    p = start(prefills, "0.34.0", 2, 2)

    async def version() -> str | None:
        return reported

    releaser = await releaser_factory(config(), version)
    assert await releaser.release(make_job(p.params("new-1"), "new-1")) is JobResult.SENT
    assert await p.received(b"new-1:1") == {rank: 1 for rank in p.ranks}
    assert p.dead == []


async def test_a_newer_vllm_whose_reply_does_not_decode_is_refused_as_unknown_wire(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    p = prefills_start(prefills, ChangedWirePrefill("0.34.0", 2, 1))
    releaser = await releaser_factory(config(vllm_version="0.35.0"))
    with pytest.raises(PermanentReleaseError) as info:
        await releaser.release(make_job(p.params("w"), "w"))
    assert info.value.reason == "unknown_wire"
    assert "newer than every release this sidecar knows" in str(info.value)
    assert sample(releaser, "kvr_nixl_refused_total", reason="unknown_wire") == 1
    assert sample(releaser, "kvr_nixl_errors_total", reason="bad_reply") == 0  # never retried
    p.drain()
    assert all(not v for v in p.notifs.values())  # nothing was sent to P


async def test_a_known_release_whose_reply_does_not_decode_is_retried_as_bad_reply(
    prefills: list[FakePrefill], releaser_factory: Callable[..., Any]
) -> None:
    """The same reply from a P the sidecar knows is a fault of that P, not a new wire."""
    p = prefills_start(prefills, ChangedWirePrefill("0.34.0", 1, 1))
    releaser = await releaser_factory(config(vllm_version="0.34.0"))
    with pytest.raises(BadReply):
        await releaser.release(make_job(p.params("k"), "k"))
    assert sample(releaser, "kvr_nixl_refused_total", reason="unknown_wire") == 0


def prefills_start(prefills: list[FakePrefill], p: FakePrefill) -> FakePrefill:
    prefills.append(p)
    return p
