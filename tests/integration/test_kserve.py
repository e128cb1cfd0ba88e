"""KServe's LLMInferenceService decode pod, end to end: its routing sidecar's exact command and env.

The command and the variables are read from KServe's decode template
(tests/deploy/fixtures/llm-d/kserve, vendored from kserve/kserve) and rendered
as KServe's controller renders them with TLS on (tests.deploy.kserve): TLS
served with ``--cert-path``, D and P reached over TLS and verified (KServe
passes no skip-verify flag), SSRF protection with the v1alpha2 InferencePool,
and ``SSL_CERT_DIR`` naming the folder of KServe's self-signed certificate.
P (sim-prefill, TP 2, real NIXL agents) and D (sim-decode) serve a
certificate shaped like KServe's (tests.support.certs: SANs ``localhost`` and the pod
address 127.0.0.1), so verification passes only if the sidecar trusts the
files of that folder as llm-d's Go sidecar does.

Substituted, as a test on one host needs: the certificate folder
``/var/run/kserve/tls`` is a temporary directory (in ``--cert-path`` and in
``SSL_CERT_DIR``, whose other folders are kept as the template has them, missing
here); the ports 8000 and 8001 are free ones; ``/app/pd-sidecar`` is the
``pd-sidecar`` console script the image links there. What a pod gets from its
platform is added: the Kubernetes API's address and the service account (a
fake API, tests.support.fake_kube), the admin port, and the side-channel ports P's
ephemeral NIXL port falls in.
"""

from __future__ import annotations

import ssl
import sys
from pathlib import Path

import httpx
import pytest
import trustme

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import serve
from tests.deploy import kserve
from tests.support.certs import kserve_self_signed, write_secret
from tests.support.fake_kube import ALPHA, LABELS, alpha_pool, kube_api, pod
from tests.support.ports import free_port
from tests.support.runner import answers, sidecar
from tests.support.sims import completion, wait_stats

pytestmark = pytest.mark.nixl
VERSION = "0.33.0"
POOL = "llm/pool"


def substituted(command: list[str], replacements: dict[str, str]) -> list[str]:
    """``command`` with each argument of ``replacements`` replaced; each must be there once."""
    for old in replacements:
        assert command.count(old) == 1, f"the template no longer has {old!r}: {command}"
    return [replacements.get(arg, arg) for arg in command]


@pytest.mark.parametrize("template", kserve.TEMPLATES)
def test_kserves_command_with_verification_on_reads_and_frees_ps_blocks(
    tmp_path: Path, template: str
) -> None:
    cert, key = kserve_self_signed(names=("localhost",), ips=("127.0.0.1",))
    certs = write_secret(tmp_path / "var-run-kserve-tls", cert, key)  # stands in for /var/run/kserve/tls
    served = {"ssl_certfile": str(certs / "tls.crt"), "ssl_keyfile": str(certs / "tls.key")}
    p_app = create_prefill_app(
        PrefillSimConfig(port=0, vllm_version=VERSION, tp=2, num_blocks=64, lease=0, side_channel_port=0)
    )
    d_config = DecodeSimConfig(port=0, version=VERSION, max_model_len=40, model="m", log_params=True)
    container = kserve.sidecar(template)
    with (
        kube_api(tmp_path, trustme.CA(), ALPHA) as (fake, api, account),
        serve(p_app, **served) as p,
        serve(create_decode_app(d_config, VllmDHooks(VERSION)), **served) as d,
    ):
        fake.put("inferencepools", alpha_pool("pool", LABELS, p.port))
        fake.put("pods", pod("prefill-0", "127.0.0.1", LABELS))
        port, admin = free_port(), free_port()
        program, *args = substituted(
            kserve.command(container, POOL),
            {
                "--port=8000": f"--port={port}",
                "--vllm-port=8001": f"--vllm-port={d.port}",
                f"--cert-path={kserve.CERT_DIR}": f"--cert-path={certs}",
            },
        )
        assert program == "/app/pd-sidecar"
        env = kserve.environment(container, namespace="llm")
        assert env["SSL_CERT_DIR"].startswith(kserve.CERT_DIR + ":")
        env["SSL_CERT_DIR"] = env["SSL_CERT_DIR"].replace(kserve.CERT_DIR, str(certs), 1)
        platform = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(api.port),
            "KVR_KUBE_SERVICE_ACCOUNT": str(account),
            "KVR_ADMIN_PORT": str(admin),
            "KVR_POOL_SIDE_CHANNEL_PORTS": "1024-65535",
        }
        ready = lambda: answers(f"http://127.0.0.1:{admin}/readyz")  # noqa: E731 - D verified over TLS
        pd_sidecar = [str(Path(sys.executable).parent / "pd-sidecar")]
        trusted = ssl.create_default_context(cafile=certs / "tls.crt")
        p_url = f"https://127.0.0.1:{p.port}"  # P's own record, over TLS
        with (
            sidecar(args, {**env, **platform}, ready, program=pd_sidecar),
            httpx.Client(verify=trusted, timeout=20) as client,
        ):
            url = f"https://127.0.0.1:{port}/v1/completions"
            header = {"x-prefiller-host-port": f"127.0.0.1:{p.port}"}
            admitted = client.post(url, json=completion(20), headers=header)
            assert admitted.status_code == 200, admitted.text
            after = wait_stats(p_url, lambda s: s["pinned_requests"] == 0, verify=trusted)
            assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]  # D read them

            rejected = client.post(url, json=completion(60, max_tokens="x"), headers=header)
            assert rejected.status_code == 400, rejected.text
            after = wait_stats(
                p_url, lambda s: s["pinned_requests"] == 0 and s["requests_pinned"] == 2, verify=trusted
            )
            assert after["notifs_per_rank"] == [2, 2] and after["notifs_unknown"] == 0  # freed by the sidecar
            metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
            assert 'kvr_releases_total{result="sent",strategy="nixl"} 1.0' in metrics
