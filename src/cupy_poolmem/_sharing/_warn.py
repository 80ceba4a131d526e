"""The warning a protocol step that failed in a background thread gives."""

from __future__ import annotations

import warnings

__all__ = ["warn_kept"]


def warn_kept(what: str, exc: BaseException) -> None:
    """A protocol step failed in a background thread: say so; what it held stays held."""
    warnings.warn(
        f"cupy_poolmem: {what} failed ({type(exc).__name__}: {exc}); the block stays held "
        "until the process holding it exits",
        RuntimeWarning,
        stacklevel=3,
    )
