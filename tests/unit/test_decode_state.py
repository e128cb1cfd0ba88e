"""``DecodeState`` against a fake upstream: the view's fields, transitions, the poller, passive
signals, the sidecar's own SIGTERM, and that ``view()`` is one attribute read."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from sidecar.classify import ENGINE_FAULTED_MESSAGE, NoAnswer
from sidecar.decode import probes as decode_probes
from sidecar.decode.probes import probe_kv_connector
from sidecar.decode.state import (
    ENGINE_DEAD_MESSAGES,
    FAULTED_HOLD,
    INFO_MAX_AGE,
    DecodeView,
    engine_dead_answer,
)
from sidecar.upstream import UpstreamError
from tests.support.fakes import NIXL_METRICS, OK, Answer, ProbedD, connect_refused, probed_state
from tests.support.until import until_async

PLAIN_METRICS = b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 0.0\n'
NO_STATS_METRICS = b"# TYPE python_gc_objects_collected counter\npython_gc_objects_collected_total 1.0\n"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the view -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "can_notify", "reason"),
    [
        (DecodeView("alive", False, True, "0.33.0"), True, ""),
        (DecodeView("alive", False, None, None), True, ""),  # cannot tell: D may notify
        (DecodeView("alive", False, False, "0.33.0"), False, "no KV connector"),
        (DecodeView("dead", False, True, "0.33.0"), False, "engine dead"),
        (DecodeView("unknown", False, True, "0.33.0"), False, "D not answering /health"),
        (DecodeView("alive", True, True, "0.33.0"), False, "shutting down"),
    ],
)
def test_can_notify_needs_a_live_engine_no_shutdown_and_a_connector(
    view: DecodeView, can_notify: bool, reason: str
) -> None:
    assert (view.can_notify, view.reason) == (can_notify, reason)


@pytest.mark.parametrize(
    ("status", "message", "dead"),
    [
        (500, "EngineCore encountered an issue. See stack trace (above) for the root cause.", True),
        (500, "The server had an error while processing your request.", True),
        (500, "The server had an error while processing your request. Sorry about that!", False),
        (503, "The server had an error while processing your request.", False),
        (500, "boom", False),
        (500, None, False),
    ],
)
def test_engine_dead_answer_is_status_500_with_an_engine_dead_error_text(
    status: int, message: str | None, dead: bool
) -> None:
    assert engine_dead_answer(status, message) is dead
    assert len(ENGINE_DEAD_MESSAGES) == 2


async def test_before_the_first_probe_d_is_unknown_and_cannot_notify() -> None:
    view = probed_state(ProbedD()).view()
    assert view == DecodeView("unknown", False, None, None) and not view.can_notify


async def test_start_reads_health_version_and_metrics_before_it_returns() -> None:
    upstream = ProbedD()
    state = probed_state(upstream)
    await state.start()
    try:
        assert state.view() == DecodeView("alive", False, True, "0.33.0")
        assert state.view().can_notify
        assert upstream.calls == ["health", "version", "metrics"]
    finally:
        await state.close()


async def test_view_is_one_attribute_read_with_no_io() -> None:
    upstream = ProbedD()
    state = probed_state(upstream)
    await state.refresh()
    calls = len(upstream.calls)
    views = {id(state.view()) for _ in range(10_000)}
    assert views == {id(state._view)} and len(upstream.calls) == calls


@pytest.mark.parametrize(
    ("health", "engine"),
    [
        (OK, "alive"),
        ((503, [], b""), "dead"),
        ((404, [], b'{"detail":"Not Found"}'), "unknown"),
        ((500, [], b""), "unknown"),
        (connect_refused(), "unknown"),
        (UpstreamError(NoAnswer.HEADER_TIMEOUT, "no response headers from D in time"), "unknown"),
    ],
)
async def test_health_status_gives_the_engine(health: Any, engine: str) -> None:
    state = probed_state(ProbedD(health=health))
    assert (await state.refresh()).engine == engine


# --- the KV connector -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics", "setting", "kv"),
    [
        (NIXL_METRICS, "auto", True),
        (PLAIN_METRICS, "auto", False),  # stats on, no NIXL family
        (NO_STATS_METRICS, "auto", None),  # --disable-log-stats: cannot tell
        ((404, [], b""), "auto", None),
        (connect_refused(), "auto", None),
        (PLAIN_METRICS, "yes", True),
        (NIXL_METRICS, "no", False),
        (NO_STATS_METRICS, "no", False),
    ],
)
async def test_kv_connector_from_metrics_unless_the_setting_says(
    metrics: Any, setting: str, kv: bool | None
) -> None:
    state = probed_state(ProbedD(metrics=metrics), kv_connector=setting)
    view = await state.refresh()
    assert view.kv_connector is kv
    assert view.can_notify is (kv is not False)


async def test_a_family_split_across_chunks_is_found() -> None:
    upstream = ProbedD()
    upstream.chunk = 7  # every marker straddles a boundary somewhere
    assert await probe_kv_connector(upstream) is True
    upstream.set(metrics=PLAIN_METRICS)
    assert await probe_kv_connector(upstream) is False


async def test_metrics_past_the_scan_limit_cannot_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_probes, "METRICS_LIMIT", 64)
    upstream = ProbedD(metrics=PLAIN_METRICS + b"# padding\n" * 20 + b"vllm:nixl_xfer_time_seconds_count 0\n")
    upstream.chunk = 32
    assert await probe_kv_connector(upstream) is None


async def test_no_connector_warns_once_and_again_only_when_it_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream, clock = ProbedD(metrics=PLAIN_METRICS), Clock()
    state = probed_state(upstream, clock=clock)
    with caplog.at_level(logging.INFO, logger="sidecar.decode_state"):
        await state.refresh()
        clock.now += INFO_MAX_AGE
        await state.refresh()  # re-read, same answer: no second warning
    warnings = [r.getMessage() for r in caplog.records if "no NIXL KV connector" in r.getMessage()]
    assert len(warnings) == 1 and "releases every rejection" in warnings[0]
    assert upstream.calls.count("metrics") == 2


async def test_cannot_tell_warns_to_set_the_setting(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.decode_state"):
        await probed_state(ProbedD(metrics=NO_STATS_METRICS)).refresh()
    assert any("set decode_kv_connector" in r.getMessage() for r in caplog.records)


# --- transitions ----------------------------------------------------------------------------


async def test_engine_death_and_return_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    upstream = ProbedD()
    state = probed_state(upstream)
    with caplog.at_level(logging.INFO, logger="sidecar.decode_state"):
        await state.refresh()
        upstream.set(health=(503, [], b""))
        assert (await state.refresh()).engine == "dead"
        assert (await state.refresh()).engine == "dead"
        upstream.set(health=OK)
        assert (await state.refresh()).can_notify
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot release" in m and "engine dead" in m for m in messages) == 1
    assert sum("D can release" in m for m in messages) == 2  # the first contact, then the return


async def test_info_is_reread_when_d_comes_back_and_when_it_is_old() -> None:
    upstream, clock = ProbedD(), Clock()
    state = probed_state(upstream, clock=clock)
    await state.refresh()
    await state.refresh()
    assert upstream.calls.count("metrics") == 1  # fresh: not re-read
    upstream.set(health=connect_refused())
    clock.now += 1
    assert (await state.refresh()).engine == "unknown"
    upstream.set(health=OK, metrics=PLAIN_METRICS, version=(200, [], b'{"version":"0.29.0"}'))
    clock.now += 1
    view = await state.refresh()  # D restarted: another process, maybe another start-up
    assert (view.engine, view.kv_connector, view.version, view.can_notify) == (
        "alive",
        False,
        "0.29.0",
        False,
    )
    clock.now += INFO_MAX_AGE
    await state.refresh()
    assert upstream.calls.count("metrics") == 3


async def test_a_failed_info_read_is_retried_at_the_next_poll() -> None:
    upstream, clock = ProbedD(metrics=connect_refused()), Clock()
    state = probed_state(upstream, clock=clock)
    assert (await state.refresh()).kv_connector is None
    upstream.set(metrics=PLAIN_METRICS)
    clock.now += 1
    assert (await state.refresh()).kv_connector is False


# --- passive signals ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("signal", "message", "engine"),
    [
        (NoAnswer.CONNECT_REFUSED, None, "unknown"),
        (NoAnswer.DNS, None, "unknown"),
        (NoAnswer.CONNECT_TIMEOUT, None, "unknown"),
        (NoAnswer.RESET_AFTER_SEND, None, "unknown"),
        (NoAnswer.HEADER_TIMEOUT, None, "alive"),  # a slow D is not a gone D
        (NoAnswer.POOL_TIMEOUT, None, "alive"),  # the sidecar's own pool
        (500, "The server had an error while processing your request.", "dead"),
        (500, "EngineCore encountered an issue. See stack trace (above) for the root cause.", "dead"),
        (500, "boom", "alive"),
        (404, "The model `x` does not exist.", "alive"),
        (200, None, "alive"),
    ],
)
async def test_observe_lowers_the_view_at_once(
    signal: NoAnswer | int, message: str | None, engine: str
) -> None:
    state = probed_state(ProbedD())
    await state.refresh()
    state.observe(signal, message)
    assert state.view().engine == engine
    assert state.view().can_notify is (engine == "alive")


@pytest.mark.parametrize(("health", "engine"), [(OK, "alive"), ((503, [], b""), "dead"), (None, "alive")])
async def test_an_answer_after_d_was_unreachable_brings_back_what_health_last_said(
    health: Answer | None, engine: str
) -> None:
    """D flapped: a refused connection, then D answers a rejection its handler raised. D's own
    fix has released it; the view must say so before the judge reads it, not a poll later."""
    upstream, clock = ProbedD(), Clock()
    if health is None:
        upstream.set(health=connect_refused())  # D was never seen before it answered
    else:
        upstream.set(health=health)
    state = probed_state(upstream, clock=clock)
    await state.refresh()
    clock.now += 1
    state.observe(NoAnswer.CONNECT_REFUSED)
    assert state.view().engine == "unknown"
    clock.now += 1
    upstream.set(health=connect_refused())  # a probe that fails meanwhile does not change what /health said
    await state.refresh()
    state.observe(404, "The model `x` does not exist.")
    assert state.view().engine == engine and state.view().can_notify is (engine == "alive")


async def test_an_answer_after_d_was_unreachable_wakes_the_poller_to_read_d_again() -> None:
    upstream = ProbedD()
    state = probed_state(upstream, interval=3600.0)
    await state.start()
    try:
        state.observe(NoAnswer.CONNECT_REFUSED)
        calls = len(upstream.calls)
        state.observe(404, None)
        await until_async(lambda: upstream.calls[calls:] == ["health", "version", "metrics"])
    finally:
        await state.close()


async def test_connection_close_means_d_is_exiting_until_an_answer_without_it() -> None:
    upstream, clock = ProbedD(), Clock()
    state = probed_state(upstream, clock=clock)
    await state.refresh()
    state.observe(400, None, closing=True)
    assert state.view().shutting_down and not state.view().can_notify
    clock.now += 1
    upstream.set(health=connect_refused())  # the listener closed: no answer, still exiting
    assert (await state.refresh()).shutting_down
    clock.now += 1
    upstream.set(health=(200, [(b"Connection", b"close")], b""))
    assert (await state.refresh()).shutting_down
    clock.now += 1
    upstream.set(health=OK)  # D restarted
    assert not (await state.refresh()).shutting_down


async def test_a_faulted_engine_cannot_notify_while_it_keeps_answering_so() -> None:
    """vLLM 0.34.0 with fault tolerance: /health stays 200 while every request is refused with
    EngineFaultedError, and D's own notification waits in the faulted engine core."""
    upstream, clock = ProbedD(), Clock()
    state = probed_state(upstream, clock=clock)
    await state.refresh()
    state.observe(503, ENGINE_FAULTED_MESSAGE)
    view = state.view()
    assert view.faulted and view.engine == "alive" and not view.can_notify
    assert view.reason == "engine faulted"
    clock.now += FAULTED_HOLD - 1
    assert not (await state.refresh()).can_notify  # /health's 200 does not end it
    state.observe(503, ENGINE_FAULTED_MESSAGE)  # each such answer renews it
    clock.now += FAULTED_HOLD - 1
    assert not (await state.refresh()).can_notify
    clock.now += 2
    assert (await state.refresh()).can_notify  # no such answer for FAULTED_HOLD: recovered


