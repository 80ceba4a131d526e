"""Opt-ins to features whose GPU checks are pending (read from the environment; this
module imports nothing of the package, so the doctor's first lines can ask it)."""

from __future__ import annotations

import os

__all__ = ["STEP_IPC_ENV", "step_ipc_opted_in"]

#: The opt-in to ``ipc=True`` with mapped or expandable blocks while their sharing
#: awaits its GPU run (docs/sharing.rst, "Mapped and expandable blocks").
STEP_IPC_ENV = "CUPY_POOLMEM_EXPERIMENTAL_STEP_IPC"


def step_ipc_opted_in() -> bool:
    """Whether ``CUPY_POOLMEM_EXPERIMENTAL_STEP_IPC=1`` is set: then a DevicePool with
    ``large_blocks="mapped"`` or ``"expandable"`` accepts ``ipc=True``, creates its
    memory exportable and sends its blocks as the steps under them.

    Examples
    --------
    >>> isinstance(step_ipc_opted_in(), bool)
    True
    """
    return os.environ.get(STEP_IPC_ENV, "") == "1"
