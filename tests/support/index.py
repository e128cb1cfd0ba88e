"""Whether a Python package index answers, for the tests that need one (install resolution, vLLM wheels).

The index is pip's (``PIP_INDEX_URL``, else PyPI). Without one those tests
skip with the one line ``unreachable()`` returns; everything else in
``make test`` runs offline.
"""

from __future__ import annotations

import os
from functools import cache

import httpx

DEFAULT_INDEX = "https://pypi.org/simple/"


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/") + "/"


@cache
def unreachable() -> str | None:
    """None when the index answers; otherwise why not, as the one line a skip prints."""
    url = index_url() + "pip/"
    try:
        # trust_env: the proxy and CA bundle the machine's pip would use.
        answer = httpx.get(url, timeout=10.0, follow_redirects=True, trust_env=True)
    except httpx.HTTPError as exc:
        return f"no package index reachable ({url}: {type(exc).__name__}: {exc})"
    if answer.status_code >= 400:
        return f"no package index reachable ({url} answered {answer.status_code})"
    return None
