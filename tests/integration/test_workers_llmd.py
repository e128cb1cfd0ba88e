"""llm-d's decode pod with ``KVR_WORKERS=2``: data-parallel ranks and the InferencePool watch.

The sidecar runs as in ``test_llmd`` (the image's ``serve`` entry point with
llm-d's arguments, real P with NIXL, sim-decode as D, a fake Kubernetes API),
as a supervisor and two workers: llm-d's flags have no workers flag, so the
setting comes from ``KVR_WORKERS``, as every setting llm-d lacks does. Which
worker served a request is read from the workers' own ``/metrics`` (each on
its Unix socket, named in its log) around one request at a time.
"""

from __future__ import annotations

import functools
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import serve
from tests.integration.workers import HANG, Workers
from tests.support.certs import write_cert
from tests.support.fake_kube import LABELS, inference_pool, kube_api, pod
from tests.support.ports import free_port
from tests.support.ranked import ranked
from tests.support.sims import completion, wait_stats
from tests.support.until import until

pytestmark = [pytest.mark.nixl, pytest.mark.serial]  # several processes each: run alone
VERSION = "0.33.0"
TRIES = 400  # new connections before concluding the kernel gives them all to one worker


def p_sim() -> Any:
    config = PrefillSimConfig(port=0, vllm_version=VERSION, tp=2, num_blocks=64, lease=0, side_channel_port=0)
    return create_prefill_app(config)


def d_config() -> DecodeSimConfig:
    return DecodeSimConfig(port=0, version=VERSION, max_model_len=40, model="m", log_params=True)


