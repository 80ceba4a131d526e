"""The settings of the IPC path: Dask's ``distributed.comm.cupy-poolmem`` section."""

from __future__ import annotations

from typing import Any

from .._errors import InvalidOptionError, OptionTypeError
from .._sizes import parse_bytes

__all__ = ["CONFIG_DEFAULTS", "CONFIG_KEY", "TransferConfig"]

#: The Dask config section of this path.
CONFIG_KEY = "distributed.comm.cupy-poolmem"
#: Its defaults (merged into Dask's config by :mod:`cupy_poolmem.dask`).
CONFIG_DEFAULTS: dict[str, Any] = {
    "ipc": True,
    "min-bytes": "1MiB",
    "refetch-timeout": "120s",
    "secret": None,
    "warm": True,
    "counters-dir": None,
}


class TransferConfig:
    """The settings of the IPC path, read from Dask's ``distributed.comm.cupy-poolmem``.

    Parameters
    ----------
    ipc : bool
        Move same-host chunks through pool IPC (default ``True``).
    min_bytes : int or str
        Smaller chunks take Dask's own path (default ``"1MiB"``).
    refetch_timeout : float or str
        Seconds a receiver waits for a chunk it could not map to come again by
        Dask's own serialization (default ``"120s"``).
    secret : str, optional
        ``"auto"`` or the path of a 0600 file: the sharing sockets authenticate
        with a key derived from this per-host secret instead of the multiprocessing
        authkey, so workers started by separate commands of one user share the path
        (see ``cupy_poolmem._dask_transfer._secret``).  ``None`` (default): only workers of one process
        family (one ``LocalCUDACluster``, one ``dask cuda worker`` command) do.
    warm : bool
        When the worker starts, meet the same-host workers already running: connect
        to their sharing sockets and import their pools, both ways, so the first
        chunks pay no such cost (default ``True``).
    counters_dir : str, optional
        A directory where the worker writes its transfer counters
        (``counters-<pid>.json``) when the path is uninstalled (the worker closes):
        how a benchmark that starts its own cluster reads them afterwards.

    Examples
    --------
    >>> TransferConfig(ipc=True, min_bytes="4MiB").min_bytes
    4194304
    """

    def __init__(
        self,
        ipc: bool = True,
        min_bytes: int | str = "1MiB",
        refetch_timeout: Any = 120.0,
        secret: str | None = None,
        warm: bool = True,
        counters_dir: str | None = None,
    ) -> None:
        self.ipc = _as_bool(ipc, f"{CONFIG_KEY}.ipc")
        self.min_bytes = parse_bytes(min_bytes, name=f"{CONFIG_KEY}.min-bytes")
        self.refetch_timeout = _as_seconds(refetch_timeout, f"{CONFIG_KEY}.refetch-timeout")
        if secret in (False, "", "null", "none", "None"):
            secret = None
        if secret is not None and not isinstance(secret, str):
            raise OptionTypeError(
                f"{CONFIG_KEY}.secret={secret!r} must be 'auto', a file path, or null"
            )
        self.secret = secret
        self.warm = _as_bool(warm, f"{CONFIG_KEY}.warm")
        if counters_dir is not None and not isinstance(counters_dir, str):
            raise OptionTypeError(f"{CONFIG_KEY}.counters-dir={counters_dir!r} must be a path")
        self.counters_dir = counters_dir or None

    @classmethod
    def from_dask_config(cls) -> TransferConfig:
        """The settings in Dask's config (``DASK_DISTRIBUTED__COMM__CUPY_POOLMEM__IPC=0``...).

        Examples
        --------
        >>> import dask
        >>> with dask.config.set({"distributed.comm.cupy-poolmem.ipc": False}):
        ...     TransferConfig.from_dask_config().ipc
        False
        """
        import dask.config

        cfg = dask.config.get(CONFIG_KEY, default={}) or {}
        if not isinstance(cfg, dict):
            raise OptionTypeError(f"dask config {CONFIG_KEY}={cfg!r} must be a mapping")
        # Dask treats "_" and "-" in keys alike (an environment variable gives
        # ``min_bytes``, beside the default's ``min-bytes``): so do we, and a value
        # set either way wins over the default.
        spelled: dict[str, Any] = {}
        for k, v in cfg.items():
            name = str(k).replace("_", "-")
            if name not in spelled or spelled[name] == CONFIG_DEFAULTS.get(name):
                spelled[name] = v
        cfg = spelled
        unknown = set(cfg) - set(CONFIG_DEFAULTS)
        if unknown:
            raise InvalidOptionError(
                f"unknown dask config key(s) {sorted(unknown)} under {CONFIG_KEY}; "
                f"known: {sorted(CONFIG_DEFAULTS)}"
            )
        merged = {**CONFIG_DEFAULTS, **cfg}
        return cls(
            ipc=merged["ipc"],
            min_bytes=merged["min-bytes"],
            refetch_timeout=merged["refetch-timeout"],
            secret=merged["secret"],
            warm=merged["warm"],
            counters_dir=merged["counters-dir"],
        )

    def __repr__(self) -> str:
        return (
            f"TransferConfig(ipc={self.ipc!r}, min_bytes={self.min_bytes!r}, "
            f"refetch_timeout={self.refetch_timeout!r}, secret={self.secret!r}, "
            f"warm={self.warm!r}, counters_dir={self.counters_dir!r})"
        )


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("true", "1", "yes", "on"):
            return True
        if v in ("false", "0", "no", "off"):
            return False
    raise OptionTypeError(f"{key}={value!r} must be true or false")


def _as_seconds(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise OptionTypeError(f"{key}={value!r}; give seconds (30, '2 minutes')")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        from dask.utils import parse_timedelta

        try:
            seconds = float(parse_timedelta(value, default="seconds"))
        except Exception:
            raise InvalidOptionError(f"{key}={value!r}; give seconds (30, '2 minutes')") from None
    else:
        raise OptionTypeError(f"{key}={value!r}; give seconds (30, '2 minutes')")
    if not seconds > 0:
        raise InvalidOptionError(f"{key}={value!r}; give a number of seconds > 0")
    return seconds
