"""Trust material an operator may mistype: ``serve`` and ``check`` end their start in bounded time.

Each case is the real CLI in a subprocess, as an operator runs it, with the variables and flags
that name outbound TLS's trust (``SSL_CERT_DIR``, ``SSL_CERT_FILE``, ``KVR_SSL_CERT_FILE``,
``--tls-ca-file``) pointing at what used to hang it or fill its memory: a FIFO, ``/proc``, a
symlink loop, a 200 MB file (sparse: it takes no disk). Each run is bounded by the test
(``subprocess`` timeouts, and pytest-timeout over the whole test); each problem is one log line
naming the file. ``serve`` goes on without what it cannot use; an unusable ``tls_ca_file`` stops
it (exit 2, one line), as ``check`` does. A SIGTERM while starting ends the start at once, also as
PID 1 of its own PID namespace, as in a container (where a signal with no handler is dropped).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sidecar.tls.trust import MAX_FILE_BYTES
from tests.support.certs import kserve_self_signed
from tests.support.ports import free_port
from tests.support.until import answered, until

BOUND = 20.0  # seconds any run may take: the start, or the start and a SIGTERM
OWN = ("KVR_", "SSL_CERT_")  # variables the test runner's environment must not set for the sidecar


def clean_env(**extra: str) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(OWN)},
        "KVR_LOG_FORMAT": "text",
        **extra,
    }


@pytest.fixture
def hazards(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a folder holding a symlink loop and a good certificate, a folder holding a 200 MB
    file, and a folder that is itself a symlink loop."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loops = tmp_path / "loops"
    loops.mkdir()
    (loops / "a.pem").symlink_to("b.pem")
    (loops / "b.pem").symlink_to("a.pem")
    (loops / "good.crt").write_bytes(kserve_self_signed()[0])
    big = tmp_path / "big"
    big.mkdir()
    with (big / "huge.pem").open("wb") as handle:
        handle.truncate(200 * 1024 * 1024)
    looped = tmp_path / "looped"
    looped.symlink_to(looped)
    return {"fifo": fifo, "loops": loops, "big": big, "looped": looped}


@contextmanager
def serving(env: dict[str, str], *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], str, float]]:
    """``serve`` until its admin port answers ``/healthz``; (process, admin URL, seconds it took)."""
    admin = free_port()
    output = tempfile.TemporaryFile()  # noqa: SIM115 - closed below
    started = time.monotonic()
    command = [sys.executable, "-m", "sidecar", "serve", "--host", "127.0.0.1", "--port", str(free_port())]
    command += ["--admin-host", "127.0.0.1", "--admin-port", str(admin), *flags]
    process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        answered(f"http://127.0.0.1:{admin}/healthz", timeout=BOUND)
        yield process, f"http://127.0.0.1:{admin}", time.monotonic() - started
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(BOUND)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        output.seek(0)
        process.output = output.read().decode()  # type: ignore[attr-defined]
        output.close()


def lines_naming(text: str, path: Path | str) -> list[str]:
    return [line for line in text.splitlines() if str(path) in line]


@pytest.mark.timeout(120)
def test_serve_starts_past_what_it_cannot_trust_naming_each_in_one_line(hazards: dict[str, Path]) -> None:
    folders = f"/proc:{hazards['loops']}:{hazards['big']}:{hazards['looped']}"
    env = clean_env(SSL_CERT_DIR=folders, SSL_CERT_FILE=str(hazards["fifo"]))
    with serving(env) as (process, _, took):
        assert took < BOUND
        resident = int(Path(f"/proc/{process.pid}/status").read_text().split("VmRSS:")[1].split()[0])
    output: str = process.output  # type: ignore[attr-defined]
    assert process.returncode == 0, output[-3000:]
    assert resident < 200 * 1024  # kB: the 200 MB file was never read
    expected = {
        "/proc": "a folder of /proc or /sys",
        str(hazards["fifo"]): "not a regular file (a FIFO)",
        str(hazards["loops"] / "a.pem"): "a symlink loop",
        str(hazards["loops"] / "b.pem"): "a symlink loop",
        str(hazards["big"] / "huge.pem"): f"209715200 bytes, over the limit of {MAX_FILE_BYTES}",
        str(hazards["looped"]): "a symlink loop",
    }
    for path, why in expected.items():
        named = [line for line in lines_naming(output, path + ":") if "outbound TLS" in line]
        assert len(named) == 1 and why in named[0], (path, named)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variable", ["SSL_CERT_FILE", "KVR_SSL_CERT_FILE"])
def test_a_fifo_named_as_the_cert_file_is_skipped_at_once(hazards: dict[str, Path], variable: str) -> None:
    with serving(clean_env(**{variable: str(hazards["fifo"])})) as (process, _, _took):
        pass
    output: str = process.output  # type: ignore[attr-defined]
    [line] = [line for line in lines_naming(output, hazards["fifo"]) if "outbound TLS" in line]
    assert "not a regular file (a FIFO): not trusted" in line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ca", ["fifo", "/proc/self/status", "huge", "loop"])
def test_an_unusable_tls_ca_file_stops_serve_and_check_in_one_line(hazards: dict[str, Path], ca: str) -> None:
    path = {
        "fifo": hazards["fifo"],
        "/proc/self/status": Path("/proc/self/status"),
        "huge": hazards["big"] / "huge.pem",
        "loop": hazards["loops"] / "a.pem",
    }[ca]
    for command in ("serve", "check"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "sidecar",
                command,
                "--admin-port",
                "0",
                "--port",
                "0",
                "--tls-ca-file",
                str(path),
            ],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=BOUND,
            check=False,
        )
        assert done.returncode == 2, (command, done.stdout[-2000:], done.stderr[-2000:])
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"kv-release-sidecar: invalid tls_ca_file (--tls-ca-file) = '{path}': "), line


@pytest.mark.timeout(120)
def test_check_ends_and_names_each_problem(hazards: dict[str, Path]) -> None:
    env = clean_env(SSL_CERT_DIR=f"/proc:{hazards['loops']}", KVR_SSL_CERT_FILE=str(hazards["fifo"]))
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "check", "--decode-url", f"http://127.0.0.1:{free_port()}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )
    trust = [line for line in done.stdout.splitlines() if line.startswith("warn  tls-trust: ")]
    assert len(trust) == 4, done.stdout
    for path in ("/proc", hazards["fifo"], hazards["loops"] / "a.pem", hazards["loops"] / "b.pem"):
        assert len(lines_naming("\n".join(trust), f"{path}:")) == 1


# --- SIGTERM while starting ----------------------------------------------------------------------

#: ``serve`` whose read of the trust material takes a minute, as on a hung network file system:
#: the read is replaced by one that says so and sleeps (nothing else of start-up is changed).
SLOW_READ = """
import sys, time
import sidecar.tls.trust as trust

