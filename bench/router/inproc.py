"""``python -m bench.router.inproc [--baseline DIR]``: router mode's own Python per stream.

The proxy's ASGI app in router mode, with P and D faked at the upstream seam
(the fakes of ``tests/support/fakes.py`` and ``tests/unit/rigs.py``: no sockets, no server), runs
``--streams`` streaming requests of 64 SSE events each through the prefill leg,
the decode leg, the inspection, the judge (``dry-run``) and the relay, and
reports the CPU time per stream (``time.process_time``). The median of
``--samples`` samples is printed per tree. With ``--baseline DIR`` (a copy of
another tree, e.g. ``git worktree add DIR REV``) the two trees alternate,
each sample in a fresh process, so both see the same machine. The figure is
the router's and the proxy's Python alone: what the HTTP exchanges and the
event loop add is in ``python -m bench --workload streams --modes router``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

_SAMPLE = """
import sys, time
sys.path.insert(0, {tree!r})
import uvloop
from tests.support.fakes import Client, FakeResponse, FakeUpstream
from tests.unit.rigs import completion, router

EVENT = (b'data: {{"id":"chatcmpl-1","object":"chat.completion.chunk","created":0,"model":"m",'
         b'"choices":[{{"index":0,"delta":{{"content":" tok"}},"finish_reason":null}}]}}\\n\\n')
SSE = [EVENT] * 64 + [b"data: [DONE]\\n\\n"]

def stream(request):
    return FakeResponse(200, [(b"content-type", b"text/event-stream")], list(SSE))

async def main() -> None:
    async with router(FakeUpstream(stream), release="dry-run") as r:
        body = completion(stream=True)
        for warm in (True, False):
            started = time.process_time()
            for _ in range(300 if warm else {streams}):
                client = Client(body=body)
                await r.proxy(client.scope(), client.receive, client.send)
            assert client.status == 200, client.status
            r.d.requests.clear()
            for p in r.ps.values():
                p.requests.clear()
        print((time.process_time() - started) / {streams} * 1e6)

uvloop.run(main())
"""


def sample(tree: Path, streams: int) -> float:
    """CPU µs per stream for one sample of ``streams`` streams through ``tree``'s code."""
    code = _SAMPLE.format(tree=str(tree.resolve()), streams=streams)
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router.inproc", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--baseline", type=Path, help="another tree, measured alternately beside this one")
    parser.add_argument("--streams", type=int, default=1500, help="streams per sample")
    parser.add_argument("--samples", type=int, default=5, help="samples per tree")
    args = parser.parse_args(argv)
    trees = {"sidecar": Path.cwd()} | ({"baseline": args.baseline} if args.baseline else {})
    found: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.samples):
        for name, tree in trees.items():
            found[name].append(sample(tree, args.streams))
    for name, values in found.items():
        spread = f"{min(values):.0f}-{max(values):.0f}"
        median = statistics.median(values)
        print(f"{name:9} router mode, CPU per stream of 64 events: median {median:.0f} µs ({spread})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
