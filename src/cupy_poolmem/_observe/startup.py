"""Start-up from the environment: ``CUPY_POOLMEM_LOG`` and ``CUPY_POOLMEM_TRACK``."""

from __future__ import annotations

import os
import warnings

from .switches import start_log, track

_ENV_LOG = "CUPY_POOLMEM_LOG"
_ENV_TRACK = "CUPY_POOLMEM_TRACK"


def init_from_env() -> None:
    """Start a log / tracking from ``CUPY_POOLMEM_LOG`` and ``CUPY_POOLMEM_TRACK``.

    Called once by ``cupy_poolmem/__init__.py``.  A log that cannot be opened gives a
    :class:`RuntimeWarning`, never an import error.
    """
    want_track = os.environ.get(_ENV_TRACK, "").strip().lower() in ("1", "true", "yes", "on")
    path = os.environ.get(_ENV_LOG, "").strip()
    if path:
        try:
            start_log(path, track=want_track, append=True)
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"{_ENV_LOG}={path!r}: cannot write the allocation log ({exc}); "
                "continuing without it",
                RuntimeWarning,
                stacklevel=2,
            )
    elif want_track:
        track(True)
