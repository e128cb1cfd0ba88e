"""The ``http`` release strategy: ask D's control endpoint (``sidecar.vllm_plugin``) to release.

For one job (the judge has decided it is the sidecar's to send, and whether it
is a dry run): pick the id D's engine should use (P's id for the request,
which D's NIXL connector needs before vLLM 0.13.0; D's version from
``--vllm-version`` or D's ``GET /version`` through D's state), and ``POST``
the job to ``--control-url`` (default: the decode URL plus ``/kv_release/v1/release``)
with the bearer token read once at start. D then does what vLLM's own fix
does and its NIXL connector notifies P. Off the request path, so httpx
(``trust_env=False``, one short timeout for every phase, a small pool).

Failures, translated once here (``reason`` is the metric label)::

    ReleaseError
    +-- RetryableReleaseError
    |   +-- ControlUnreachable "unreachable"   connect error or connect/pool timeout: nothing delivered
    |   +-- ControlFailed      "timeout"       no answer in time: the engine may have acted
    |                          "transport"     connection lost after sending
    |                          "server_error"  5xx (503: no engine, engine failed)
    |                          "throttled"     408, 429
    +-- PermanentReleaseError  "bad_request" (400, 413, 422), "unauthorized" (401), "forbidden" (403),
                               "not_found" (404, 405: no plugin, or it has no token), "rejected" (other 4xx),
                               "no_request_id", "no_params" (no parameters as sent)
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram

from sidecar import __version__
from sidecar.config import Config
from sidecar.exceptions import Reason
from sidecar.nixl.versions import WireProfile, engine_request_id
from sidecar.release.base import (
    JobResult,
    PermanentReleaseError,
    ReleaseJob,
    RetryableReleaseError,
    TargetHealth,
)
from sidecar.tls.client import outbound
from sidecar.tls.trust import SECRET_BYTES, Unusable, read_regular
from sidecar.vllm_plugin.messages import ACCEPTED_DECODER, ENCODER, HEALTH_PATH, RELEASE_PATH

log = logging.getLogger(__name__)

LOG_INTERVAL = 10.0
#: Permanent reasons for which the plugin certainly did not act (another path is safe).
NOT_DELIVERED = frozenset({Reason.NOT_FOUND, Reason.UNAUTHORIZED, Reason.FORBIDDEN})
Probe = Literal["present", "absent", "unauthorized", "forbidden", "no_engine", "unreachable", "error"]
#: ``--dry-run``: the health route's answer read as the release route's refusal reason.
REHEARSAL_REASONS: dict[Probe, Reason] = {
    "absent": Reason.NOT_FOUND,
    "unauthorized": Reason.UNAUTHORIZED,
    "forbidden": Reason.FORBIDDEN,
}
#: ``--dry-run``: seconds one health probe stands for every release.
REHEARSAL_PROBE = 5.0
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ControlUnreachable(RetryableReleaseError):
    """The control endpoint could not be reached: the request was never delivered."""

    reason = Reason.UNREACHABLE
    health = TargetHealth.DOWN


class ControlFailed(RetryableReleaseError):
    """The request may have reached D's engine, but no success came back."""

    def __init__(self, message: str, reason: Reason) -> None:
        super().__init__(message)
        self.reason = reason
        self.health = TargetHealth.DOWN if reason is Reason.TIMEOUT else TargetHealth.UP


def answer_kind(
    status: int,
) -> tuple[Reason | Literal["accepted"], type[ControlFailed | PermanentReleaseError] | None]:
    """The result label of an answer (``kvr_control_requests{result}``: ``accepted``, or the
    ``Reason`` of the error it raises), and that error (None: released)."""
    if 200 <= status < 300:
        return "accepted", None
    if status >= 500:
        return Reason.SERVER_ERROR, ControlFailed
    if status in (408, 429):
        return Reason.THROTTLED, ControlFailed
    reasons = {401: Reason.UNAUTHORIZED, 403: Reason.FORBIDDEN, 404: Reason.NOT_FOUND, 405: Reason.NOT_FOUND}
    reason = reasons.get(status, Reason.BAD_REQUEST if status in (400, 413, 422) else Reason.REJECTED)
    return reason, PermanentReleaseError


def release_url(config: Config) -> str:
    return config.control_url.rstrip("/") or config.decode_url.rstrip("/") + RELEASE_PATH


def health_url(config: Config) -> str:
    """The plugin's health route beside the release route (``.../release`` -> ``.../health``)."""
    base = release_url(config).rsplit("/", 1)[0]
    return base + "/" + HEALTH_PATH.rsplit("/", 1)[1]


def read_token(config: Config) -> str:
    """``control_token``, else the first line of ``control_token_file``; raises OSError if unreadable
    (read as trust material is: a regular file, never blocking, ``sidecar.tls.trust.read_regular``)."""
    if config.control_token or not config.control_token_file:
        return config.control_token.strip()
    try:
        data = read_regular(config.control_token_file, SECRET_BYTES)
    except Unusable as exc:
        raise OSError(errno.EINVAL, exc.why, config.control_token_file) from exc
    return data.decode("utf-8", "replace").strip()


