"""The request path.

``dispatch`` (the ASGI entry, one path per request), ``context`` (the request
read once, the exchange with D), ``inspect`` (the only makers of an exchange),
``judge`` (the one home of the release decision), ``forward`` (the bytes to D
and back), ``disconnect`` (the client leaving), ``refusals`` (the sidecar's own
answers) and ``kit`` (the collaborators shared with ``sidecar.router.legs``).
"""

from sidecar.proxy.dispatch import Proxy, ProxyParts

__all__ = ["Proxy", "ProxyParts"]