@pytest.mark.parametrize(
    ("status", "message"),
    [(503, ENGINE_FAULTED_MESSAGE + " "), (500, ENGINE_FAULTED_MESSAGE), (503, "busy"), (503, None)],
)
async def test_only_the_faulted_answer_marks_the_engine_faulted(status: int, message: str | None) -> None:
    state = probed_state(ProbedD())
    await state.refresh()
    state.observe(status, message)
    assert not state.view().faulted and state.view().can_notify


async def test_a_probe_that_started_before_an_observation_does_not_undo_it() -> None:
    upstream, clock = ProbedD(), Clock()
    state = probed_state(upstream, clock=clock)
    await state.refresh()
    answered, go = asyncio.Event(), asyncio.Event()

    async def slow_health() -> Answer:
        answered.set()
        await go.wait()
        return OK

    upstream.set(health=slow_health)
    probe = asyncio.create_task(state.refresh())
    await answered.wait()  # the probe is in flight, started at clock.now
    clock.now += 0.5
    state.observe(500, "The server had an error while processing your request.")
    go.set()
    assert (await probe).engine == "dead"
    upstream.set(health=(503, [], b""))
    clock.now += 1
    assert (await state.refresh()).engine == "dead"
    upstream.set(health=OK)
    clock.now += 1
    assert (await state.refresh()).engine == "alive"