class ControlMetrics:
    """``kvr_control_*`` collectors, on the registry passed in (a private one without)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "kvr_control_requests",
            "Release requests to D's control endpoint, by result.",
            ["result"],
            registry=reg,
        )
        self.latency = Histogram(
            "kvr_control_latency_seconds",
            "Round trip of one release request to D's control endpoint.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.probes = Counter(
            "kvr_control_probes", "Probes of D's control endpoint, by result.", ["result"], registry=reg
        )


class HttpReleaser:
    """``Releaser`` that posts each job to D's control endpoint (see the module docstring)."""

    name = "http"
    frees = True
    checked = True
    keeps_raw = True

    def __init__(
        self,
        config: Config,
        decode_version: Callable[[], Awaitable[str | None]],
        registry: CollectorRegistry | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._config = config
        self._decode_version = decode_version
        self._transport = transport
        self.metrics = ControlMetrics(registry)
        self.release_url, self.health_url = release_url(config), health_url(config)
        self._client: httpx.AsyncClient | None = None
        self._headers: dict[str, str] = {}
        self._logged: dict[str, float] = {}
        self._probed: tuple[float, Probe] | None = None  # --dry-run: (when, what) of the last probe

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        token = read_token(self._config)  # an unreadable file stops start-up: fix it, do not guess
        if not token:
            log.warning(
                "no control token (--control-token-file or KVR_CONTROL_TOKEN): D's control endpoint "
                "will answer 401 unless it runs with KVR_CONTROL_INSECURE=1"
            )
        self._headers = {
            "content-type": "application/json",
            "user-agent": f"kv-release-sidecar/{__version__}",
        }
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        size = self._config.release_workers + 1  # one per worker, plus the probe
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self._config.control_timeout),
            limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
            trust_env=False,
            transport=self._transport,
            # D's certificate trusted as the proxy path trusts it, always verified: the token goes here.
            verify=outbound(self._config, insecure=False),
        )

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def ready(self) -> bool:
        return self._client is not None

    def detail(self) -> dict[str, object]:
        return {}

    def target(self, job: ReleaseJob) -> str:
        return self.release_url  # every job goes to D's control endpoint

    # --- one job ---------------------------------------------------------------------------

    async def release(self, job: ReleaseJob) -> JobResult:
        return await self._release(job, rehearse=False)

    async def rehearse(self, job: ReleaseJob) -> JobResult:
        """What a release would meet at D's control endpoint (``_rehearse``); nothing is sent."""
        return await self._release(job, rehearse=True)

    async def _release(self, job: ReleaseJob, rehearse: bool) -> JobResult:
        if job.raw_params is None:
            raise PermanentReleaseError(
                "the http strategy sends P's parameters as they came", Reason.NO_PARAMS
            )
        text = self._config.vllm_version or await self._decode_version()
        profile = WireProfile.for_version(text) if text else None
        request_id = _request_id(profile, job)
        if rehearse:
            return await self._rehearse()
        body = Outgoing(
            request_id=request_id,
            kv_transfer_params=msgspec.Raw(job.raw_params),
            data_parallel_rank=job.data_parallel_rank,
        )
        status, content = await self._send(body)
        if status == 400 and body.data_parallel_rank is not None:
            # A rank D does not have (the client's header, which D may never have seen): any of
            # D's engine cores can notify P, so the release goes to the default one instead.
            self.metrics.requests.labels(Reason.BAD_REQUEST).inc()
            status, content = await self._send(msgspec.structs.replace(body, data_parallel_rank=None))
        label, error = answer_kind(status)
        self.metrics.requests.labels(label).inc()
        if label == "accepted":
            self._log_accepted(job, content)
            return JobResult.SENT
        message = f"control endpoint answered {status}: {_error_message(content)}"
        if error is ControlFailed:
            raise ControlFailed(message, label)
        self._log_refusal(label, message)
        raise PermanentReleaseError(message, label, TargetHealth.UP)  # the endpoint answered

    async def _send(self, body: Outgoing) -> tuple[int, bytes]:
        try:
            return await self._post(ENCODER.encode(body))
        except (ControlUnreachable, ControlFailed) as exc:
            self.metrics.requests.labels(exc.reason).inc()
            raise

    async def _rehearse(self) -> JobResult:
        """``--dry-run``: what a release would meet at D's control endpoint, from its health
        route (probed at most every ``REHEARSAL_PROBE`` seconds), never its release route."""
        now = time.monotonic()
        if self._probed is None or now - self._probed[0] >= REHEARSAL_PROBE:
            self._probed = (now, await self.probe())
        probe = self._probed[1]
        if probe == "present":
            return JobResult.WOULD_SEND
        if probe == "unreachable":
            raise ControlUnreachable("control endpoint unreachable (dry run: its health route)")
        reason = REHEARSAL_REASONS.get(probe)
        message = f"control endpoint's health route says {probe} (dry run)"
        if reason is None:
            raise ControlFailed(message, Reason.SERVER_ERROR if probe == "no_engine" else Reason.TRANSPORT)
        self._log_refusal(reason, message)
        raise PermanentReleaseError(message, reason, TargetHealth.UP)

    async def probe(self) -> Probe:
        """Whether D serves the control endpoint to this sidecar's token (``GET .../health``)."""
        result = await self._probe()
        self.metrics.probes.labels(result).inc()
        return result

    async def _probe(self) -> Probe:
        assert self._client is not None, "start() first"
        try:
            response = await self._client.get(self.health_url, headers=self._headers)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
            return "unreachable"
        except httpx.HTTPError:
            return "error"
        statuses: dict[int, Probe] = {
            200: "present",
            401: "unauthorized",
            403: "forbidden",
            404: "absent",
            405: "absent",
            503: "no_engine",
        }
        return statuses.get(response.status_code, "error")

    async def _post(self, content: bytes) -> tuple[int, bytes]:
        assert self._client is not None, "start() first"
        started = time.perf_counter()
        headers = {**self._headers, "content-length": str(len(content))}
        try:
            response = await self._client.post(self.release_url, content=_pieces(content), headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise ControlUnreachable(f"control endpoint unreachable: {exc!r}") from exc
        except httpx.TimeoutException as exc:
            raise ControlFailed(f"control endpoint timed out: {exc!r}", Reason.TIMEOUT) from exc
        except httpx.HTTPError as exc:
            raise ControlFailed(f"control endpoint connection failed: {exc!r}", Reason.TRANSPORT) from exc
        self.metrics.latency.observe(time.perf_counter() - started)
        return response.status_code, response.content

    # --- D's release and P's id ------------------------------------------------------------

    # --- logs ------------------------------------------------------------------------------

    def _log_accepted(self, job: ReleaseJob, content: bytes) -> None:
        try:
            accepted = ACCEPTED_DECODER.decode(content)
        except msgspec.DecodeError:
            return
        log.debug(
            "control endpoint accepted the release",
            extra={
                "request_id": job.request_id,
                "outcome": accepted.outcome,
                "duplicate": accepted.duplicate,
            },
        )

    def _log_refusal(self, reason: str, message: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_INTERVAL) >= LOG_INTERVAL:
            self._logged[reason] = now
            log.warning("http release: %s", message, extra={"reason": reason})


WRITE_PIECE = 64 * 1024


async def _pieces(content: bytes) -> AsyncIterator[bytes]:
    """``content`` in pieces the event loop writes at once: a body of megabytes (P's block ids)
    written whole would be buffered by uvloop's transport, which keeps that memory after the
    write (an open uvloop issue: transport buffers are not freed after connection_lost)."""
    view = memoryview(content)
    for start in range(0, len(view), WRITE_PIECE):
        yield bytes(view[start : start + WRITE_PIECE])


class Outgoing(msgspec.Struct, frozen=True, kw_only=True):
    """``ReleaseRequest`` as the strategy sends it: ``kv_transfer_params`` exactly as they came
    (every field, also those a newer vLLM appends), never decoded into Python objects."""

    request_id: str
    kv_transfer_params: msgspec.Raw
    data_parallel_rank: int | None = None


def _request_id(profile: WireProfile | None, job: ReleaseJob) -> str:
    """P's id for the request: ``remote_request_id`` (0.13.0+), else derived from X-Request-Id."""
    if profile is not None:
        found = engine_request_id(profile, job.params, job.x_request_id, job.route, job.body_request_id)
    else:  # release unknown: P's parameters tell (remote_request_id is there from 0.13.0 on)
        found = job.params.remote_request_id or _derived_id(job)
    if not found:
        raise PermanentReleaseError(
            f"P's id for this request cannot be known (route {job.route}, x-request-id "
            f"{job.x_request_id!r}, no remote_request_id)",
            Reason.NO_REQUEST_ID,
        )
    return found


def _derived_id(job: ReleaseJob) -> str | None:
    """Before 0.13.0 D's engine id equals P's (vLLM builds both from X-Request-Id):
    ``chatcmpl-<id>``, ``cmpl-<id>-0``, or the body's ``request_id`` for ``/v1/responses``."""
    if job.route == "/v1/responses":
        return job.body_request_id or None
    x_request_id = job.x_request_id
    if not x_request_id:
        return None
    if job.route in ("/v1/chat/completions", "/v1/messages"):  # /v1/messages runs the chat handler
        return f"chatcmpl-{x_request_id}"
    if job.route == "/v1/completions":
        return f"cmpl-{x_request_id}-0"
    return None


def _error_message(content: bytes) -> str:
    try:
        decoded = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return content[:200].decode("utf-8", "replace")
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", ""))[:500]
    return str(error or decoded)[:200]
