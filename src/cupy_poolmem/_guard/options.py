"""Guard options: :class:`GuardOptions`, read from arguments or ``CUPY_POOLMEM_GUARD``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .._errors import InvalidOptionError, OptionTypeError
from .._sizes import parse_bytes

#: The environment variable read by pools created with ``guard=None`` (the default).
ENV = "CUPY_POOLMEM_GUARD"

_MODES = ("raise", "warn")
_CROSS = ("raise", "warn", "off")
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")

_MAX_RED_ZONE = 1 << 20


# ----------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GuardOptions:
    """What the guard checks, and whether it raises or warns.

    Parameters
    ----------
    mode : {"raise", "warn"}
        ``"raise"`` (default): a bug raises its :class:`~cupy_poolmem.GuardError`
        subclass; found during a free (a destructor, where nothing can be raised) it
        is raised by the next allocation from the pool, :meth:`Guard.verify` or
        :func:`~cupy_poolmem.check`.  ``"warn"``: a
        :class:`~cupy_poolmem.GuardWarning` at once, and the program goes on.  Both
        count every report (:meth:`Guard.stats`) and keep it in ``pool.guard.events``.
    red_zone : int
        Bytes after each block filled with ``canary`` and checked when it is freed;
        writes further past the end than this are not seen.  ``0`` turns the check
        off.  Default 256 (32 ``float64`` elements).
    quarantine_bytes : int or str
        Most bytes of freed blocks held back (poisoned) before they are really freed;
        the oldest leave first.  Default ``"256MiB"``; ``0`` frees at once (after the
        check).
    quarantine_blocks : int
        Most blocks held back.  Default 1024.
    cross_stream : {"warn", "raise", "off"}
        What to do when a block is dropped while a stream other than its allocation
        stream is current and that stream was not given to
        :func:`~cupy_poolmem.record_stream`.  A heuristic (the guard cannot see which
        streams used an array), so it warns by default.
    poison : int
        Byte written over freed blocks (default ``0xFD``: ``float32``/``float64``
        values near ``-4e37``/``-1e295``, ``int32`` ``-33686019``).
    canary : int
        Byte written into red zones (default ``0xFA``).
    history : int
        Freed blocks remembered for reports (double frees, stale pointers).
        Default 16384.

    Examples
    --------
    >>> GuardOptions(mode="warn", red_zone=1024).quarantine_bytes
    268435456
    >>> GuardOptions.from_env("warn,quarantine_bytes=1GiB,cross_stream=off").cross_stream
    'off'
    >>> GuardOptions.from_env("0") is None
    True
    """

    mode: str = "raise"
    red_zone: int = 256
    quarantine_bytes: int | str = "256MiB"
    quarantine_blocks: int = 1024
    cross_stream: str = "warn"
    poison: int = 0xFD
    canary: int = 0xFA
    history: int = 16384

    def __post_init__(self) -> None:
        _choice(self.mode, "mode", _MODES)
        _choice(self.cross_stream, "cross_stream", _CROSS)
        _int(self.red_zone, "red_zone", 0, _MAX_RED_ZONE)
        _int(self.quarantine_blocks, "quarantine_blocks", 0, None)
        _int(self.poison, "poison", 0, 255)
        _int(self.canary, "canary", 0, 255)
        _int(self.history, "history", 0, None)
        q = parse_bytes(self.quarantine_bytes, name="quarantine_bytes")
        object.__setattr__(self, "quarantine_bytes", q)

    @classmethod
    def from_env(cls, value: str | None = None, *, name: str = ENV) -> GuardOptions | None:
        """Options from a ``CUPY_POOLMEM_GUARD``-style string (``None``: the variable).

        Parameters
        ----------
        value : str, optional
            Comma-separated: a switch (``1``/``on``/``true``/``yes``/``raise``,
            ``warn``, or ``0``/``off``/``false``/``no`` alone), then ``field=value``
            pairs for any field of this class, in any order.  Not given: the
            environment variable ``name``.
        name : str, default "CUPY_POOLMEM_GUARD"
            The variable read when ``value`` is not given, and named in errors.

        Returns
        -------
        GuardOptions or None
            ``None`` (no guard) when the text is empty or off.

        Raises
        ------
        InvalidOptionError
            For an unknown switch or field, or a value that does not parse.

        Examples
        --------
        >>> GuardOptions.from_env("1").mode
        'raise'
        >>> GuardOptions.from_env("red_zone=64").red_zone
        64
        """
        if value is None:
            value = os.environ.get(name, "")
        text = value.strip()
        if text.lower() in _OFF:
            return None
        kw: dict[str, Any] = {}
        valid = [f.name for f in fields(cls)]
        for raw in text.split(","):
            tok = raw.strip()
            if not tok:
                continue
            low = tok.lower()
            if "=" not in tok:
                if low in _ON or low == "raise":
                    kw.setdefault("mode", "raise")
                elif low == "warn":
                    kw["mode"] = "warn"
                else:
                    raise InvalidOptionError(
                        f"{name}={value!r}: {tok!r} is not a switch; use 1 (raise), warn or 0, "
                        f"then field=value pairs among {', '.join(valid)} "
                        f"(for example {name}=warn,quarantine_bytes=1GiB)"
                    )
                continue
            key, _, val = (s.strip() for s in tok.partition("="))
            if key not in valid:
                raise InvalidOptionError(
                    f"{name}={value!r}: unknown field {key!r}; valid fields: {', '.join(valid)}"
                )
            if key in ("mode", "cross_stream", "quarantine_bytes"):
                kw[key] = val
            else:
                try:
                    kw[key] = int(val, 0)
                except ValueError:
                    raise InvalidOptionError(
                        f"{name}={value!r}: {key} must be an integer (decimal or 0x..); got {val!r}"
                    ) from None
        return cls(**kw)


def _choice(value: Any, name: str, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise OptionTypeError(
            f"guard option {name} must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )
    if value not in allowed:
        raise InvalidOptionError(
            f"guard option {name}={value!r} is not one of {', '.join(map(repr, allowed))}"
        )


def _int(value: Any, name: str, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"guard option {name} must be an int; got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidOptionError(f"guard option {name}={value} must be {rng}")


def resolve(guard: Any) -> GuardOptions | None:
    """The options a pool's ``guard=`` argument asks for; ``None``: no guard.

    ``None`` (the default) reads ``CUPY_POOLMEM_GUARD``; ``False``/``True``; a mode
    string (``"raise"``, ``"warn"``, or a ``CUPY_POOLMEM_GUARD``-style string); a
    mapping of :class:`GuardOptions` fields; or a :class:`GuardOptions`.
    """
    if guard is None:
        return GuardOptions.from_env()
    if guard is False:
        return None
    if guard is True:
        return GuardOptions()
    if isinstance(guard, GuardOptions):
        return guard
    if isinstance(guard, str):
        return GuardOptions.from_env(guard, name="guard")
    if isinstance(guard, Mapping):
        valid = {f.name for f in fields(GuardOptions)}
        bad = sorted(set(guard) - valid)
        if bad:
            raise InvalidOptionError(
                f"guard={dict(guard)!r}: unknown field(s) {', '.join(map(str, bad))}; "
                f"valid fields: {', '.join(sorted(valid))}"
            )
        return GuardOptions(**guard)
    raise OptionTypeError(
        f"guard must be True, False, None (read {ENV}), 'raise', 'warn', a dict of "
        f"GuardOptions fields or a GuardOptions; got {guard!r} of type {type(guard).__name__}"
    )
