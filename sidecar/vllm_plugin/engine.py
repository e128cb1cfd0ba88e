"""What the plugin asks of vLLM's engine client, typed without vLLM, and the two ways to ask it.

vLLM's ``EngineClient`` (``vllm/engine/protocol.py``) is reached as
``app.state.engine_client`` (set by ``init_app_state`` in every release
0.9.2-0.34.0). The plugin uses only:

* ``notify_kv_transfer_request_rejected(request_id, kv_transfer_params, *,
  data_parallel_rank=None)`` (0.21.0+): ``AsyncLLM`` submits a one-token
  ``EngineCoreRequest`` with ``abort_immediately=True``; the engine core aborts it
  before scheduling, and D's NIXL connector, seeing ``do_remote_prefill``, queues
  an empty receive and notifies P. It is vLLM's own fix, the same call its
  ``_with_kv_transfer_rejection_cleanup`` makes.
* on older releases, ``generate(prompt, sampling_params, request_id, ...)`` and
  ``abort(request_id)``: the plugin submits a one-token prompt whose
  ``SamplingParams.extra_args["kv_transfer_params"]`` carry P's parameters (how
  vLLM's OpenAI layer passes them, 0.9.2+) and aborts it at once. An aborted
  request still holding ``do_remote_prefill`` makes D's connector queue the same
  empty receive and notify P (0.9.2+).

The race in the emulation, and why it is harmless: if the scheduler admits the
one-token request before the abort lands, D's connector reads P's blocks (the
tail that fits one token) and notifies P when the read completes, which frees
the blocks just the same; the abort then finishes an admitted request. The
only losing order is an abort sent before ``generate`` submitted the request,
so the plugin lets ``generate`` run for ``emulate_grace`` first, and cancels
the stream (which makes vLLM abort it again) only after ``emulate_settle``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from sidecar.vllm_plugin.messages import Action, Outcome

SamplingParamsFactory = Callable[[dict[str, Any]], Any]
#: One token: the smallest prompt the input processor accepts (the same as vLLM's own fix).
PROMPT: dict[str, Any] = {"prompt_token_ids": [0]}


@runtime_checkable
class NotifyingEngine(Protocol):
    """``EngineClient`` of vLLM 0.21.0+."""

    async def notify_kv_transfer_request_rejected(
        self, request_id: str, kv_transfer_params: dict[str, Any], *, data_parallel_rank: int | None = None
    ) -> None: ...


@runtime_checkable
class GeneratingEngine(Protocol):
    """``EngineClient`` of any release: ``generate`` is an async generator, ``abort`` a coroutine."""

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *, data_parallel_rank: int | None = None
    ) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...


class EngineRefused(Exception):
    """The engine rejected the call's arguments (``ValueError``/``TypeError``): retrying cannot help."""


class EngineUnavailable(Exception):
    """The engine is dead, stuck or failed otherwise: worth retrying later."""


def action_of(engine: object) -> Action | None:
    """Which way this engine client can release, or None when it can do neither."""
    if callable(getattr(engine, "notify_kv_transfer_request_rejected", None)):
        return "notify"
    if callable(getattr(engine, "generate", None)) and callable(getattr(engine, "abort", None)):
        return "emulate"
    return None


def vllm_sampling_params(kv_transfer_params: dict[str, Any]) -> Any:
    """vLLM's ``SamplingParams`` for the one-token request (imported here: only inside vLLM)."""
    from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found]

    return SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(kv_transfer_params)})


async def notify(
    engine: NotifyingEngine, request_id: str, params: dict[str, Any], rank: int | None
) -> Outcome:
    """vLLM's own fix: one call, the engine core does the rest."""
    await engine.notify_kv_transfer_request_rejected(request_id, params, data_parallel_rank=rank)
    return "notified"


async def emulate(
    engine: GeneratingEngine,
    request_id: str,
    params: dict[str, Any],
    rank: int | None,
    *,
    make_sampling_params: SamplingParamsFactory,
    waits: tuple[float, float],
) -> Outcome:
    """Submit a one-token request carrying ``params`` and abort it at once (module docstring);
    ``waits`` are the grace before the abort and the settle after it, in seconds."""
    grace, settle = waits
    kwargs: dict[str, Any] = {} if rank is None else {"data_parallel_rank": rank}
    stream = engine.generate(PROMPT, make_sampling_params(params), request_id, **kwargs)
    first = asyncio.ensure_future(_first(stream))
    try:
        done, _ = await asyncio.wait({first}, timeout=grace)
        if not done:
            await engine.abort(request_id)
            await asyncio.wait({first}, timeout=settle)
        if first.done():
            output = first.result()  # raises what generate() raised
            return "admitted" if output is not None and not _aborted(output) else "aborted"
        return "aborted"
    finally:
        if not first.done():
            first.cancel()  # vLLM's generate() aborts the request again on cancellation
            await asyncio.gather(first, return_exceptions=True)
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


async def _first(stream: AsyncIterator[Any]) -> Any:
    return await anext(stream, None)


def _aborted(output: Any) -> bool:
    """A ``RequestOutput`` whose completion finished with reason ``abort``."""
    outputs = getattr(output, "outputs", None) or []
    return any(getattr(o, "finish_reason", None) == "abort" for o in outputs)


@contextlib.asynccontextmanager
async def translated() -> AsyncIterator[None]:
    """Translate an engine call's failures into the two errors above, once (timeouts included)."""
    try:
        yield
    except TimeoutError as exc:
        raise EngineUnavailable("the engine did not answer in time") from exc
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        # IndexError: vLLM 0.21.0-0.33.0's DP load-balancing client indexes its engines by the
        # request's rank (``core_engines[rank]``) with no check, so a rank past its DP size is a
        # refusal of this request (the sidecar retries on the default rank), not a dead engine.
        raise EngineRefused(f"{exc.__class__.__name__}: {exc}") from exc
    except Exception as exc:  # EngineDeadError, EngineGenerateError, ZMQ errors, ...
        raise EngineUnavailable(f"{exc.__class__.__name__}: {exc}") from exc
