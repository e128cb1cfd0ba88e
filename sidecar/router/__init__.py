"""Router mode: the sidecar runs the prefill leg on P, then the decode leg on D.

``pool`` chooses P and runs the prefill leg's HTTP call, ``bodies`` builds both
legs' bodies (``sidecar.proxy.usage`` corrects D's answer), ``legs`` (built by
the app on the proxy's admission step, ``legs.Admission``; the proxy sees it as
``sidecar.proxy.handler.RouterMode``) drives one request through both legs and
gives the judge the router's policy: because the router holds P's parameters
itself, it releases when the client leaves or the decode leg times out before
headers (it closes its connection to D, which aborts the request), and
client-supplied ``kv_transfer_params`` are dropped (they could name any host).
"""

from sidecar.router.bodies import (
    PREFILL_PARAMS,
    decode_body,
    prefill_body,
    prefill_headers,
    sized,
)
from sidecar.router.pool import PrefillPool, PrefillResult, RouterError, parse_targets

__all__ = [
    "PREFILL_PARAMS",
    "PrefillPool",
    "PrefillResult",
    "RouterError",
    "decode_body",
    "parse_targets",
    "prefill_body",
    "prefill_headers",
    "sized",
]
