"""The rows of shared expandable and mapped pools in ``bench alloc``, ``bench churn`` and
``bench ipc`` (issue 35), and the line that sets the receiver's reserved address space
per imported exporter beside torch's (9/8 of the GPU per import of an expandable
segment).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = [
    "EXPANDABLE_IPC_LABEL",
    "MAPPED_IPC_LABEL",
    "STEP_KIND",
    "churn_pools",
    "reserved_line",
]

EXPANDABLE_IPC_LABEL = "cupy_poolmem DevicePool large_blocks='expandable' ipc=True"
MAPPED_IPC_LABEL = "cupy_poolmem DevicePool large_blocks='mapped' ipc=True"
#: ``bench ipc``'s method for arrays of a shared expandable pool
STEP_KIND = "cupy_poolmem expandable"
#: torch reserves this share of the GPU's memory in a receiver per imported segment
TORCH_SHARE = 9 / 8


def churn_pools() -> list[tuple[str, dict[str, Any]]]:
    """The extra ``(label, DevicePool options)`` of ``bench alloc`` and ``bench churn``:
    the expandable and mapped pools with ``ipc=True`` (their memory created exportable).

    Examples
    --------
    >>> [label for label, _ in churn_pools()][0]
    "cupy_poolmem DevicePool large_blocks='expandable' ipc=True"
    """
    return [
        (EXPANDABLE_IPC_LABEL, {"large_blocks": "expandable", "ipc": True}),
        (MAPPED_IPC_LABEL, {"large_blocks": "mapped", "ipc": True}),
    ]


def reserved_line(per_import: list[int], gpu_bytes: int) -> str:
    """The receiver's reserved address space per imported exporter (the largest each
    receiver reserved at once, one per run), beside torch's 9/8 of the GPU per import.

    Examples
    --------
    >>> print(reserved_line([4 << 20, 258 << 20], 140 << 30))
    receiver's reserved address space per imported exporter: median 131.0 MiB, max 258.0 MiB (2 receivers); torch: 9/8 of the GPU per import = 157.5 GiB (max 0.0016x of it)
    >>> print(reserved_line([], 1 << 30))
    receiver's reserved address space per imported exporter: not measured
    """
    head = "receiver's reserved address space per imported exporter: "
    if not per_import:
        return head + "not measured"
    torch = gpu_bytes * TORCH_SHARE
    top = max(per_import)
    return (
        f"{head}median {statistics.median(per_import) / 2**20:.1f} MiB, max "
        f"{top / 2**20:.1f} MiB ({len(per_import)} receivers); torch: 9/8 of the GPU per "
        f"import = {torch / 2**30:.1f} GiB (max {top / torch:.4f}x of it)"
    )
