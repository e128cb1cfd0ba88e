"""pd-sidecar takes header blocks up to 1 MiB, as llm-d's Go server does; serve keeps 64 KiB.

Go's net/http server reads a request's line and headers up to
``DefaultMaxHeaderBytes`` (1 MiB) and llm-d's sidecar does not lower it, so
clients and gateways in front of it may send large headers (long tokens,
trace baggage). The ``pd-sidecar`` process here runs llm-d's args (TLS off)
in front of sim-decode, itself served with room for such headers: a 512 KiB
header reaches D, one above 1 MiB is refused with 431 in vLLM's error shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from sidecar.config import Config
from sidecar.llmd.command import load
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import serve
from tests.support.ports import free_port
from tests.support.runner import answers, sidecar

MIB = 1024 * 1024


def test_header_blocks_up_to_1_mib_pass_in_pd_sidecar_mode_and_larger_get_431() -> None:
    d_app = create_decode_app(DecodeSimConfig(port=0, model="m", log_params=True))
    with serve(d_app, h11_max_incomplete_event_size=4 * MIB) as d:  # D takes them, as vLLM's httptools
        port, admin = free_port(), free_port()
        args = [f"--port={port}", f"--vllm-port={d.port}", "--secure-serving=false"]
        env = {"KVR_ADMIN_PORT": str(admin), "KVR_PREFILL_ALLOW": "127.0.0.1"}
        ready = lambda: answers(f"http://127.0.0.1:{admin}/readyz")  # noqa: E731
        pd_sidecar = [str(Path(sys.executable).parent / "pd-sidecar")]
        with sidecar(args, env, ready, program=pd_sidecar):
            url = f"http://127.0.0.1:{port}/v1/completions"
            body = {"model": "m", "prompt": "tok tok", "max_tokens": 2}
            big = {"x-big": "a" * (512 * 1024), "x-request-id": "big-header"}
            passed = httpx.post(url, json=body, headers=big, timeout=20)
            assert passed.status_code == 200, passed.text[:300]
            assert "big-header" in {e["request_id"] for e in httpx.get(d.url + "/sim/log").json()}
            try:
                refused = httpx.post(url, json=body, headers={"x-big": "a" * (MIB + 64 * 1024)}, timeout=20)
            except httpx.RemoteProtocolError:  # pragma: no cover - a reset may eat the answer
                pytest.fail("the sidecar closed the connection without its 431")
            assert refused.status_code == 431
            assert refused.json()["error"]["type"] == "RequestHeaderFieldsTooLargeError"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, MIB), ({"KVR_MAX_HEADER_BYTES": "65536"}, 65536)],
)
def test_pd_sidecars_limit_is_go_s_and_a_setting_still_changes_it(
    environ: dict[str, str], expected: int
) -> None:
    config, _ = load(["--secure-serving=false"], environ)
    assert config.max_header_bytes == expected
    assert Config().max_header_bytes == 64 * 1024  # serve's own stays
