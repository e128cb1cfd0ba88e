"""Answers a proxy in front of the decode pods may retry elsewhere are never released behind.

A gateway or mesh that resends a failed request, P's ``kv_transfer_params``
and all, to another decode pod makes that pod's D read P's blocks; a release
by this sidecar would let P reuse them first. ``retried_statuses`` (default
502, 503, 504) names what such a proxy retries: the judge leaves those
rejections to the retry (or to P's lease), the answer stays as it was (no
``x-should-retry: false``: the parameters are not spent), and the refusal of
spent parameters takes a status outside the list. Router mode is untouched: a
retry there runs a fresh prefill. Over real retrying proxies (nginx, haproxy)
in ``tests/faults/test_mesh_retries.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from sidecar import retries
from sidecar.asgi import OVER_LIMIT
from sidecar.config import Config, ConfigError, load
from tests.support.fakes import Client, FakeResponse, FakeUpstream, refused
from tests.unit.rigs import V033, Rig, completion, error, rig, router


@pytest.mark.parametrize(
    ("entries", "statuses"),
    [
        (("502", "503", "504"), {502, 503, 504}),
        (("none",), set()),
        (("5xx",), set(range(500, 600))),
        (("5XX", "409"), {*range(500, 600), 409}),
        (("429", "503"), {429, 503}),
    ],
)
def test_entries_name_statuses(entries: tuple[str, ...], statuses: set[int]) -> None:
    assert retries.problem(entries) is None
    assert retries.parse(entries) == statuses


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        (("none", "503"), "stands alone"),
        (("200",), "not a 4xx or 5xx"),
        (("abc",), "not a 4xx or 5xx"),
        (("6xx",), "not a 4xx or 5xx"),
        (("4xx",), "leaves no status"),
        (("409", "410", "400"), "leaves no status"),
        (("600",), "not a 4xx or 5xx"),
        (("399",), "not a 4xx or 5xx"),
        (("5xx", "abc"), "'abc' is not a 4xx or 5xx"),  # every entry is read, not just the first
        (("none", "5xx"), "stands alone"),
    ],
)
def test_bad_entries_are_refused_with_the_reason(entries: tuple[str, ...], words: str) -> None:
    assert words in (retries.problem(entries) or "")
    with pytest.raises(ConfigError, match="retried_statuses"):
        Config(retried_statuses=entries)


def test_every_status_from_400_to_599_is_accepted_and_the_refusals_say_why_in_full() -> None:
    assert all(retries.problem((str(status),)) is None for status in (400, 499, 500, 599))
    assert retries.problem(("409", "410", "400")) == (
        "retrying 409, 410 and 400 leaves no status to refuse a spent request with"
    )
    assert retries.problem(("6xx",)) == "'6xx' is not a 4xx or 5xx status, 4xx, 5xx or 'none'"
    assert retries.problem(("none", "503")) == (
        "'none' stands alone (nothing in front of the decode pods retries)"
    )


@pytest.mark.parametrize(
    ("retried", "status"),
    [(set(), 409), ({502, 503, 504}, 409), ({409}, 410), ({409, 410}, 400), (set(range(500, 600)), 409)],
)
def test_the_spent_answer_is_a_status_no_proxy_in_front_retries(retried: set[int], status: int) -> None:
    assert retries.replay_status(frozenset(retried)) == status


def test_ranges_are_shown_folded() -> None:
    assert retries.shown(frozenset()) == "none"
    assert retries.shown(retries.parse(("502", "503", "504", "409"))) == "409,502-504"
    assert retries.shown(retries.parse(("5xx",))) == "500-599"


def test_flags_variables_and_the_file_all_take_the_list() -> None:
    assert load({}, {}).retried_statuses == ("502", "503", "504")
    assert load({}, {"KVR_RETRIED_STATUSES": "none"}).retried_statuses == ("none",)
    assert load({"retried_statuses": "503, 5xx"}, {}).retried_statuses == ("503", "5xx")
    assert load({}, {}, "retried_statuses = [503, 502]").retried_statuses == ("503", "502")
    with pytest.raises(ConfigError, match=r"KVR_RETRIED_STATUSES.*'nope'"):
        load({}, {"KVR_RETRIED_STATUSES": "nope"})


def _left(r: Rig, cause: str) -> float:
    labels = {"outcome": "retryable", "cause": cause}
    return r.metrics.registry.get_sample_value("kvr_not_released_total", labels) or 0.0


def _answer(status: int) -> Any:
    return lambda request: error(status, "ServiceUnavailableError")


@pytest.mark.parametrize(
    ("d", "settings", "client_status", "cause"),
    [
        (FakeUpstream(refused, reached=False), {}, 503, "unreachable"),
        (FakeUpstream(_answer(503)), {}, 503, "rejected_5xx"),
        (FakeUpstream(lambda r: FakeResponse.json(200, {})), {"inject_header": True}, 503, "injected"),
        (FakeUpstream(_answer(500)), {"retried_statuses": ("5xx",)}, 500, "rejected_5xx"),
        (FakeUpstream(_answer(429)), {"retried_statuses": ("429",)}, 429, "rejected_4xx"),
    ],
    ids=["d-down", "d-503", "injected-503", "d-500-under-5xx", "d-429-listed"],
)
async def test_a_retryable_answer_is_left_to_the_retry(
    d: FakeUpstream, settings: dict[str, Any], client_status: int, cause: str
) -> None:
    headers = [(b"x-kvr-inject-reject", b"503")] if settings.get("inject_header") else []
    async with rig(d, **settings) as r:
        client = await r.call(Client(body=completion(V033), headers=headers))
        assert client.status == client_status
        assert r.releaser.jobs == [] and _left(r, cause) == 1
        # Not spent: a retry with the same parameters, here or elsewhere, may use them.
        assert b"x-should-retry" not in client.response_headers
        again = await r.call(Client(body=completion(V033)))
        assert again.status != 409


@pytest.mark.parametrize(
    ("d", "settings", "client_status"),
    [
        (FakeUpstream(refused, reached=False), {"retried_statuses": ("none",)}, 503),
        (FakeUpstream(_answer(500)), {}, 500),
        (FakeUpstream(lambda r: error(400, "Bad Request")), {}, 400),
        (FakeUpstream(lambda r: error(400, "Bad Request")), {"retried_statuses": ("5xx",)}, 400),
    ],
    ids=["d-down-nothing-retries", "d-500", "d-400", "d-400-under-5xx"],
)
async def test_other_answers_are_released_and_spent(
    d: FakeUpstream, settings: dict[str, Any], client_status: int
) -> None:
    async with rig(d, **settings) as r:
        client = await r.call(Client(body=completion(V033, max_tokens="x")))
        assert client.status == client_status and len(r.releaser.jobs) == 1
        assert client.response_headers[b"x-should-retry"] == b"false"


async def test_a_stream_opening_with_an_error_is_released_whatever_is_retried() -> None:
    """A 200 went out: no proxy retries it."""
    refusal = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    async with rig(FakeUpstream(lambda r: FakeResponse.sse(refusal)), retried_statuses=("5xx", "409")) as r:
        client = await r.call(Client(body=completion(V033, stream=True)))
        assert client.status == 200 and [job.cause for job in r.releaser.jobs] == ["stream_admission_error"]


@pytest.mark.parametrize(("retried", "status"), [(("503",), 409), (("409",), 410), (("409", "410"), 400)])
async def test_spent_parameters_are_refused_with_a_status_the_proxy_does_not_retry(
    retried: tuple[str, ...], status: int
) -> None:
    async with rig(FakeUpstream(lambda r: error(400, "Bad Request")), retried_statuses=retried) as r:
        await r.call(Client(body=completion(V033, max_tokens="x")))
        again = await r.call(Client(body=completion(V033)))
        assert again.status == status and again.response_headers[b"x-should-retry"] == b"false"
        assert len(r.d.requests) == 1


async def test_above_the_concurrency_limit_the_body_is_read_only_when_its_503_may_be_released() -> None:
    def over() -> Client:
        client = Client(body=completion(V033))
        scope = client.scope
        client.scope = lambda: {**scope(), "extensions": {OVER_LIMIT: {}}}  # type: ignore[method-assign]
        return client

    d = FakeUpstream(lambda r: FakeResponse.json(200, {}))
    async with rig(d, limit_concurrency=10) as r:
        client = await r.call(over())
        assert client.status == 503 and r.releaser.jobs == [] and _left(r, "overloaded") == 0
    async with rig(d, limit_concurrency=10, retried_statuses=("none",)) as r:
        client = await r.call(over())
        assert client.status == 503 and [job.cause for job in r.releaser.jobs] == ["overloaded"]


async def test_router_mode_releases_behind_any_status_a_retry_runs_a_fresh_prefill() -> None:
    async with router(FakeUpstream(refused, reached=False)) as r:
        client = await r.call(Client(body=completion()))
        assert client.status == 503 and [job.cause for job in r.releaser.jobs] == ["unreachable"]


async def test_a_stream_cut_after_its_200_is_released_under_the_default_when_ambiguous_ones_are() -> None:
    """The 200 went out, so no proxy retries the request: the cut is not an answer a proxy retries
    (the 502 the sidecar would map a reset to never reached anyone)."""
    assert Config().retried_statuses == ("502", "503", "504")  # the rig keeps the shipped default
    async with rig(FakeUpstream(lambda r: FakeResponse.sse(broken=True)), release_ambiguous=True) as r:
        with pytest.raises(Exception, match="broke"):
            await r.call(Client(body=completion(V033, stream=True)))
        await r.proxy.pipeline.flush(2)
        assert [job.cause for job in r.releaser.jobs] == ["reset_after_send"]
        assert _left(r, "reset_after_send") == 0


async def test_parameters_left_to_a_retry_are_not_released_by_a_later_rejection() -> None:
    """A 503 left for the mesh's retry: another pod's D may be reading P's blocks, so a later
    rejection here with the same parameters is not released while that lease runs."""
    answers = iter([error(503, "ServiceUnavailableError"), error(400, "Bad Request")])
    async with rig(FakeUpstream(lambda r: next(answers))) as r:
        first = await r.call(Client(body=completion(V033)))
        assert first.status == 503 and _left(r, "rejected_5xx") == 1
        second = await r.call(Client(body=completion(V033, max_tokens="x")))
        assert second.status == 400 and len(r.d.requests) == 2
        assert r.releaser.jobs == []
        labels = {"outcome": "no_release", "cause": "params_in_use"}
        assert r.metrics.registry.get_sample_value("kvr_not_released_total", labels) == 1


def test_the_start_up_line_warns_when_every_503_is_released(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.retries")
    with caplog.at_level(logging.INFO, logger="test.retries"):
        retries.announce(log, ("none",), ())
        retries.announce(log, ("503", "504"), (503, 429))
    quiet, listed = caplog.records
    assert quiet.levelno == logging.WARNING and quiet.setting == "retried_statuses"  # type: ignore[attr-defined]
    assert quiet.getMessage().startswith("retried_statuses none: every rejection is released")
    assert listed.levelno == logging.INFO and listed.setting == "retried_statuses"  # type: ignore[attr-defined]
    assert listed.getMessage().startswith("retried_statuses 503-504: rejections answered with them")
    assert "injected 503 rejections are not released either" in listed.getMessage()


NOTHING_RETRIED = (
    "retried_statuses none: every rejection is released, D unreachable (503) included",
    "make sure no gateway or mesh in front of the decode pods retries this pod's answers on another "
    "pod (Istio retries 503 by default); or list what it retries (deploy/mesh has Istio and Envoy "
    "retry policies)",
)
RETRIED = (
    "retried_statuses 503-504 (KVR_RETRIED_STATUSES): rejections answered with them are not released, since "
    "a gateway or mesh in front of the decode pods may retry them on another pod, whose D reads P's blocks "
    "(P's lease frees them otherwise); injected 503,504 rejections are not released either",
    "retry no other status on the decode route (deploy/mesh); if nothing in front retries, set "
    "retried_statuses to none so that D unreachable, draining and over-limit answers (503) are released too",
)


def test_the_advice_an_operator_reads_word_for_word(caplog: pytest.LogCaptureFixture) -> None:
    assert retries.advice(frozenset()) == NOTHING_RETRIED
    retried = retries.parse(("503", "504"))
    assert retries.advice(retried, (504, 429, 503), "KVR_RETRIED_STATUSES") == RETRIED
    with caplog.at_level(logging.INFO, logger="test.retries"):
        retries.announce(logging.getLogger("test.retries"), ("none",), ())
    assert caplog.records[0].getMessage() == "; ".join(NOTHING_RETRIED)


def test_the_advice_names_the_setting_its_source_and_what_to_do() -> None:
    what, fix = retries.advice(frozenset(), source="KVR_RETRIED_STATUSES")
    assert what.startswith("retried_statuses none (KVR_RETRIED_STATUSES): every rejection is released")
    assert "Istio retries 503 by default" in fix
    what, fix = retries.advice(retries.parse(("5xx",)), injected=(429,))
    assert what.startswith("retried_statuses 500-599: ") and "injected" not in what
    assert fix.startswith("retry no other status on the decode route")
