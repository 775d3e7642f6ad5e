#!/usr/bin/env python3
"""Layout check for mlx_ds4tp: import cycles inside the package and files that have grown too big.

Run from anywhere: python tools/layout_check.py (it checks the checkout it lives in; .ci/run
runs it on every build).
Subpackages count: every .py below mlx_ds4tp/ is a module named by its dotted path.
And no product module imports mlx_ds4tp.testing: what the demo and the benches run is product
code (onehost/, synthetic/); test scaffolding stays out of what users import. The rule holds
while no testing/ package exists, so one cannot come back with product code leaning on it.
Outside link/ and collectives/ (where the wire's pair and mesh live), one Group serves any N:
no isinstance() test on a group class of collectives/, and at most MAX_SIZE_BRANCHES
comparisons of a size (an expression naming `size` or `ranks`) with 2 or 3; each offender is
printed as file:line.
Inside the package link/ is reached one way, by its modules' names (`from ..link.handshake import
connect`): transport.py and warmup.py are the faces users and tests import, so no package module
but the package's own __init__ imports them (each offender printed as file:line).
A group forms one way, link/mesh.py's form_mesh (door, JOIN, ROSTER, a link per pair of ranks):
no module outside link/ imports link/handshake.py, whose connect() is one link's steps inside it
(transport.py, the face tests check one link through, excepted; each offender as file:line).
Prints what it finds; exits 1 when there is a cycle, an oversized file or an offender, or when it
finds no package to check (a check that passes on nothing would hide a moved tree), else 0.
"""
import ast
import os
import re
import sys
from typing import Iterator, Tuple

PKG = "mlx_ds4tp"
# The checkout this file belongs to (tools/ sits at its root).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_PY, MAX_C = 500, 900
# Test scaffolding no product module may import (every module below PKG outside it is product).
TESTING = f"{PKG}.testing"
# The link layer's public faces: for users and tests, never imported inside the package.
LINK_FACES = (f"{PKG}.transport", f"{PKG}.warmup")
# One link's steps (connect()): only link/ (form_mesh) makes links; a group forms through it.
LINK_STEP = f"{PKG}.link.handshake"
# Where a pair and a mesh may differ: the wire's formation and the group over it.
GROUP_ROOMS = ("link", "collectives")
# The group classes of collectives/, old and new: an isinstance() on one asks what kind of group it is.
GROUP_CLASSES = {"Group", "PairGroup", "MeshGroup", "LinkedGroup"}
MAX_SIZE_BRANCHES = 6
_SIZE_NAME = re.compile(r"\b(size|ranks)\b|size\(\)")


