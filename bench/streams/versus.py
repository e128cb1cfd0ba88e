"""Two side-by-side readings of one streams round: router mode beside vllm-router, one worker beside two.

``versus`` judges the sidecar in router mode against vLLM's own P/D router
on the same workload in the same round, once with each pinned to the hop's
CPU and once with each free on both CPUs (the sidecar with ``--workers 2``,
vllm-router with its default threads): the sidecar must be at or ahead on
rate (streams completed per second of the window; "at": within
``RATE_SLACK``, the window's edges alone move a closed loop's count that
much) and on TTFT p99. ``workers_burst`` reads the accept-burst step at one
and two workers: two must be no worse than one on the new connections'
TTFT p99. ``versus_lines`` and ``workers_lines`` print them. The judged pairs
(``Versus``) are part of the report (``bench.streams.report``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from bench.streams.report import PathRun, Versus
from bench.streams.vllm_router import SENDS

RATE_SLACK = 0.01
#: (the sidecar's path, vllm-router's, how they run)
PAIRS = (("sidecar", "vllm-router", "one core each"), ("sidecar-w2", "vllm-router-w2", "every core"))
_COLUMNS = ("direct", "sidecar", "vllm-router", "sidecar-w2", "vllm-router-w2")
# A client above this share of its core may be what limits the rate.
CLIENT_BUSY = 0.9


def rate(run: PathRun, seconds: float) -> float:
    """Streams started in the measured window and completed, per second of it."""
    return run.sample.streams / seconds


def versus(paths: Mapping[str, PathRun], seconds: float) -> list[Versus]:
    """Each pair of ``PAIRS`` that ran, judged."""
    found = []
    for ours, theirs, _ in PAIRS:
        mine, ref = paths.get(ours), paths.get(theirs)
        if mine is None or ref is None:
            continue
        mine_rate, their_rate = rate(mine, seconds), rate(ref, seconds)
        p99, their_p99 = mine.sample.ttft_p99_ms, ref.sample.ttft_p99_ms
        passed = mine_rate >= their_rate * (1 - RATE_SLACK) and p99 <= their_p99
        found.append(
            Versus(
                ours=ours,
                theirs=theirs,
                rate=mine_rate,
                their_rate=their_rate,
                ttft_p99_ms=p99,
                their_ttft_p99_ms=their_p99,
                passed=passed,
            )
        )
    return found


def p_got(run: PathRun, events: int) -> str:
    """What the fake P got per stream of the phase (ramp and drain included: each had ``events``
    events and [DONE]): prefill legs, those with X-Request-Id, with min_tokens, other requests;
    then the legs it refused."""
    got = run.prefill
    if got is None:
        return "-"
    streams = max(1.0, run.sample.events_total / (events + 1))
    names = ("legs", "with_request_id", "with_min_tokens", "other")
    return "/".join(f"{got.get(n, 0) / streams:.2f}" for n in names) + f" ({got.get('refused', 0)})"


def versus_lines(
    paths: Mapping[str, PathRun], judged: Sequence[Versus], seconds: float, events: int
) -> list[str]:
    """The side-by-side table, the verdicts, a warning when the load generator was near a full
    core, and what each hop sends; nothing when vllm-router did not run."""
    shown = [p for p in _COLUMNS if p in paths]
    if not any(p.startswith("vllm-router") for p in shown):
        return []
    lines = ["  router mode beside vllm-router (hop CPU: its process, threads and children; per stream of "
             "the phase, ramp and drain included):"]  # fmt: skip
    lines += _table([paths[p] for p in shown], shown, seconds, events)
    how = {ours: text for ours, _, text in PAIRS}
    for v in judged:
        verdict = "PASS" if v.passed else "MISS"
        lines.append(
            f"  {how[v.ours]}: {v.ours} {v.rate:,.0f} streams/s, TTFT p99 {v.ttft_p99_ms:,.1f} ms; "
            f"{v.theirs} {v.their_rate:,.0f}, {v.their_ttft_p99_ms:,.1f}: at or ahead on both  {verdict}"
        )
    busy = [p for p in shown if paths[p].load.client_cores > CLIENT_BUSY]
    if busy:
        lines.append(f"  the load generator used over {CLIENT_BUSY:g} of its core on {', '.join(busy)}: "
                     "it may limit those rates")  # fmt: skip
    return lines + [f"  {name} sends {text}" for name, text in SENDS.items()]


def _table(runs: Sequence[PathRun], names: Sequence[str], seconds: float, events: int) -> list[str]:
    header = ["path", "streams/s", "TTFT p50 ms", "TTFT p99 ms", "gap p99 ms", "hop CPU/stream us",
              "client / D+P cores",
              "P got per stream: legs/X-Request-Id/min_tokens/other (refused)"]  # fmt: skip
    rows = [header]
    for name, run in zip(names, runs, strict=True):
        s = run.sample
        rows.append([
            name, f"{rate(run, seconds):,.0f}", f"{s.ttft_p50_ms:,.1f}", f"{s.ttft_p99_ms:,.1f}",
            f"{s.gap_p99_ms:,.1f}",
            f"{run.load.hop_us_per_stream:,.0f}" if name != "direct" else "-",
            f"{run.load.client_cores:.2f} / {run.load.decode_cores:.2f}", p_got(run, events),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["    " + "  ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)) for row in rows]


class WorkersBurst(msgspec.Struct, kw_only=True):
    """The accept-burst step's TTFT p99 at one and two workers, one round."""

    one_ms: float
    two_ms: float
    passed: bool  # two no worse than one


def workers_burst(paths: Mapping[str, PathRun]) -> WorkersBurst | None:
    one, two = paths.get("sidecar"), paths.get("sidecar-w2")
    if one is None or two is None or one.burst is None or two.burst is None:
        return None
    a, b = one.burst.ttft_p99_ms, two.burst.ttft_p99_ms
    return WorkersBurst(one_ms=a, two_ms=b, passed=b <= a)


def workers_lines(rounds: Sequence[tuple[int, WorkersBurst]]) -> list[str]:
    """One line per round, then whether two workers were no worse than one in every round."""
    if not rounds:
        return []
    lines = [""]
    for round_, w in rounds:
        verdict = "PASS" if w.passed else "MISS"
        figures = f"1 worker {w.one_ms:,.1f} ms, 2 workers {w.two_ms:,.1f} ms"
        lines.append(f"round {round_}: burst TTFT p99, {figures}  {verdict}")
    held = sum(w.passed for _, w in rounds)
    verdict = "PASS" if held == len(rounds) else "MISS"
    lines.append(f"two workers no worse than one in every round: {held} of {len(rounds)}  {verdict}")
    return lines
