"""The control route's behaviour, shared by the endpoint plugin and the middleware form.

One ``ControlService`` per app, kept on ``app.state`` (both forms find the
same one, so loading the plugin both ways is harmless): it authenticates
(bearer token, constant-time comparison), validates the body with msgspec,
de-duplicates by (P engine, request id) over a bounded set of recent ids,
and acts through the engine client found at ``app.state.engine_client``.
Answers: 202 done (or done before), 400 bad body or refused by the engine,
401 no token, 403 wrong token, 413 body too large, 503 no engine or the
engine failed. Errors use vLLM's shape, ``{"error": {"message", "type",
"param", "code"}}``. Every action is logged; tokens never are.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import sys
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sidecar.vllm_plugin.engine import (
    EngineRefused,
    EngineUnavailable,
    GeneratingEngine,
    NotifyingEngine,
    SamplingParamsFactory,
    action_of,
    emulate,
    notify,
    translated,
    vllm_sampling_params,
)
from sidecar.vllm_plugin.messages import (
    ENCODER,
    HEALTH_PATH,
    RELEASE_PATH,
    REQUEST_DECODER,
    Action,
    Health,
    ReleaseAccepted,
    ReleaseRequest,
)
from sidecar.vllm_plugin.settings import PluginSettings
from sidecar.wire import KVTransferParams, error_body

# A child of vLLM's "vllm" logger: vLLM configures that one (handler, INFO), not the root logger.
log = logging.getLogger("vllm.kv_release")

STATE_ATTR = "kv_release_control"
WARN_INTERVAL = 10.0
_Key = tuple[str, str]


class ControlService:
    """Authenticate, validate, de-duplicate and act (see the module docstring)."""

    def __init__(
        self,
        settings: PluginSettings,
        *,
        make_sampling_params: SamplingParamsFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        # Digests of equal length: the comparison leaks neither the token nor its length.
        self._token = hashlib.sha256(settings.token.encode()).digest() if settings.token else None
        self._make_sampling_params = make_sampling_params or vllm_sampling_params
        self._recent: collections.OrderedDict[_Key, asyncio.Future[ReleaseAccepted | None]] = (
            collections.OrderedDict()
        )
        self.counts: collections.Counter[str] = collections.Counter()
        self._clock = clock
        self._warned: dict[str, float] = {}

    @classmethod
    def of(
        cls, state: Any, settings: PluginSettings, make_sampling_params: SamplingParamsFactory | None = None
    ) -> ControlService:
        """The app's service, created on first use and kept on ``state``."""
        service = getattr(state, STATE_ATTR, None)
        if not isinstance(service, ControlService):
            service = cls(settings, make_sampling_params=make_sampling_params)
            setattr(state, STATE_ATTR, service)
        return service

    # --- routes ----------------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        """Dispatch one request under ``/kv_release/v1/`` (the middleware form)."""
        routes = {RELEASE_PATH: ("POST", self.release), HEALTH_PATH: ("GET", self.health)}
        if path not in routes:
            return _error(f"no route {path}", HTTPStatus.NOT_FOUND, "NotFoundError")
        method, endpoint = routes[path]
        if request.method != method:
            return _error(f"use {method} on {path}", HTTPStatus.METHOD_NOT_ALLOWED, "MethodNotAllowed")
        return await endpoint(request)

    async def health(self, request: Request) -> Response:
        """``GET /kv_release/v1/health``: 200 when the engine client can release, else 503."""
        denied = self._authorize(request)
        if denied is not None:
            return denied
        engine = _engine(request)
        action = action_of(engine) if engine is not None else None
        version = getattr(sys.modules.get("vllm"), "__version__", None)
        health = Health(
            status="ok" if action else "no_engine",
            action=action,
            vllm_version=str(version) if version is not None else None,
            counts=dict(self.counts),
        )
        status = HTTPStatus.OK if action else HTTPStatus.SERVICE_UNAVAILABLE
        return Response(ENCODER.encode(health), status_code=status, media_type="application/json")

    async def release(self, request: Request) -> Response:
        """``POST /kv_release/v1/release``: see the module docstring."""
        denied = self._authorize(request)
        if denied is not None:
            return denied
        parsed = await self._parse(request)
        if isinstance(parsed, Response):
            return parsed
        body, engine_id = parsed
        engine = _engine(request)
        action = action_of(engine) if engine is not None else None
        if action is None:
            self.counts["unavailable"] += 1
            return _error(
                "no engine client on app.state (not started yet, or the render-only server)",
                HTTPStatus.SERVICE_UNAVAILABLE,
                "ServiceUnavailableError",
            )
        return await self._once(engine, action, body, (engine_id, body.request_id))

    # --- one release, at most once per id -------------------------------------------------

    async def _once(self, engine: object, action: Action, body: ReleaseRequest, key: _Key) -> Response:
        while (pending := self._recent.get(key)) is not None:
            earlier = await asyncio.shield(pending)
            if earlier is not None:
                self.counts["duplicate"] += 1
                log.info("KV release for request %s: duplicate, already %s", key[1], earlier.outcome)
                return _accepted(msgspec.structs.replace(earlier, duplicate=True))
            # The earlier attempt failed and was forgotten: this one acts.
        future: asyncio.Future[ReleaseAccepted | None] = asyncio.get_running_loop().create_future()
        self._remember(key, future)
        try:
            accepted = await self._act(engine, action, body)
        except (EngineRefused, EngineUnavailable) as exc:
            self._forget(key, future)
            return self._failed(body, exc)
        except BaseException:
            self._forget(key, future)
            raise
        future.set_result(accepted)
        self.counts["accepted"] += 1
        log.info(
            "KV release for request %s (P engine %s, DP rank %s): %s via %s",
            body.request_id,
            key[0] or "?",
            body.data_parallel_rank,
            accepted.outcome,
            action,
        )
        return _accepted(accepted)

    async def _act(self, engine: object, action: Action, body: ReleaseRequest) -> ReleaseAccepted:
        settings = self.settings
        params, rank = body.kv_transfer_params, body.data_parallel_rank
        async with translated(), asyncio.timeout(settings.engine_timeout):
            if action == "notify":
                assert isinstance(engine, NotifyingEngine)
                outcome = await notify(engine, body.request_id, params, rank)
            else:
                assert isinstance(engine, GeneratingEngine)
                outcome = await emulate(
                    engine,
                    body.request_id,
                    params,
                    rank,
                    make_sampling_params=self._make_sampling_params,
                    waits=(settings.emulate_grace, settings.emulate_settle),
                )
        return ReleaseAccepted(request_id=body.request_id, action=action, outcome=outcome)

    def _failed(self, body: ReleaseRequest, exc: EngineRefused | EngineUnavailable) -> Response:
        log.warning("KV release for request %s failed: %s", body.request_id, exc)
        if isinstance(exc, EngineRefused):
            self.counts["refused"] += 1
            return _error(f"the engine refused the release: {exc}", HTTPStatus.BAD_REQUEST, "BadRequestError")
        self.counts["unavailable"] += 1
        return _error(f"the engine failed: {exc}", HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError")

    def _forget(self, key: _Key, future: asyncio.Future[ReleaseAccepted | None]) -> None:
        """A failed or cancelled attempt: waiters act themselves, a retry acts again."""
        future.set_result(None)
        if self._recent.get(key) is future:
            del self._recent[key]

    def _remember(self, key: _Key, future: asyncio.Future[ReleaseAccepted | None]) -> None:
        self._recent[key] = future
        while len(self._recent) > self.settings.recent_size:
            self._recent.popitem(last=False)

    # --- request checks --------------------------------------------------------------------

    def _authorize(self, request: Request) -> Response | None:
        if self._token is None:  # served without a token only with KVR_CONTROL_INSECURE=1
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            self._rejected("unauthorized", request)
            response = _error("a bearer token is required", HTTPStatus.UNAUTHORIZED, "Unauthorized")
            response.headers["www-authenticate"] = "Bearer"
            return response
        if not hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(), self._token):
            self._rejected("forbidden", request)
            return _error("the bearer token is not valid", HTTPStatus.FORBIDDEN, "Forbidden")
        return None

    async def _parse(self, request: Request) -> tuple[ReleaseRequest, str] | Response:
        raw = await _read(request, self.settings.max_body_bytes)
        if raw is None:
            self.counts["bad_request"] += 1
            limit = self.settings.max_body_bytes
            return _error(f"body over {limit} bytes", HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "BadRequestError")
        try:
            body = REQUEST_DECODER.decode(raw)
        except msgspec.DecodeError as exc:  # ValidationError included
            return self._bad(exc, "")
        try:
            params = msgspec.convert(body.kv_transfer_params, KVTransferParams)
        except msgspec.ValidationError as exc:
            return self._bad(exc, "kv_transfer_params")
        if not params.do_remote_prefill:
            self.counts["bad_request"] += 1
            return _error(
                "kv_transfer_params.do_remote_prefill is not true: D holds nothing to release for it",
                HTTPStatus.BAD_REQUEST,
                "BadRequestError",
                "kv_transfer_params.do_remote_prefill",
            )
        return body, params.remote_engine_id or ""

    def _bad(self, exc: msgspec.DecodeError, within: str) -> Response:
        self.counts["bad_request"] += 1
        if not isinstance(exc, msgspec.ValidationError):
            return _error(f"body is not JSON: {exc}", HTTPStatus.BAD_REQUEST, "BadRequestError")
        message, param = _split(str(exc))
        param = ".".join(p for p in (within, param) if p) or None
        return _error(f"invalid body: {message}", HTTPStatus.BAD_REQUEST, "BadRequestError", param)

    def _rejected(self, kind: str, request: Request) -> None:
        self.counts[kind] += 1
        now = self._clock()
        if now - self._warned.get(kind, -WARN_INTERVAL) >= WARN_INTERVAL:
            self._warned[kind] = now
            client = request.client.host if request.client else "?"
            log.warning(
                "KV release control: %s request from %s (%d so far); check KVR_CONTROL_TOKEN on both sides",
                kind,
                client,
                self.counts[kind],
            )


