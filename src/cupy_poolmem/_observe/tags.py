"""Tags: the thread-local tag path every observed allocation carries, and the count of
open :func:`~cupy_poolmem.tag` scopes the recorder reads (with its fork hook)."""

from __future__ import annotations

import contextlib
import os
import threading
from array import array
from typing import Any

from .._errors import OptionTypeError

_current_thread = threading.current_thread


class _TagState(threading.local):
    """Per thread: the tag path, the stack of outer ones, and the thread (for the log)."""

    tag = ""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.thread = _current_thread()


class Tags:
    """The process's tag state: the thread-local tag path (``tls``) and the count of
    ``tag()`` scopes open in all threads (``scopes``, an array the recorder reads: while
    it is 0 the recorder does not read ``tls``), with its fork hook."""

    def __init__(self) -> None:
        self.tls = _TagState()
        self.scopes = array("q", [0])
        self.lock = threading.Lock()

    def after_fork_child(self) -> None:
        """In a forked child only this thread is left: its own open tag scopes count."""
        self.lock = threading.Lock()
        self.scopes[0] = len(self.tls.stack)


TAGS = Tags()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=TAGS.after_fork_child)


class TagScope(contextlib.ContextDecorator):
    """Context manager (and decorator) returned by :func:`~cupy_poolmem.tag`."""

    def __init__(self, name: str) -> None:
        self.name = str(name)  # a plain str: the recorder looks tags up from C

    def _recreate_cm(self) -> TagScope:  # a fresh scope per decorated call
        return TagScope(self.name)

    def __enter__(self) -> str:
        with TAGS.lock:  # counted before the tag is set: the recorder then reads it
            TAGS.scopes[0] += 1
        tls = TAGS.tls
        prev = tls.tag
        tls.stack.append(prev)
        tls.tag = f"{prev}/{self.name}" if prev else self.name
        return tls.tag

    def __exit__(self, *exc: Any) -> None:
        tls = TAGS.tls
        if not tls.stack:
            tls.tag = ""
            return
        tls.tag = tls.stack.pop()
        with TAGS.lock:
            TAGS.scopes[0] -= 1


def tag(name: str) -> TagScope:
    """Label every allocation made in this thread inside the ``with`` block.

    Tags nest: inside ``tag("model")`` and then ``tag("attention")`` allocations carry
    the full path ``"model/attention"``.  Statistics, the log and :func:`~cupy_poolmem.stats.outstanding`
    record that path; ``report --tag-depth 1`` groups by the outer component.  Tags are
    thread-local: a tag set in one thread does not apply to allocations made by other
    threads (a worker thread started inside the block starts untagged).  Allocations made
    through other front ends that use the same pools (the Numba plugin) carry the tag too.

    ``tag`` installs nothing: it only costs a thread-local push and pop.  Tags show up
    wherever allocations are observed (:func:`~cupy_poolmem.statistics`, :func:`~cupy_poolmem.start_log`,
    :func:`~cupy_poolmem.track`).  It can also be used as a function decorator.

    Parameters
    ----------
    name : str
        The label; must be a non-empty string.

    Returns
    -------
    context manager
        Use it in a ``with`` statement, or as a decorator.

    Examples
    --------
    >>> with cupy_poolmem.tag("model"):
    ...     with cupy_poolmem.tag("attention"):
    ...         cupy_poolmem.current_tag()
    'model/attention'
    >>> @cupy_poolmem.tag("loss")
    ... def loss():
    ...     return cupy_poolmem.current_tag()
    >>> loss()
    'loss'
    """
    if not isinstance(name, str) or not name:
        raise OptionTypeError(f"tag name must be a non-empty string; got {name!r}")
    return TagScope(name)


def current_tag() -> str | None:
    """The tag path applied to allocations made now in this thread, or ``None``.

    Returns
    -------
    str or None
        The tags open in this thread, outermost first, joined by ``/``.

    Examples
    --------
    >>> with cupy_poolmem.tag("a"), cupy_poolmem.tag("b"):
    ...     cupy_poolmem.current_tag()
    'a/b'
    >>> cupy_poolmem.current_tag() is None
    True
    """
    return TAGS.tls.tag or None
