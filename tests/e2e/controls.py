"""The output control: D reads another request's blocks, and the output check must say so.

"The same answer as D alone" proves D read the right blocks only if reading
the wrong ones changes the answer. This control makes real D read the wrong
ones: P pins two prompts, A and B, of the same number of tokens (so the same
number of blocks), and the sidecar gets A's decode leg carrying B's
``kv_transfer_params`` and B's decode leg carrying A's. D reads B's blocks
for A's prompt and A's for B's, computes only each prompt's last token
itself, and notifies P for the blocks it read, so P frees both pins as for
any admitted request. Each answer is then compared with D's own answer to
its prompt, exactly as an admitted scenario is (``tests.e2e.answers``): the
check must find both different. If either matches, the check cannot tell
the right blocks from the wrong ones and the run fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.e2e.evidence import Evidence
from tests.e2e.runner import Runner, compare
from tests.e2e.scenarios import ADMITTED, COMPLETIONS, Expect, Scenario, client_body, decode_leg, prompt
from tests.e2e.sidecars import Proxy
from tests.e2e.traffic import Traffic

WRONG_BLOCKS = Scenario(
    "control-wrong-blocks",
    "D reads another request's blocks (A's prompt with B's parameters, and B's with A's)",
    ADMITTED,
    COMPLETIONS,
    Expect.D_READS,
    long_prompt=True,
)
#: Prompts tried for B, at most, to find one of A's token count.
TRIES = 200


@dataclass
class Leg:
    """One crossed decode leg: whose prompt, whose blocks, and how its answer compared."""

    prompt_of: str
    blocks_of: str
    evidence: Evidence


@dataclass
class OutputControl:
    """The control's legs and P's evidence for the two pins (``p``)."""

    legs: list[Leg] = field(default_factory=list)
    p: Evidence = field(default_factory=Evidence)
    tokens: int = 0
    error: str = ""

    @property
    def detected(self) -> bool:
        """Whether the output check failed every crossed leg (it must), on answers D computed
        from P's blocks: each leg answered 200 and D made a NIXL read for each."""
        if self.error or len(self.legs) != 2 or self.p.d_reads < 2:
            return False
        return all(leg.evidence.status == 200 and leg.evidence.same_output is False for leg in self.legs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": WRONG_BLOCKS.title,
            "detected_as_it_must": self.detected,
            "prompt_tokens": self.tokens,
            "error": self.error,
            "d_reads": self.p.d_reads,
            "p": {key: getattr(self.p, key) for key in ("freed_after", "expired", "after_expiry")},
            "legs": [
                {
                    "prompt_of": leg.prompt_of,
                    "blocks_of": leg.blocks_of,
                    "status": leg.evidence.status,
                    "same_output": leg.evidence.same_output,
                    "differences": leg.evidence.output_differences,
                    "logprob_gap": leg.evidence.logprob_gap,
                    "output": leg.evidence.output,
                    "reference": leg.evidence.reference,
                }
                for leg in self.legs
            ],
        }


def same_length_prompts(runner: Runner) -> tuple[str, str, int]:
    """Two different prompts of the same token count (D's ``/tokenize``), over one block."""
    words = runner.target.long_prompt_words
    first = prompt("control:wrong-blocks:a", words)
    tokens = _count(runner, first)
    for attempt in range(TRIES):
        second = prompt(f"control:wrong-blocks:b{attempt}", words)
        if _count(runner, second) == tokens:
            return first, second, tokens
    raise RuntimeError(f"no prompt of {tokens} tokens found for the wrong-blocks control in {TRIES} tries")


def _count(runner: Runner, text: str) -> int:
    answer = runner.client.post(
        runner.target.d_url + "/tokenize", json={"model": runner.target.model, "prompt": text}
    )
    answer.raise_for_status()
    return int(answer.json()["count"])


def wrong_blocks(runner: Runner, sidecar: Proxy) -> OutputControl:
    """Run the control through ``sidecar`` (see the module docstring)."""
    control = OutputControl()
    first, second, control.tokens = same_length_prompts(runner)
    before = runner.before(sidecar)
    with Traffic(runner.target.p_url, runner.target.model):
        params = {}
        for name, text in (("A", first), ("B", second)):
            params[name], started = runner.pin(WRONG_BLOCKS, text, control.p)
        for name, blocks, text in (("A", "B", first), ("B", "A", second)):
            leg = Leg(name, blocks, Evidence(lease=runner.target.lease))
            body = client_body(WRONG_BLOCKS, runner.target.model, text, runner.target.limits)
            runner.send(
                sidecar.url + COMPLETIONS, decode_leg(body, params[blocks]), WRONG_BLOCKS, leg.evidence
            )
            if leg.evidence.status == 200:
                compare(runner, COMPLETIONS, False, text, runner.answer, leg.evidence)
            control.legs.append(leg)
        runner.wait_p_idle(started, control.p)
        runner.settle(sidecar, before)
        runner.after(sidecar, before, control.p)
    return control


def summary(control: OutputControl) -> str:
    """One line for the table."""
    state = "detected (fails as it must)" if control.detected else "NOT DETECTED"
    gaps = [
        None if gap is None else round(gap, 3) for gap in (leg.evidence.logprob_gap for leg in control.legs)
    ]
    freed = "held" if control.p.freed_after is None else f"freed {control.p.freed_after:.1f}s"
    return f"output control: D read another request's blocks: {state}; logprob gaps {gaps}; " + (
        control.error or f"{control.p.d_reads} reads, P {freed}, expired +{control.p.expired}"
    )
