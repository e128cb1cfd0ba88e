"""Real retrying proxies in front of two decode pods: nginx and haproxy, as ``deploy/mesh`` ships them.

``front(kind, upstreams)`` runs Debian's ``nginx`` or ``haproxy`` binary with
the configuration file in ``deploy/mesh`` (its listen address and the two
decode pods' addresses swapped for loopback ports), waits until it accepts
connections (polled), and stops it at the end. The binaries come with the
test set-up (``make tools``); a missing one fails the test with that hint,
never a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import pytest

from tests.support.ports import free_port, listening
from tests.support.until import until

MESH = Path(__file__).resolve().parents[2] / "deploy" / "mesh"
PODS = ("decode-0.vllm-decode.llm.svc:8000", "decode-1.vllm-decode.llm.svc:8000")
Kind = Literal["nginx", "haproxy"]


def binary(kind: Kind) -> str:
    path = shutil.which(kind) or shutil.which(kind, path="/usr/sbin:/sbin")
    if path is None:
        pytest.fail(f"{kind} is not installed: run `make tools` (Debian's {kind} package)")
    return path


def _swapped(text: str, listen: str, upstreams: Sequence[str]) -> str:
    for pod, upstream in zip(PODS, upstreams, strict=True):
        text = text.replace(pod, upstream)
    return text.replace("listen 8000;", f"listen {listen};").replace("bind :8000", f"bind {listen}")


def nginx_conf(workdir: Path, port: int, upstreams: Sequence[str]) -> str:
    shipped = (MESH / "nginx-decode.conf").read_text()
    (workdir / "decode.conf").write_text(_swapped(shipped, f"127.0.0.1:{port}", upstreams))
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers write the temp paths below
    temps = "".join(f"    {name}_temp_path {workdir}/{name};\n" for name in ("client_body", "proxy"))
    return (
        f"{user}daemon off;\npid {workdir}/nginx.pid;\nerror_log {workdir}/error.log warn;\n"
        "events { worker_connections 1024; }\n"
        "http {\n"
        "    log_format upstreams '$status $upstream_addr $upstream_status';\n"
        f"    access_log {workdir}/access.log upstreams;\n{temps}"
        f"    include {workdir}/decode.conf;\n}}\n"
    )


def haproxy_conf(workdir: Path, port: int, upstreams: Sequence[str]) -> str:
    shipped = (MESH / "haproxy-decode.cfg").read_text()
    return "global\n    maxconn 1024\n\n" + _swapped(shipped, f"127.0.0.1:{port}", upstreams)


@contextmanager
def front(kind: Kind, upstreams: Sequence[str]) -> Iterator[str]:
    """``kind`` in front of ``upstreams`` (``host:port`` each); yields its URL."""
    exe = binary(kind)
    with tempfile.TemporaryDirectory(prefix=f"kvr-{kind}-") as tmp:
        workdir, port = Path(tmp), free_port()
        if kind == "nginx":
            conf = workdir / "nginx.conf"
            conf.write_text(nginx_conf(workdir, port, upstreams))
            argv = [exe, "-p", str(workdir), "-c", str(conf)]
        else:
            conf = workdir / "haproxy.cfg"
            conf.write_text(haproxy_conf(workdir, port, upstreams))
            argv = [exe, "-db", "-f", str(conf)]
        log = (workdir / "stderr").open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_listening(proc, port, workdir / "stderr")
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _wait_listening(proc: subprocess.Popen[bytes], port: int, output: Path, timeout: float = 10.0) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.returncode}: {output.read_text()[-2000:]}")
        return listening(port)

    until(up, f"{proc.args[0]} to listen on {port}", timeout)
