"""The plugin's settings, read once from the decode server's environment.

``KVR_CONTROL_TOKEN`` (the bearer token) or ``KVR_CONTROL_TOKEN_FILE`` (a file
holding it, e.g. a mounted Kubernetes secret); the variable wins when both are
set. Without a token the route is not served, unless ``KVR_CONTROL_INSECURE=1``
(tests only). A token file that cannot be read also leaves the route unserved:
the plugin fails closed. The token is never logged and never part of ``repr``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

TOKEN_ENV = "KVR_CONTROL_TOKEN"
TOKEN_FILE_ENV = "KVR_CONTROL_TOKEN_FILE"
INSECURE_ENV = "KVR_CONTROL_INSECURE"
_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """How the control route authenticates and acts; ``problem`` says why it is not served."""

    token: str = field(default="", repr=False)
    insecure: bool = False
    problem: str = ""
    recent_size: int = 4096  # request ids remembered for idempotency
    max_body_bytes: int = 1 << 20
    engine_timeout: float = 5.0  # bound on one engine call
    # Emulation (vLLM < 0.21.0): let generate() submit before aborting, then wait this long for
    # the aborted stream to end (0.13.0+ ends it; before, it is cancelled). Their sum stays well
    # under the sidecar's --control-timeout (1 s).
    emulate_grace: float = 0.1
    emulate_settle: float = 0.2

    @property
    def enabled(self) -> bool:
        """Whether the route is served: a token, or the explicit insecure setting."""
        return not self.problem and (bool(self.token) or self.insecure)

    def disabled_reason(self) -> str:
        if self.problem:
            return self.problem
        return (
            f"no token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} in the decode server's environment "
            f"(or {INSECURE_ENV}=1 for tests)"
        )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> PluginSettings:
        """Read the token once; the file is read here, never again."""
        insecure = environ.get(INSECURE_ENV, "").strip().lower() in _TRUE
        token = environ.get(TOKEN_ENV, "").strip()
        path = environ.get(TOKEN_FILE_ENV, "").strip()
        if token or not path:
            return cls(token=token, insecure=insecure)
        try:
            with open(path, encoding="utf-8") as handle:
                token = handle.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc.__class__.__name__
            return cls(insecure=insecure, problem=f"{TOKEN_FILE_ENV}={path!r} cannot be read: {reason}")
        if not token:
            return cls(insecure=insecure, problem=f"{TOKEN_FILE_ENV}={path!r} is empty")
        return cls(token=token, insecure=insecure)
