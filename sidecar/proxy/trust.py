"""Which ``kv_transfer_params`` the sidecar may act on.

A release is triggered by parameters inside a request. In sidecar mode anyone
who can reach the sidecar could send a failing request carrying another
tenant's ``remote_request_id`` and make P free blocks D is reading for that
tenant. With ``--trust token`` a release needs the router's shared token in
``x-kvr-router-token``; with ``--trust hmac`` it needs
``x-kvr-params-signature``: hex HMAC-SHA256, keyed with the shared key, over
``x-request-id``, a newline and the exact bytes of the ``kv_transfer_params``
value in the body. Router mode signs what it forwards. Untrusted parameters
are forwarded unchanged but never released (counted as ``untrusted``), and so
are a client's own parameters while no allowlist vets the P they name
(``prefill_allow_default = "routable"`` with neither ``prefill_allow`` nor
``inference_pool``: the router's own legs still release). With
``release_client_params`` off (pd-sidecar's default, as llm-d's sidecar) a
client's own parameters are forwarded and never released, whatever the
allowlist. Trusted parameters under ``token`` or ``hmac`` are vouched for:
their ranks are P's own topology (``sidecar.nixl.session.Session.claim``).
Independently of the mode, ``sidecar.decision.judge.InFlight`` vetoes releasing
parameters D may still be reading.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from sidecar.config import Config, ConfigError
from sidecar.tls.trust import SECRET_BYTES, Unusable, read_regular

TOKEN_HEADER = b"x-kvr-router-token"
SIGNATURE_HEADER = b"x-kvr-params-signature"


def _secret(value: str, path: str, field: str) -> bytes:
    """The secret: ``value``, or the file ``path``'s text (read as trust material is: a regular
    file, never blocking, ``sidecar.tls.trust.read_regular``)."""
    if path:
        try:
            value = read_regular(path, SECRET_BYTES).decode("utf-8", "replace").strip()
        except Unusable as exc:
            raise ConfigError(field + "_file", path, f"cannot read: {exc.why}") from exc
    return value.encode()


def sign(key: bytes, request_id: str, raw_params: bytes) -> str:
    """The signature a router puts in ``x-kvr-params-signature``."""
    return hmac.new(key, request_id.encode("latin-1") + b"\n" + raw_params, hashlib.sha256).hexdigest()


class Trust:
    """Decides whether a request's parameters may trigger a release."""

    def __init__(self, config: Config) -> None:
        self.mode = config.trust
        # Trusted parameters carry the router hop's token or signature: they are P's own.
        self.vouches = self.mode in ("token", "hmac")
        # Off (pd-sidecar's default, as llm-d): a client's own parameters are never released.
        self.client_params = config.release_client_params
        # Without an allowlist (pd-sidecar's routable default) nothing vets the P a client's own
        # parameters name: only the parameters P returned to the router's own leg are released.
        listed = bool(config.prefill_allow or config.inference_pool)
        self.open = config.prefill_allow_default == "routable" and not listed
        self.token = _secret(config.trust_token, config.trust_token_file, "trust_token")
        self.key = _secret(config.trust_key, config.trust_key_file, "trust_key")
        if self.mode == "token" and not self.token:
            raise ConfigError("trust_token", "", "--trust token needs trust_token or trust_token_file")
        if self.mode == "hmac" and not self.key:
            raise ConfigError("trust_key", "", "--trust hmac needs trust_key or trust_key_file")

    def trusted(self, headers: Mapping[bytes, bytes], request_id: str, raw_params: bytes) -> bool:
        """Whether these parameters may trigger a release; ``headers`` maps the request's
        (lower-case) header names to their first value."""
        if self.open:
            return False
        if self.mode == "any":
            return True
        given = headers.get(TOKEN_HEADER if self.mode == "token" else SIGNATURE_HEADER)
        if given is None:
            return False
        expected = self.token if self.mode == "token" else sign(self.key, request_id, raw_params).encode()
        return hmac.compare_digest(given, expected)

    def outgoing(self, request_id: str, raw_params: bytes) -> list[tuple[str, str]]:
        """Headers a router adds to its decode leg so the sidecar in front of D trusts it."""
        headers = []
        if self.key:
            headers.append((SIGNATURE_HEADER.decode(), sign(self.key, request_id, raw_params)))
        if self.token:
            headers.append((TOKEN_HEADER.decode(), self.token.decode("latin-1")))
        return headers
