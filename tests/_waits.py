"""Waiting helpers shared by the multi-process GPU tests."""

from __future__ import annotations

import time

import pytest


def join(*procs, timeout: float = 120.0) -> None:
    """Join every child; kill and fail the test for one that does not finish in time."""
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
            pytest.fail(f"child {p.name} did not finish")


def wait_for(pred, timeout: float = 20.0) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()
