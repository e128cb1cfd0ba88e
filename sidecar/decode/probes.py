"""One-shot reads of D's own endpoints: ``/health``, ``/version`` and what ``/metrics`` shows of
its KV connector. Each answers ``None`` (or "unknown") when D gives no usable answer.

What D exposes about its KV connector, read in vLLM 0.21.0, 0.25.1, 0.29.0,
0.31.0 and 0.33.0 (and pinned in ``tests/conformance/test_vllm_decode_state_source.py``):

* ``/metrics``: ``KVConnectorProm.__init__`` (``kv_connector/v1/metrics.py``)
  registers the connector's own families only when ``kv_transfer_config.kv_connector``
  is set; ``NixlConnector.build_prom_metrics`` (``nixl/connector.py``) returns
  ``NixlPromMetrics`` (``nixl/stats.py``), which creates ``vllm:nixl_xfer_time_seconds``
  and the other ``vllm:nixl_*`` families for every engine at start-up
  (``create_metric_per_engine``), so they are listed before any transfer.
  ``MultiConnector.build_prom_metrics`` includes its NIXL part's. All of them exist
  only while vLLM logs stats (``AsyncLLM.__init__``: no stat loggers with
  ``--disable-log-stats``); ``vllm:num_requests_running`` (``PrometheusStatLogger``)
  tells the two apart. So: a ``vllm:nixl_`` family means a NIXL connector; stats on
  and none means no NIXL connector, and D's notify (which needs ``has_kv_connector``,
  ``kv_transfer_config is not None``) cannot reach a NIXL P; stats off means "cannot tell".
* ``/v1/models``, ``/version``, ``/health``, ``/load``: nothing about the connector.
  ``/server_info`` prints the whole config but exists only with
  ``VLLM_SERVER_DEV_MODE``, which vLLM warns must not run in production; not used.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, NamedTuple

import msgspec

from sidecar.classify import NoAnswer
from sidecar.nixl.versions import parse_version
from sidecar.upstream import Client, UpstreamError

Engine = Literal["alive", "dead", "unknown"]

#: Each probe's budget for D's response headers, in seconds.
PROBE_TIMEOUT = 2.0
#: Bytes of ``/metrics`` scanned at most (vLLM's exposition is tens to hundreds of KiB).
METRICS_LIMIT = 8 << 20
#: The prefix of ``NixlPromMetrics``' families (``vllm:nixl_xfer_time_seconds``...).
NIXL_FAMILY = b"vllm:nixl_"
#: A family ``PrometheusStatLogger`` always registers: present whenever vLLM logs stats.
STATS_FAMILY = b"vllm:num_requests_running"
_VERSION = msgspec.json.Decoder(dict[str, object])


def says_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether an answer carries ``Connection: close``. vLLM never sets it; uvicorn adds it to
    answers it finishes once its server is exiting (``HttpToolsProtocol.shutdown``)."""
    return any(
        name.lower() == b"connection" and b"close" in (token.strip() for token in value.lower().split(b","))
        for name, value in headers
    )


async def probe_health(upstream: Client) -> tuple[Engine, bool]:
    """D's engine by ``GET /health`` (200 alive, 503 dead, else unknown), and whether the
    answer said ``Connection: close``."""
    try:
        async with await upstream.send("GET", "/health", [], None, header_timeout=PROBE_TIMEOUT) as response:
            await response.read(1024)
            status, closing = response.status, says_close(response.headers)
    except UpstreamError:
        return "unknown", False
    return ("alive" if status == 200 else "dead" if status == 503 else "unknown"), closing


class VersionRead(NamedTuple):
    """What ``GET /version`` gave: whether D answered, the version string it named (if any), and
    why the answer is no vLLM version when D answered one that is not (``reason`` is a metric
    label: ``status``, ``not_json``, ``no_version`` or ``not_a_version``; ``problem`` says more)."""

    answered: bool
    version: str | None = None
    reason: str | None = None
    problem: str | None = None


