"""The process's runtime registries, at the bottom of the package.

It owns which hot path is loaded, the pools alive in this process (and the lock
guarding them, made anew in a fork child), and the hooks the upper layers install:
callbacks before an out-of-memory retry, callbacks for each IPC-enabled pool, and the
observer every pool reports to; and the allocators ``set_allocator()`` installed.  It imports nothing of the package but the hot path.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("cupy_poolmem._pools")

if os.environ.get("CUPY_POOLMEM_PURE_PYTHON"):
    from . import _hotpath_py as hp
else:
    try:
        from . import _hotpath as hp  # type: ignore[no-redef]
    except (ImportError, TypeError, ValueError) as _exc:  # not built, or other ABIs
        log.info("hot path: the pure-Python twin (compiled module not loaded: %s)", _exc)
        from . import _hotpath_py as hp
    else:
        from . import _hotpath_py as _twin

        if getattr(hp, "VERSION", None) != _twin.VERSION:  # built from an older source
            log.info("hot path: the pure-Python twin (compiled module built from older source)")
            hp = _twin

# Every pool alive in this process (statistics(), logs and sharing walk it).
POOLS: weakref.WeakSet[Any] = weakref.WeakSet()


class _RegistryLock:
    """The lock of :data:`POOLS`, made anew in a fork child on its first use there: a
    parent thread may have held it at the fork, and then no thread of the child would
    ever release it (the fork handlers of every module use the registry, in any order)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: a pool's __del__ may run inside a GC here
        self.pid = os.getpid()  # the process the lock was made in

    def get(self) -> threading.RLock:
        pid = os.getpid()
        if self.pid != pid:
            self.lock, self.pid = threading.RLock(), pid
        return self.lock


_REGISTRY_LOCK = _RegistryLock()


def registry_lock() -> threading.RLock:
    """The lock of :data:`POOLS` (made anew in a fork child on its first use there)."""
    return _REGISTRY_LOCK.get()


class Hooks:
    """What the layers above the pools install for the pools to call: they never import
    those layers."""

    def __init__(self) -> None:
        #: Run before an out-of-memory retry (sharing's limbo collection).
        self.oom: list[Callable[[], Any]] = []
        #: Run with each IPC-enabled pool when it is created (sharing).
        self.ipc_pool: list[Callable[[Any], Any]] = []
        #: The observer every pool, present and future, reports to: None, or the
        #: process's one recorder (the statistics, logs and tracking configure it).
        self.observer: Any = None
        #: ``Pool.outstanding``: the tracked live allocations of a pool (observability).
        self.outstanding: Callable[..., Any] | None = None


HOOKS = Hooks()
RECORDER = hp.Recorder()
# The allocators set_allocator() installed, by kind ("device", "pinned"); None: CuPy's own.
INSTALLED_ALLOCATORS: dict[str, Any] = {"device": None, "pinned": None}


def installed_allocator(kind: str) -> Any:
    """The allocator ``set_allocator()`` installed for ``kind`` ("device" or "pinned")."""
    return INSTALLED_ALLOCATORS[kind]


def hotpath_implementation() -> str:
    """Which hot path the pools use: the compiled one, or its pure-Python twin.

    Returns
    -------
    str
        ``"cython"`` when the compiled hot path is in use, else ``"python"`` (not
        built, or ``CUPY_POOLMEM_PURE_PYTHON=1``).

    Examples
    --------
    >>> cupy_poolmem.hotpath_implementation() in ("cython", "python")
    True
    """
    return hp.IMPLEMENTATION


def all_pools() -> list[Any]:
    """The pools alive in this process, oldest first.

    Returns
    -------
    list of Pool
        Every device, pinned and managed pool not yet garbage collected, closed ones
        included.

    Examples
    --------
    >>> isinstance(cupy_poolmem.all_pools(), list)
    True
    >>> [p.stats().kind for p in cupy_poolmem.all_pools()]  # doctest: +SKIP
    ['device', 'pinned']
    """
    with registry_lock():
        return sorted(POOLS, key=lambda p: p._serial)


def set_global_observer(observer: Any) -> None:
    """Install ``observer`` (or ``None``) on every pool, and on pools created later."""
    HOOKS.observer = observer
    for p in all_pools():
        p.observer = observer
