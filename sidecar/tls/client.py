"""Outbound TLS: the context the sidecar verifies D or P with, one per stage.

D is reached over TLS when ``decode_url`` is ``https``; P named by llm-d's
``x-prefiller-host-port`` when ``prefill_tls`` is set. Each stage verifies
the peer's certificate and name against the system's store, ``tls_ca_file``,
``ssl_cert_file`` and every certificate in ``ssl_cert_dir``'s folders (the
last two also from ``SSL_CERT_FILE`` and ``SSL_CERT_DIR``, read as Go reads
them), unless its ``*_tls_insecure`` setting is on. The files are read once
per process, safely and in bounded time (``sidecar.tls.trust``); start-up
reads them before its event loop runs (``sidecar.server.serve.preflight``).
TLS 1.2 is the minimum.
"""

from __future__ import annotations

import ssl
import sys

from sidecar.tls.trust import TrustSettings, trust_store

__all__ = ["TrustSettings", "outbound"]


def outbound(config: TrustSettings, insecure: bool) -> ssl.SSLContext:
    """The client context for one stage: the trust ``config`` names, and that stage's
    ``*_tls_insecure`` (``insecure``). Raises ``CAFileError`` when ``tls_ca_file`` cannot be used."""
    # What ssl.create_default_context makes, without the store it loads: OpenSSL would read the
    # files SSL_CERT_FILE and SSL_CERT_DIR name itself, unchecked (a FIFO there blocks forever).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # certificate and name verified
    if sys.version_info >= (3, 13):
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN | ssl.VERIFY_X509_STRICT
    trust_store(config).load(context)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
