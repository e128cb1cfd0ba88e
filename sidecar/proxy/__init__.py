"""The request path.

``handler`` (the ASGI entry, the admission step that is also router mode's way
in, the sidecar's own refusals, and the bytes to D and back, the request
path's way to the judge), ``context`` (the request read once: its head, its
body under the cap, and its exchange with D, with the only maker of one),
``answers`` (the sidecar's own answers, in vLLM's style or llm-d's),
``disconnect`` (the client leaving), ``headers`` (hop-by-hop hygiene and the
request id), ``trust`` (which parameters may trigger a release) and ``usage``
(router mode's ``cached_tokens`` correction). The release decision itself
lives in ``sidecar.decision``.
"""

from sidecar.proxy.handler import Proxy, ProxyParts

__all__ = ["Proxy", "ProxyParts"]
