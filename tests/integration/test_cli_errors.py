"""Each misconfiguration an operator can make stops ``serve`` with one line naming its source, and exit 2.

The commands run as the installed CLI does (``python -m sidecar``), in a clean
environment, so the line checked is the whole of stderr: no traceback, no
usage dump, no "Task exception was never retrieved". Warnings (a misspelt
``KVR_*`` variable, ``--release nixl`` without an allowlist) are read from a
sidecar that starts, logs, and is stopped with SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sidecar import cli

CLEAN_ENV = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/")}
EPHEMERAL = ("--host", "127.0.0.1", "--port", "0", "--admin-host", "127.0.0.1", "--admin-port", "0")


def fails(*argv: str, env: dict[str, str] | None = None) -> str:
    """Run ``serve`` with ``argv``; assert exit 2 and a single stderr line, and return it."""
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", *argv],
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    return lines[0]


@contextmanager
def listening() -> Iterator[int]:
    """A port somebody else already listens on."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_decode_url_port_out_of_range() -> None:
    line = fails("--decode-url", "http://127.0.0.1:99999", *EPHEMERAL)
    assert line == (
        "kv-release-sidecar: invalid decode_url (--decode-url) = 'http://127.0.0.1:99999': "
        "port '99999' is not a TCP port (1-65535)"
    )


def test_decode_url_with_a_path_is_refused() -> None:
    line = fails("--decode-url", "http://host:8200/v1", *EPHEMERAL)
    assert line.startswith("kv-release-sidecar: invalid decode_url (--decode-url) = 'http://host:8200/v1': ")
    assert "without a path (got '/v1')" in line


def test_proxy_port_in_use() -> None:
    with listening() as port:
        line = fails(
            "--host", "127.0.0.1", "--port", str(port), "--admin-host", "127.0.0.1", "--admin-port", "0"
        )
    assert line.startswith(f"kv-release-sidecar: cannot listen on 127.0.0.1:{port} (--port): ")
    assert "in use" in line


def test_admin_port_in_use() -> None:
    with listening() as port:
        line = fails(
            "--host", "127.0.0.1", "--port", "0", "--admin-host", "127.0.0.1", "--admin-port", str(port)
        )
    assert line.startswith(f"kv-release-sidecar: cannot listen on 127.0.0.1:{port} (--admin-port): ")


def test_a_bad_variable_names_the_variable() -> None:
    line = fails(*EPHEMERAL[:2], env={"KVR_PORT": "abc"})
    assert line == "kv-release-sidecar: invalid port (KVR_PORT) = 'abc': expected int"


