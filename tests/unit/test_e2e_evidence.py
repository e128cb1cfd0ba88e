"""The e2e harness's evidence: P's /metrics, P's log lines, the sidecar's counts, answers' errors."""

from __future__ import annotations

import pytest

from tests.e2e.answers import TOLERANCE, Output, differences, logprob_gap, output_of
from tests.e2e.evidence import Evidence, PLog, PView, by_label, d_reads, delta, error_shape, sidecar_results

# As vLLM 0.32's P serves them (one engine, one model), with the lines a naive parser trips on.
P_METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.031746031746031744
vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 0.0
vllm:nixl_num_failed_transfers_created{engine="0",model_name="tiny-llama"} 1.7961762368849700e+09
vllm:nixl_num_failed_notifications_total{engine="0",model_name="tiny-llama"} 0.0
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="tiny-llama"} 2.0
vllm:nixl_num_kv_expired_reqs_created{engine="0",model_name="tiny-llama"} 1.796176236885016e+09
vllm:nixl_num_notifications_after_expiry_total{engine="0",model_name="tiny-llama"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny-llama"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-llama"} 41.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny-llama"} 3.0
vllm:request_prompt_tokens_bucket{engine="0",le="2.0",model_name="tiny-llama"} 29.0
vllm:request_prompt_tokens_bucket{engine="0",le="5.0",model_name="tiny-llama"} 30.0
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 42.0
vllm:request_prompt_tokens_count{engine="0",model_name="tiny-llama"} 42.0
vllm:request_prompt_tokens_sum{engine="0",model_name="tiny-llama"} 2030.0
"""
SIDECAR_METRICS = """\
kvr_releases_total{strategy="nixl",result="sent"} 4.0
kvr_releases_total{strategy="nixl",result="covered_by_engine"} 2.0
kvr_releases_created{strategy="nixl",result="sent"} 1.79e+09
"""
EXPIRED = (
    "(Worker pid=25523) WARNING 12-02 02:09:54 [base_worker.py:3032] Releasing expired KV blocks for "
    "request cmpl-83f7-0-905e9ea1 which were retrieved by 0 remote worker(s) before lease expired."
)
UNRECOGNIZED = (
    "(Worker pid=25523) ERROR 12-02 02:10:01 [pull_worker.py:667] Potentially invalid KV blocks for "
    "unrecognized request chatcmpl-ad06-87e6fabf were retrieved by a decode worker. They may have expired."
)


def test_p_view_reads_p_own_series_and_sums_labels() -> None:
    view = PView.parse(P_METRICS)
    assert view == PView(
        usage=pytest.approx(2 / 63),
        expired=2.0,
        after_expiry=1.0,
        failed_notifications=0.0,
        failed_transfers=0.0,
        finished=42.0,
        prefills=12.0,  # the requests of more than 5 prompt tokens
    )


def test_a_p_without_nixl_counters_is_refused() -> None:
    with pytest.raises(ValueError, match="no vllm:nixl_"):
        PView.parse('vllm:kv_cache_usage_perc{engine="0"} 0.0\n')


def test_d_reads_and_the_sidecar_results() -> None:
    assert d_reads(P_METRICS) == 3.0
    assert sidecar_results(SIDECAR_METRICS) == {"sent": 4.0, "covered_by_engine": 2.0}
    assert by_label(P_METRICS, "vllm:request_success_total", "finished_reason") == {
        "stop": 1.0,
        "length": 41.0,
    }
    assert delta({"sent": 5.0, "covered_by_engine": 2.0}, {"sent": 4.0, "covered_by_engine": 2.0}) == {
        "sent": 1
    }


def test_p_log_lines_name_the_requests() -> None:
    log = PLog.parse("\n".join(["INFO: 127.0.0.1 - GET /metrics", EXPIRED, "noise", UNRECOGNIZED]))
    assert log.expired == ("cmpl-83f7-0-905e9ea1",)
    assert log.unrecognized == ("chatcmpl-ad06-87e6fabf",)
    assert len(log.lines) == 2
    assert PLog.parse("INFO: nothing to see") == PLog()


@pytest.mark.parametrize(
    ("body", "shape"),
    [
        (
            b'{"error":{"message":"m","type":"Bad Request","param":"body.max_tokens","code":400}}',
            ("Bad Request", "body.max_tokens", 400, False),
        ),
        (
            b'{"error":{"type":"BadRequestError","message":"m","param":null,"code":404}}',
            ("BadRequestError", None, 404, False),
        ),
        (
            b'data: {"error": {"message": "m", "type": "BadRequestError", "param": null, "code": 400}}\n\n'
            b"data: [DONE]\n\n",
            ("BadRequestError", None, 400, True),
        ),
        (b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n', (None, None, None, False)),
        (b'{"choices": []}', (None, None, None, False)),
        (b"not json", (None, None, None, False)),
        (b'{"error": "Unauthorized"}', (None, None, None, False)),
    ],
)
def test_error_shape(body: bytes, shape: tuple[object, ...]) -> None:
    found = error_shape(body)
    assert (found.type, found.param, found.code, found.in_stream) == shape


@pytest.mark.parametrize(
    ("evidence", "notified"),
    [
        (Evidence(d_reads=1, freed_after=0.5), True),  # D read and notified after reading
        (Evidence(freed_after=0.2), True),  # freed, nobody else sent: D's own fix
        (Evidence(sidecar={"sent": 1}, freed_after=0.2), False),  # the sidecar's was the only one
        (Evidence(sidecar={"sent": 1}, freed_after=0.2, after_expiry=1), True),  # both: a duplicate
        (Evidence(expired=1, freed_after=6.0), False),  # nobody notified in time
        (Evidence(expired=1, after_expiry=1, sidecar={"sent": 1}, freed_after=6.0), None),  # too late to tell
        (Evidence(expired=1, after_expiry=1, freed_after=6.0), True),  # D's, after P's lease
        (Evidence(), None),  # P still held it
    ],
)
def test_whether_d_notified_as_p_and_the_sidecar_tell_it(evidence: Evidence, notified: bool | None) -> None:
    assert evidence.d_notified is notified


@pytest.mark.parametrize(
    ("route", "raw", "text"),
    [
        (
            "/v1/completions",
            b'{"choices":[{"text":" ab","token_ids":[5,6]}]}',
            " ab | tokens [5, 6]",
        ),
        (
            "/v1/completions",
            b'data: {"choices":[{"text":" a","token_ids":[5]}]}\n\n'
            b'data: {"choices":[{"text":"b","token_ids":[6]}]}\n\ndata: [DONE]\n\n',
            " ab | tokens [5, 6]",
        ),
        ("/v1/chat/completions", b'{"choices":[{"message":{"content":"hi"}}]}', "hi"),
        (
            "/v1/chat/completions",
            b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
            b'data: {"choices":[{"delta":{"content":"h"}}]}\n\n'
            b'data: {"choices":[{"delta":{"content":"i"}}]}\n\ndata: [DONE]\n\n',
            "hi",
        ),
        (
            "/v1/responses",
            b'{"output":[{"type":"message","content":[{"type":"output_text","text":"yo"}]}]}',
            "yo",
        ),
        (
            "/v1/responses",
            b'event: response.created\ndata: {"type":"response.created","response":{}}\n\n'
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"y"}\n\n'
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"o"}\n\n',
            "yo",
        ),
        ("/v1/completions", b"garbage", ""),
    ],
)
def test_the_generated_text_of_an_answer(route: str, raw: bytes, text: str) -> None:
    assert output_of(route, raw).summary() == text


COMPLETION = (
    b'{"choices":[{"text":" ab","token_ids":[5,6],'
    b'"logprobs":{"tokens":[" a","b"],"token_logprobs":[-0.5,-1.25]}}]}'
)
CHAT_STREAM = (
    b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"h"},"token_ids":[7],'
    b'"logprobs":{"content":[{"token":"h","logprob":-0.1}]}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"i"},"token_ids":[8],'
    b'"logprobs":{"content":[{"token":"i","logprob":-0.2}]}}]}\n\ndata: [DONE]\n\n'
)
RESPONSES = (
    b'{"output":[{"type":"message","content":[{"type":"output_text","text":"yo",'
    b'"logprobs":[{"token":"y","logprob":-0.3},{"token":"o","logprob":-0.4}]}]}]}'
)
RESPONSES_STREAM = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"y",'
    b'"logprobs":[{"token":"y","logprob":-0.3}]}\n\n'
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"o",'
    b'"logprobs":[{"token":"o","logprob":-0.4}]}\n\n'
)


@pytest.mark.parametrize(
    ("route", "raw", "output"),
    [
        ("/v1/completions", COMPLETION, Output(" ab", (5, 6), (" a", "b"), (-0.5, -1.25))),
        ("/v1/chat/completions", CHAT_STREAM, Output("hi", (7, 8), ("h", "i"), (-0.1, -0.2))),
        ("/v1/responses", RESPONSES, Output("yo", (), ("y", "o"), (-0.3, -0.4))),
        ("/v1/responses", RESPONSES_STREAM, Output("yo", (), ("y", "o"), (-0.3, -0.4))),
    ],
)
def test_tokens_and_logprobs_of_an_answer(route: str, raw: bytes, output: Output) -> None:
    assert output_of(route, raw) == output


def test_an_answer_differs_by_text_tokens_or_a_logprob_beyond_the_tolerance() -> None:
    reference = Output(" ab", (5, 6), (" a", "b"), (-0.5, -1.25))
    assert differences(reference, reference) == []
    assert differences(Output(" ab", (5, 6), (" a", "b"), (-0.505, -1.25)), reference) == []
    # The same greedy tokens, but computed from other blocks: the logprobs move.
    moved = differences(Output(" ab", (5, 6), (" a", "b"), (-0.9, -1.25)), reference)
    assert moved == [f"logprobs differ by up to 0.4000 (tolerance {TOLERANCE})"]
    assert differences(Output(" ac", (5, 9), (" a", "c"), (-0.5, -1.25)), reference) == [
        "text: ' ac' vs D's own ' ab'",
        "ids: (5, 9) vs D's own (5, 6)",
        "tokens: (' a', 'c') vs D's own (' a', 'b')",
    ]
    assert differences(Output(" ab", (5, 6), (" a", "b")), reference) == ["logprobs: 0 vs D's own 2"]
    assert "the P/D answer has no output" in differences(Output(), reference)
    assert logprob_gap(Output(), reference) is None
