"""Each vendored llm-d manifest's exact sidecar args serve P/D traffic and release D's rejections.

The args are read from the manifests themselves (tests/deploy/fixtures/llm-d,
rendered with ``deploy/llm-d`` as an llm-d user renders them): the P/D recipe's
decode Deployment, the guide's DisaggregatedSet with ``--secure-serving=false``
and its earlier revision with ``--secure-proxy=false``. No guide ships a TLS
variant; the fourth case is the guide's args without their ``--secure-*=false``,
which is pd-sidecar's default: TLS serving with a self-signed certificate.

Two network namespaces stand for two pods (``tests.integration.test_llmd_netns``):
the decode pod runs sim-decode as vLLM on 8200 and, one case after the other,
the sidecar with the case's args; the prefill pod runs sim-prefill (TP 2, real
NIXL) on an address of its own, so the guides' args, which name no allowlist,
reach P as they would in a cluster. For each case, on completions, chat with
``min_tokens``, ``/v1/messages`` and ``/inference/v1/generate``, an admitted
request is read at P by D, and one D rejects is freed by the sidecar.

``SCENARIOS`` is where more requests per manifest go (a route, a field): each
is a function of the running case and is run for every manifest.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.llmd.command import load
from tests.deploy.manifests import COMPONENT, SIDECAR_IMAGE, render, sidecars
from tests.integration.netns import Pods, pods, running, start_sims
from tests.support.runner import answers
from tests.support.sims import chat, completion, generate, messages, wait_stats

pytestmark = [pytest.mark.nixl, pytest.mark.netns]
HEADER = "x-prefiller-host-port"


def guide_args(tmp_path: Path, shape: str) -> list[str]:
    """The routing sidecar's args in ``shape``'s rendered manifest, the image swapped by deploy/llm-d."""
    [container] = sidecars(render(tmp_path, shape, COMPONENT))
    assert SIDECAR_IMAGE in container["image"]
    return list(container["args"])


def tls_default(args: list[str]) -> list[str]:
    """The guide's args without ``--secure-serving=false``/``--secure-proxy=false``: serving TLS."""
    kept = [a for a in args if not a.startswith(("--secure-serving=", "--secure-proxy="))]
    assert len(kept) == len(args) - 1
    return kept


CASES: dict[str, tuple[str, Callable[[list[str]], list[str]]]] = {
    "deployment": ("deployment", list),
    "disaggregatedset": ("disaggregatedset", list),
    "disaggregatedset-secure-proxy": ("disaggregatedset-secure-proxy", list),
    "deployment-tls": ("deployment", tls_default),
}


