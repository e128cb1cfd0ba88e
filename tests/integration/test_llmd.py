"""The llm-d drop-in end to end: llm-d's decode args, TLS, the InferencePool watch, real P and D.

The sidecar runs as llm-d's decode pod runs its routing sidecar: the image's
``serve`` entry point with llm-d's exact arguments (TLS on, a certificate
directory, SSRF protection with an InferencePool), in front of sim-decode (vLLM
D) with sim-prefill (TP 2, real NIXL) as P. Kubernetes is a fake API server
(tests.support.fake_kube) reached with the pod's service-account token over HTTPS. A real
TLS client (httpx, verifying the test CA) sends requests with llm-d's header.
"""

from __future__ import annotations

import shutil
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
from tests.support.certs import write_cert
from tests.support.fake_kube import LABELS, inference_pool, kube_api, pod
from tests.support.ports import free_port
from tests.support.ranked import ranked
from tests.support.runner import answers, sidecar
from tests.support.sims import completion, p_stats, wait_stats
from tests.support.until import until

pytestmark = pytest.mark.nixl
VERSION = "0.33.0"


def test_llm_d_decode_args_with_tls_and_the_pool_watch(tmp_path: Path) -> None:
    ca = trustme.CA()
    certs = tmp_path / "certs"
    write_cert(ca, certs)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    p_app = create_prefill_app(
        PrefillSimConfig(port=0, vllm_version=VERSION, tp=2, num_blocks=64, lease=0, side_channel_port=0)
    )
    d_config = DecodeSimConfig(port=0, version=VERSION, max_model_len=40, model="m", log_params=True)
    with (
        kube_api(tmp_path, ca) as (fake, api, account),
        serve(p_app) as p,
        serve(create_decode_app(d_config, VllmDHooks(VERSION))) as d,
    ):
        fake.put("inferencepools", inference_pool("pool", LABELS, [p.port]))
        fake.put("pods", pod("prefill-0", "127.0.0.1", LABELS))
        port, admin = free_port(), free_port()
        llm_d_args = [
            f"--port={port}",
            f"--vllm-port={d.port}",
            "--kv-connector=nixlv2",
            "--secure-proxy=true",
            f"--cert-path={certs}",
            "--enable-ssrf-protection",
            "--inference-pool=llm/pool",
            "--zap-encoder=json",
            "--zap-log-level=info",
        ]
        env = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(api.port),
            "KVR_KUBE_SERVICE_ACCOUNT": str(account),
            "KVR_ADMIN_PORT": str(admin),
            "KVR_POOL_SIDE_CHANNEL_PORTS": "1024-65535",
        }
        url = f"https://127.0.0.1:{port}"
        ready = lambda: answers(f"http://127.0.0.1:{admin}/readyz")  # noqa: E731
        with (
            sidecar(llm_d_args, env, ready),
            httpx.Client(verify=ssl.create_default_context(cafile=ca_file), timeout=20) as client,
        ):
            header = {"x-prefiller-host-port": f"127.0.0.1:{p.port}"}
            assert client.get(url + "/health").status_code == 200
            ok = client.post(url + "/v1/completions", json=completion(20), headers=header)
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"]
            after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
            assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]  # D read them

            rejected = client.post(
                url + "/v1/completions", json=completion(60, max_tokens="x"), headers=header
            )
            assert rejected.status_code == 400
            after = wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["requests_pinned"] == 2)
            assert after["notifs_per_rank"] == [2, 2] and after["notifs_unknown"] == 0  # freed by the sidecar
            metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
            assert 'kvr_releases_total{result="sent",strategy="nixl"} 1.0' in metrics

            outside = {"x-prefiller-host-port": f"127.0.0.2:{p.port}"}
            denied = client.post(url + "/v1/completions", json=completion(5), headers=outside)
            assert denied.status_code == 403
            assert denied.text == "Forbidden: prefill target not allowed by SSRF protection\n"

            fake.delete("pods", "prefill-0")  # the pool follows: P is no longer allowed

            def status() -> int:
                return client.post(url + "/v1/completions", json=completion(5), headers=header).status_code

            until(lambda: status() == 403, "the change", 5.0, 0.05)
            fake.put("pods", pod("prefill-1", "127.0.0.1", LABELS))
            until(lambda: status() == 200, "the change", 5.0, 0.05)
            assert p_stats(p)["requests_pinned"] >= 3


