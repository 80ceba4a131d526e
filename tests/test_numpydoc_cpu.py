"""Every public name's docstring passes numpydoc's validation.

The public names are the ``__all__`` of the package and of its public modules.  Checks
left out, and why:

- ``SA01`` (a "See Also" section): the API page groups related names already; a See
  Also on every name would repeat it.
- ``ES01`` (an extended summary): a one-line summary is enough for a small function;
  where more is needed the docstring says it.

The public methods and properties of the public classes are validated too: those a
class defines itself (not the ones it inherits from a base outside the package, such as
``Exception`` or a Dask plugin base, nor the hot-path core's).  Fields of a record
are documented by the record's "Attributes" section, not one by one.

A record (a dataclass or named tuple the package returns) documents its fields once,
under "Attributes", which are also its constructor's parameters: ``PR01`` (parameters
not documented) passes when every parameter it names is documented there.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

numpydoc_validate = pytest.importorskip("numpydoc.validate", reason="needs numpydoc ('.[docs]')")

IGNORED = {"SA01", "ES01"}
MODULES = [
    "cupy_poolmem",
    "cupy_poolmem.stats",
    "cupy_poolmem.report",
    "cupy_poolmem.managed",
    "cupy_poolmem.numba",
    "cupy_poolmem.dask",
]


def public_objects() -> dict[str, str]:
    """``{import path of the object: public name}`` for every documented callable."""
    out: dict[str, str] = {}
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # cupy_poolmem.dask / .numba without their extra
            continue
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.ismodule(obj):
                continue  # its own names are listed through MODULES
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                obj = type(obj)  # an instance (``cupy_poolmem.sharing``): its class
                if obj.__module__ == "builtins":
                    continue  # a constant (``__version__``, ``LOG_COLUMNS``)
            out.setdefault(f"{obj.__module__}.{obj.__qualname__}", f"{mod_name}.{name}")
    return out


def _member_kind(value: object) -> str | None:
    """``"method"``/``"property"`` for a member worth validating, else None."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property) or type(value).__name__ == "cached_property":
        return "property"
    if inspect.isfunction(value):
        return "method"
    return None  # a field, a constant, a named tuple's item getter


def public_members() -> dict[str, str]:
    """``{import path: public name}`` for the methods and properties of public classes."""
    out: dict[str, str] = {}
    for path, public in public_objects().items():
        mod_name, _, qualname = path.rpartition(".")
        cls = getattr(importlib.import_module(mod_name), qualname)
        if not inspect.isclass(cls):
            continue
        for name, value in vars(cls).items():
            if name.startswith("_") or _member_kind(value) is None:
                continue
            out.setdefault(f"{path}.{name}", f"{public}.{name}")
    return out


def test_the_public_names_are_found():
    objs = public_objects()
    assert "cupy_poolmem._pools.device.DevicePool" in objs
    assert "cupy_poolmem._sharing._settings.SharingSettings" in objs
    assert len(objs) > 60
    members = public_members()
    for path in (
        "cupy_poolmem._pools._base.Pool.trim",  # a method
        "cupy_poolmem._pools._base.Pool.max_size",  # a property
        "cupy_poolmem._guard.GuardOptions.from_env",  # a classmethod
        "cupy_poolmem._sharing._settings.SharingSettings.fallback",
    ):
        assert path in members
    assert not any(p.rpartition(".")[2].startswith("_") for p in members)
    assert "cupy_poolmem.report.Summary.n_events" not in members  # a field: "Attributes"
    assert not any(p.endswith(".with_traceback") for p in members)  # Exception's


def _attributes(path: str) -> set[str]:
    """The names documented in the "Attributes" section of a class's docstring."""
    from numpydoc.docscrape import ClassDoc

    mod_name, _, qualname = path.rpartition(".")
    obj = getattr(importlib.import_module(mod_name), qualname, None)
    if not inspect.isclass(obj):
        return set()
    doc = ClassDoc(obj, config={"show_class_members": False})
    return {name.strip() for item in doc["Attributes"] for name in item.name.split(",")}


def _documented_as_attributes(path: str, code: str, msg: str) -> bool:
    if code != "PR01":
        return False
    missing = set(re.findall(r"'([^']+)'", msg))
    return bool(missing) and missing <= _attributes(path)


@pytest.mark.parametrize("path", sorted(public_objects()) + sorted(public_members()))
def test_numpydoc_validation(path):
    result = numpydoc_validate.validate(path)
    errors = [
        f"{code}: {msg}"
        for code, msg in result["errors"]
        if code not in IGNORED and not _documented_as_attributes(path, code, msg)
    ]
    assert not errors, f"{path} ({result['file']}:{result['file_line']}):\n" + "\n".join(errors)