@dataclass(frozen=True)
class Case:
    """One manifest's sidecar, running in the decode pod, and what a scenario needs of it."""

    url: str  # the serving port, as the gateway reaches the decode pod
    admin: str
    p_url: str
    client: httpx.Client

    def p_stats(self, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        return wait_stats(self.p_url, check)


def sent_releases(case: Case) -> float:
    """The sidecar's ``kvr_releases_total{result="sent",strategy="nixl"}`` (0 before the first)."""
    metrics = httpx.get(case.admin + "/metrics", timeout=5).text
    line = 'kvr_releases_total{result="sent",strategy="nixl"} '
    return next((float(m.removeprefix(line)) for m in metrics.splitlines() if m.startswith(line)), 0.0)


def read_at_p(case: Case, route: str, body: dict[str, Any]) -> None:
    """``body`` on ``route`` takes the prefill leg, D admits it and reads P's blocks on both ranks."""
    before, sent = case.p_stats(lambda s: True), sent_releases(case)
    served = case.client.post(case.url + route, json=body, headers={HEADER: case.p_url[7:]})
    assert served.status_code == 200, served.text
    after = case.p_stats(
        lambda s: (
            s["pinned_requests"] == 0 and s["freed_by_notification"] == before["freed_by_notification"] + 1
        )
    )
    assert after["requests_pinned"] == before["requests_pinned"] + 1  # the prefill leg reached P
    assert after["notifs_per_rank"] == [n + 1 for n in before["notifs_per_rank"]]  # D read both ranks
    assert sent_releases(case) == sent  # D's read freed P, not the sidecar


def freed_by_the_sidecar(case: Case, route: str, body: dict[str, Any]) -> None:
    """D refuses ``body`` on ``route`` before reading; the sidecar's one release frees P."""
    before, sent = case.p_stats(lambda s: True), sent_releases(case)
    rejected = case.client.post(case.url + route, json=body, headers={HEADER: case.p_url[7:]})
    assert rejected.status_code == 400, rejected.text  # D's answer
    after = case.p_stats(
        lambda s: s["pinned_requests"] == 0 and s["requests_pinned"] == before["requests_pinned"] + 1
    )
    assert after["notifs_per_rank"] == [n + 1 for n in before["notifs_per_rank"]]
    assert after["notifs_unknown"] == before["notifs_unknown"]
    assert after["freed_by_notification"] == before["freed_by_notification"] + 1
    assert after["freed_by_expiry"] == before["freed_by_expiry"]
    # D refused it before reading (its 400): the notification that freed P is the sidecar's release.
    assert sent_releases(case) == sent + 1


def admitted_request_is_read_at_p(case: Case) -> None:
    read_at_p(case, "/v1/completions", completion(20))


def rejected_request_is_freed_by_the_sidecar(case: Case) -> None:
    freed_by_the_sidecar(case, "/v1/completions", completion(60, max_tokens="x"))


def min_tokens_chat_is_read_at_p(case: Case) -> None:
    # P gets max_tokens and min_tokens 1 (vLLM refuses min_tokens above max_tokens); D gets 20 and 10.
    read_at_p(case, "/v1/chat/completions", chat("one two three", max_tokens=20, min_tokens=10))


def messages_are_read_at_p(case: Case) -> None:
    read_at_p(case, "/v1/messages", messages("hello there"))


def messages_refused_before_the_handler_are_freed(case: Case) -> None:
    freed_by_the_sidecar(case, "/v1/messages", messages("hi", max_tokens="x"))


def generate_is_read_at_p(case: Case) -> None:
    read_at_p(case, "/inference/v1/generate", generate(12, max_tokens=20, min_tokens=6))


def generate_refused_in_the_handler_is_freed(case: Case) -> None:
    # 60 prompt tokens, over D's max_model_len (40): the generate handler refuses it and, unlike the
    # OpenAI handlers, never notifies P (vLLM's cleanup does not wrap it).
    freed_by_the_sidecar(case, "/inference/v1/generate", generate(60))


# Every scenario runs against every manifest's sidecar, in this order.
SCENARIOS: list[Callable[[Case], None]] = [
    admitted_request_is_read_at_p,
    rejected_request_is_freed_by_the_sidecar,
    min_tokens_chat_is_read_at_p,
    messages_are_read_at_p,
    messages_refused_before_the_handler_are_freed,
    generate_is_read_at_p,
    generate_refused_in_the_handler_is_freed,
]


@dataclass(frozen=True)
class Cluster:
    net: Pods
    p_url: str


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """The two pods, with sim-prefill in one and sim-decode (vLLM on 8200) in the other."""
    with pods() as net, ExitStack() as stack:
        p_url = start_sims(net, stack)
        yield Cluster(net, p_url)


@pytest.mark.parametrize("name", CASES)
def test_the_manifests_exact_args_serve_and_release(cluster: Cluster, tmp_path: Path, name: str) -> None:
    shape, variant = CASES[name]
    args = variant(guide_args(tmp_path, shape))
    net = cluster.net
    scheme = "https" if load(args, {})[0].tls else "http"
    assert (scheme == "https") == name.endswith("-tls")
    admin = f"http://{net.decode_ip}:9100"
    with ExitStack() as stack:
        log = stack.enter_context(tempfile.TemporaryFile())
        sidecar = net.run(net.decode_ns, "serve", *args, log=log)
        stack.enter_context(
            running(sidecar, log, f"the sidecar ({name})", lambda: answers(admin + "/readyz"))
        )
        client = stack.enter_context(httpx.Client(timeout=30, verify=False))  # self-signed when TLS
        case = Case(f"{scheme}://{net.decode_ip}:8000", admin, cluster.p_url, client)
        for scenario in SCENARIOS:
            scenario(case)
