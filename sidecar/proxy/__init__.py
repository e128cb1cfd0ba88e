"""The request path.

``dispatch`` (the ASGI entry, one path per request), ``context`` (the request
read once, the exchange with D), ``inspect`` (the only makers of an exchange),
``admit`` (the one step to D, also router mode's seam), ``forward`` (the bytes
to D and back, and the request path's way to the judge), ``stream`` (a 200
stream judged from its first event), ``disconnect`` (the client leaving),
``refusals`` (the sidecar's own answers) and ``style`` (their style: vLLM's or
llm-d's). The release decision itself lives in ``sidecar.decision``.
"""

from sidecar.proxy.dispatch import Proxy, ProxyParts

__all__ = ["Proxy", "ProxyParts"]
