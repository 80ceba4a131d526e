"""The rows of shared expandable and mapped pools in ``bench churn`` and ``bench ipc``
(issue 35): which pools, the goal line that judges the shared
expandable pool, and the receiver's reserved address space beside torch's (the
measurements need a GPU)."""

from __future__ import annotations

from cupy_poolmem.benchmarks import _step_ipc as S
from cupy_poolmem.benchmarks import churn
from cupy_poolmem.benchmarks._paired import PairedRatio

MiB, GiB = 1 << 20, 1 << 30


def test_the_shared_pools_measured_are_the_expandable_and_mapped_pools_with_ipc():
    assert S.churn_pools() == [
        (S.EXPANDABLE_IPC_LABEL, {"large_blocks": "expandable", "ipc": True}),
        (S.MAPPED_IPC_LABEL, {"large_blocks": "mapped", "ipc": True}),
    ]


def test_the_goal_line_judges_the_shared_expandable_pool_when_it_was_measured():
    rows = [
        (churn.BASE_LABEL, 2e-6, 1000),
        (churn.EXPANDABLE_LABEL, 1.8e-6, 780),
        (S.EXPANDABLE_IPC_LABEL, 2.2e-6, 790),
    ]
    paired = {S.EXPANDABLE_IPC_LABEL: PairedRatio(1.02, 0.98, 1.06, 6)}
    line = churn.goal_line(rows, paired)
    assert "large_blocks='expandable' met (0.78x, 0.90x)" in line
    assert "large_blocks='expandable' ipc=True met (0.79x, 1.02x paired)" in line
    assert "ipc=True" not in churn.goal_line(rows[:2])  # not measured: not judged


def test_the_reserved_line_sets_each_receivers_reservation_beside_torchs():
    line = S.reserved_line([2 * MiB, 6 * MiB, 64 * MiB], 80 * GiB)
    assert "median 6.0 MiB, max 64.0 MiB (3 receivers)" in line
    assert "9/8 of the GPU per import = 90.0 GiB" in line
    assert "(max 0.0007x of it)" in line
    assert S.reserved_line([], 80 * GiB).endswith("not measured")
