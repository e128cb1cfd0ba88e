"""Why router mode keeps ``n > 1`` off the P/D path, pinned to vLLM's code release by release.

D's engine fans a request with ``n > 1`` out into ``n`` engine requests, each
with its own id and a copy of the sampling parameters (and so of
``extra_args["kv_transfer_params"]``); D's NIXL scheduler decides per engine
request whether to read P's blocks, with nothing that ties the copies
together. So one P request is read once per choice, each read ending with its
own notifications, and P frees the blocks after the first reader's while the
others may still read (docs/llm-d.md, "``n > 1``"). Read from the wheels with
``zipfile`` + ``ast`` (``tests/conformance/vllm_source.py``), never imported.
"""

from __future__ import annotations

import ast

import pytest

from tests.conformance.vllm_source import Source, calls, release_source, releases

NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
PREFIXES = ("vllm/v1/engine/", "vllm/v1/request.py", NIXL)
Version = tuple[int, int, int]


@pytest.fixture(scope="module", params=releases("KVR_CONFORMANCE_SAMPLING_VLLM"))
def vllm(request: pytest.FixtureRequest) -> tuple[Version, Source]:
    return release_source(request.param, PREFIXES)


def test_each_choice_is_an_engine_request_of_its_own(vllm: tuple[Version, Source]) -> None:
    _, src = vllm
    child = ast.unparse(src.find("get_child_info", "parallel_sampling.py"))
    assert "f'{index}_{self.request_id}'" in child
    params = ast.unparse(src.find("_get_child_sampling_params", "parallel_sampling.py"))
    assert "copy(self.sampling_params)" in params  # a shallow copy: extra_args are the parent's
    add = src.find("add_request", "async_llm.py", cls="AsyncLLM")
    assert {"get_child_info", "ParentRequest"} <= calls(add)
    assert "extra_args.get('kv_transfer_params')" in ast.unparse(src.find("__init__", "vllm/v1/request.py"))


def test_d_decides_per_engine_request_whether_to_read_ps_blocks(vllm: tuple[Version, Source]) -> None:
    _, src = vllm
    deciding = [
        node
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc")
        for path, cls, node in src.defs[name]
        if path.startswith(NIXL) and "do_remote_prefill" in ast.unparse(node)
    ]
    assert deciding, "the NIXL scheduler's remote-prefill decision"
    for node in deciding:
        text = ast.unparse(node)
        assert "parent" not in text and "sampling_params.n" not in text  # nothing ties choices together
    queued = [ast.unparse(n) for n in deciding if "_reqs_need_recv[request.request_id]" in ast.unparse(n)]
    assert queued, "one pending read per engine request id"