def test_a_rotated_certificate_reaches_new_connections_without_a_restart(tmp_path: Path) -> None:
    ca = trustme.CA()
    certs = tmp_path / "certs"
    write_cert(ca, certs)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with serve(create_decode_app(DecodeSimConfig(port=0, model="m"))) as d:
        port, admin = free_port(), free_port()
        args = [f"--port={port}", f"--model-server-port={d.port}", f"--cert-path={certs}"]
        env = {"KVR_ADMIN_PORT": str(admin), "KVR_PREFILL_ALLOW": "127.0.0.1", "KVR_RELEASE": "dry-run"}
        ready = lambda: answers(f"http://127.0.0.1:{admin}/readyz")  # noqa: E731
        with sidecar(args, env, ready):
            first = served_serial(port, ca_file)
            write_cert(ca, certs)  # the Secret's new version
            until(lambda: served_serial(port, ca_file) != first, "the change", 5.0, 0.05)
            with httpx.Client(verify=ssl.create_default_context(cafile=ca_file)) as client:
                assert client.get(f"https://127.0.0.1:{port}/health").status_code == 200


def served_serial(port: int, ca_file: Path) -> int:
    """The serial number of the certificate a new TLS connection is served."""
    import socket

    from cryptography import x509

    context = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_data_parallel_size_2_routes_each_rank_to_its_own_d_and_releases_to_the_leg_s_p() -> None:
    d_base = free_port(2)
    configs = [DecodeSimConfig(port=0, version=VERSION, max_model_len=40, model="m", log_params=True)] * 2
    ps = [
        create_prefill_app(
            PrefillSimConfig(port=0, vllm_version=VERSION, tp=2, num_blocks=64, lease=0, side_channel_port=0)
        )
        for _ in range(2)
    ]
    with serve(ps[0]) as p0, serve(ps[1]) as p1, ranked(configs, d_base, lambda: VllmDHooks(VERSION)) as ds:
        base, admin = free_port(2), free_port()
        args = [
            f"--port={base}",
            f"--model-server-port={d_base}",
            "--data-parallel-size=2",
            "--secure-serving=false",
        ]
        env = {"KVR_ADMIN_PORT": str(admin), "KVR_PREFILL_ALLOW": "127.0.0.1", "POD_IP": "127.0.0.1"}
        ready = lambda: answers(f"http://127.0.0.1:{admin}/readyz")  # noqa: E731
        with sidecar(args, env, ready):
            checks = httpx.get(f"http://127.0.0.1:{admin}/readyz").json()["checks"]
            assert checks["decode"] and checks["decode_rank_1"], checks  # each rank's D is probed
            for rank, p in ((0, p0), (1, p1)):
                header = {"x-prefiller-host-port": f"127.0.0.1:{p.port}", "x-request-id": f"rank-{rank}"}
                target = f"http://127.0.0.1:{base + rank}/v1/completions"
                assert httpx.post(target, json=completion(20), headers=header, timeout=20).status_code == 200
                rejected = httpx.post(target, json=completion(60, max_tokens="x"), headers=header, timeout=20)
                assert rejected.status_code == 400
            for rank, d in enumerate(ds):
                log = httpx.get(d.url + "/sim/log").json()
                assert {entry["request_id"] for entry in log} == {f"rank-{rank}"}, log
            for p in (p0, p1):  # each P: one read by its D rank, one freed by the sidecar
                after = wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["requests_pinned"] == 2)
                assert after["freed_by_notification"] == 2 and after["notifs_unknown"] == 0
            rank0 = f"http://127.0.0.1:{base}/v1/completions"
            for named, status in ((f"127.0.0.1:{base + 5}", 400), (f"10.9.9.9:{base + 1}", 400)):
                wrong = httpx.post(rank0, json=completion(5), headers={"x-data-parallel-host-port": named})
                assert (wrong.status_code, wrong.content) == (status, b"")  # not POD_IP:a rank's port
            by_header = {"x-data-parallel-host-port": f"127.0.0.1:{base + 1}", "x-request-id": "by-header"}
            assert httpx.post(rank0, json=completion(5), headers=by_header, timeout=20).status_code == 200
            assert "by-header" in {entry["request_id"] for entry in httpx.get(ds[1].url + "/sim/log").json()}


def test_the_self_signed_certificate_is_made_at_start_without_a_directory(tmp_path: Path) -> None:
    assert shutil.which(sys.executable)
    with serve(create_decode_app(DecodeSimConfig(port=0, model="m"))) as d:
        port, admin = free_port(), free_port()
        env = {"KVR_ADMIN_PORT": str(admin), "KVR_PREFILL_ALLOW": "127.0.0.1", "KVR_RELEASE": "dry-run"}
        ready = lambda: answers(f"http://127.0.0.1:{admin}/readyz")  # noqa: E731
        with sidecar([f"--port={port}", f"--vllm-port={d.port}"], env, ready):
            assert httpx.get(f"https://127.0.0.1:{port}/health", verify=False).status_code == 200
            with pytest.raises(httpx.ConnectError):  # self-signed: a verifying client refuses it
                httpx.get(f"https://127.0.0.1:{port}/health")
