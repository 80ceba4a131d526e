"""Every public name's docstring passes numpydoc's validation.

The public names are the ``__all__`` of the package and of its public modules.  Checks
left out, and why:

- ``SA01`` (a "See Also" section): the API page groups related names already; a See
  Also on every name would repeat it.
- ``ES01`` (an extended summary): a one-line summary is enough for a small function;
  where more is needed the docstring says it.

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


def test_the_public_names_are_found():
    objs = public_objects()
    assert "cupy_poolmem._pools.DevicePool" in objs
    assert "cupy_poolmem._sharing._settings.SharingSettings" in objs
    assert len(objs) > 60


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


@pytest.mark.parametrize("path", sorted(public_objects()))
def test_numpydoc_validation(path):
    result = numpydoc_validate.validate(path)
    errors = [
        f"{code}: {msg}"
        for code, msg in result["errors"]
        if code not in IGNORED and not _documented_as_attributes(path, code, msg)
    ]
    assert not errors, f"{path} ({result['file']}:{result['file_line']}):\n" + "\n".join(errors)