def test_unknown_toml_key_names_the_file_and_the_closest_key(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text('relase = "nixl"\n')
    line = fails("--config", str(path), *EPHEMERAL)
    assert line == f"kv-release-sidecar: {path}: unknown key 'relase' (did you mean 'release'?)"


def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text('release = "nixl"\nport = = 1\n')
    line = fails(*EPHEMERAL, env={"KVR_CONFIG": str(path)})
    assert line.startswith(f"kv-release-sidecar: {path}: not valid TOML: ")
    assert "line 2" in line


def test_a_bad_value_in_the_file_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text('release = "teleport"\n')
    line = fails("--config", str(path), *EPHEMERAL)
    assert line == (
        f"kv-release-sidecar: invalid release ({path}, key release) = 'teleport': "
        "must be one of off, dry-run, nixl, http, auto"
    )


def test_a_missing_trust_secret_names_the_file_and_key(tmp_path: Path) -> None:
    # The shipped decode pod: trust = "hmac" with the key file of a Secret nobody created.
    path = tmp_path / "sidecar.toml"
    path.write_text('trust = "hmac"\ntrust_key_file = "/var/run/kv-release-sidecar/trust/key"\n')
    line = fails("--config", str(path), *EPHEMERAL)
    assert line == (
        f"kv-release-sidecar: invalid trust_key_file ({path}, key trust_key_file) = "
        "'/var/run/kv-release-sidecar/trust/key': cannot read: No such file or directory"
    )


def test_reversed_port_range_in_the_allowlist() -> None:
    line = fails("--prefill-allow", "10.0.0.1:5-2", *EPHEMERAL)
    assert line == (
        "kv-release-sidecar: invalid prefill_allow (--prefill-allow) = '10.0.0.1:5-2': "
        "port range '5-2' is reversed: write 2-5"
    )


def test_unknown_release_lists_the_choices_in_one_line() -> None:
    line = fails("--release", "foo", *EPHEMERAL)
    assert line.startswith("kv-release-sidecar serve: argument --release: invalid choice: 'foo'")
    for choice in ("off", "dry-run", "nixl", "http", "auto"):
        assert f"'{choice}'" in line


@pytest.mark.parametrize("strategy", ["nixl", "auto"])
def test_nixl_strategies_without_the_extra_name_it(
    strategy: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for module in ("nixl", "nixl_cu12"):
        monkeypatch.setitem(sys.modules, module, None)  # find_spec finds nothing, import fails
    assert cli.main(["serve", "--release", strategy, *EPHEMERAL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"kv-release-sidecar: --release {strategy} needs the nixl extra, which is not installed"
    )
    assert "README.md" in err


@pytest.mark.parametrize(
    ("argv", "blocked", "extra"),
    [
        (["loadtest", "--help"], "aiohttp", "loadtest"),
        (["demo"], "matplotlib", "loadtest"),
        (["demo"], "zmq", "nixl"),
        (["sim-prefill"], "numpy", "nixl"),
        (["sim-decode", "--vllm-d", "--port", "0"], "zmq", "nixl"),  # imported once the mode is chosen
    ],
)
def test_commands_without_their_extra_name_it(
    argv: list[str],
    blocked: str,
    extra: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in [m for m in sys.modules if m == blocked or m.startswith(blocked + ".")]:
        monkeypatch.delitem(sys.modules, name)
    for name in [m for m in sys.modules if m.startswith("sidecar.sim") or m.startswith("sidecar.loadtest")]:
        monkeypatch.delitem(sys.modules, name)  # re-imported: a cached module would hide the failure
    monkeypatch.setitem(sys.modules, blocked, None)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        f"kv-release-sidecar {argv[0]} needs the {extra} extra, which is not installed (no module {blocked})"
        in err
    )


@contextmanager
def started(*argv: str, env: dict[str, str] | None = None) -> Iterator[list[str]]:
    """A running ``serve``; yields its stderr lines up to start-up, the rest added after SIGTERM."""
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--log-format", "text", *EPHEMERAL, *argv],
        env={**CLEAN_ENV, **(env or {})},
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert process.stderr is not None
    lines: list[str] = []
    try:
        for line in process.stderr:  # start-up is over when the app logs it (or the process ends)
            lines.append(line.rstrip("\n"))
            if "sidecar started" in line:
                break
        yield lines
    finally:
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
        lines.extend(rest.splitlines())
    assert process.returncode == 0, "\n".join(lines)


def test_misspelt_variable_gets_a_warning_with_the_closest_name() -> None:
    with started(env={"KVR_RELASE": "nixl"}) as lines:
        pass
    warnings = [line for line in lines if "KVR_RELASE" in line]
    assert warnings == [
        "warning sidecar.serve: KVR_RELASE is not a setting and is ignored (did you mean 'KVR_RELEASE'?)"
    ]


def test_nixl_without_an_allowlist_warns_once() -> None:
    with started("--release", "nixl") as lines:
        assert any("NIXL agent started" in line for line in lines), lines
    warnings = [line for line in lines if line.startswith("warning ") and "prefill-allow" in line]
    assert len(warnings) == 1 and "--prefill-allow is empty" in warnings[0], lines


def test_a_failed_start_exits_1_after_the_reason_without_a_task_traceback() -> None:
    # The NIXL agent cannot start (in production: no UCX transport, an unreadable ~/.nixl.cfg).
    script = (
        "import sys; from sidecar import cli; from sidecar.nixl import peer\n"
        "def broken(self): raise RuntimeError('no UCX transport')\n"
        "peer.NixlPeer._create = broken\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    argv = ["serve", "--release", "nixl", "--prefill-allow", "10.0.0.0/8", "--log-format", "text", *EPHEMERAL]
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "no UCX transport" in done.stderr
    assert "Task exception was never retrieved" not in done.stderr and "SystemExit" not in done.stderr
    assert done.stderr.splitlines()[-1] == "kv-release-sidecar: start-up failed (the error is logged above)"


def test_an_unknown_llm_d_flag_names_the_flag_and_the_newest_llm_d_tag_known() -> None:
    # /app/pd-sidecar with a flag a newer llm-d release may add: the start stops, saying which.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "pd-sidecar",
            "--port=8000",
            "--kv-connector=nixlv2",
            "--new-knob=1",
        ],
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "kv-release-sidecar: invalid new-knob (--new-knob) = '--new-knob=1': unknown flag: not a flag of "
        "llm-d's pd-sidecar up to v0.10.0, the newest release this sidecar knows; a newer release's flag "
        "needs a newer kv-release-sidecar (docs/llm-d.md lists the flags)\n"
    )
