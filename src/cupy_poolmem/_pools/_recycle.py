"""CUDA pools of a drained pool, closed together or parked for the next pool of its kind."""

from __future__ import annotations

import contextlib
from typing import Any

from .. import _retire
from .._errors import check_driver
from . import _driver


def park(resource: Any) -> None:
    """A drained pool's CUDA pools, parked for the next pool of their kind: they keep
    no memory (release threshold 0, so what their pending frees give back goes to the
    device at the next synchronising call; a trim now for what is free already)."""
    for mr in Resources.members(resource):
        _driver.set_attr(mr, _driver.A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 0)
        check_driver(_driver.drv().cuMemPoolTrimTo(_driver.pool_handle(mr), 0), "cuMemPoolTrimTo")


def recycled_mrs(key: Any) -> list[Any]:
    """The CUDA pools a drained pool of ``key`` left parked, or [] (create new ones)."""
    res = _retire.retirer().take_recycled(key)
    return [] if res is None else list(Resources.members(res))


class Revoke:
    """Revoke every peer grant of the CUDA pools ``mrs`` (a pool about to be destroyed)."""

    def __init__(self, mrs: tuple[Any, ...]) -> None:
        self.mrs = mrs

    def __call__(self) -> None:
        for mr in self.mrs:
            with contextlib.suppress(Exception):
                mr.peer_accessible_by = ()


class Resources:
    """The retirer's resource for a pool made of several CUDA pools: closed together."""

    def __init__(self, mrs: tuple[Any, ...]) -> None:
        self.mrs = mrs

    @staticmethod
    def owner(mrs: Any, backend: Any = None, device: int = 0) -> Any:
        """What the retirer holds for the CUDA pools ``mrs`` and the ``backend``: the
        one, or all together (None: nothing)."""
        if not mrs:
            return backend
        if backend is None and len(mrs) == 1:
            return mrs[0]
        if backend is None:
            return Resources(tuple(mrs))
        return WithBackend(tuple(mrs), backend, device)

    @staticmethod
    def members(resource: Any) -> tuple[Any, ...]:
        """The CUDA pools of a resource :meth:`owner` made."""
        return resource.mrs if isinstance(resource, Resources) else (resource,)

    def close(self) -> None:
        errors = []
        for mr in self.mrs:
            try:
                mr.close()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


class WithBackend(Resources):
    """CUDA pools and a backend for the large blocks: closed together, the backend
    first; a leftover block goes back to whichever holds it."""

    def __init__(self, mrs: tuple[Any, ...], backend: Any, device: int) -> None:
        super().__init__(mrs)
        self.backend = backend
        self.device = device

    def close(self) -> None:
        try:
            self.backend.close()
        finally:
            super().close()

    def free_leftover(self, ptr: int) -> None:
        if self.backend.owns(ptr):
            self.backend.free_leftover(ptr)
        else:
            _retire.free_on_legacy_stream(ptr, self.device)
