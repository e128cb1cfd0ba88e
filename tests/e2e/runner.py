"""Running one scenario against real P and D through a sidecar, and collecting P's evidence.

Scenarios run one at a time, so every rise of P's counters and every line P
logs in a scenario's window belong to it. Each starts with P holding no
block, and ends only when P holds none again (freed, or after P's lease),
once the sidecar has decided the request and P has taken one more engine
step, so a late notification is processed and counted before P's counters
are read.

P gets light traffic for the whole scenario (``tests.e2e.traffic``), as a P
in service has: vLLM moves NIXL notifications only when an engine steps.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from tests.e2e import answers
from tests.e2e.engines import Child
from tests.e2e.evidence import (
    Evidence,
    PLog,
    PView,
    d_reads,
    delta,
    error_shape,
    sidecar_not_released,
    sidecar_requests,
    sidecar_results,
    totals,
)
from tests.e2e.scenarios import (
    ROUTED,
    Expect,
    Limits,
    Mode,
    Scenario,
    base_body,
    client_body,
    decode_leg,
    headers_for,
    pin_body,
    prompt,
)
from tests.e2e.sidecars import Proxy
from tests.e2e.stalls import StallWatch
from tests.e2e.traffic import Traffic

DECIDED = ("kvr_releases_total", "kvr_not_released_total", "kvr_ineligible_total")
SHORT_PROMPT_WORDS = 12


class LogSource:
    """P's log, when the harness can read it (its own engines, or ``--p-log``)."""

    def __init__(self, size: Callable[[], int], since: Callable[[int], str]) -> None:
        self.size, self.since = size, since

    @classmethod
    def of(cls, child: Child) -> LogSource:
        return cls(child.log_size, child.log_since)


@dataclass
class Target:
    """The P and D the scenarios run against."""

    p_url: str
    d_url: str
    model: str
    lease: float
    p_log: LogSource | None
    long_prompt_words: int = 100
    max_model_len: int = 256
    d_up: bool = True
    d_key: str = ""  # D's API key (vllm serve --api-key), when it requires one

    @property
    def limits(self) -> Limits:
        return Limits(self.max_model_len)

    @property
    def d_headers(self) -> dict[str, str]:
        """What the harness's own requests to D carry: D's API key, when it has one."""
        return {"authorization": f"Bearer {self.d_key}"} if self.d_key else {}


@dataclass
class Before:
    p: PView
    d_reads: float
    sidecar: dict[str, float]
    not_released: dict[str, float]
    decided: float
    requests: float
    p_log: int


