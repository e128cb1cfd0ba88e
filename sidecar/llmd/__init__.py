"""The drop-in for llm-d's P/D routing sidecar (``kv-release-sidecar pd-sidecar``, docs/llm-d.md).

``table`` lists every flag of llm-d's ``pd-sidecar`` with the release it appeared
in; ``flags`` reads llm-d's command line (and its YAML configuration and
environment variables) into this project's one ``Config``, refusing what it
cannot honour; ``command`` runs it. The data-parallel ranks' listeners and
each rank's client and D state are ``sidecar.app.ranks`` and
``sidecar.app.decode_ranks``; llm-d's client-visible answers, where they
differ from vLLM's, are the ``LLMD`` answer style, picked at start
(``sidecar.proxy.answers``).
"""