def slow(config, environ=None):
    print("reading trust material", flush=True)
    time.sleep(60)
    raise AssertionError("not interrupted")

trust.read_store = slow
from sidecar.cli import main
sys.exit(main(sys.argv[1:]))
"""


def pid_one() -> list[str]:
    """A command prefix making the sidecar PID 1 of a new PID namespace (as in a container), or []
    where this machine cannot make one (the handler is then seen in the exit status alone)."""
    for prefix in (
        ["unshare", "--pid", "--fork", "--kill-child"],
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"],
    ):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return prefix
    return []


def child_of(pid: int) -> int:
    """The one child of ``pid`` (unshare's forked child: the sidecar, PID 1 inside)."""
    children = lambda: Path(f"/proc/{pid}/task/{pid}/children").read_text().split()  # noqa: E731
    return int(until(children, "unshare's child", BOUND)[0])


@pytest.mark.timeout(120)
def test_sigterm_during_start_up_ends_it_at_once_even_as_pid_one() -> None:
    prefix = pid_one()
    command = [*prefix, sys.executable, "-c", SLOW_READ, "serve", "--admin-port", "0", "--port", "0"]
    process = subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().decode().strip() == "reading trust material"
        target = child_of(process.pid) if prefix else process.pid
        started = time.monotonic()
        os.kill(target, signal.SIGTERM)
        code = process.wait(BOUND)
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        output = process.stdout.read().decode() if process.stdout else ""
        if process.stdout is not None:
            process.stdout.close()
    assert code == 128 + signal.SIGTERM, output  # the handler's exit, not the signal's default
    assert took < 5.0 and "stopped while starting" in output
