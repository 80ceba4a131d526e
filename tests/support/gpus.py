"""The GPUs this process sees, named the way a child's ``CUDA_VISIBLE_DEVICES`` must name them.

A child's ``CUDA_VISIBLE_DEVICES`` names the host's GPUs (indices or UUIDs), not this
process's ordinals: a test that starts workers on ``"0,1"`` while ``.ci/gpu`` runs it
with ``CUDA_VISIBLE_DEVICES=2,3`` puts them on GPUs 0 and 1, where other suites run
meanwhile.  Tests name the GPUs of a cluster they start with :func:`visible`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def visible(n: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """The first ``n`` GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them
    (``"0"``, ``"1"``, ... when it is unset)."""
    env = os.environ if environ is None else environ
    seen = env.get("CUDA_VISIBLE_DEVICES")
    if seen is None:
        return [str(i) for i in range(n)]
    names = [s.strip() for s in seen.split(",") if s.strip()]
    if len(names) < n:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={seen!r} names fewer than {n} GPUs")
    return names[:n]
