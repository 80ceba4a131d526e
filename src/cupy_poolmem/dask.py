"""Dask integration: a worker plugin and preload hooks that put each worker on cupy_poolmem pools.

Use :class:`PoolmemPlugin` from the client, ``--preload cupy_poolmem.dask`` (configured
by the ``cupy-poolmem.*`` keys), or :mod:`cupy_poolmem_dask` in distributed's preload
config.  With it, CuPy chunks between workers of one host go through pool IPC
(:func:`transfer_stats` says which path they took); :func:`gather_stats` collects the
workers' pool statistics.  docs/dask.rst has the options, config keys and rules.

Examples
--------
>>> from cupy_poolmem.dask import PoolmemPlugin  # doctest: +SKIP
>>> client.register_plugin(PoolmemPlugin(pool_size=0.5, maximum_pool_size="90%"))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

try:
    import dask.config
    from distributed.diagnostics.plugin import WorkerPlugin
except ImportError as _exc:  # pragma: no cover - depends on the environment
    from ._errors import MissingDependencyError

    raise MissingDependencyError(
        "cupy_poolmem.dask",
        str(_exc),
        needs="dask and distributed",
        install='pip install "cupy_poolmem[dask]"',
    ) from _exc

import cupy_poolmem

from . import _dask_transfer
from ._dask_transfer import TransferConfig
from ._device import require_gpu
from ._errors import InvalidOptionError, NoGPUError, OptionTypeError, PoolClosedError
from ._gc_freeze import GcFreeze
from ._pools._options import large_blocks_mode
from ._sizes import format_bytes, parse_bytes

__all__ = [
    "PoolmemPlugin",
    "dask_setup",
    "dask_teardown",
    "gather_stats",
    "transfer_stats",
    "TransferConfig",
    "CONFIG_DEFAULTS",
    "TRANSFER_CONFIG_DEFAULTS",
]

logger = logging.getLogger("cupy_poolmem.dask")

#: Defaults of the ``cupy-poolmem`` Dask config section (shipped with this module).
CONFIG_DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "pool-size": None,
    "maximum-pool-size": None,
    "release-threshold": None,
    "pinned": True,
    "ipc": True,
    "gc-freeze": True,
    "large-blocks": "pool",
}
dask.config.update_defaults({"cupy-poolmem": dict(CONFIG_DEFAULTS)})

#: Defaults of the ``distributed.comm.cupy-poolmem`` config section (same-host transfers).
TRANSFER_CONFIG_DEFAULTS: dict[str, Any] = dict(_dask_transfer.CONFIG_DEFAULTS)
dask.config.update_defaults(
    {"distributed": {"comm": {"cupy-poolmem": dict(TRANSFER_CONFIG_DEFAULTS)}}}
)

_SIZE_OPTIONS = ("pool_size", "maximum_pool_size", "release_threshold")
# What fractions are validated against before the device's real size is known.
_PROBE_TOTAL = 2**60
# dask-cuda's string spelling of a fraction: "0.5", ".25", "1.0" (no unit, a decimal point).
_DASK_CUDA_FRACTION = re.compile(r"^\s*(?:[0-9]*\.[0-9]+|[0-9]+\.)\s*$")


def _dask_cuda_form(value: Any) -> Any:
    """``"0.5"`` -> ``0.5``: dask-cuda reads a bare decimal string in (0, 1] as a fraction.

    ``rmm_pool_size="0.5"`` (and ``--rmm-pool-size 0.5``) mean half of the GPU in
    dask-cuda, so the plugin reads them the same way; everything else goes to
    :func:`~cupy_poolmem.parse_bytes` unchanged.
    """
    if isinstance(value, str) and _DASK_CUDA_FRACTION.match(value):
        frac = float(value)
        if 0 < frac <= 1:
            return frac
    return value


def _parse(value: Any, name: str, total: int | None = None) -> int | None:
    return parse_bytes(_dask_cuda_form(value), name=name, total=total, allow_none=True)


def _size_kind(value: Any, name: str) -> str:
    """``"none"``, ``"bytes"`` or ``"fraction"``; raises for values that are neither."""
    if value is None:
        return "none"
    _parse(value, name, _PROBE_TOTAL)  # type and syntax errors raise here
    try:
        _parse(value, name)
    except InvalidOptionError:
        return "fraction"
    return "bytes"


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise OptionTypeError(
            f"{name} must be True or False; got {value!r} of type {type(value).__name__}"
        )
    return value


def _config_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise OptionTypeError(f"dask config {key}={value!r} must be true or false")


class PoolmemPlugin(WorkerPlugin):
    """Worker plugin: each worker allocates CuPy memory from cupy_poolmem pools on its GPU.

    Parameters
    ----------
    pool_size : int, str or float, optional
        Memory reserved up front: bytes (``20 * 2**30``), a string (``"20GB"``) or a
        fraction of the GPU's memory (``0.5``, ``"50%"``, or dask-cuda's ``"0.5"``), as
        dask-cuda's ``rmm_pool_size`` reads them.  The
        pools here have no built-in initial size, so the plugin allocates this much
        once and frees it; the pool keeps it reserved as long as the release
        threshold allows (the default keeps everything).  Such a pool has one CUDA
        pool (``small_pool=None``), so every allocation comes out of the reservation.
        ``None``: grow on demand (with the small-block pool).
    maximum_pool_size : int, str or float, optional
        Hard cap of the device pool (the pool's ``max_size``), in the same forms.
        ``None``: limited by the GPU only.
    release_threshold : int, str or float, optional
        Reserved bytes the pool keeps across synchronisations.  ``None`` (default)
        keeps all; ``0`` releases unused memory at every synchronisation.  Must not
        be below ``pool_size`` (the reservation would be released at once).
    pinned : bool
        Also make CuPy's pinned host allocator a :class:`~cupy_poolmem.PinnedPool`
        on the GPU's NUMA node.  Default ``True``.
    ipc : bool
        Create the device pool IPC-enabled, so arrays can be shared with other
        processes without a copy.  Default ``True``.
    gc_freeze : bool
        At setup, collect once and freeze the worker's start-up objects
        (``gc.freeze``), so Python's full collections no longer stall the worker
        for about 0.1 s in the middle of a computation.  Skipped on a worker that
        already holds tasks and in a plain process (``setup()`` without a worker);
        undone at teardown.  Default ``True``.
    large_blocks : {"pool", "expandable", "mapped"}
        Where the device pool places its blocks (:class:`~cupy_poolmem.DevicePool`'s
        ``large_blocks``).  ``"pool"`` (default, as :func:`~cupy_poolmem.set_allocator`):
        CUDA pools.  ``"expandable"`` reserves less where sizes vary, and its arrays
        travel between same-host workers too (as the steps under their blocks); it
        takes no ``pool_size``, ``maximum_pool_size`` nor ``release_threshold``.
        ``"mapped"`` takes no ``pool_size`` nor ``maximum_pool_size``.

    Raises
    ------
    OptionTypeError, InvalidOptionError
        At construction, for values of a wrong type, unparsable sizes, or
        inconsistent sizes given in the same form (both bytes or both fractions).
        Sizes that mix bytes and fractions are checked on the worker, where the
        GPU's size is known.
    NoGPUError
        From ``setup`` on a worker without a usable GPU; ``client.register_plugin``
        re-raises it in the client.

    Notes
    -----
    * Device: the current CUDA device of the worker process (device 0, which is the
      first GPU of the worker's ``CUDA_VISIBLE_DEVICES``; dask-cuda gives every worker
      its own list).  Run one GPU worker per process: the allocator is process-wide.
    * Plugins registered with ``client.register_plugin`` are kept by the scheduler and
      run on workers that connect later (distributed's ``Worker`` runs the
      ``worker-plugins`` the scheduler sends when it registers), so restarted workers
      get their pools again.  The plugin is named ``"cupy-poolmem"``: registering it
      again replaces the previous one (teardown, then setup).
    * Teardown closes the pools (live arrays stay valid until freed) and restores
      ``cupy.get_default_memory_pool().malloc`` and the default pinned pool.
    * Setup also installs same-host transfers through pool IPC on the worker
      (unless ``distributed.comm.cupy-poolmem.ipc`` is false), keys the worker's
      sharing sockets with the per-host secret when ``...cupy-poolmem.secret`` is
      set, and meets the same-host workers already running; teardown removes the
      path.  See :func:`transfer_stats`.

    Examples
    --------
    >>> from dask_cuda import LocalCUDACluster  # doctest: +SKIP
    >>> from distributed import Client  # doctest: +SKIP
    >>> from cupy_poolmem.dask import PoolmemPlugin, gather_stats  # doctest: +SKIP
    >>> client = Client(LocalCUDACluster())  # doctest: +SKIP
    >>> client.register_plugin(PoolmemPlugin(pool_size=0.5, maximum_pool_size="90%"))  # doctest: +SKIP
    >>> gather_stats(client)  # doctest: +SKIP
    {'tcp://127.0.0.1:40123': {'kind': 'device', 'used_bytes': 0, ...}}
    """

    name = "cupy-poolmem"
    idempotent = False

    def __init__(
        self,
        pool_size: int | str | float | None = None,
        maximum_pool_size: int | str | float | None = None,
        release_threshold: int | str | float | None = None,
        pinned: bool = True,
        ipc: bool = True,
        gc_freeze: bool = True,
        large_blocks: str = "pool",
    ) -> None:
        self.pool_size = pool_size
        self.maximum_pool_size = maximum_pool_size
        self.release_threshold = release_threshold
        self.pinned = _check_bool(pinned, "pinned")
        self.ipc = _check_bool(ipc, "ipc")
        self.gc_freeze = _check_bool(gc_freeze, "gc_freeze")
        self.large_blocks = large_blocks_mode(large_blocks)
        self._check_placement()
        kinds = {n: _size_kind(getattr(self, n), n) for n in _SIZE_OPTIONS}
        # Consistency checks that need no GPU: both values in the same form.
        for a, b in (("pool_size", "maximum_pool_size"), ("release_threshold", "pool_size")):
            if kinds[a] == kinds[b] != "none":
                self._check_order(a, b, _PROBE_TOTAL)
        self._device_alloc: Any = None
        self._pinned_alloc: Any = None
        self._gc: GcFreeze | None = None
        self.device: int | None = None

    def _check_placement(self) -> None:
        """Refuse the sizes the pool of ``large_blocks`` has no use for."""
        why = {
            "pool_size": "the reservation is a CUDA pool's, made with small_pool=None",
            "maximum_pool_size": "the cap is a CUDA pool's",
            "release_threshold": "the ranges keep freed memory mapped until a trim",
        }
        refused = {"expandable": tuple(why), "mapped": ("pool_size", "maximum_pool_size")}
        for name in refused.get(self.large_blocks, ()):
            value = getattr(self, name)
            if value is not None:
                raise InvalidOptionError(
                    f"{name}={value!r} cannot be used with large_blocks={self.large_blocks!r}: "
                    f"{why[name]}. Leave {name} unset, or use large_blocks='pool'"
                )

    @classmethod
    def from_config(cls) -> PoolmemPlugin:
        """A plugin configured from Dask's ``cupy-poolmem.*`` config keys.

        Examples
        --------
        >>> import dask
        >>> with dask.config.set({"cupy-poolmem.pool-size": "1GB"}):
        ...     plugin = PoolmemPlugin.from_config()
        >>> plugin.pool_size
        '1GB'
        """
        cfg = {
            k: dask.config.get(f"cupy-poolmem.{k}", default=v) for k, v in CONFIG_DEFAULTS.items()
        }
        return cls(
            pool_size=cfg["pool-size"],
            maximum_pool_size=cfg["maximum-pool-size"],
            release_threshold=cfg["release-threshold"],
            pinned=_config_bool(cfg["pinned"], "cupy-poolmem.pinned"),
            ipc=_config_bool(cfg["ipc"], "cupy-poolmem.ipc"),
            gc_freeze=_config_bool(cfg["gc-freeze"], "cupy-poolmem.gc-freeze"),
            large_blocks=cfg["large-blocks"],
        )

    # -- sizes -------------------------------------------------------------------------
    def resolve(self, total: int) -> dict[str, int | None]:
        """The three sizes in bytes for a GPU of ``total`` bytes (``None`` where unset).

        Parameters
        ----------
        total : int
            The GPU's memory in bytes (what percentages and fractions are of).

        Returns
        -------
        dict
            ``pool_size``, ``maximum_pool_size`` and ``release_threshold``: bytes, or
            ``None`` where the plugin was not given one.

        Raises
        ------
        InvalidOptionError
            A size exceeds the GPU, ``pool_size > maximum_pool_size``, or
            ``release_threshold < pool_size``.

        Examples
        --------
        >>> PoolmemPlugin(pool_size="25%", maximum_pool_size="30GB").resolve(80 * 10**9)
        {'pool_size': 20000000000, 'maximum_pool_size': 30000000000, 'release_threshold': None}
        >>> PoolmemPlugin(pool_size="0.5").resolve(80 * 10**9)["pool_size"]  # dask-cuda's form
        40000000000
        """
        out = {n: _parse(getattr(self, n), n, total) for n in _SIZE_OPTIONS}
        for n in ("pool_size", "maximum_pool_size"):
            size = out[n]
            if size is not None and size > total:
                raise InvalidOptionError(
                    f"{n}={getattr(self, n)!r} ({format_bytes(size)}) is more than the GPU "
                    f"has ({format_bytes(total)})"
                )
        if (
            out["maximum_pool_size"] is not None
            and out["pool_size"] is not None
            and out["pool_size"] > out["maximum_pool_size"]
        ):
            self._raise_order("pool_size", "maximum_pool_size", out)
        if (
            out["release_threshold"] is not None
            and out["pool_size"] is not None
            and out["release_threshold"] < out["pool_size"]
        ):
            self._raise_order("release_threshold", "pool_size", out)
        return out

    def _check_order(self, a: str, b: str, total: int) -> None:
        va = _parse(getattr(self, a), a, total)
        vb = _parse(getattr(self, b), b, total)
        assert va is not None and vb is not None  # callers pass options that are set
        if (a, b) == ("pool_size", "maximum_pool_size") and va > vb:
            self._raise_order(a, b, {a: va, b: vb})
        if (a, b) == ("release_threshold", "pool_size") and va < vb:
            self._raise_order(a, b, {a: va, b: vb})

    def _raise_order(self, a: str, b: str, values: dict) -> None:
        if a == "pool_size":
            why = "the pool cannot reserve more than its cap"
            rel = "more than"
        else:
            why = (
                "the reservation would be released at the first synchronisation; leave "
                "release_threshold unset to keep it"
            )
            rel = "less than"
        detail = ""
        if values.get(a, 0) < _PROBE_TOTAL // 2 and values.get(b, 0) < _PROBE_TOTAL // 2:
            detail = f" ({format_bytes(values[a])} vs {format_bytes(values[b])})"
        raise InvalidOptionError(
            f"{a}={getattr(self, a)!r} is {rel} {b}={getattr(self, b)!r}{detail}: {why}"
        )

    # -- worker lifecycle --------------------------------------------------------------
    def setup(self, worker: Any = None) -> None:
        """Create the pools on the worker's GPU and make CuPy allocate from them.

        Dask calls it when the plugin is registered on a worker.

        Parameters
        ----------
        worker : distributed.Worker, optional
            The worker (its address goes into error messages, and pool IPC transfers
            are installed on it where enabled); ``None`` in a plain process.

        Raises
        ------
        NoGPUError
            The worker sees no GPU (the message names ``CUDA_VISIBLE_DEVICES``).

        Examples
        --------
        >>> client.register_plugin(PoolmemPlugin(pool_size="50%"))  # doctest: +SKIP
        >>> PoolmemPlugin().setup()  # in this process  # doctest: +SKIP
        """
        import cupy

        addr = getattr(worker, "address", None)
        where = f"worker {addr}" if addr else f"process {os.getpid()}"
        try:
            require_gpu(f"PoolmemPlugin on {where}")
        except NoGPUError as exc:
            raise NoGPUError(
                f"{exc} (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})"
            ) from None
        dev = cupy.cuda.runtime.getDevice()
        try:
            with cupy.cuda.Device(dev) as d:
                total = int(d.mem_info[1])
                sizes = self.resolve(total)
                # A pre-reserved pool is one CUDA pool: a small-block pool beside it
                # would reserve memory of its own beyond pool_size.
                extra = {"small_pool": None} if sizes["pool_size"] else {}
                self._device_alloc = cupy_poolmem.set_allocator(
                    max_size=sizes["maximum_pool_size"],
                    release_threshold=sizes["release_threshold"],
                    ipc=self.ipc,
                    large_blocks=self.large_blocks,
                    **extra,
                )
                pool = self._device_alloc.pool(dev)
                if sizes["pool_size"]:
                    _prereserve(pool, sizes["pool_size"])
                if self.pinned:
                    self._pinned_alloc = cupy_poolmem.set_pinned_memory_allocator()
                    self._pinned_alloc.pool(dev)
            transfers = False
            if worker is not None:
                transfers = _dask_transfer.install(worker, dev)
        except BaseException:
            self._restore(worker)
            raise
        self.device = dev
        froze = "off"
        if self.gc_freeze:
            self._gc = GcFreeze()
            froze = self._gc.freeze_for(worker)
        logger.info(
            "cupy_poolmem on %s: device %d (%s, CUDA_VISIBLE_DEVICES=%s), pool_size=%s, "
            "maximum_pool_size=%s, release_threshold=%s, pinned=%s, ipc=%s, "
            "same-host IPC transfers=%s, gc freeze: %s",
            where,
            dev,
            _device_name(dev),
            os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
            _fmt(sizes["pool_size"]),
            _fmt(sizes["maximum_pool_size"]),
            _fmt(sizes["release_threshold"]),
            self.pinned,
            self.ipc,
            transfers,
            froze,
        )

    def teardown(self, worker: Any = None) -> None:
        """Close the pools and restore CuPy's default device and pinned allocators.

        Dask calls it when the plugin is removed or the worker closes.

        Parameters
        ----------
        worker : distributed.Worker, optional
            The worker :meth:`setup` was given (its transfers are uninstalled).

        Examples
        --------
        >>> plugin = PoolmemPlugin()  # doctest: +SKIP
        >>> plugin.setup()  # doctest: +SKIP
        >>> plugin.teardown()  # doctest: +SKIP
        """
        self._restore(worker)

    def _restore(self, worker: Any = None) -> None:
        # Loaded late: the allocator module loads the pools (CuPy, cuda.core), which a
        # client that only builds and pickles this plugin must not need.
        from . import _allocator

        if worker is not None:
            _dask_transfer.uninstall(worker)
        if self._gc is not None:
            self._gc.unfreeze()
            self._gc = None

        dev_alloc, pin_alloc = self._device_alloc, self._pinned_alloc
        self._device_alloc = self._pinned_alloc = None
        if dev_alloc is None and pin_alloc is None:
            return
        if dev_alloc is not None:
            _allocator.uninstall("device", dev_alloc)
            dev_alloc.close()
        if pin_alloc is not None:
            _allocator.uninstall("pinned", pin_alloc)
            pin_alloc.close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_device_alloc"] = state["_pinned_alloc"] = state["_gc"] = None
        state["device"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"PoolmemPlugin(pool_size={self.pool_size!r}, "
            f"maximum_pool_size={self.maximum_pool_size!r}, "
            f"release_threshold={self.release_threshold!r}, pinned={self.pinned!r}, "
            f"ipc={self.ipc!r}, gc_freeze={self.gc_freeze!r}, "
            f"large_blocks={self.large_blocks!r})"
        )


def _prereserve(pool: Any, nbytes: int) -> None:
    """Allocate ``nbytes`` once and free it: the pool keeps the memory reserved."""
    import cupy

    try:
        mem = pool.malloc(nbytes)
    except MemoryError as exc:
        raise InvalidOptionError(
            f"pool_size: could not reserve {format_bytes(nbytes)} on device {pool.device_id} "
            f"({exc}); lower pool_size"
        ) from exc
    del mem
    # A pool_size up to the reuse cache's block limit would stay cached for that one
    # size: back in the CUDA pool, every allocation can use it.
    pool.flush_cache()
    cupy.cuda.get_current_stream().synchronize()


def _fmt(n: int | None) -> str:
    return "unset" if n is None else format_bytes(n)


def _device_name(dev: int) -> str:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(dev)["name"].decode()
    except Exception:
        return "?"


# -- preload hooks -----------------------------------------------------------------------
def _log_where_the_worker_logs() -> None:
    """Hand the ``cupy_poolmem`` logger the worker's own log handlers, unless the
    application routed it (or the root logger) already: the package's logger is
    silent by default, and a worker that runs without cupy_poolmem must say why."""
    ours = logging.getLogger("cupy_poolmem")
    if logging.getLogger().handlers or any(
        not isinstance(h, logging.NullHandler) for h in ours.handlers
    ):
        return
    for handler in logging.getLogger("distributed").handlers:
        ours.addHandler(handler)


async def dask_setup(worker: Any) -> None:
    """Preload hook: install :class:`PoolmemPlugin` configured from Dask's config.

    Used by ``dask worker ... --preload cupy_poolmem.dask``, ``dask cuda worker ...
    --preload cupy_poolmem.dask``, ``LocalCUDACluster(preload=["cupy_poolmem.dask"])``,
    and by the configuration-only route (:mod:`cupy_poolmem_dask` in
    ``distributed.nanny.preload`` and ``distributed.worker.preload``).  Options come
    from the ``cupy-poolmem.*`` keys (``DASK_CUPY_POOLMEM__POOL_SIZE=0.5`` and so
    on).  The plugin is added to the worker under the name ``"cupy-poolmem"``, so the
    worker's close tears it down; a worker that has it already is left alone.

    A worker whose plugin cannot be set up (no GPU, a bad option, an insecure
    secret file...) still comes up, without cupy_poolmem, and logs a warning naming
    why.  On a nanny, the hook adds this preload to its worker's preloads
    (:func:`cupy_poolmem_dask.add_worker_preload`); anything else (a scheduler) is
    left alone.  ``cupy-poolmem.enabled: false`` switches it off.

    Parameters
    ----------
    worker : distributed.Worker
        What Dask passes to a preload's ``dask_setup``.

    Examples
    --------
    >>> # DASK_CUPY_POOLMEM__POOL_SIZE=0.5 dask cuda worker tcp://sched:8786 \\
    >>> #     --preload cupy_poolmem.dask
    """
    from distributed import Nanny, Worker

    import cupy_poolmem_dask

    if isinstance(worker, Nanny):
        await cupy_poolmem_dask.dask_setup(worker)
        return
    if not isinstance(worker, Worker):
        logger.info(
            "cupy_poolmem.dask preload ignored on %s (only workers get pools)",
            type(worker).__name__,
        )
        return
    _log_where_the_worker_logs()
    addr = getattr(worker, "address", None) or f"process {os.getpid()}"
    try:
        on = cupy_poolmem_dask.enabled()
    except ValueError as exc:
        logger.warning("cupy_poolmem: worker %s runs without cupy_poolmem: %s", addr, exc)
        return
    if not on:
        logger.info("cupy_poolmem: off on worker %s (cupy-poolmem.enabled is false)", addr)
        return
    if PoolmemPlugin.name in getattr(worker, "plugins", {}):
        return  # preloaded twice (both config keys), or registered by a client already
    try:
        plugin = PoolmemPlugin.from_config()
        await worker.plugin_add(plugin=plugin, name=plugin.name, catch_errors=False)
    except Exception as exc:
        worker.plugins.pop(PoolmemPlugin.name, None)
        logger.warning(
            "cupy_poolmem: worker %s runs without cupy_poolmem: %s: %s. Dask's configuration "
            "preloads cupy_poolmem; fix the cause, or set cupy-poolmem.enabled: false "
            "(DASK_CUPY_POOLMEM__ENABLED=false) to run without it",
            addr,
            type(exc).__name__,
            exc,
        )


async def dask_teardown(worker: Any) -> None:
    """Preload hook: nothing to do (the worker tears its plugins down when it closes).

    Parameters
    ----------
    worker : distributed.Worker
        What Dask passes to a preload's ``dask_teardown``.

    Examples
    --------
    >>> import asyncio
    >>> asyncio.run(dask_teardown(None))  # what Dask awaits when the worker closes
    """


# -- statistics --------------------------------------------------------------------------
def _worker_stats(kind: str) -> dict:
    try:
        pool = cupy_poolmem.get_pool() if kind == "device" else cupy_poolmem.get_pinned_pool()
    except PoolClosedError:
        raise PoolClosedError(
            f"this worker has no cupy_poolmem {kind} pool: register "
            "cupy_poolmem.dask.PoolmemPlugin (client.register_plugin) or preload "
            "cupy_poolmem.dask"
        ) from None
    return pool.stats().to_dict()


def gather_stats(
    client: Any, *, kind: str = "device", workers: list[str] | None = None
) -> dict[str, dict]:
    """Every worker's pool statistics, through ``client.run``.

    Parameters
    ----------
    client : distributed.Client
        A client of the cluster whose workers run :class:`PoolmemPlugin`.
    kind : {"device", "pinned"}
        Which pool: the device pool (:func:`cupy_poolmem.get_pool`) or the pinned
        one (:func:`cupy_poolmem.get_pinned_pool`).
    workers : list of str, optional
        Worker addresses; default all.

    Returns
    -------
    dict
        ``{worker_address: PoolStats.to_dict()}``.

    Raises
    ------
    PoolClosedError
        A worker has no pool (the plugin is not installed there).

    Examples
    --------
    >>> stats = gather_stats(client)  # doctest: +SKIP
    >>> {w: s["n_allocs"] for w, s in stats.items()}  # doctest: +SKIP
    {'tcp://127.0.0.1:40123': 1024}
    """
    if kind not in ("device", "pinned"):
        raise InvalidOptionError(f"kind must be 'device' or 'pinned'; got {kind!r}")
    return client.run(_worker_stats, kind, workers=workers)


def _worker_transfer_counters() -> dict:
    return _dask_transfer.counters()


def transfer_stats(client: Any, *, workers: list[str] | None = None) -> dict[str, dict]:
    """How every worker's CuPy chunks travelled: through pool IPC, or Dask's own path.

    Parameters
    ----------
    client : distributed.Client
        A client of the cluster.
    workers : list of str, optional
        Worker addresses; default all.

    Returns
    -------
    dict
        ``{worker_address: counters}``, counters being ``installed`` and ``ipc``
        (the path is installed / switched on), ``sent_ipc`` and ``sent_ipc_bytes``
        (chunks this worker sent as a descriptor), ``received_view`` (received on
        the same GPU: zero-copy), ``received_copy`` (from another GPU: one device
        copy), ``received_bytes``, ``refetched`` (could not be mapped, came again
        through Dask's serialization), ``refetch_served`` (the sender's side of
        that) and ``fallback``: ``{reason: count}`` of the chunks serialized
        through Dask's own path here (``"peer-without-plugin"`` for the client,
        ``"no-recipient"`` for spilling, ``"other-host"``, ``"small"`` ... see
        ``cupy_poolmem._dask_transfer.REASONS``); also ``timings`` (seconds per
        step), ``warm`` (how each meeting with a same-host peer ended) and
        ``met_peers`` (the workers whose blocks this one mapped at a meeting).

    Examples
    --------
    >>> stats = transfer_stats(client)  # doctest: +SKIP
    >>> sum(s["sent_ipc"] for s in stats.values())  # doctest: +SKIP
    12
    """
    return client.run(_worker_transfer_counters, workers=workers)
