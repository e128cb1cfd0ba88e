"""Outbound TLS: the context the sidecar verifies D or P with, one per stage.

D is reached over TLS when ``decode_url`` is ``https``; P named by llm-d's
``x-prefiller-host-port`` when ``prefill_tls`` is set. Each stage verifies
the peer's certificate and name against the system's store, ``tls_ca_file``,
``ssl_cert_file`` and every certificate in ``ssl_cert_dir``'s folders (the
last two also from ``SSL_CERT_FILE`` and ``SSL_CERT_DIR``, read as Go reads
them: ``sidecar.tls.trust``), unless its ``*_tls_insecure`` setting is on.
TLS 1.2 is the minimum.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Protocol

from sidecar.tls.trust import trust


class TrustSettings(Protocol):
    """The settings of ``sidecar.config.Config`` that name what outbound TLS trusts."""

    @property
    def tls_ca_file(self) -> str: ...
    @property
    def ssl_cert_file(self) -> str: ...
    @property
    def ssl_cert_dir(self) -> Sequence[str]: ...


def outbound(config: TrustSettings, insecure: bool) -> ssl.SSLContext:
    """The client context for one stage: the trust ``config`` names, and that stage's
    ``*_tls_insecure`` (``insecure``). Reads the files it names: build it at start, not per request."""
    context = ssl.create_default_context()  # the system's store
    if config.tls_ca_file:
        context.load_verify_locations(cafile=config.tls_ca_file)
    trust(context, [config.ssl_cert_file], config.ssl_cert_dir)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
