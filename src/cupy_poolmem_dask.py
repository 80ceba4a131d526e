"""cupy_poolmem on Dask workers, switched on by Dask's configuration alone.

Name this module in both of distributed's preload keys (in a Dask config file, or
their environment variables)::

    export DASK_DISTRIBUTED__NANNY__PRELOAD='["cupy_poolmem_dask"]'
    export DASK_DISTRIBUTED__WORKER__PRELOAD='["cupy_poolmem_dask"]'

* In a **nanny** (``LocalCUDACluster``, ``dask cuda worker``, ``LocalCluster``), it
  adds the worker preload :mod:`cupy_poolmem.dask` to the preloads the nanny gives
  its worker process.  dask-cuda passes its own worker preload list
  (``dask_cuda.initialize``), which replaces ``distributed.worker.preload``; it
  leaves ``distributed.nanny.preload`` alone.  Every worker process the nanny
  starts, restarted ones included, gets the preload.
* In a **worker** (``dask worker``, whose command line passes an empty nanny preload
  list but reads ``distributed.worker.preload``; ``dask worker --no-nanny``), it
  runs :func:`cupy_poolmem.dask.dask_setup`: the plugin, configured from the
  ``cupy-poolmem.*`` keys.
* Anywhere else (a scheduler, a client) it does nothing.

This module imports neither CuPy nor cupy_poolmem: with ``LocalCUDACluster`` the
nannies live in the client's process, which imports no CUDA library because of it.
``cupy-poolmem.enabled: false`` (``DASK_CUPY_POOLMEM__ENABLED=false``) switches it off
without touching the preload keys.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["ENABLED_KEY", "WORKER_PRELOAD", "add_worker_preload", "dask_setup", "enabled"]

logger = logging.getLogger("cupy_poolmem.dask")

#: The preload a nanny adds for its worker process.
WORKER_PRELOAD = "cupy_poolmem.dask"
#: Preload names that already bring cupy_poolmem to a worker.
_NAMES = ("cupy_poolmem_dask", "cupy_poolmem.dask")
#: The Dask config key that switches the configured route on or off.
ENABLED_KEY = "cupy-poolmem.enabled"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def enabled() -> bool:
    """Dask's ``cupy-poolmem.enabled`` (default true).

    Raises
    ------
    ValueError
        A value that is not a boolean (``"maybe"``).

    Examples
    --------
    >>> import dask
    >>> with dask.config.set({"cupy-poolmem.enabled": "off"}):
    ...     enabled()
    False
    """
    import dask.config

    value = dask.config.get(ENABLED_KEY, default=True)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(
        f"dask config {ENABLED_KEY}={value!r} must be true or false "
        "(DASK_CUPY_POOLMEM__ENABLED=false switches cupy_poolmem off)"
    )


def add_worker_preload(nanny: Any) -> bool:
    """Add ``cupy_poolmem.dask`` to the preloads ``nanny`` gives its worker process.

    Keeps the preloads it has (``dask_cuda.initialize`` first, so the worker's CUDA
    context exists on the right GPU before the pools are made) and their
    arguments; a preload already naming cupy_poolmem is left alone.  True when
    added.

    Examples
    --------
    >>> class Nanny:
    ...     preload, preload_argv = ["dask_cuda.initialize"], ["--create-cuda-context"]
    >>> n = Nanny()
    >>> add_worker_preload(n), n.preload
    (True, ['dask_cuda.initialize', 'cupy_poolmem.dask'])
    >>> add_worker_preload(n)
    False
    """
    pre = nanny.preload
    pre = [pre] if isinstance(pre, str) else list(pre or [])
    if any(p in _NAMES for p in pre):
        return False
    argv = getattr(nanny, "preload_argv", None)
    if argv and isinstance(argv[0], (list, tuple)):  # one argument list per preload
        nanny.preload_argv = [list(a) for a in argv] + [[]]
    nanny.preload = [*pre, WORKER_PRELOAD]
    return True


async def dask_setup(server: Any) -> None:
    """Preload hook: a nanny gives its worker the preload; a worker gets the plugin."""
    from distributed import Nanny, Worker

    if isinstance(server, Nanny):
        if not enabled():
            logger.info("cupy_poolmem: off (%s is false); nanny %s left alone", ENABLED_KEY, server)
            return
        if add_worker_preload(server):
            logger.info(
                "cupy_poolmem: the nanny starts its worker with the preload %s (preloads: %s)",
                WORKER_PRELOAD,
                server.preload,
            )
        return
    if isinstance(server, Worker):
        from cupy_poolmem.dask import dask_setup as worker_setup

        await worker_setup(server)
        return
    logger.info("cupy_poolmem_dask preload ignored on %s (only nannies and workers)", type(server))


async def dask_teardown(server: Any) -> None:
    """Preload hook: nothing to do (the worker tears its plugins down when it closes)."""
