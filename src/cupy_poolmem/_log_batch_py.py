"""Pure-Python twin of ``_log_batch.pyx``: log records in batches and their CSV lines."""

from __future__ import annotations

LOG_BATCH = 4096  # log records per batch handed to the writer


class Batch:
    """Log records, in order: (time_ns, ptr, size, stream, used, reserved, device, op,
    thread, tag, callsite); ``format`` makes their CSV lines."""

    __slots__ = ("recs",)

    def __init__(self) -> None:
        self.recs: list[tuple] = []

    def __len__(self) -> int:
        return len(self.recs)

    def rows(self) -> list[tuple]:
        """The records (for tests)."""
        return list(self.recs)

    def format(self, pid: int) -> bytes:
        """The CSV lines of the records (``stats.LOG_COLUMNS``), UTF-8."""
        out = []
        for ns, ptr, size, stream, used, reserved, dev, op, thread, tag, site in self.recs:
            out.append(
                f"{ns // 1_000_000_000}.{ns // 1000 % 1_000_000:06d},{pid},{_csv(thread)},{dev},{stream},{_csv(op)},0x{ptr:x},{size},"
                f"{_csv(tag)},{_csv(site)},{'' if used < 0 else used},"
                f"{'' if reserved < 0 else reserved}\n"
            )
        return "".join(out).encode("utf-8", "backslashreplace")


def _csv(s: str | None) -> str:
    """A CSV field as ``csv.writer`` quotes it (QUOTE_MINIMAL, '\\n' lines)."""
    if not s:
        return ""
    if "," in s or '"' in s or "\n" in s or "\r" in s:
        return '"' + s.replace('"', '""') + '"'
    return s
