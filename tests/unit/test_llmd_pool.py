"""The InferencePool's members as allowlist entries, for both API groups llm-d's sidecar watches.

v1 (``inference.networking.k8s.io``) selects pods with ``selector.matchLabels`` and
names ``targetPorts``; v1alpha2 (``inference.networking.x-k8s.io``, which KServe's
LLMInferenceService still passes as ``--pool-group``) has a flat ``selector`` and one
``targetPortNumber`` (llm-d-router's pkg/sidecar/proxy/allowlist.go reads the same).
"""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.k8s.members import Members

RUNNING = {"metadata": {"name": "p0"}, "status": {"phase": "Running", "podIP": "10.0.0.5"}}
FAILED = {"metadata": {"name": "p1"}, "status": {"phase": "Failed", "podIP": "10.0.0.6"}}


@pytest.mark.parametrize(
    "spec",
    [
        {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]},
        {"selector": {"app": "vllm"}, "targetPortNumber": 8000},
    ],
    ids=["v1", "v1alpha2"],
)
def test_pool_members_become_entries_finished_pods_leave(spec: dict[str, Any]) -> None:
    members = Members()
    assert members.apply_pool({"spec": spec})
    assert members.selector == {"app": "vllm"} and members.ports == (8000,)
    members.apply_pod("ADDED", RUNNING)
    members.apply_pod("ADDED", FAILED)
    assert members.entries("5600-5663") == (["10.0.0.5:8000"], ["10.0.0.5:5600-5663"])
    members.apply_pod("DELETED", {"metadata": {"name": "p0"}})
    assert members.entries("5600-5663") == ([], [])


def test_a_selector_change_is_seen_in_either_shape() -> None:
    members = Members()
    members.apply_pool({"spec": {"selector": {"app": "a"}, "targetPortNumber": 8000}})
    assert not members.apply_pool({"spec": {"selector": {"app": "a"}, "targetPortNumber": 8001}})
    assert members.ports == (8001,)
    assert members.apply_pool({"spec": {"selector": {"app": "b"}, "targetPortNumber": 8001}})
