"""Paired ratios: the cost of one thing over another's, robust to a CPU whose speed jumps.

The two sides timed in short bursts back to back (ABBA), the median of the per-pair
ratios; why and how: docs/cli.rst, "Paired ratios".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._errors import InvalidOptionError

#: ``burst(n)``: make ``n`` calls, return the seconds per call they took.
Burst = Callable[[int], float]


@dataclass(frozen=True)
class PairedRatio:
    """Median of per-pair ratios, with the low and high quartiles, over ``pairs`` pairs.

    Examples
    --------
    >>> r = PairedRatio.of([0.95, 0.97, 0.99, 0.96, 0.98])
    >>> r.median, r.pairs
    (0.97, 5)
    >>> print(r)
    0.97x (IQR 0.96-0.98, 5 pairs)
    """

    median: float
    low: float
    high: float
    pairs: int

    @classmethod
    def of(cls, ratios: Sequence[float]) -> PairedRatio:
        """Median and quartiles of ``ratios`` (quartiles interpolated between the values,
        as ``statistics.quantiles(method="inclusive")``: ``[1, 2, 3, 4]`` gives 1.75 and
        3.25).  One ratio is its own median and quartiles; none raises
        :class:`~cupy_poolmem.InvalidOptionError` (a ``ValueError``).

        Examples
        --------
        >>> PairedRatio.of([1.0, 2.0, 3.0, 4.0])
        PairedRatio(median=2.5, low=1.75, high=3.25, pairs=4)
        """
        if not ratios:
            raise InvalidOptionError("no ratios: a paired ratio needs one pair at least")
        if len(ratios) == 1:
            return cls(ratios[0], ratios[0], ratios[0], 1)
        low, _mid, high = statistics.quantiles(ratios, n=4, method="inclusive")
        return cls(statistics.median(ratios), low, high, len(ratios))

    def __str__(self) -> str:
        return self.format()

    def format(self, label: str = "") -> str:
        """``0.97x (IQR 0.95-0.99, 25 pairs)``; ``label`` goes first inside the brackets.

        Examples
        --------
        >>> PairedRatio(0.97, 0.95, 0.99, 25).format("paired median, ")
        '0.97x (paired median, IQR 0.95-0.99, 25 pairs)'
        """
        return f"{self.median:.2f}x ({label}IQR {self.low:.2f}-{self.high:.2f}, {self.pairs} pairs)"


def timed_burst(fn: Callable[[], object], timer: Callable[[], float] = time.perf_counter) -> Burst:
    """A burst of ``fn``: ``burst(n)`` calls it ``n`` times and returns seconds per call.

    Examples
    --------
    >>> clock = [0.0]
    >>> def work():
    ...     clock[0] += 2e-6
    >>> burst = timed_burst(work, timer=lambda: clock[0])
    >>> round(burst(100) * 1e6, 6)
    2.0
    """

    def burst(n: int) -> float:
        t0 = timer()
        for _ in range(n):
            fn()
        return (timer() - t0) / n

    return burst


def paired_ratio(
    a: Burst, b: Burst, *, pairs: int, calls: int, warmup: int | None = None
) -> PairedRatio:
    """Median over ``pairs`` pairs of ``b``'s seconds per call over ``a``'s.

    One untimed warm-up burst of each first (``warmup`` calls, default ``calls``), then
    pair ``k`` runs ``a(calls)`` then ``b(calls)`` when ``k`` is even, ``b`` then ``a``
    when odd (ABBA), and its ratio is ``b / a``.

    Examples
    --------
    A ``b`` that takes 0.9 of ``a``'s time, on a fake clock whose speed halves after
    the first pairs (both bursts of most pairs see the same speed):

    >>> clock = [0.0]
    >>> def cost(seconds):
    ...     def call():  # twice as slow after the first millisecond
    ...         clock[0] += seconds * (1.0 if clock[0] < 1e-3 else 2.0)
    ...     return timed_burst(call, timer=lambda: clock[0])
    >>> r = paired_ratio(cost(2e-6), cost(1.8e-6), pairs=9, calls=100)
    >>> print(r)
    0.90x (IQR 0.90-0.90, 9 pairs)
    """
    if pairs < 1 or calls < 1:
        raise InvalidOptionError(f"pairs and calls must be at least 1 (got {pairs} and {calls})")
    warmup = calls if warmup is None else warmup
    if warmup > 0:
        a(warmup)
        b(warmup)
    ratios = []
    for k in range(pairs):
        if k % 2 == 0:
            ta = a(calls)
            tb = b(calls)
        else:
            tb = b(calls)
            ta = a(calls)
        ratios.append(tb / ta)
    return PairedRatio.of(ratios)
