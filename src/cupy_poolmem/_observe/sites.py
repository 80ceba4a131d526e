"""Call sites: which frames are not a call site (those of the packages skipped) and
how many frames to walk, shared by tracking and the guard's reports."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_SKIP = ("cupy_poolmem", "cupy", "cupyx", "cupy_backends", "numba", "numba_cuda")


def package_dir(name: str) -> str | None:
    """The directory (with a trailing separator) or file of module ``name``, or ``None``."""
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        loc = list(spec.submodule_search_locations)
        return os.path.join(loc[0], "") if loc else None
    if spec.origin:
        return spec.origin
    return None


class CallSites:
    """The packages whose frames are skipped (:data:`DEFAULT_SKIP` and ``extra``, as
    :func:`~cupy_poolmem.track` sets them) and the most frames walked (``depth``)."""

    def __init__(self, depth: int = 32) -> None:
        self.depth = depth
        self.extra: tuple[str, ...] = ()
        self._prefixes: tuple[str, ...] | None = None  # computed on first use

    def set_skip(self, extra: tuple[str, ...]) -> None:
        """Skip the frames of these packages or path prefixes too (replacing the last)."""
        self.extra = tuple(extra)
        self._prefixes = None

    def prefixes(self) -> tuple[str, ...]:
        """Path prefixes of the packages whose frames are not call sites (cached)."""
        if self._prefixes is not None:
            return self._prefixes
        prefixes = []
        for name in (*DEFAULT_SKIP, *self.extra):
            if os.sep in name or name.endswith(".py"):
                prefixes.append(name)
                continue
            d = package_dir(name)
            if d:
                prefixes.append(d)
        self._prefixes = tuple(prefixes)
        return self._prefixes


SITES = CallSites()