async def read_version(upstream: Client) -> VersionRead:
    """D's release from ``GET /version`` (``{"version": "0.34.0"}`` in every vLLM release)."""
    try:
        async with await upstream.send("GET", "/version", [], None, header_timeout=PROBE_TIMEOUT) as response:
            body = await response.read(4096)
            status = response.status
    except UpstreamError:
        return VersionRead(False)
    if status != 200:
        return VersionRead(True, None, "status", f"answered {status}")
    try:
        version = _VERSION.decode(body).get("version")
    except msgspec.DecodeError:
        shown = "an empty body" if not body.strip() else f"{body[:40]!r}"
        return VersionRead(True, None, "not_json", f"answered {shown}, not a JSON object")
    if not isinstance(version, str) or not version:
        return VersionRead(True, None, "no_version", "answered JSON without a version string")
    if parse_version(version) is None:
        return VersionRead(True, version, "not_a_version", f"named {version[:40]!r}, not a version")
    return VersionRead(True, version)


async def read_kv_connector(upstream: Client) -> tuple[bool, bool | None]:
    """(D answered, whether its ``/metrics`` shows a NIXL connector; None: cannot tell)."""
    try:
        async with await upstream.send("GET", "/metrics", [], None, header_timeout=PROBE_TIMEOUT) as response:
            if response.status != 200:
                return True, None
            return True, await _scan_metrics(response.chunks())
    except UpstreamError:
        return False, None


async def probe_kv_connector(upstream: Client) -> bool | None:
    """Whether D has a NIXL KV connector, from its ``/metrics``: True, False, or None when D
    does not answer or logs no stats (``--disable-log-stats``). For ``check`` and start-up."""
    return (await read_kv_connector(upstream))[1]


async def _scan_metrics(chunks: AsyncIterator[bytes]) -> bool | None:
    stats, tail, size = False, b"", 0
    async for chunk in chunks:
        text = tail + chunk
        if NIXL_FAMILY in text:
            return True
        stats = stats or STATS_FAMILY in text
        tail = text[-len(STATS_FAMILY) :]
        size += len(chunk)
        if size >= METRICS_LIMIT:
            return None  # the families may sit past what was read
    return False if stats else None


async def unreachable_cause(upstream: Client) -> str | None:
    """Why D's ``GET /health`` gets no answer now, in plain words with the likely fix (None: it
    answered). For the one warning at start-up: a D that cannot be reached is otherwise silent."""
    try:
        async with await upstream.send("GET", "/health", [], None, header_timeout=PROBE_TIMEOUT) as response:
            await response.read(1024)
    except UpstreamError as exc:
        return likely_cause(exc.failure, str(exc), upstream.base_url)
    return None


def likely_cause(failure: NoAnswer, detail: str, url: str) -> str:
    """``failure`` reaching D at ``url`` as a cause an operator can act on."""
    https = url.startswith("https://")
    causes = {
        NoAnswer.CONNECT_REFUSED: f"nothing accepts connections at {url}: D not started yet, a wrong port, "
        "or D listening on another address (localhost may be ::1 for one and 127.0.0.1 for the other)",
        NoAnswer.DNS: f"the host of {url} does not resolve",
        NoAnswer.CONNECT_TIMEOUT: f"no answer to a connection to {url}: a wrong host, or a firewall",
        NoAnswer.TLS_FAILED: f"the TLS handshake with {url} failed: D serves plain http? (use http:// in "
        "decode_url), or its certificate is not trusted (tls_ca_file, ssl_cert_dir or SSL_CERT_DIR, "
        "decode_tls_insecure)",
        NoAnswer.HEADER_TIMEOUT: f"{url} accepted the connection but did not answer GET /health in time",
    }
    cause = causes.get(failure)
    if cause is None:
        plain = "" if https else ": D serves https? (use https:// in decode_url)"
        cause = f"{url} closed the connection without an HTTP answer{plain}"
    return f"{cause} ({detail})"