async def test_draining_is_sticky_whatever_d_answers() -> None:
    state = probed_state(ProbedD())
    await state.refresh()
    state.draining()
    assert state.view().shutting_down and not state.view().can_notify
    assert (await state.refresh()).shutting_down


# --- the poller -----------------------------------------------------------------------------


async def test_the_poller_follows_d_and_stops_on_close() -> None:
    upstream = ProbedD()
    state = probed_state(upstream, interval=0.001)
    await state.start()
    upstream.set(health=(503, [], b""))
    await until_async(lambda: state.view().engine == "dead")
    upstream.set(health=OK)
    await until_async(lambda: state.view().engine == "alive")
    await state.close()
    calls = len(upstream.calls)
    await asyncio.sleep(0.01)
    assert len(upstream.calls) == calls


async def test_the_poller_survives_a_bug_and_says_unknown(caplog: pytest.LogCaptureFixture) -> None:
    upstream = ProbedD()
    state = probed_state(upstream, interval=0.001)
    await state.start()
    try:
        with caplog.at_level(logging.ERROR, logger="sidecar.decode_state"):
            upstream.set(health=RuntimeError("a bug"))
            await until_async(lambda: state.view().engine == "unknown")
        assert any("probing D failed" in r.getMessage() for r in caplog.records)
        upstream.set(health=OK)
        await until_async(lambda: state.view().engine == "alive")
    finally:
        await state.close()


