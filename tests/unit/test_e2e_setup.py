"""``make e2e``'s set-up, without vLLM: what is missing is said in one line, and no run is faked.

The engines' environment refuses to start without the CPU torch wheel (never a
CUDA build from the index), the harness refuses to run without the engines'
environment and leaves no report behind, the engines get the flags vLLM's CPU
build needs, and the project's own environment never loads torch or vLLM for it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import retries
from sidecar.config import args as config_args
from sidecar.server import serve
from tests.e2e import setup_env, twopods, vllmrouter
from tests.e2e.__main__ import Chosen
from tests.e2e.__main__ import main as e2e_main
from tests.e2e.engines import EngineSpec, cpu_set, engine_command, engine_env, pin_group, split_cores
from tests.e2e.evidence import sidecar_results
from tests.e2e.scenarios import (
    REDUCED,
    ROUTED,
    ROUTER_SCENARIOS,
    SIDECAR_SCENARIOS,
    Expect,
    Limits,
    client_body,
    decode_leg,
    pin_body,
    scenarios_for,
)
from tests.e2e.sidecars import Peers, sidecar_command

ROOT = Path(__file__).resolve().parents[2]
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
WHEEL = f"torch-2.13.0+cpu-{TAG}-{TAG}-manylinux_2_28_x86_64.whl"


def test_a_missing_cpu_torch_wheel_is_one_line_and_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    venv = tmp_path / "venv"
    code = setup_env.main(
        ["--uv", "/nonexistent/uv", "--venv", str(venv), "--wheel", "x.whl", "--find-links", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == setup_env.MISSING == 3
    assert err.count("\n") == 1
    assert err.startswith(
        "make e2e: torch==2.13.0+cpu for Python 3.11 is missing: no torch-2.13.0+cpu-cp311-"
    )
    assert str(tmp_path) in err
    assert not venv.exists()  # nothing was built, nothing was downloaded


def test_the_cpu_wheel_is_found_where_pip_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / WHEEL).write_bytes(b"")
    assert setup_env.torch_wheel(["/nonexistent", str(tmp_path)]) == str(tmp_path / WHEEL)
    monkeypatch.setenv("PIP_FIND_LINKS", f"/a {tmp_path}")
    assert setup_env.find_links("") == ["/a", str(tmp_path)]
    assert setup_env.find_links("/given") == ["/given"]


def test_an_environment_is_ready_only_with_today_pins(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert not setup_env.ready(tmp_path)
    (tmp_path / setup_env.STAMP).write_text('{"torch": "torch==2.12.0+cpu"}')
    assert not setup_env.ready(tmp_path)
    (tmp_path / setup_env.STAMP).write_text(json.dumps(setup_env.PINS))
    assert setup_env.ready(tmp_path)


def test_the_harness_without_the_engines_environment_says_so_and_writes_no_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "e2e"
    out.mkdir()
    (out / "report.json").write_text('{"result": "pass"}')  # an old run's
    code = e2e_main(["--engine-python", str(tmp_path / "none" / "python"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 3
    assert err.count("\n") == 1 and "the engines' environment is missing" in err
    assert not (out / "report.json").exists()


def spec(role: str, token: Path | None = None, cpus: str = "") -> EngineSpec:
    return EngineSpec(role, "/e2e/bin/python", Path("/m"), 8301, 5701, 20, Path("/l"), token, cpus)


def test_engines_run_the_api_server_module_with_the_cpu_build_settings() -> None:
    command = engine_command(spec("P"))
    assert command[:3] == ["/e2e/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for flag in (
        "--max-model-len 256",
        "--max-num-seqs 4",
        "--enforce-eager",
        "--num-gpu-blocks-override 64",
    ):
        assert flag in joined
    kv = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_buffer_device"] == "cpu"
    assert kv["kv_connector_extra_config"] == {"kv_lease_duration": 20}


def test_only_d_loads_the_plugin_by_its_entry_point(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "VLLM_PLUGINS": "other", "KVR_CONTROL_TOKEN": "leak", "VIRTUAL_ENV": "/x"}
    p_env = engine_env(spec("P", cpus="0"), base)
    d_env = engine_env(spec("D", tmp_path / "token", "1"), base)
    assert "VLLM_PLUGINS" not in p_env and "KVR_CONTROL_TOKEN" not in p_env and "VIRTUAL_ENV" not in p_env
    assert d_env["VLLM_PLUGINS"] == "kv_release"
    assert d_env["KVR_CONTROL_TOKEN_FILE"] == str(tmp_path / "token")
    assert "KVR_CONTROL_TOKEN" not in d_env
    assert (p_env["VLLM_CPU_OMP_THREADS_BIND"], d_env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    for env in (p_env, d_env):
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5701"


@pytest.mark.parametrize(
    ("count", "cores"), [(1, ("", "")), (2, ("0", "1")), (8, ("0-3", "4-7")), (3, ("0", "1-2"))]
)
def test_split_cores(count: int, cores: tuple[str, str]) -> None:
    assert split_cores(count) == cores


def test_scenario_bodies_carry_the_fault_to_d_only() -> None:
    scenario = next(s for s in SIDECAR_SCENARIOS if s.key == "pre-validation")
    pin = json.loads(pin_body(scenario, "m", "ka lo"))
    assert pin["max_tokens"] == 1 and pin["stream"] is False
    assert pin["kv_transfer_params"]["do_remote_decode"] is True
    leg = decode_leg(client_body(scenario, "m", "ka lo", Limits()), {"remote_request_id": "r"})
    assert leg.endswith(b'"kv_transfer_params": {"remote_request_id": "r"}}')  # last, as routers append
    assert b'"max_tokens": "abc"' in leg
    cap = next(s for s in SIDECAR_SCENARIOS if s.oversize)
    assert len(json.dumps(client_body(cap, "m", "ka", Limits()))) > Limits().body_cap


@pytest.mark.parametrize("max_model_len", [256, 32768])
def test_faults_over_the_context_are_sized_from_d(max_model_len: int) -> None:
    limits = Limits(max_model_len)
    by_key = {s.key: s for s in SIDECAR_SCENARIOS}
    prompt = client_body(by_key["handler-too-long"], "m", "ka", limits)["prompt"]
    assert len(prompt.split()) > max_model_len  # every word is a token at least
    assert client_body(by_key["handler-max-tokens"], "m", "ka", limits)["max_tokens"] == max_model_len + 1
    assert len(json.dumps(client_body(by_key["handler-too-long"], "m", "ka", limits))) < limits.body_cap


MODES = ("nixl", "http", "router", "auto", "defaults")


def test_every_mode_has_its_cases_and_a_short_set() -> None:
    for mode in MODES:
        full, reduced = scenarios_for(mode), scenarios_for(mode, reduced=True)  # type: ignore[arg-type]
        assert len({s.key for s in full}) == len(full)
        assert {s.group for s in full} >= {"admitted", "before D's handler", "D's handler", "D down"}
        assert 0 < len(reduced) < len(full)
        assert {s.key for s in reduced} == REDUCED[mode]  # type: ignore[index]
        assert full[-1].d_down  # D-down scenarios last: D stays stopped after them
    down = next(s for s in SIDECAR_SCENARIOS if s.d_down)
    assert [down.expectation(mode) for mode in ("nixl", "http", "auto", "defaults", "pods")] == [
        Expect.SIDECAR_FREES,
        Expect.LEASE,
        Expect.SIDECAR_FREES,
        Expect.LEFT,
        Expect.LEFT,
    ]
    assert all(not s.headers and s.content_type == "application/json" for s in ROUTER_SCENARIOS)
    assert not any(s.oversize for s in scenarios_for("defaults"))  # the shipped cap is 64 MiB


def test_the_reduced_run_covers_every_group_route_and_strategy() -> None:
    rows = [(mode, s) for mode in MODES for s in scenarios_for(mode, reduced=True)]  # type: ignore[arg-type]
    assert {s.group for _, s in rows} == {s.group for s in SIDECAR_SCENARIOS}
    routes = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
    assert {s.route for _, s in rows} == routes | {"/inference/v1/generate"}
    admitted = {(s.route, s.stream) for _, s in rows if s.expect is Expect.D_READS}
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages"} <= {route for route, _ in admitted}
    # The routes llm-d added, where the sidecar writes both legs: an Anthropic answer D computed
    # from P's blocks, and a token-in request D refuses after P pinned it (the sidecar frees it).
    router = {(s.route, s.expectation("router")) for mode, s in rows if mode == "router"}
    assert {("/v1/messages", Expect.D_READS), ("/inference/v1/generate", Expect.SIDECAR_FREES)} <= router
    assert any(stream for _, stream in admitted)
    assert {mode for mode, _ in rows} == set(MODES)
    # Most rows would fail behind a plain pass-through proxy: it releases nothing, and D down is
    # its own 502 (those a pass-through passes: D reads, D's own fix, P's lease).
    passes = [
        s for mode, s in rows if s.expectation(mode) in (Expect.D_READS, Expect.D_FREES) and not s.d_down
    ]
    assert len(passes) < len(rows) / 2


def test_the_serving_path_never_imports_the_harness() -> None:
    for path in (ROOT / "sidecar").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(name == "tests" or name.startswith("tests.") for name in names), path


def test_the_harness_loads_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, tests.e2e.__main__, tests.e2e.cluster, tests.e2e.simcompare; "
        "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_defaults_sidecar_runs_serve_as_shipped(tmp_path: Path) -> None:
    peers = Peers("http://127.0.0.1:8302", "http://127.0.0.1:8301", "127.0.0.1", 20.0)
    command = sidecar_command("defaults", peers, 8000, 9100, sys.executable)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = config_args.load(parser.parse_args(command[4:]))[0]
    given = {"decode_url", "port", "admin_port", "host", "admin_host", "release", "prefill_allow"}
    shipped = config_args.load(parser.parse_args([]))[0]
    differs = {name for name in config.__struct_fields__ if getattr(config, name) != getattr(shipped, name)}
    assert differs <= given
    assert config.release == "nixl" and config.retried_statuses == ("502", "503", "504")


@pytest.mark.parametrize("mode", ["nixl", "http", "router", "auto", "off", "vllm-router"])
def test_every_e2e_sidecar_command_is_one_serve_accepts(mode: str, tmp_path: Path) -> None:
    peers = Peers("http://127.0.0.1:8302", "http://127.0.0.1:8301", "127.0.0.1", 20.0, tmp_path / "token")
    (tmp_path / "token").write_text("t")
    command = sidecar_command(mode, peers, 8000, 9100, sys.executable)  # type: ignore[arg-type]
    assert command[1:4] == ["-m", "sidecar", "serve"]
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = config_args.load(parser.parse_args(command[4:]))[0]
    assert retries.parse(config.retried_statuses) == frozenset()  # D down's 503 may be released
    assert config.release == ("nixl" if mode in ("router", "vllm-router") else mode)
    assert config.release_deadline == 10.0 and config.p_hold_seconds == 20.0
    assert config.prefill == (("http://127.0.0.1:8301",) if mode == "router" else ())


def test_the_vllm_router_mode_runs_the_page_and_its_control() -> None:
    rows = scenarios_for("vllm-router")
    assert rows == scenarios_for("vllm-router", reduced=True)  # a few: the reduced run takes them all
    assert {s.expectation("vllm-router") for s in rows} == {
        Expect.D_READS,
        Expect.SIDECAR_FREES,
        Expect.D_FREES,
    }
    assert rows[-1].d_down and all(not s.d_down for s in rows[:-1])
    # The refusal only the sidecar can free: D's body has stream_options without stream, P's leg
    # (vllm-router drops stream_options and asks P for one token, not streamed) is valid.
    [control] = scenarios_for("vllm-router-bare")
    assert control.expectation("vllm-router") is Expect.SIDECAR_FREES
    assert control.expectation("vllm-router-bare") is Expect.LEASE
    body = client_body(control, "m", "a b", Limits())
    assert body["stream_options"] and not body.get("stream")
    assert {"vllm-router", "vllm-router-bare", "router", "smg", "smg-bare"} == ROUTED


def test_the_e2e_environment_installs_the_tested_vllm_router(tmp_path: Path) -> None:
    pins = (ROOT / "requirements" / "vllm-router.txt").read_text()
    assert setup_env.router_requirement() in pins.splitlines()
    assert setup_env.router_requirement().startswith("vllm-router==0.1.")
    (tmp_path / "bin").mkdir()
    beside = tmp_path / "bin" / "vllm-router"
    beside.touch()
    assert vllmrouter.router_binary(str(tmp_path / "bin" / "python")) == beside
    assert vllmrouter.router_binary(str(tmp_path / "nowhere" / "python")) in (None, vllmrouter.TOOLS_ROUTER)


def test_only_picks_scenarios_by_key_or_mode_and_key() -> None:
    admitted = Chosen(only=("nixl:admit*",))
    assert [s.key for s in admitted("nixl")] == [
        *("admit", "admit-chat", "admit-stream", "admit-responses", "admit-messages")
    ]
    assert admitted("http") == ()
    assert [s.key for s in Chosen(only=("cap",))("router")] == ["cap"]
    assert {s.key for s in Chosen(reduced=True, only=("*down*",))("defaults")} == {"down"}
    assert Chosen()("auto") == scenarios_for("auto")


def test_two_pods_need_memory_for_three_engines(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 25000000 kB\nMemAvailable: 4194304 kB\n")
    with pytest.raises(RuntimeError, match=r"two pods need 6 GB available for three engines; 4\.0 GB is"):
        twopods.enough_memory(meminfo)
    meminfo.write_text("MemAvailable: 20000000 kB\n")
    twopods.enough_memory(meminfo)


def test_two_pods_run_the_shipped_defaults_and_sum_both_sidecars() -> None:
    class Fixed:
        def __init__(self, text: str) -> None:
            self.text = text

        def metrics(self, client: object) -> str:
            return self.text

    pods = [
        Fixed('kvr_releases_total{result="sent"} 1.0\n'),
        Fixed('kvr_releases_total{result="sent"} 2.0\n'),
    ]
    front = twopods.Front("http://127.0.0.1:1", pods)  # type: ignore[arg-type]
    assert sidecar_results(front.metrics(None)) == {"sent": 3.0}  # type: ignore[arg-type]
    down = twopods.scenarios(twopods.BOTH_DOWN)
    assert [s.expectation("pods") for s in down] == [Expect.LEFT]
    assert all(not s.d_down for s in twopods.scenarios(twopods.POD1_DOWN))


@pytest.mark.parametrize(("cpus", "expected"), [("0", {0}), ("2-3", {2, 3}), ("0,2-3", {0, 2, 3})])
def test_cpu_set(cpus: str, expected: set[int]) -> None:
    assert cpu_set(cpus) == expected


def test_pin_group_moves_every_thread_of_every_process_in_the_group() -> None:
    """A child with a second thread, and its own child, in a new group: all of them on CPU 0 after."""
    code = (
        "import subprocess, sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(grandchild.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    own = os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        tasks = [Path(f"/proc/{pid}/task") for pid in (child.pid, grandchild)]
        tids = [task for base in tasks for task in base.iterdir()]
        assert len(tids) >= 3  # the child's two threads and the grandchild's one
        assert pin_group(child.pid, "0") == len(tids)
        for task in tids:
            allowed = next(
                line.split()[1]
                for line in (task / "status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list")
            )
            assert allowed == "0"
        assert os.sched_getaffinity(0) == own  # the caller, in another group, not moved
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
