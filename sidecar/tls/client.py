"""Outbound TLS: the context the sidecar verifies D or P with, one per stage.

D is reached over TLS when ``decode_url`` is ``https``; P named by llm-d's
``x-prefiller-host-port`` when ``prefill_tls`` is set. Each stage verifies
the peer's certificate and name against ``tls_ca_file`` (or the system's
store) unless its ``*_tls_insecure`` setting is on. TLS 1.2 is the minimum.
"""

from __future__ import annotations

import ssl


def outbound(ca_file: str, insecure: bool) -> ssl.SSLContext:
    """The client context for one stage: ``tls_ca_file`` (empty: the system's store), and that
    stage's ``*_tls_insecure``."""
    context = ssl.create_default_context(cafile=ca_file or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
