"""Hypothesis strategies shared by the property tests: JSON values and ``kv_transfer_params``.

Values are kept small (few leaves, short strings) so a few hundred examples run in
well under a second per property; sizes that matter (long ids, big ports, deep
nesting, huge block lists) are generated on purpose or tested by example.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Strings as P or a hostile client may send them: ASCII ids, colons, non-ASCII, control characters.
ids = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=st.sampled_from("ab:-_.é漢\x00\n "), max_size=12),
    st.sampled_from(["", ":", "a:b:c", "ü:1", "漢字", "x" * 512, "x" * 513, "h" * 253, "h" * 254]),
)
ints = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([65535, 65536, 70000, 1024, 1025, 2**31, -(2**63), 2**64, 10**30]),
    st.integers(),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=False, allow_infinity=False),
    ids,
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(ids, children, max_size=4),
    max_leaves=12,
)

block_ids = st.one_of(
    st.lists(ints, max_size=4),
    st.lists(st.lists(ints, max_size=3), max_size=3),
    st.lists(st.one_of(ints, st.booleans(), st.lists(ints, max_size=2)), max_size=3),
    st.lists(
        st.lists(
            st.one_of(ints, st.booleans(), st.floats(allow_nan=False, allow_infinity=False)), max_size=2
        ),
        max_size=2,
    ),
    json_values,
)


def _field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes any JSON value at all."""
    return st.one_of(valid, valid, valid, json_values)


params_dicts = st.fixed_dictionaries(
    {},
    optional={
        "do_remote_prefill": _field(st.just(True)),
        "do_remote_decode": _field(st.booleans()),
        "remote_engine_id": _field(ids),
        "remote_request_id": _field(st.none() | ids),
        "remote_host": _field(ids),
        "remote_port": _field(st.integers(min_value=-2, max_value=70000) | ints),
        "remote_block_ids": block_ids,
        "tp_size": _field(st.integers(min_value=-1, max_value=1100) | ints),
        "pp_size": _field(st.none() | st.integers(min_value=-1, max_value=40)),
        "dcp_size": _field(st.none() | ints),
        "transfer_mode": _field(st.sampled_from([None, "pull", "push", "PULL", ""])),
        "remote_num_tokens": _field(st.none() | ints),
        "remote_registration_generation": _field(st.none() | ints),
        "unknown_field": json_values,
    },
)


def valid_params(
    engine_id: str = "p-engine", request_id: str = "req-1", blocks: list[Any] | None = None
) -> dict[str, Any]:
    """Parameters ``sidecar.params.check`` accepts (vLLM 0.33.0 pull shape)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2, 3]] if blocks is None else blocks,
        "tp_size": 2,
        "pp_size": 1,
        "dcp_size": 1,
        "transfer_mode": "pull",
        "remote_num_tokens": 40,
        "remote_registration_generation": 0,
    }


def encode(value: Any) -> bytes:
    """JSON as a Python client (and vLLM's own parser) writes it; big ints survive."""
    return json.dumps(value).encode()
