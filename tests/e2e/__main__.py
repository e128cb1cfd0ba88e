"""``python -m tests.e2e``: every scenario between real P and D, judged from P's evidence (``make e2e``).

With ``--engine-python`` (the engines' environment, ``make e2e`` builds it)
the harness makes the tiny model and starts P and D itself; with ``--p-url``
and ``--d-url`` it runs the same scenarios against a user's own P and D
(``--lease`` their ``kv_lease_duration``; ``--p-log`` P's log file, for P's
log lines; ``--control-token-file`` D's plugin token, for the http mode).
Order: the modes' scenarios (``nixl``, ``http``, ``router``, ``auto``, and
``defaults``: the sidecar with every setting as ``serve`` ships it; with
``--modes`` also ``vllm-router``: vLLM's own P/D router in front, the sidecar
in front of D, then its control without the sidecar, ``tests.e2e.vllmrouter``;
and ``smg``: SGLang's gateway in front of a decode engine that requires an API
key, then its control, ``tests.e2e.smg``), the
negative control (releases off), the output control (``tests.e2e.controls``),
the simulator comparison, then D stopped for the D-down scenarios. It
writes ``out/e2e/report.json``, prints the table and exits 0 only on a
pass; it stops every process it started, also on failure and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from fnmatch import fnmatch
from pathlib import Path
from types import FrameType

import httpx

from tests.e2e import cluster, controls, simcompare, smg, twopods, vllmrouter
from tests.e2e.engines import EngineFailed, Processes
from tests.e2e.report import Attempt, Report, Row, table
from tests.e2e.runner import Runner, Target
from tests.e2e.scenarios import (
    CONTROL,
    SIDECAR_SCENARIOS,
    SMG_CONTROL,
    VLLM_ROUTER_CONTROL,
    Mode,
    Scenario,
    scenarios_for,
)
from tests.e2e.sidecars import Peers, Proxy, start_sidecar
from tests.e2e.stalls import StallWatch
from tests.e2e.verdict import judge, kinds_of, retry_allowed

MODES: tuple[Mode, ...] = ("nixl", "http", "router", "auto", "defaults")
#: Modes run only when ``--modes`` names them: vllm-router (``tests.e2e.vllmrouter``), smg
#: (``tests.e2e.smg``: a third engine, its D with an API key).
OPT_IN: tuple[Mode, ...] = ("vllm-router", "smg")
#: The modes whose P ran a counted number of prefills per request (a front that retries the pair).
COUNTED: frozenset[Mode] = frozenset({"smg", "smg-bare"})
MISSING = 3
#: Seconds the harness keeps an idle connection: under the servers' own 5 s keep-alive.
KEEPALIVE = 2.0
#: P's lease for the harness's own engines. Short enough that the negative control fails fast, long
#: enough that a loaded 2-core machine (engines stalled for seconds) frees nothing by expiry.
LEASE = 20


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--engine-python", default="", help="the engines' Python (.venv-e2e/bin/python)")
    parser.add_argument("--p-url", default="", help="your own P (then --d-url too): no engines are started")
    parser.add_argument("--d-url", default="", help="your own D")
    parser.add_argument(
        "--lease",
        type=float,
        default=0,
        help=f"P's kv_lease_duration, seconds (default {LEASE}; 30 for yours)",
    )
    parser.add_argument("--p-log", default="", help="your P's log file (its lines are evidence too)")
    parser.add_argument(
        "--control-token-file", default="", help="your D's kv_release plugin token (http mode)"
    )
    parser.add_argument("--prefill-allow", default="", help="P's side-channel hosts (default: P's host)")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"modes to run (default {','.join(MODES)}; also {','.join(OPT_IN)})",
    )
    parser.add_argument("--reduced", action="store_true", help="a few scenarios per mode (CI)")
    parser.add_argument(
        "--only",
        default="",
        help="only the scenarios matching these comma-separated patterns (KEY or MODE:KEY, fnmatch)",
    )
    parser.add_argument("--no-controls", action="store_true", help="skip the negative and output controls")
    parser.add_argument(
        "--two-pods",
        action="store_true",
        help="only the two-pod run: P, two decode pods (shipped defaults) behind nginx (tests.e2e.twopods)",
    )
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator comparison")
    parser.add_argument("--out", default="out/e2e", help="where the report, logs and model go")
    parser.add_argument("--engine-timeout", type=float, default=600, help="seconds for an engine to start")
    args = parser.parse_args(argv)
    if bool(args.p_url) != bool(args.d_url):
        parser.error("--p-url and --d-url go together")
    if not args.p_url and not args.engine_python:
        parser.error("give --engine-python (the harness starts P and D) or --p-url and --d-url")
    if args.two_pods and args.p_url:
        parser.error("--two-pods starts its own engines: give --engine-python, not --p-url")
    return args


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").unlink(missing_ok=True)  # never leave an old pass behind
    shutil.rmtree(out / "logs", ignore_errors=True)
    if args.engine_python and not args.p_url and not Path(args.engine_python).exists():
        print(
            f"make e2e: the engines' environment is missing: {args.engine_python} does not exist",
            file=sys.stderr,
        )
        return MISSING
    signal.signal(signal.SIGTERM, _interrupt)
    report, processes, started = Report(), Processes(), time.monotonic()
    report.info["started"] = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        run(args, out, processes, report)
    except (EngineFailed, RuntimeError, httpx.HTTPError, KeyboardInterrupt) as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        # Where it stopped: the harness's last frames (a run that stops early says which call failed).
        report.info["error_at"] = [
            f"{frame.filename}:{frame.lineno} {frame.name}"
            for frame in traceback.extract_tb(exc.__traceback__)
        ][-4:]
    finally:
        processes.stop_all()
    report.info["wall_seconds"] = round(time.monotonic() - started, 1)
    (out / "report.json").write_text(json.dumps(report.as_dict(), indent=2, default=str))
    print(table(report), flush=True)
    print(f"report: {out / 'report.json'} ({report.info['wall_seconds']} s)", flush=True)
    return 0 if report.result == "pass" else 1


def run(args: argparse.Namespace, out: Path, processes: Processes, report: Report) -> None:
    if args.p_url:
        engines = cluster.given_engines(
            args.p_url, args.d_url, args.lease or 30, args.p_log, args.control_token_file
        )
    else:
        keyed = "smg" in args.modes.split(",") and not args.two_pods
        if args.two_pods or keyed:
            twopods.enough_memory()
        engines = cluster.own_engines(
            processes,
            args.engine_python,
            out,
            int(args.lease or LEASE),
            args.engine_timeout,
            decoders=2 if args.two_pods else 1,
            keyed=keyed,
        )
    report.info.update(engines.info)
    try:
        run_all(args, out, processes, report, engines)
    finally:
        if engines.memory is not None:
            engines.memory.__exit__()
            report.info["engines_peak_pss_mb"] = round(engines.memory.peak_mb)


def run_all(
    args: argparse.Namespace, out: Path, processes: Processes, report: Report, engines: cluster.Engines
) -> None:
    """The modes, the control, the simulator, then D stopped (see the module docstring)."""
    target = engines.target
    # Idle connections are dropped after 2 s: uvicorn (P, D, the sidecars) closes them after 5 s, and a
    # request sent on one it is closing fails ("Server disconnected without sending a response").
    keepalive = httpx.Limits(keepalive_expiry=KEEPALIVE)
    with httpx.Client(timeout=120, trust_env=False, limits=keepalive) as client, StallWatch() as stalls:
        report.info.update(cluster.calibrate(target, client))
        report.info["warm_up_seconds"] = round(cluster.warm_up(target, client), 1)
        report.info["lease"] = target.lease
        runner = Runner(target, client, stalls)
        host = httpx.URL(target.p_url).host
        allow = args.prefill_allow or host
        peers = Peers(
            target.d_url,
            target.p_url,
            allow,
            target.lease,
            engines.control_token_file,
            target.limits.body_cap,
        )
        if args.two_pods:
            twopods.run_two_pods(runner, processes, engines, peers, out, report, run_row)
            return
        modes = [m for m in (*MODES, *OPT_IN) if m in args.modes.split(",")]
        for needs_token in ("http", "auto"):
            if needs_token in modes and engines.control_token_file is None:
                modes.remove(needs_token)
                report.skipped.append(f"{needs_token}: no --control-token-file for D's kv_release plugin")
        router = vllmrouter.router_binary(args.engine_python)
        if "vllm-router" in modes and router is None:
            modes.remove("vllm-router")
            report.skipped.append("vllm-router: not installed beside the engines nor in .tools (make test)")
        smg_binary = smg.smg_binary()
        if "smg" in modes and (smg_binary is None or engines.keyed_d is None):
            modes.remove("smg")
            report.skipped.append(
                "smg: not installed in .tools/smg (make e2e installs it)"
                if smg_binary is None
                else "smg: needs the harness's own engines (a decode engine with an API key)"
            )
        chosen = Chosen(args.reduced, tuple(p for p in args.only.split(",") if p))
        sidecars: dict[Mode, Proxy] = {
            mode: start_sidecar(processes, mode, peers, out / "logs" / f"sidecar-{mode}.log")
            for mode in modes
            if mode not in OPT_IN
        }
        bare = None  # vllm-router straight to D: its control
        if "vllm-router" in modes and router is not None:
            sidecars["vllm-router"], bare = vllmrouter.start_fronts(processes, router, peers, out / "logs")
        for mode in modes:
            if mode != "smg":
                run_mode(runner, mode, sidecars[mode], report, down=False, chosen=chosen)
        if bare is not None and not args.no_controls:
            report.rows.append(run_row(runner, "vllm-router-bare", VLLM_ROUTER_CONTROL, bare))
        if "smg" in modes and smg_binary is not None and engines.keyed_d is not None:
            run_smg(args, out, processes, report, runner, peers, smg_binary, engines.keyed_d, chosen)
        if not args.no_controls:
            control = start_sidecar(processes, "off", peers, out / "logs" / "sidecar-off.log")
            evidence = runner.run(CONTROL, "off", control)
            expect = CONTROL.expectation("off")
            report.control = Row("off", CONTROL, evidence, judge(expect, CONTROL.expected_status(), evidence))
            report.output_control = controls.wrong_blocks(runner, sidecars.get("nixl") or control)
            print(controls.summary(report.output_control), flush=True)
        else:
            report.skipped.append("controls: --no-controls (the run cannot pass without them)")
        if not args.no_sim:
            compare(runner, report, client)
        if engines.d is None:
            report.skipped.append("D down: D is yours, the harness does not stop it")
            return
        processes.stop(engines.d)
        target.d_up = False
        for mode in modes:
            if mode != "smg":  # its D (Dk) stays up: it has no D-down scenario
                run_mode(runner, mode, sidecars[mode], report, down=True, chosen=chosen)


def run_smg(
    args: argparse.Namespace,
    out: Path,
    processes: Processes,
    report: Report,
    runner: Runner,
    peers: Peers,
    binary: Path,
    keyed_d: tuple[str, str],
    chosen: Chosen,
) -> None:
    """The smg mode against the decode engine that requires an API key, then its control."""
    url, key = keyed_d
    main = runner.target
    target = Target(
        main.p_url,
        url,
        main.model,
        main.lease,
        main.p_log,
        main.long_prompt_words,
        main.max_model_len,
        d_key=key,
    )
    report.info["smg_warm_up_seconds"] = round(cluster.warm_up(target, runner.client), 1)
    keyed = Runner(target, runner.client, runner.stalls)
    front, bare = smg.start_fronts(
        processes, binary, replace(peers, d_url=url), target.model, key, out / "logs"
    )
    run_mode(keyed, "smg", front, report, down=False, chosen=chosen)
    if not args.no_controls:
        report.rows.append(run_row(keyed, "smg-bare", SMG_CONTROL, bare))


@dataclass(frozen=True)
class Chosen:
    """Which scenarios run: all, or the reduced set (``--reduced``), then only those ``--only`` names."""

    reduced: bool = False
    only: tuple[str, ...] = ()

    def __call__(self, mode: Mode) -> tuple[Scenario, ...]:
        return tuple(
            scenario
            for scenario in scenarios_for(mode, self.reduced)
            if not self.only
            or any(fnmatch(scenario.key, p) or fnmatch(f"{mode}:{scenario.key}", p) for p in self.only)
        )


def run_mode(
    runner: Runner, mode: Mode, sidecar: Proxy, report: Report, *, down: bool, chosen: Chosen
) -> None:
    """The mode's scenarios with D up (``down`` False) or those run with D stopped."""
    for scenario in chosen(mode):
        if scenario.d_down != down:
            continue
        report.rows.append(run_row(runner, mode, scenario, sidecar))


