"""The hook through which other parts of the package (the guard's reports) write an
event line to the allocation log: the observer installs the writing callable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class EventLog:
    """Event lines for the allocation log: :meth:`note` hands them to the callable the
    observer installed (it writes them only while a log is open), else drops them."""

    def __init__(self) -> None:
        self.sink: Callable[[Any, str, int, int, int, str, str], None] | None = None

    def note(
        self, core: Any, op: str, ptr: int, size: int, stream_ptr: int, tag: str, callsite: str
    ) -> None:
        """One ``op`` line (``guard:<kind>``) for pool ``core``.  Never raises."""
        sink = self.sink
        if sink is not None:
            sink(core, op, ptr, size, stream_ptr, tag, callsite)


EVENTS = EventLog()