class Runner:
    """Runs scenarios with one HTTP client; see the module docstring."""

    def __init__(self, target: Target, client: httpx.Client, stalls: StallWatch | None = None) -> None:
        self.target = target
        self.client = client
        self.stalls = stalls or StallWatch()
        self.answer = b""  # the last answer ``send`` read

    def p_view(self) -> PView:
        started = time.monotonic()
        text = self.client.get(self.target.p_url + "/metrics").text
        self.stalls.note(started, time.monotonic())
        return PView.parse(text)

    def wait_p_idle(self, since: float, ev: Evidence) -> None:
        """Poll P until it holds no block; ``ev.freed_after`` counts from ``since``. A decode leg
        that took longer than P's lease (a loaded machine) is still looked at: at least once, and
        ``ev.first_poll`` says how late the first look came."""
        ev.first_poll = time.monotonic() - since
        deadline = max(since + self.target.lease, time.monotonic()) + 6.0
        while True:
            if self.p_view().usage == 0.0:
                ev.freed_after = time.monotonic() - since
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def step_engines(self) -> None:
        """A one-token request to P and to D (when up): each engine steps and moves its NIXL queues."""
        body = {"model": self.target.model, "prompt": "ka", "max_tokens": 1}
        self.client.post(self.target.p_url + "/v1/completions", json=body).raise_for_status()
        if self.target.d_up:
            d = self.client.post(
                self.target.d_url + "/v1/completions", json=body, headers=self.target.d_headers
            )
            d.raise_for_status()

    def before(self, sidecar: Proxy) -> Before:
        """The counters a scenario starts from, once P holds no block and both engines have
        stepped: a notification still queued from before (an idle P reads one only when it steps;
        seen here: the warm-up's, which D sent after P's lease) is counted before, not in it."""
        self.step_engines()
        if self.p_view().usage != 0.0:
            idle = Evidence()
            self.wait_p_idle(time.monotonic(), idle)
            if idle.freed_after is None:
                raise RuntimeError("P still holds blocks from before this scenario")
        metrics = sidecar.metrics(self.client)
        return Before(
            self.p_view(),
            self._d_reads(),
            sidecar_results(metrics),
            sidecar_not_released(metrics),
            _decided(metrics),
            sidecar_requests(metrics),
            self.target.p_log.size() if self.target.p_log else 0,
        )

    def _d_reads(self) -> float:
        if not self.target.d_up:
            return 0.0
        return d_reads(self.client.get(self.target.d_url + "/metrics").text)

    def run(self, scenario: Scenario, mode: Mode, sidecar: Proxy) -> Evidence:
        """One scenario, start to end (see the module docstring)."""
        before = self.before(sidecar)
        self.stalls.reset()
        ev = Evidence(lease=self.target.lease)
        with Traffic(self.target.p_url, self.target.model):
            asked_at, pinned_at = self._run(scenario, mode, sidecar, before, ev)
        # The release window: from P's pin to its lease's end (a timing failure happens in it).
        # P's lease began between the prefill request and its answer, so a stall of the harness
        # while P's answer waited to be read counts as in the window too.
        window = self.stalls.longest_within(asked_at, pinned_at + self.target.lease)
        ev.window_stall = round(window, 2)
        ev.stall = round(self.stalls.worst, 2)
        ev.harness_stall = round(self.stalls.worst_gap, 2)
        ev.load = round(os.getloadavg()[0], 1)
        return ev

    def _run(
        self, scenario: Scenario, mode: Mode, sidecar: Proxy, before: Before, ev: Evidence
    ) -> tuple[float, float]:
        """The scenario's requests and P's evidence; when the prefill was asked for and when P
        was known to have pinned the blocks (``time.monotonic()``)."""
        text = self.text(scenario, mode)
        body = client_body(scenario, self.target.model, text, self.target.limits)
        asked = time.monotonic()
        if mode in ROUTED:
            started = asked
            content = json.dumps(body).encode()
        else:
            params, started = self.pin(scenario, text, ev)
            content = decode_leg(body, params)
        self.send(sidecar.url + scenario.route, content, scenario, ev)
        if mode in ROUTED:  # the router ran the prefill leg (or legs) before the decode leg
            ev.prefills = round(self.p_view().prefills - before.p.prefills)
            ev.pinned = ev.prefills > 0
        self.wait_p_idle(started, ev)
        if ev.pinned:
            self.settle(sidecar, before)
        self.after(sidecar, before, ev)
        if scenario.expectation(mode) is Expect.D_READS and ev.status == 200:
            self.compare(scenario, body, ev)
        return asked, started

    def text(self, scenario: Scenario, mode: Mode) -> str:
        words = self.target.long_prompt_words if scenario.long_prompt else SHORT_PROMPT_WORDS
        return prompt(f"{mode}:{scenario.key}", words)

    def pin(self, scenario: Scenario, text: str, ev: Evidence) -> tuple[dict[str, Any], float]:
        """The prefill leg on P; P's parameters and when P answered."""
        response = self.client.post(
            self.target.p_url + scenario.route,
            content=pin_body(scenario, self.target.model, text),
            headers={"content-type": "application/json"},
        )
        response.raise_for_status()
        params = response.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            raise RuntimeError(f"P answered no kv_transfer_params: {response.text[:300]}")
        ev.pinned = any(params.get("remote_block_ids") or ())  # P says it holds these blocks for D
        return params, time.monotonic()

    def send(self, url: str, content: bytes, scenario: Scenario, ev: Evidence) -> None:
        """The scenario's request through the sidecar. A request that fails without an answer is
        evidence too (``ev.transport_error``), not the end of the run: P's and the sidecar's
        counters then say whether the sidecar ever read it (``tests.e2e.verdict``)."""
        headers = headers_for(scenario, f"e2e-{scenario.key}-{time.time_ns()}")
        if not scenario.keyless:
            headers.update(self.target.d_headers)
        try:
            with self.client.stream("POST", url, content=content, headers=headers) as response:
                raw = response.read()
        except httpx.TransportError as exc:
            ev.status, ev.answered_by = 0, "nobody"
            ev.transport_error = f"{type(exc).__name__}: {exc}"
            self.answer = b""
            return
        ev.status = response.status_code
        ev.body = raw.decode(errors="replace")
        shape = error_shape(raw)
        ev.error_type, ev.error_param = shape.type, shape.param
        ev.stream_error = shape.code if shape.in_stream else None
        ev.answered_by = "sidecar" if b"decode server" in raw or b"kv-release-sidecar" in raw else "D"
        if ev.status == 200:
            ev.output = answers.output_of(scenario.route, raw).summary()
        self.answer = raw

    def settle(self, sidecar: Proxy, before: Before) -> None:
        """Wait until the sidecar has decided the request, then make P take one more step."""
        deadline = time.monotonic() + self.target.lease
        while time.monotonic() < deadline and _decided(sidecar.metrics(self.client)) <= before.decided:
            time.sleep(0.05)
        self.step_engines()

    def after(self, sidecar: Proxy, before: Before, ev: Evidence) -> None:
        p = self.p_view()
        ev.expired = round(p.expired - before.p.expired)
        ev.after_expiry = round(p.after_expiry - before.p.after_expiry)
        ev.failed_notifications = round(p.failed_notifications - before.p.failed_notifications)
        ev.failed_transfers = round(p.failed_transfers - before.p.failed_transfers)
        ev.d_reads = round(self._d_reads() - before.d_reads)
        metrics = sidecar.metrics(self.client)
        ev.sidecar = delta(sidecar_results(metrics), before.sidecar)
        ev.not_released = delta(sidecar_not_released(metrics), before.not_released)
        ev.sidecar_requests = round(sidecar_requests(metrics) - before.requests)
        if self.target.p_log is not None:
            ev.p_log = PLog.parse(self.target.p_log.since(before.p_log))
        else:
            ev.notes.append("P's log not available: judged from P's /metrics only")

    def compare(self, scenario: Scenario, body: dict[str, Any], ev: Evidence) -> None:
        """The same request, served by D alone: the P/D answer must be the same, token for token,
        each token's logprob within ``answers.TOLERANCE``."""
        compare(self, scenario.route, scenario.stream, _prompt_of(body), self.answer, ev)

    def alone(self, route: str, stream: bool, text: str) -> answers.Output:
        """D's own answer to ``text`` (greedy, with tokens and logprobs)."""
        reference = base_body(route, self.target.model, text, detail=True)
        if stream:
            reference["stream"] = True
        response = self.client.post(self.target.d_url + route, json=reference, headers=self.target.d_headers)
        response.raise_for_status()
        return answers.output_of(route, response.content)


def compare(runner: Runner, route: str, stream: bool, text: str, raw: bytes, ev: Evidence) -> None:
    """Fill ``ev``'s output fields: the P/D answer ``raw`` beside D's own answer to ``text``."""
    pd, reference = answers.output_of(route, raw), runner.alone(route, stream, text)
    ev.output, ev.reference = pd.summary(), reference.summary()
    ev.output_differences = answers.differences(pd, reference)
    ev.logprob_gap = answers.logprob_gap(pd, reference)
    ev.same_output = not ev.output_differences


def _decided(metrics: str) -> float:
    summed = totals(metrics)
    return sum(summed.get(name, 0.0) for name in DECIDED)


def _prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][0]["content"])
    return str(body.get("prompt", body.get("input", "")))