def run_row(runner: Runner, mode: Mode, scenario: Scenario, sidecar: Proxy) -> Row:
    """One scenario, run again only while ``retry_allowed`` says so; every failed attempt is kept."""
    expect, status = scenario.expectation(mode), scenario.expected_status()
    prefills = scenario.prefills if mode in COUNTED else None
    attempts: list[Attempt] = []
    while True:
        evidence = runner.run(scenario, mode, sidecar)
        problems = judge(expect, status, evidence, scenario.also_accepted(mode), prefills)
        if not retry_allowed(kinds_of(problems), evidence.window_stall, len(attempts) + 1):
            break
        attempts.append(Attempt.of(problems, evidence))
        print(
            f"{mode:7} {scenario.key:30} retry: {attempts[-1].kinds} in a {evidence.window_stall} s stall",
            flush=True,
        )
    row = Row(mode, scenario, evidence, problems, attempts)
    verdict = "pass" if row.passed else "FAIL " + "; ".join(map(str, problems))
    print(f"{mode:7} {scenario.key:30} {verdict}{' (retried)' if row.retried else ''}", flush=True)
    return row


def compare(runner: Runner, report: Report, client: httpx.Client) -> None:
    """The simulator beside real vLLM, for each scenario D answered in the nixl mode."""
    real = {row.scenario.key: row.evidence for row in report.rows if row.mode == "nixl"}
    version = str(report.info.get("vllm_version") or "0.33.0")
    with simcompare.simulators(version, runner.target.model, runner.target.max_model_len) as sims:
        for scenario in SIDECAR_SCENARIOS:
            if scenario.key in real and simcompare.comparable(scenario):
                found = simcompare.compare(sims, scenario, real[scenario.key], client, runner.target.limits)
                report.comparisons.append(found)


if __name__ == "__main__":
    sys.exit(main())
