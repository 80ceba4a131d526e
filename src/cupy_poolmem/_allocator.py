"""One-line allocators for CuPy: one pool per device, created lazily, and scoped use."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import cupy

from . import (
    _guard,
    _runtime,
    _sharing,  # noqa: F401  (importing it installs sharing's hooks in _runtime)
)
from ._device import nearest_numa_node, require_gpu, resolve_peer_access
from ._errors import OptionTypeError, PoolClosedError
from ._pools import DevicePool, PinnedPool, Pool
from ._pools._options import raise_bad_size
from ._runtime import hp as _hp
from .stats import outstanding

__all__ = [
    "set_allocator",
    "set_pinned_memory_allocator",
    "using",
    "get_pool",
    "get_pinned_pool",
    "PoolAllocator",
]

# The public layer wires observability into the pools (they never import it).
_runtime.HOOKS.outstanding = outstanding

_lock = threading.Lock()
# The installed allocators live in _runtime (sharing and Dask read them there).
_installed = _runtime.INSTALLED_ALLOCATORS


class PoolAllocator(_hp.Dispatch):
    """A ``malloc(size)`` callable that keeps one pool per device.

    Created by :func:`set_allocator` and :func:`set_pinned_memory_allocator`; call it
    like ``MemoryPool.malloc``.  The pool for a device is created the first time an
    allocation happens with that device current, so multi-GPU code works unchanged.

    Parameters
    ----------
    factory : callable
        ``factory(device)`` creates the pool for a device ordinal.
    kind : str
        ``"device"`` or ``"pinned"``: which of CuPy's allocators this one replaces.

    Examples
    --------
    >>> alloc = cupy_poolmem.set_allocator(ipc=True)  # doctest: +SKIP
    >>> alloc.pool(0).stats().n_allocs  # doctest: +SKIP
    0
    """

    def __init__(self, factory: Callable[[int], Pool], kind: str) -> None:
        self.kind = kind
        self._factory = factory
        self._pools: dict[int, Pool] = {}
        self._plock = threading.Lock()
        # Calling the allocator runs Dispatch.__call__ (C level in the Cython build):
        # no Python frame between CuPy and the pool.
        super().__init__(self._create, require_gpu())

    def _bad_size(self, size: Any) -> None:
        raise_bad_size(size, f"PoolAllocator({self.kind!r})")

    def _create(self, device: int) -> Pool:
        with self._plock:
            p = self._pools.get(device)
            if p is None or p.closed:
                p = self._pools[device] = self._factory(device)
            return p

    def pool(self, device: int | None = None) -> Pool:
        """The pool serving ``device`` (default: current), created if needed.

        Parameters
        ----------
        device : int, optional
            The device ordinal; the current device when not given.

        Returns
        -------
        Pool
            This allocator's pool for that device.

        Examples
        --------
        >>> alloc = cupy_poolmem.set_allocator()  # doctest: +SKIP
        >>> alloc.pool(0).stats().device  # doctest: +SKIP
        0
        """
        return self._create(cupy.cuda.runtime.getDevice() if device is None else device)

    def pools(self) -> dict[int, Pool]:
        """The pools created so far, by device ordinal.

        Returns
        -------
        dict of int to Pool
            A copy: pools created later are not added to it.

        Examples
        --------
        >>> alloc = cupy_poolmem.set_allocator()  # doctest: +SKIP
        >>> x = cupy.zeros(10)  # doctest: +SKIP
        >>> list(alloc.pools())  # doctest: +SKIP
        [0]
        """
        with self._plock:
            return dict(self._pools)

    def close(self) -> None:
        """Close every pool this allocator created.

        Live allocations stay valid (see :meth:`Pool.close`); a later
        :meth:`pool` call creates a new pool.

        Examples
        --------
        >>> alloc = cupy_poolmem.set_allocator()  # doctest: +SKIP
        >>> alloc.close()  # doctest: +SKIP
        """
        with self._plock:
            pools, self._pools = list(self._pools.values()), {}
        self._forget()
        for p in set(pools):
            p.close()


class _GuardedAllocator(PoolAllocator):
    """A :class:`PoolAllocator` for guarded pools: each call goes through ``pool.malloc``
    (the guard's) instead of the hot path's C-level call (see ``_guard``)."""

    def __call__(self, size: Any) -> Any:
        return self.pool().malloc(size)


def set_allocator(**pool_options: Any) -> PoolAllocator:
    """Make CuPy allocate device memory from stream-ordered pools, one per GPU.

    Parameters
    ----------
    **pool_options
        Passed to :class:`DevicePool` for each device (``max_size``,
        ``release_threshold``, ``ipc``, ``peer_access``, ``small_pool``,
        ``large_blocks``).  ``large_blocks`` defaults to ``"pool"``;
        ``"expandable"`` reserves less where sizes vary and shares its arrays too, at
        a few percent more per allocation and slower fresh sends (the device-pool
        guide's "Which placement set_allocator uses"; ``doctor`` says which is in
        use).  ``ipc``
        defaults to ``True`` so arrays can be shared with other processes without a
        copy (blocks up to ``small_pool``, 8 MiB by default, are shared from the
        small-block pool that holds them).
        ``peer_access`` defaults to ``"all"``: each pool's memory is readable and
        writable from every GPU that can access its GPU, so code that uses an array
        from another GPU works as with CuPy's own pool; ``None`` keeps each pool's
        memory to its own GPU, a list names the GPUs.  Checked for every pair of GPUs
        here, so a pair that cannot access each other fails now, not at a later
        allocation.  ``guard`` (default: ``CUPY_POOLMEM_GUARD``) puts every pool under
        the debug guard (:doc:`guard`).

    Returns
    -------
    PoolAllocator
        The callable installed with :func:`cupy.cuda.set_allocator`.

    Examples
    --------
    >>> import cupy, cupy_poolmem
    >>> cupy_poolmem.set_allocator()  # doctest: +SKIP
    >>> x = cupy.arange(10)  # allocated from the pool of the current device  # doctest: +SKIP
    >>> cupy_poolmem.set_allocator(large_blocks="expandable")  # doctest: +SKIP
    """
    pool_options.setdefault("ipc", True)
    pool_options.setdefault("peer_access", "all")
    _validate_options(DevicePool, pool_options)
    # Read CUPY_POOLMEM_GUARD once: every device's pool gets the same answer.
    guard = pool_options["guard"] = _guard.resolve(pool_options.get("guard")) or False
    for dev in range(require_gpu()):
        resolve_peer_access(pool_options["peer_access"], dev)
    cls = _GuardedAllocator if guard else PoolAllocator
    alloc = cls(lambda dev: DevicePool(device=dev, **pool_options), "device")
    alloc.pool()  # create the current device's pool now: bad options fail here
    cupy.cuda.set_allocator(alloc)
    _replace("device", alloc)
    return alloc


def set_pinned_memory_allocator(**pool_options: Any) -> PoolAllocator:
    """Make CuPy allocate pinned host memory from a pool on the GPU's nearest NUMA node.

    One :class:`PinnedPool` serves all GPUs attached to the same NUMA node.

    Parameters
    ----------
    **pool_options
        Passed to :class:`PinnedPool` (``max_size``, ``release_threshold``, ``ipc``,
        ``numa_node``).

    Returns
    -------
    PoolAllocator
        The allocator installed, which creates one pool per NUMA node on first use.

    Examples
    --------
    >>> cupy_poolmem.set_pinned_memory_allocator()  # doctest: +SKIP
    >>> h = cupyx.empty_pinned((1 << 20,), dtype="u1")  # doctest: +SKIP
    """
    _validate_options(PinnedPool, pool_options)
    by_node: dict[int, PinnedPool] = {}

    def factory(dev: int) -> PinnedPool:
        node = pool_options.get("numa_node")
        node = nearest_numa_node(dev) if node is None else node
        p = by_node.get(node)
        if p is None or p.closed:
            with cupy.cuda.Device(dev):
                p = by_node[node] = PinnedPool(**pool_options)
        return p

    alloc = PoolAllocator(factory, "pinned")
    alloc.pool()
    cupy.cuda.set_pinned_memory_allocator(alloc)
    _replace("pinned", alloc)
    return alloc


def _validate_options(cls: type, options: dict) -> None:
    import inspect

    init = cls.__dict__.get("__init__") or next(
        k.__dict__["__init__"] for k in cls.__mro__ if "__init__" in k.__dict__
    )
    allowed = set(inspect.signature(init).parameters) - {"self", "device"}
    bad = sorted(set(options) - allowed)
    if bad:
        raise OptionTypeError(
            f"unknown option(s) {', '.join(bad)} for {cls.__name__}; "
            f"valid options: {', '.join(sorted(allowed))}"
        )


def _replace(kind: str, alloc: PoolAllocator) -> None:
    with _lock:
        _installed[kind] = alloc


def uninstall(kind: str, alloc: PoolAllocator) -> bool:
    """Give CuPy its own allocator of ``kind`` ("device" or "pinned") back when ``alloc``
    is the one installed; whether it was."""
    with _lock:
        if _installed.get(kind) is not alloc:
            return False
        if kind == "device":
            cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
        else:
            cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
        _installed[kind] = None
        return True


def get_pool(device: int | None = None) -> Pool:
    """The :class:`DevicePool` that :func:`set_allocator` uses for ``device``.

    Parameters
    ----------
    device : int, optional
        Device ordinal; defaults to the current device.

    Returns
    -------
    DevicePool
        The pool, created on first use.

    Raises
    ------
    PoolClosedError
        If :func:`set_allocator` has not been called in this process.

    Examples
    --------
    >>> cupy_poolmem.set_allocator()  # doctest: +SKIP
    >>> cupy_poolmem.get_pool().stats()  # doctest: +SKIP
    """
    alloc = _installed["device"]
    if alloc is None:
        raise PoolClosedError("no pool: call cupy_poolmem.set_allocator() first")
    return alloc.pool(device)


def get_pinned_pool(device: int | None = None) -> Pool:
    """The :class:`PinnedPool` that :func:`set_pinned_memory_allocator` uses for ``device``.

    Parameters
    ----------
    device : int, optional
        Device ordinal; defaults to the current device.  GPUs on the same NUMA node
        share one pool.

    Returns
    -------
    PinnedPool
        The pool, created on first use.

    Raises
    ------
    PoolClosedError
        If :func:`set_pinned_memory_allocator` has not been called in this process.

    Examples
    --------
    >>> cupy_poolmem.set_pinned_memory_allocator()  # doctest: +SKIP
    >>> cupy_poolmem.get_pinned_pool().stats().kind  # doctest: +SKIP
    'pinned'
    """
    alloc = _installed["pinned"]
    if alloc is None:
        raise PoolClosedError("no pinned pool: call cupy_poolmem.set_pinned_memory_allocator()")
    return alloc.pool(device)


@contextlib.contextmanager
def using(pool: Pool | Callable[[int], Any]) -> Iterator[Any]:
    """Allocate from ``pool`` inside the ``with`` block, in this thread only.

    Like :func:`cupy.cuda.using_allocator`; accepts a pool or any ``malloc``
    callable.  Pinned pools go to CuPy's pinned allocator instead (process-wide:
    CuPy has no thread-local pinned allocator; it is restored on exit).

    Parameters
    ----------
    pool : Pool or callable
        The pool, or a ``malloc(size)`` callable, to allocate from.

    Yields
    ------
    Pool or callable
        ``pool`` itself.

    Examples
    --------
    >>> pool = cupy_poolmem.DevicePool()  # doctest: +SKIP
    >>> with cupy_poolmem.using(pool):  # doctest: +SKIP
    ...     x = cupy.ones(100)
    """
    if isinstance(pool, PinnedPool):
        if pool.closed:
            pool._raise_closed()
        # CuPy has no getter for the pinned allocator: restore ours, or CuPy's default.
        prev = _installed["pinned"] or cupy.get_default_pinned_memory_pool().malloc
        cupy.cuda.set_pinned_memory_allocator(pool.malloc)
        try:
            yield pool
        finally:
            cupy.cuda.set_pinned_memory_allocator(prev)
        return
    if isinstance(pool, Pool) and pool.closed:
        pool._raise_closed()
    malloc = pool.malloc if isinstance(pool, Pool) else pool
    if not callable(malloc):
        raise OptionTypeError(
            f"using() takes a cupy_poolmem pool or a malloc callable; got {pool!r}"
        )
    with cupy.cuda.using_allocator(malloc):
        yield pool