def announce(settings: PluginSettings, form: str) -> None:
    """One loud line at load: whether the route is served, and why not."""
    if not settings.enabled:
        log.error(
            "KV release control endpoint (%s) NOT served: %s. The sidecar's http strategy cannot "
            "release through this server",
            form,
            settings.disabled_reason(),
        )
    elif not settings.token:
        log.warning(
            "KV release control endpoint (%s) served WITHOUT authentication "
            "(KVR_CONTROL_INSECURE=1): for tests only",
            form,
        )
    else:
        log.info("KV release control endpoint (%s) served at %s (bearer token required)", form, RELEASE_PATH)


def _engine(request: Request) -> object | None:
    return getattr(request.app.state, "engine_client", None)


async def _read(request: Request, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _split(message: str) -> tuple[str, str | None]:
    """msgspec's "Expected `int`, got `str` - at `$.a.b`" -> ("Expected ...", "a.b")."""
    text, sep, where = message.rpartition(" - at ")
    if not sep:
        return message, None
    return text, where.strip("`").removeprefix("$").removeprefix(".") or None


def _accepted(accepted: ReleaseAccepted) -> Response:
    return Response(ENCODER.encode(accepted), status_code=HTTPStatus.ACCEPTED, media_type="application/json")


def _error(message: str, status: HTTPStatus, type_: str, param: str | None = None) -> Response:
    return Response(
        error_body(message, int(status), type_, param), status_code=status, media_type="application/json"
    )