@contextmanager
def llm_d_workers(args: list[str], env: dict[str, str], log: Path, url: str, admin: int) -> Iterator[Workers]:
    """``serve <llm-d's args>`` with ``KVR_WORKERS=2``, until ready and both workers logged."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVR_")}
    environ |= {"KVR_WORKERS": "2", "KVR_ADMIN_PORT": str(admin), **env}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", *args, "--zap-encoder=json"],
            env=environ, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    workers = Workers(process, log, url, f"http://127.0.0.1:{admin}")
    try:
        workers.ready()
        until(
            lambda: len(workers.sockets()) == 2, "both workers' admin sockets logged", timeout=HANG, poll=0.02
        )
        yield workers
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(HANG)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
    assert code == 0, log.read_text()[-3000:]


def each_worker(
    workers: Workers,
    send: Callable[[int], Any],
    metric: str = "kvr_requests_total",
    waiting: bool = False,
    **labels: str,
) -> dict[int, list[Any]]:
    """``send(i)`` (i = 0, 1, ...), one at a time, until each worker's ``metric`` rose: what each
    call returned, by the worker whose ``metric`` it raised (by one). ``waiting``: a call may
    raise it on no worker (kept under -1), as while a change is still on its way to one."""
    served: dict[int, list[Any]] = {-1: [], 0: [], 1: []}
    for i in range(TRIES):
        before = [workers.worker_sample(w, metric, **labels) for w in (0, 1)]
        answer = send(i)
        after = [workers.worker_sample(w, metric, **labels) for w in (0, 1)]
        rose = [w for w in (0, 1) if after[w] != before[w]]
        if not rose and waiting:
            served[-1].append(answer)
            continue
        assert len(rose) == 1 and after[rose[0]] == before[rose[0]] + 1, (answer, before, after)
        served[rose[0]].append(answer)
        if served[0] and served[1]:
            return served
    raise AssertionError(f"the kernel gave every connection to one worker {TRIES} times")


def sender(target: str, prefiller: str, rank: int) -> Callable[..., tuple[str, int]]:
    """``send(i, **body)``: one completion to ``target`` over a new connection, its prefill on
    ``prefiller``: (its request id, the status)."""

    def send(i: int, **body: Any) -> tuple[str, int]:
        rid = f"rank-{rank}-{'x' if body else 'ok'}-{i}"
        header = {"x-prefiller-host-port": prefiller, "x-request-id": rid}
        answer = httpx.post(target, json=completion(20, **body), headers=header, timeout=HANG)
        return rid, answer.status_code

    return send


def test_each_data_parallel_rank_is_served_by_every_worker(tmp_path: Path) -> None:
    d_base = free_port(2)
    with (
        serve(p_sim()) as p0,
        serve(p_sim()) as p1,
        ranked([d_config()] * 2, d_base, lambda: VllmDHooks(VERSION)) as ds,
    ):
        base, admin = free_port(2), free_port()
        args = [f"--port={base}", f"--model-server-port={d_base}", "--data-parallel-size=2",
                "--secure-serving=false"]  # fmt: skip
        env = {"KVR_PREFILL_ALLOW": "127.0.0.1", "POD_IP": "127.0.0.1"}
        log, url = tmp_path / "sidecar.log", f"http://127.0.0.1:{base}"
        with llm_d_workers(args, env, log, url, admin) as workers:
            ready = workers.ready()
            assert ready["checks"]["decode"] and ready["checks"]["decode_rank_1"], ready  # on every worker
            rejections = 0
            for rank, p in ((0, p0), (1, p1)):
                send = sender(f"http://127.0.0.1:{base + rank}/v1/completions", f"127.0.0.1:{p.port}", rank)
                served = each_worker(workers, send)  # each worker answers on this rank's port
                assert {status for answers in served.values() for _, status in answers} == {200}
                ok = {rid for answers in served.values() for rid, _ in answers}
                judged = each_worker(workers, functools.partial(send, max_tokens="x"))
                assert {status for answers in judged.values() for _, status in answers} == {400}
                rejected = {rid for answers in judged.values() for rid, _ in answers}
                rejections += len(rejected)
                seen = {entry["request_id"] for entry in httpx.get(ds[rank].url + "/sim/log").json()}
                assert ok <= seen <= ok | rejected  # this rank's D, and only it, had this rank's requests
                # P: each request pinned once and freed once: read by D, or released by the sidecar
                pinned = len(ok) + len(rejected)
                after = wait_stats(
                    p, lambda s, n=pinned: s["pinned_requests"] == 0 and s["requests_pinned"] == n
                )
                assert after["freed_by_notification"] == pinned, after
                assert after["notifs_per_rank"] == [pinned, pinned] and after["notifs_unknown"] == 0, after
            until(
                lambda: released(workers, 0) + released(workers, 1) == rejections,
                "each released",
                timeout=HANG,
                poll=0.02,
            )
            assert workers.sample("kvr_releases_total", result="sent") == rejections
            assert released(workers, 0) >= 2 and released(workers, 1) >= 2  # one per rank at least


def test_the_supervisor_watches_the_inference_pool_once_and_every_worker_enforces_it(tmp_path: Path) -> None:
    ca = trustme.CA()
    certs = tmp_path / "certs"
    write_cert(ca, certs)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with (
        kube_api(tmp_path, ca) as (fake, api, account),
        serve(p_sim()) as p,
        serve(create_decode_app(d_config(), VllmDHooks(VERSION))) as d,
    ):
        fake.put("inferencepools", inference_pool("pool", LABELS, [p.port]))
        fake.put("pods", pod("prefill-0", "127.0.0.1", LABELS))
        port, admin = free_port(), free_port()
        args = [f"--port={port}", f"--vllm-port={d.port}", "--kv-connector=nixlv2", "--secure-proxy=true",
                f"--cert-path={certs}", "--enable-ssrf-protection", "--inference-pool=llm/pool"]  # fmt: skip
        env = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(api.port),
            "KVR_KUBE_SERVICE_ACCOUNT": str(account),
            "KVR_POOL_SIDE_CHANNEL_PORTS": "1024-65535",
        }
        url = f"https://127.0.0.1:{port}"
        with (
            llm_d_workers(args, env, tmp_path / "sidecar.log", url, admin) as workers,
            httpx.Client(verify=ssl.create_default_context(cafile=ca_file), timeout=HANG) as client,
        ):
            assert all(w["checks"]["inference_pool"] for w in workers.ready()["workers"])
            # What the API server carries: one watch of the pool and one of its pods, the
            # supervisor's, whatever the number of workers.
            watches = ["inferencepools", "pods"]
            until(
                lambda: sorted(resource for resource, _ in fake.watchers) == watches,
                "one watch each",
                timeout=HANG,
                poll=0.02,
            )

            def send(i: int, named: str = "127.0.0.1", **body: Any) -> int:
                header = {"x-prefiller-host-port": f"{named}:{p.port}", "connection": "close"}
                return client.post(
                    url + "/v1/completions", json=completion(5, **body), headers=header
                ).status_code

            refused = "kvr_prefill_refused_total"
            served = each_worker(workers, send)
            assert statuses(served) == {200}  # the pool's pod: allowed on each worker
            judged = each_worker(workers, functools.partial(send, max_tokens="x"), status_class="4xx")
            assert statuses(judged) == {400}
            until(  # each worker released its own rejections to the pool's P
                lambda: all(released(workers, w) == len(judged[w]) for w in (0, 1)),
                "each rejection released",
                timeout=HANG,
                poll=0.02,
            )
            pinned = sum(len(answers) for answers in (*served.values(), *judged.values()))
            after = wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["requests_pinned"] == pinned)
            assert after["notifs_per_rank"] == [pinned, pinned] and after["notifs_unknown"] == 0, after
            outside = each_worker(workers, lambda i: send(i, "127.0.0.2"), refused, reason="not_allowed")
            assert statuses(outside) == {403}  # not a pool member, on each worker

            fake.delete("pods", "prefill-0")  # the pool follows: P is no longer allowed, on every worker
            forbidden(workers, send)
            fake.put("pods", pod("prefill-1", "127.0.0.1", LABELS))  # a pod added: allowed again
            allowed(workers, send)
            fake.delete("pods", "prefill-1")  # and removed: refused again
            forbidden(workers, send)
            fake.put("pods", pod("prefill-2", "127.0.0.1", LABELS))
            allowed(workers, send)

            # A restarted worker enforces the current lists at once: its first answers are 200
            # (a worker without them would answer 503 while starting, then 403).
            before = pids(workers)
            os.kill(before[0], signal.SIGKILL)
            until(lambda: pids(workers)[0] != before[0], "worker 0 restarted", timeout=HANG, poll=0.02)
            assert statuses(each_worker(workers, send, status_class="2xx")) == {200}
            assert sorted(resource for resource, _ in fake.watchers) == watches  # none added, none lost
            assert len(fake.watch_requests("inferencepools")) == len(fake.watch_requests("pods")) == 1
            assert len(fake.list_requests("inferencepools")) == len(fake.list_requests("pods")) == 1


def forbidden(workers: Workers, send: Callable[..., int]) -> None:
    """Each worker took the change (a 403 counted on each), then answers 403 on each."""
    refused = "kvr_prefill_refused_total"
    each_worker(workers, send, refused, waiting=True, reason="not_allowed")
    assert statuses(each_worker(workers, send, refused, reason="not_allowed")) == {403}


def allowed(workers: Workers, send: Callable[..., int]) -> None:
    """Each worker took the change (a 2xx counted on each), then answers 200 on each."""
    each_worker(workers, send, waiting=True, status_class="2xx")
    assert statuses(each_worker(workers, send, status_class="2xx")) == {200}


def pids(workers: Workers) -> dict[int, int]:
    return {w["worker"]: w["pid"] for w in workers.ready()["workers"]}


def released(workers: Workers, worker: int) -> float:
    return workers.worker_sample(worker, "kvr_releases_total", result="sent", strategy="nixl")


def statuses(served: dict[int, list[Any]]) -> set[Any]:
    return {answer for answers in served.values() for answer in answers}