def modules() -> dict:
    """Dotted module name -> path, for every .py below PKG (a package is named by its __init__)."""
    found = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(root, f), ".")[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = os.path.join(root, f)
    return found


def imports_of(name: str, path: str, known: dict) -> set:
    """Package modules that `name` imports, at module level or inside functions."""
    out = set()
    for _, target in imported_names(name, path):
        if not target.startswith(PKG + "."):
            continue
        # the longest known prefix: `from .a.b import c` may name module a.b.c or a name in a.b
        parts = target.split(".")
        for k in range(len(parts), 0, -1):
            cand = ".".join(parts[:k])
            if cand in known:
                out.add(cand)
                break
    out.discard(name)
    # importing a package's submodule also runs the package's __init__: not a cycle of ours
    return {m for m in out if not name.startswith(m + ".")}


def imported_names(name: str, path: str) -> Iterator[Tuple[int, str]]:
    """(line, dotted name) of every import in `name`, relative imports resolved against its package."""
    is_pkg = path.endswith("__init__.py")
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                yield node.lineno, f"{mod}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name


def testing_imports(known: dict) -> list:
    """`file:line: ...` for every product module's import of TESTING or a module below it."""
    found = []
    for name, path in sorted(known.items()):
        if name == TESTING or name.startswith(TESTING + "."):
            continue
        for line, target in imported_names(name, path):
            if target == TESTING or target.startswith(TESTING + "."):
                found.append(f"{path}:{line}: product module {name} imports {target} (test scaffolding; "
                             f"move what it needs into the product, e.g. {PKG}/onehost/ or {PKG}/synthetic/)")
    return found


def face_imports(known: dict) -> list:
    """`file:line: ...` for every package module's import of a link face (LINK_FACES)."""
    found = []
    for name, path in sorted(known.items()):
        if name == PKG or name in LINK_FACES:
            continue
        for line, target in imported_names(name, path):
            face = next((f for f in LINK_FACES if target == f or target.startswith(f + ".")), None)
            if face:
                found.append(f"{path}:{line}: {name} imports {face}, a face for users and tests; inside the "
                             f"package import the link/ module that defines the name (e.g. {PKG}.link.mesh)")
    return found


def link_step_imports(known: dict) -> list:
    """`file:line: ...` for every import of LINK_STEP from outside link/ (and the faces)."""
    found = []
    for name, path in sorted(known.items()):
        if name.startswith(f"{PKG}.link.") or name in LINK_FACES:
            continue
        for line, target in imported_names(name, path):
            if target == LINK_STEP or target.startswith(LINK_STEP + "."):
                found.append(f"{path}:{line}: {name} imports {target}: connect() is one link's steps, made "
                             f"inside link/ only; form a group with {PKG}.link.mesh.form_mesh (gate_ops.init)")
    return found


def _names_a_group_class(node: ast.AST) -> bool:
    """An isinstance() class argument naming a group class of ours (alone, dotted, or in a
    tuple); MLX's own (mx.distributed.Group) is the interface every group has, not a kind."""
    if isinstance(node, ast.Tuple):
        return any(_names_a_group_class(e) for e in node.elts)
    if isinstance(node, ast.Attribute):
        return node.attr in GROUP_CLASSES and "distributed" not in ast.unparse(node.value)
    return getattr(node, "id", None) in GROUP_CLASSES


def _size_branch(node: ast.Compare) -> bool:
    """`size == 2`, `group.size() > 2`, `(link.size or 2) == 2`, `2 < ranks`: a size against 2 or 3."""
    operands = [node.left, *node.comparators]
    small = [o for o in operands if isinstance(o, ast.Constant) and type(o.value) is int and o.value in (2, 3)]
    sized = [o for o in operands if not isinstance(o, ast.Constant) and _SIZE_NAME.search(ast.unparse(o))]
    return bool(small and sized)


def group_kind_checks(paths: list) -> tuple:
    """(isinstance tests on a group class, size-2-style comparisons): file:line of each, in the
    modules outside GROUP_ROOMS."""
    kinds, sizes = [], []
    for path in paths:
        parts = os.path.relpath(path, PKG).split(os.sep)
        if parts[0] in GROUP_ROOMS:
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                    and len(node.args) == 2 and _names_a_group_class(node.args[1])):
                kinds.append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.Compare) and _size_branch(node):
                sizes.append(f"{path}:{node.lineno}")
    return kinds, sizes


def main() -> int:
    os.chdir(ROOT)
    if not os.path.isdir(PKG):
        print(f"layout check: no {PKG}/ in {ROOT}: nothing to check")
        return 1
    known = modules()
    edges = {m: imports_of(m, p, known) for m, p in known.items()}
    cycles = set()

    def walk(node, stack):
        for nxt in edges.get(node, ()):
            if nxt in stack:
                cycles.add(tuple(sorted(stack[stack.index(nxt):])))
            elif len(stack) < 14:
                walk(nxt, stack + [nxt])

    for m in known:
        walk(m, [m])
    problems = [f"import cycle: {' <-> '.join(c)}" for c in sorted(cycles)]
    problems += testing_imports(known)
    problems += face_imports(known)
    problems += link_step_imports(known)
    for root, _, files in os.walk(PKG):
        for f in sorted(files):
            path = os.path.join(root, f)
            limit = MAX_PY if f.endswith(".py") else MAX_C if f.endswith((".c", ".h", ".cpp", ".hpp", ".cc")) else None
            if limit and (n := sum(1 for _ in open(path, errors="replace"))) > limit:
                problems.append(f"{path}: {n} lines (over {limit}: which second idea lives in it?)")
    kinds, sizes = group_kind_checks(sorted(known.values()))
    problems += [f"{where}: isinstance() on a group class of collectives/: one Group serves any N; "
                 "ask it (link_to, size) instead" for where in kinds]
    if len(sizes) > MAX_SIZE_BRANCHES:
        problems += [f"{where}: a size compared with 2 or 3 ({len(sizes)} outside "
                     f"{'/ and '.join(GROUP_ROOMS)}/, at most {MAX_SIZE_BRANCHES}): write it for any N"
                     for where in sizes]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
