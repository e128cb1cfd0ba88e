"""What vLLM's own P did with a second "done" notification, order by order (data, no vLLM needed).

``tests/conformance/test_vllm_duplicates.py`` records it by running vLLM's P
code from the wheels of ``RECORDED`` (P with TP=2, D with TP=4, so every P rank
expects two notifications); ``tests/unit/test_sim_prefill_vllm_outcomes.py``
holds the prefill simulator to the same table. See the former's docstring for
the counting rules behind it.
"""

from __future__ import annotations

from sidecar.nixl.versions import WireProfile

#: The releases whose P code produced ``RESULT`` (the conformance run's default).
RECORDED = ("0.34.0", "0.21.0")
#: Releases that gave the same ``RESULT`` when run by hand (``KVR_CONFORMANCE_DUPLICATE_VLLM``):
#: the reader count (0.29.0) and D's TP size (0.26.0) schemes beside the default two.
ALSO_MATCHED = ("0.33.0", "0.29.0", "0.26.0")
P_TP, D_TP = 2, 4

# Who sends, per P rank, in the order P handles it: "D" one of D's two readers, "S" the sidecar.
ORDERS = {
    "D alone": ("D", "D"),
    "sidecar first": ("S", "D", "D"),
    "sidecar between D's readers": ("D", "S", "D"),
    "sidecar last": ("D", "D", "S"),
}
# What vLLM's P did: the 0-based index of the message that freed the request on every rank, or
# "lease". The same in both counting schemes (tp_ratio, 0.14.0-0.28.x; reader count, 0.29.0+).
RESULT: dict[str, int | str] = {
    "D alone": 1,
    "sidecar first": 0,  # freed at once (no one reads here); D's two messages are "unrecognized"
    "sidecar between D's readers": "lease",  # count 2 != 1, then 3 != 2: stranded
    "sidecar last": 1,  # freed by D; the sidecar's message is "unrecognized"
}


def d_message(version: str, request_id: str) -> str:
    """What each of a TP=4 D's readers sends a TP=2 P (P's notification counting)."""
    profile = WireProfile.for_version(version)
    assert profile is not None
    readers_count = profile.low >= (0, 29, 0)
    return f"{request_id}:{D_TP // P_TP if readers_count else D_TP}"


def sidecar_message(request_id: str) -> str:
    """The sidecar's release: one reader."""
    return f"{request_id}:1"


def unrecognized(order: str, freed: int | str, ranks: int) -> int:
    """The "unrecognized request" lines P logs: every message after the one that freed it, per rank."""
    return (len(ORDERS[order]) - 1 - freed) * ranks if isinstance(freed, int) else 0
