"""Measure the package's layout from its own source: files and lines, the import graph
(imports inside functions count), its circles and floors, the package's own imports made
inside functions, and the tests' ``monkeypatch.setattr`` calls on private names.

Usage::

    python tools/layout.py            # a summary
    python tools/layout.py --verbose  # every circle, floor and late import
    python tools/layout.py --json     # the figures, for a test or a note

Imports under ``if TYPE_CHECKING:`` are not edges (they never run).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
PKG = "cupy_poolmem"
MAX_LINES = 800


def modules(src: str = SRC) -> dict[str, str]:
    """Module name -> path for every .py and .pyx of the package (.pxd left out)."""
    out: dict[str, str] = {}
    base = os.path.join(src, PKG)
    for dirpath, _dirs, files in os.walk(base):
        for f in sorted(files):
            if not f.endswith((".py", ".pyx")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            name = rel.rsplit(".", 1)[0].replace(os.sep, ".")
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            key = name + (".pyx" if f.endswith(".pyx") else "")
            out[key] = os.path.join(dirpath, f)
    return out


def _is_package(mod: str, mods: dict[str, str]) -> bool:
    return mods.get(mod, "").endswith("__init__.py")


def _resolve(current: str, level: int, target: str | None, mods: dict[str, str]) -> str:
    pkg = current if _is_package(current, mods) else current.rsplit(".", 1)[0]
    for _ in range(level - 1):
        pkg = pkg.rsplit(".", 1)[0]
    if level == 0:
        return target or ""
    return f"{pkg}.{target}" if target else pkg


def _known(name: str, mods: dict[str, str]) -> str | None:
    """The package module *name* names (a module, or the module defining it)."""
    while name:
        if name in mods:
            return name
        if name + ".pyx" in mods:
            return name + ".pyx"
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return None


class _Visitor(ast.NodeVisitor):
    def __init__(self, current: str, mods: dict[str, str], lines: list[str]) -> None:
        self.current = current
        self.mods = mods
        self.lines = lines
        self.depth = 0
        self.type_checking = 0
        self.found: list[tuple[str, int, bool, bool]] = []  # target, line, late, commented

    def _commented(self, lineno: int) -> bool:
        here = self.lines[lineno - 1]
        above = self.lines[lineno - 2] if lineno >= 2 else ""
        return "#" in here or above.strip().startswith("#")

    def _add(self, target: str | None, node: ast.stmt | ast.expr) -> None:
        if target is None or self.type_checking or target == self.current:
            return
        late = self.depth > 0
        self.found.append((target, node.lineno, late, self._commented(node.lineno)))

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        tc = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        if tc:
            self.type_checking += 1
            for n in node.body:
                self.visit(n)
            self.type_checking -= 1
            for n in node.orelse:
                self.visit(n)
        else:
            self.generic_visit(node)

    def _func(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = _func
    visit_AsyncFunctionDef = _func
    visit_Lambda = _func

    def visit_Call(self, node: ast.Call) -> None:
        """``importlib.import_module(...)`` of the package's own modules counts as an import
        (one whose name is not a literal counts as a late import of the package itself)."""
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                text = arg.value
                if text.startswith("."):
                    level = len(text) - len(text.lstrip("."))
                    text = _resolve(self.current, level, text.lstrip(".") or None, self.mods)
                if text.split(".")[0] == PKG:
                    self._add(_known(text, self.mods), node)
            elif self.depth:
                self._add(PKG, node)
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] == PKG:
                self._add(_known(a.name, self.mods), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(self.current, node.level, node.module, self.mods)
        if base.split(".")[0] != PKG:
            return
        for a in node.names:
            sub = _known(f"{base}.{a.name}", self.mods)
            target = sub if sub and sub != _known(base, self.mods) else _known(base, self.mods)
            self._add(target, node)


_PYX_IMPORT = re.compile(r"^(\s*)(?:from\s+(\.*)(\S*)\s+c?import\s+(.+)|c?import\s+(\S+))")


def _pyx_imports(
    current: str, path: str, mods: dict[str, str]
) -> list[tuple[str, int, bool, bool]]:
    found = []
    lines = open(path, encoding="utf-8").read().splitlines()
    for i, line in enumerate(lines, 1):
        m = _PYX_IMPORT.match(line)
        if not m:
            continue
        indent, dots, mod, names, plain = m.groups()
        late = bool(indent)
        commented = "#" in line or (i >= 2 and lines[i - 2].strip().startswith("#"))
        if plain:
            if plain.split(".")[0] == PKG and (t := _known(plain, mods)):
                found.append((t, i, late, commented))
            continue
        base = _resolve(current.removesuffix(".pyx"), len(dots), mod or None, mods)
        if base.split(".")[0] != PKG:
            continue
        for n in names.replace("(", "").replace(")", "").split(","):
            n = n.strip().split(" as ")[0]
            if not n:
                continue
            sub = _known(f"{base}.{n}", mods)
            t = sub if sub and sub != _known(base, mods) else _known(base, mods)
            if t and t != current:
                found.append((t, i, late, commented))
    return found


def graph(mods: dict[str, str]) -> dict[str, list[tuple[str, int, bool, bool]]]:
    g: dict[str, list[tuple[str, int, bool, bool]]] = {}
    for name, path in mods.items():
        if path.endswith(".pyx"):
            g[name] = _pyx_imports(name, path, mods)
            continue
        text = open(path, encoding="utf-8").read()
        v = _Visitor(name, mods, text.splitlines())
        v.visit(ast.parse(text))
        g[name] = v.found
    return g


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def floors(edges: dict[str, set[str]], comps: list[list[str]]) -> dict[str, int]:
    """Floor of each module: 0 for one importing nothing of the package, else one above
    the highest module it imports (a circle counts as one room)."""
    rep = {m: c[0] for c in comps for m in c}
    cond: dict[str, set[str]] = {}
    for v, ws in edges.items():
        rv = rep.get(v, v)
        cond.setdefault(rv, set())
        for w in ws:
            rw = rep.get(w, w)
            if rw != rv:
                cond[rv].add(rw)
    memo: dict[str, int] = {}

    def floor(v: str) -> int:
        if v not in memo:
            memo[v] = 0
            memo[v] = 1 + max((floor(w) for w in cond.get(v, ())), default=-1)
        return memo[v]

    return {v: floor(rep.get(v, v)) for v in edges}


def private_patches(tests: str) -> tuple[int, int, list[str]]:
    """(all ``monkeypatch.setattr`` calls, those on private names, where the private ones
    are); ``mp`` is counted as another name of the ``monkeypatch`` fixture.  Calls are
    found in the syntax tree, so a call written inside a string is not one."""
    total = 0
    where: list[str] = []
    files = sorted(
        os.path.relpath(os.path.join(d, f), tests)
        for d, _dirs, fs in os.walk(tests)
        for f in fs
        if f.endswith(".py")
    )
    for f in files:
        tree = ast.parse(open(os.path.join(tests, f), encoding="utf-8").read())
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "setattr"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("monkeypatch", "mp")
                and node.args
            ):
                continue
            total += 1
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                obj, _, attr = first.value.rpartition(".")
            else:
                obj = ast.unparse(first)
                second = node.args[1] if len(node.args) > 1 else None
                value = second.value if isinstance(second, ast.Constant) else ""
                attr = value if isinstance(value, str) else ""
            if attr.startswith("_") and not attr.startswith("__"):
                where.append(f"tests/{f}:{node.lineno}: {obj}.{attr}")
    return total, len(where), where


def measure(root: str = ROOT) -> dict[str, object]:
    """The figures of the checkout at *root* (its ``src/`` and ``tests/``)."""
    mods = modules(os.path.join(root, "src"))
    g = graph(mods)
    edges = {m: {t for t, *_ in es} for m, es in g.items()}
    comps = circles(edges)
    fl = floors(edges, comps)
    late = [
        (m, t, line, commented)
        for m, es in g.items()
        for t, line, is_late, commented in es
        if is_late
    ]
    sizes = {m: sum(1 for _ in open(p, encoding="utf-8")) for m, p in mods.items()}
    back = [
        (m, t)
        for m, ws in edges.items()
        for t in ws
        if fl[t] >= fl[m] and not any(m in c and t in c for c in comps)
    ]
    tests = os.path.join(root, "tests")
    total, private, where = private_patches(tests) if os.path.isdir(tests) else (0, 0, [])
    return {
        "files": len(mods),
        "lines": sum(sizes.values()),
        "over_limit": {m: n for m, n in sorted(sizes.items()) if n > MAX_LINES},
        "circles": comps,
        "floors": 1 + max(fl.values(), default=-1),
        "late_imports": [
            f"{m} -> {t} (line {line}){'' if c else ' UNCOMMENTED'}" for m, t, line, c in late
        ],
        "late_import_edges": len({(m, t) for m, t, _l, _c in late}),
        "back_arrows": len(back),
        "monkeypatch_setattr": total,
        "monkeypatch_setattr_private": private,
        "private_patches": where,
        "floor_of": fl,
    }


def _summary(r: dict[str, object], verbose: bool) -> Iterator[str]:
    circ = r["circles"]
    assert isinstance(circ, list)
    yield f"files {r['files']}, lines {r['lines']}, floors {r['floors']}"
    over = r["over_limit"]
    assert isinstance(over, dict)
    yield f"files over {MAX_LINES} lines: {len(over)}" + "".join(
        f"\n  {m}: {n}" for m, n in over.items()
    )
    yield f"import circles: {len(circ)} ({', '.join(str(len(c)) for c in circ) or 'none'} modules)"
    if verbose:
        for c in circ:
            yield "  " + " ".join(c)
    late = r["late_imports"]
    assert isinstance(late, list)
    yield f"package imports inside functions: {len(late)} ({r['late_import_edges']} edges)"
    if verbose:
        for x in late:
            yield "  " + x
    yield f"monkeypatch.setattr: {r['monkeypatch_setattr']}, on private names: {r['monkeypatch_setattr_private']}"
    if verbose:
        for x in r["private_patches"]:  # type: ignore[attr-defined]
            yield "  " + x
        fl = r["floor_of"]
        assert isinstance(fl, dict)
        for n in range(r["floors"]):  # type: ignore[call-overload]
            yield f"floor {n}: " + " ".join(
                sorted(m.removeprefix(PKG + ".") for m, f in fl.items() if f == n)
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--root", default=ROOT, help="the checkout to measure (default: this one)")
    a = p.parse_args(argv)
    r = measure(a.root)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        print("\n".join(_summary(r, a.verbose)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