async def test_decode_version_reads_version_once_when_the_poller_has_none() -> None:
    upstream = ProbedD(health=connect_refused())
    state = probed_state(upstream)
    await state.refresh()
    assert state.view().version is None and "version" not in upstream.calls
    assert await state.decode_version() == "0.33.0"
    assert await state.decode_version() == "0.33.0"
    assert upstream.calls.count("version") == 1 and state.view().version == "0.33.0"


async def test_ds_release_once_read_is_kept_while_d_is_down() -> None:
    """The strategies ask D's state for P's release on every job: D gone (a restart, a crash)
    must not make them forget it, or every release would be refused ``unknown_version``."""
    upstream = ProbedD()
    state = probed_state(upstream)
    await state.refresh()
    assert state.view().version == "0.33.0"
    upstream.set(health=connect_refused(), version=connect_refused(), metrics=connect_refused())
    await state.refresh()
    state.observe(NoAnswer.CONNECT_REFUSED)
    assert state.view().engine == "unknown"
    assert await state.decode_version() == "0.33.0" and state.version() == "0.33.0"


async def test_without_polling_nothing_is_asked_until_readiness_asks() -> None:
    upstream = ProbedD()
    state = probed_state(upstream, interval=0)
    await state.start()
    assert upstream.calls == [] and state.view().engine == "unknown"
    assert (await state.fresh()).engine == "alive"
    calls = len(upstream.calls)
    assert (await state.fresh(max_age=60)).engine == "alive" and len(upstream.calls) == calls  # cached
    await state.close()


async def test_start_waits_for_a_silent_d_no_longer_than_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.decode import state as decode_state

    async def silent() -> Answer:
        await asyncio.Event().wait()
        raise AssertionError("never answers")

    monkeypatch.setattr(decode_state, "START_BOUND", 0.05)
    state = probed_state(ProbedD(health=silent))
    try:
        await asyncio.wait_for(state.start(), 2)
        assert state.view().engine == "unknown" and not state.view().can_notify
    finally:
        await state.close()
