"""Light traffic on P while a scenario runs: a one-token request every few tenths of a second.

vLLM moves NIXL notifications only when an engine steps. Seen here with P
idle (nothing but the scenario's own requests): P read a notification only
at its next step, which could be the lease's deadline (P then freed by
expiry first and counted the notification as one for a request it no longer
held), and D's answer to a rejection its own fix releases was held until
P's lease ran out (D's engine, sending the notification, waited on P). A P
in service has traffic; this thread gives it some. The requests carry no
``kv_transfer_params``, so they pin nothing and send nothing to P's side
channel: a release that was never sent still ends in P's expiry, and a
second one still shows.
"""

from __future__ import annotations

import threading

import httpx


class Traffic:
    """One-token completions to ``url`` every ``interval`` seconds, in a thread, inside the block."""

    def __init__(self, url: str, model: str, interval: float = 0.3) -> None:
        self.url, self.model, self.interval = url, model, interval
        self.sent = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p-traffic", daemon=True)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "ka", "max_tokens": 1}
        with httpx.Client(timeout=30, trust_env=False) as client:
            while not self._stop.wait(self.interval):
                try:
                    client.post(self.url + "/v1/completions", json=body).raise_for_status()
                    self.sent += 1
                except httpx.HTTPError:
                    self.failed += 1

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(35)
