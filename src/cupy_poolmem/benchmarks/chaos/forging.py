"""Forging and peeking at pickled messages."""

from __future__ import annotations

import pickle
import random
import types
from typing import Any


# -- forging and peeking at pickled messages ---------------------------------------------------------
class Call:
    """A pickled call ``func(*args)`` kept as it is (what a message's bytes unpickle to)."""

    def __init__(self, func: Any, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


class _Peeker(pickle.Unpickler):
    """Unpickles a message without running cupy_poolmem's functions in it (its rebuild:
    nothing is claimed or mapped); classes (the descriptor's) are built as usual."""

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        if module.split(".")[0] == "cupy_poolmem" and isinstance(obj, types.FunctionType):
            return lambda *args: Call(obj, args)
        return obj


def peek(data: bytes) -> Call:
    """The rebuild call a message's bytes hold (its descriptor is ``call.args[0]``)."""
    import io

    call = _Peeker(io.BytesIO(data)).load()
    if not isinstance(call, Call):
        raise TypeError(f"not a zero-copy message: unpickles to {type(call).__name__}")
    return call


def repickle(call: Call) -> bytes:
    """The bytes of a message that runs ``call`` when unpickled."""
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(call))


def forge(desc: Any, field: str, rng: random.Random) -> Any:
    """``desc`` (a descriptor, a NamedTuple) with ``field`` forged; None when this version's
    descriptor has no such field."""
    f = getattr(desc, "_fields", ())
    need = {"ticket", "export_id", "size", "offset", "shape", "strides", "dtype", "life"}
    if field == "version":
        need = {"version"}
    if not need <= set(f):
        return None
    if field == "version":
        return desc._replace(version=desc.version + 1)
    size, shape, off = desc.size, desc.shape, desc.offset
    n = shape[0] if shape else 1
    if field == "ticket":
        return desc._replace(ticket=bytes(rng.getrandbits(8) for _ in range(len(desc.ticket))))
    if field == "export_id":
        return desc._replace(export_id=desc.export_id + rng.randint(1, 4))
    if field == "size":
        return desc._replace(size=size * 64)
    if field == "size+shape":
        return desc._replace(size=size * 64, shape=(n * 64,))
    if field == "size+offset":
        return desc._replace(size=size * 64, offset=size * 2)
    if field == "offset":
        return desc._replace(offset=size)
    if field == "offset+shape":
        k = rng.randint(1, max(n - 1, 1))
        return desc._replace(offset=off + 8 * k, shape=(max(n - k, 0),))
    if field == "shape-larger":
        return desc._replace(shape=(n * 2,))
    if field == "shape-smaller":
        return desc._replace(shape=(max(n // 2, 1),))
    if field == "strides-negative":
        return desc._replace(strides=(-8,))
    if field == "strides-reversed":
        return desc._replace(strides=(-8,), offset=off + 8 * (n - 1))
    if field == "strides-huge":
        return desc._replace(strides=(8 * 1024,))
    if field == "dtype-object":
        return desc._replace(dtype="|O")
    if field == "dtype-wider":
        return desc._replace(dtype="<c16")
    if field == "dtype-reinterpret":
        return desc._replace(dtype="<f8")
    if field == "life-newer":
        return desc._replace(life=desc.life + 1)
    if field == "life-older":
        return desc._replace(life=max(desc.life - 1, 0))
    if field == "life-huge":
        return desc._replace(life=2**63)
    raise ValueError(f"unknown forgery {field!r}")
