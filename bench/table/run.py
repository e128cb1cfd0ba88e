"""``python -m bench.table [--against FILE] [--requests N] [--rounds N]``: the shared table per request.

What the ledger and the in-flight veto cost a request, in one process, for
three tables side by side: one process's own (``--workers 1``: ``Ledger`` and
``InFlight``), the shared table of this tree (``--workers 2``: two shards,
the ledger and the veto in ``/dev/shm``), and, with ``--against``, another
implementation of ``sidecar/release/shared.py`` loaded from a file (an
earlier release, say: ``git show REV:sidecar/release/shared.py > old.py``).

A request is what the request path asks of them for one inspected P/D
request: the replay check, then at D, then left D admitted; a rejected one
adds the veto's question and the ledger's record. Each round times
``requests`` of each kind per table, the tables in turn (their order rotated
every round), and the median of the rounds is reported with its ratio to one
process's tables. One process, one mapping: the cost of the operations
themselves, not of two workers contending (``make bench``'s accept burst at
one and two workers measures the whole path).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from sidecar.decision.judge import InFlight
from sidecar.release import shared
from sidecar.release.ledger import Ledger

TTL, LEASE = 600.0, 30.0


@dataclass(frozen=True)
class Table:
    """One implementation's five operations, as the request path calls them."""

    name: str
    spent: Callable[[Hashable], bool]
    spend: Callable[[Hashable], bool]
    forwarded: Callable[[Hashable], None]
    finished: Callable[[Hashable], None]  # left D, admitted
    may_be_read: Callable[[Hashable], bool]


def own_tables() -> Table:
    ledger, inflight = Ledger(131072, TTL), InFlight(65536, LEASE)
    return Table(
        "one process",
        ledger.__contains__,
        ledger.add,
        inflight.forwarded,
        lambda key: inflight.finished(key, admitted=True),
        inflight.may_be_read,
    )


def shared_tables(module: ModuleType, name: str, directory: Path) -> Table:
    table = module.SharedTable.create(directory / name.replace(" ", "-"), 131072, workers=2)
    return Table(
        name,
        table.spent,
        lambda key: table.spend(key, TTL),
        lambda key: table.at_decode(key, 0, 1),
        lambda key: table.at_decode(key, 0, -1, LEASE),
        table.may_be_read,
    )


def load(path: Path) -> ModuleType:
    """``path`` as a module of its own (it imports ``sidecar`` as this tree has it)."""
    spec = importlib.util.spec_from_file_location("bench_table_against", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def admitted(table: Table, keys: Sequence[Hashable]) -> float:
    started = time.perf_counter()
    for key in keys:
        table.spent(key)
        table.forwarded(key)
        table.finished(key)
    return (time.perf_counter() - started) / len(keys) * 1e6


def rejected(table: Table, keys: Sequence[Hashable]) -> float:
    started = time.perf_counter()
    for key in keys:
        table.spent(key)
        table.forwarded(key)
        table.finished(key)
        if not table.may_be_read(key):  # admitted above: never here; the question is what costs
            table.spend(key)
    return (time.perf_counter() - started) / len(keys) * 1e6


def measure(tables: list[Table], requests: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median microseconds per request of each kind, per table."""
    times: dict[str, dict[str, list[float]]] = {t.name: {"admitted": [], "rejected": []} for t in tables}
    for round_ in range(rounds):
        order = tables[round_ % len(tables) :] + tables[: round_ % len(tables)]
        for table in order:
            keys = [("engine", f"{table.name}-{round_}-{i}") for i in range(requests)]
            times[table.name]["admitted"].append(admitted(table, keys))
            keys = [("engine", f"{table.name}-{round_}-r{i}") for i in range(requests)]
            times[table.name]["rejected"].append(rejected(table, keys))
    return {name: {kind: statistics.median(v) for kind, v in kinds.items()} for name, kinds in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.table", description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, help="another sidecar/release/shared.py to measure beside")
    parser.add_argument("--requests", type=int, default=20_000, help="requests of each kind per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as scratch:
        tables = [own_tables(), shared_tables(shared, "shared (this tree)", Path(scratch))]
        if args.against:
            tables.append(shared_tables(load(args.against), f"shared ({args.against.name})", Path(scratch)))
        result = measure(tables, args.requests, args.rounds)
    base = result["one process"]
    print(f"{'table':<28} {'admitted us':>12} {'ratio':>6} {'rejected us':>12} {'ratio':>6}")
    for name, kinds in result.items():
        cells = [f"{kinds[k]:>12.2f} {kinds[k] / base[k]:>6.2f}" for k in ("admitted", "rejected")]
        print(f"{name:<28} {' '.join(cells)}")
    return 0
