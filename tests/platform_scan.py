"""Finds what only Linux has, reached on macOS, in Python source (tests/test_platform_calls.py).

A *use* is one of:
  - an attribute of a module that CPython lacks on a Mac (``os.sched_setaffinity``,
    ``select.epoll``: tests/linux_only.py's table), or ``from os import sched_setaffinity``;
  - an attribute named after glibc's allocator calls (``ctypes.CDLL(None).mallopt``);
  - a path under /proc, /sys or /dev/shm, as a string or the start of an f-string (a parameter's
    default counts at each place the function reads that parameter);
  - ``ctypes.CDLL("libc.so.6")`` (an ELF library name), or a subprocess command whose program
    only Linux has (``subprocess.run(["ip", ...])``).

A use is *guarded* (macOS never reaches it, or reaches it only where the failure is caught) when
one of these holds, evaluating platform tests as they come out on a Mac (``sys.platform`` is
"darwin", ``platform.system()`` "Darwin", ``os.name`` "posix"; ``hasattr(os, "X")`` and
``getattr(os, "X", default)`` for an X of the table are False and the default; an existence test
of a Linux path, ``os.path.exists("/proc/...")`` or ``Path("/sys/...").exists()``, is False):
  1. it is in the branch of an ``if``/``elif``/conditional expression that such a test rules out
     on a Mac, or after an operand of ``and``/``or`` that decides the result on a Mac;
  2. an earlier statement of a block it is in (or of any block around that one) is an ``if``
     whose test is true on a Mac and whose body ends in return, raise, continue or break;
  3. it is in the body of a ``try`` whose handler catches what a Mac raises there (AttributeError
     for a missing attribute, ImportError for an import, FileNotFoundError or OSError for a path
     or a program, OSError for a library; ``Exception``, ``BaseException`` and a bare ``except``
     catch all), with no function between the two (a handler around a ``def`` does not see its
     calls);
  4. an existence test of a Linux path is itself not a use (it asks whether this is Linux).
Anything else is reported, however harmless it may look to a reader: the fix is a guard the rule
sees (rules 1-3), which also tells the reader that the line is Linux's own.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

from linux_only import ELF_LIBRARY, GLIBC_ATTRS, LINUX_PATH, LINUX_PROGRAMS, python_attrs

UNKNOWN = object()
_CATCH_ALL = frozenset({"Exception", "BaseException"})
CATCHES = {
    "AttributeError": frozenset({"AttributeError"}) | _CATCH_ALL,
    "ImportError": frozenset({"ImportError"}) | _CATCH_ALL,
    "FileNotFoundError": frozenset({"FileNotFoundError", "OSError", "IOError", "EnvironmentError"}) | _CATCH_ALL,
    "OSError": frozenset({"OSError", "IOError", "EnvironmentError"}) | _CATCH_ALL,
}
_EXISTS_FUNCS = frozenset({"exists", "isfile", "isdir", "lexists"})
_PATH_PROBES = frozenset({"exists", "is_file", "is_dir"})
_SUBPROCESS_CALLS = frozenset({"run", "Popen", "check_output", "check_call", "call"})
_LIBRARY_LOADERS = frozenset({"CDLL", "PyDLL", "LoadLibrary"})
_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: {self.what} exists only on Linux and a Mac reaches it: guard it "
                "(tests/platform_scan.py says which guards count)")


def _dotted(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _linux_path_literal(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and LINUX_PATH.match(node.value):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and LINUX_PATH.match(first.value):
            return ast.unparse(node)
    return None


class _Module:
    """One parsed file: its parents, module aliases, and the Mac-side evaluation of tests."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.parent: Dict[ast.AST, ast.AST] = {}
        self.alias: Dict[str, str] = {}  # local name -> module (import x as y)
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        self.missing = python_attrs()

    def module_of(self, node: ast.AST) -> Optional[str]:
        return self.alias.get(node.id) if isinstance(node, ast.Name) else None

    # -- what a test comes out as on a Mac (a value, or UNKNOWN) -------------------------------
    def mac_value(self, node: ast.AST):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            vals = [self.mac_value(e) for e in node.elts]
            return UNKNOWN if any(v is UNKNOWN for v in vals) else tuple(vals)
        if isinstance(node, ast.Attribute):
            mod = self.module_of(node.value)
            if (mod, node.attr) == ("sys", "platform"):
                return "darwin"
            if (mod, node.attr) == ("os", "name"):
                return "posix"
            return UNKNOWN
        if isinstance(node, ast.Call):
            return self._mac_call(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = self.mac_value(node.operand)
            return UNKNOWN if v is UNKNOWN else not v
        if isinstance(node, ast.BoolOp):
            return self._mac_boolop(node)
        if isinstance(node, ast.Compare):
            return self._mac_compare(node)
        return UNKNOWN

    def _mac_call(self, node: ast.Call):
        func, args = node.func, node.args
        if isinstance(func, ast.Attribute) and self.module_of(func.value) == "platform" and func.attr == "system":
            return "Darwin"
        if isinstance(func, ast.Name) and func.id in ("hasattr", "getattr") and len(args) >= 2:
            mod, name = self.module_of(args[0]), args[1]
            if isinstance(name, ast.Constant) and name.value in self.missing.get(mod or "", ()):
                if func.id == "hasattr":
                    return False
                return self.mac_value(args[2]) if len(args) == 3 else UNKNOWN
            return UNKNOWN
        if isinstance(func, ast.Attribute) and func.attr in ("startswith", "endswith") and len(args) == 1:
            s, arg = self.mac_value(func.value), self.mac_value(args[0])
            if isinstance(s, str) and isinstance(arg, (str, tuple)):
                return getattr(s, func.attr)(arg)
            return UNKNOWN
        return False if self.is_existence_probe(node) else UNKNOWN

    def is_existence_probe(self, node: ast.AST) -> bool:
        """os.path.exists("/proc/...") or Path("/proc/...").exists() (and the like)."""
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            return False
        func = node.func
        if _dotted(func.value) in ("os.path", "path") and func.attr in _EXISTS_FUNCS and node.args:
            return _linux_path_literal(node.args[0]) is not None
        inner = func.value
        return (func.attr in _PATH_PROBES and isinstance(inner, ast.Call) and bool(inner.args)
                and (_dotted(inner.func) or "").split(".")[-1] in ("Path", "PurePath")
                and _linux_path_literal(inner.args[0]) is not None)

    def _mac_boolop(self, node: ast.BoolOp):
        unknown = False
        for v in node.values:
            t = self.truth(v)
            if t is None:
                unknown = True
            elif isinstance(node.op, ast.And) and t is False:
                return False
            elif isinstance(node.op, ast.Or) and t is True:
                return True
        return UNKNOWN if unknown else isinstance(node.op, ast.And)

    def _mac_compare(self, node: ast.Compare):
        left = self.mac_value(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = self.mac_value(right_node)
            if left is UNKNOWN or right is UNKNOWN:
                return UNKNOWN
            try:
                ok = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
                      ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
                      ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b}[type(op)](left, right)
            except (KeyError, TypeError):
                return UNKNOWN
            if not ok:
                return False
            left = right
        return True

    def truth(self, node: ast.AST) -> Optional[bool]:
        v = self.mac_value(node)
        return None if v is UNKNOWN else bool(v)

    # -- guards --------------------------------------------------------------------------------
    def guarded(self, use: ast.AST, raises: str) -> bool:
        child, crossed_function = use, False
        node = self.parent.get(child)
        while node is not None:
            if isinstance(node, _FUNCTIONS) and child is not getattr(node, "args", None):
                crossed_function = True
            if self._branch_ruled_out(node, child) or self._after_exit(node, child):
                return True
            if isinstance(node, ast.Try) and child in node.body and not crossed_function:
                if any(_catches(h, raises) for h in node.handlers):
                    return True
            child, node = node, self.parent.get(node)
        return False

    def _branch_ruled_out(self, node: ast.AST, child: ast.AST) -> bool:
        if isinstance(node, (ast.If, ast.IfExp)):
            body = node.body if isinstance(node.body, list) else [node.body]
            orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
            t = self.truth(node.test) if child is not node.test else None
            return (t is False and child in body) or (t is True and child in orelse)
        if isinstance(node, ast.BoolOp) and child in node.values:
            for v in node.values[:node.values.index(child)]:
                t = self.truth(v)
                if (isinstance(node.op, ast.And) and t is False) or (isinstance(node.op, ast.Or) and t is True):
                    return True
        return False

    def _after_exit(self, node: ast.AST, child: ast.AST) -> bool:
        for _, value in ast.iter_fields(node):
            if isinstance(value, list) and child in value:
                for stmt in value[:value.index(child)]:
                    if isinstance(stmt, ast.If) and self._exits_on_mac(stmt):
                        return True
        return False

    def _exits_on_mac(self, stmt: ast.If) -> bool:
        t = self.truth(stmt.test)
        branch = stmt.body if t is True else stmt.orelse if t is False else []
        return bool(branch) and isinstance(branch[-1], _EXITS)

    # -- uses ----------------------------------------------------------------------------------
    def uses(self) -> Iterator[Tuple[ast.AST, str, str]]:
        """(node, what, what a Mac raises there) for every use in the file."""
        glibc = {m.attr for m in GLIBC_ATTRS}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute):
                mod = self.module_of(node.value)
                if mod and node.attr in self.missing.get(mod, ()):
                    yield node, f"{mod}.{node.attr}", "AttributeError"
                elif node.attr in glibc:
                    yield node, f"glibc's {node.attr} ({ast.unparse(node)})", "AttributeError"
            elif isinstance(node, ast.ImportFrom) and node.module in self.missing:
                for a in node.names:
                    if a.name in self.missing[node.module]:
                        yield node, f"from {node.module} import {a.name}", "ImportError"
            elif isinstance(node, ast.Call):
                yield from self._call_uses(node)
            elif isinstance(node, (ast.Constant, ast.JoinedStr)):
                yield from self._path_uses(node)

    def _call_uses(self, node: ast.Call) -> Iterator[Tuple[ast.AST, str, str]]:
        name = (_dotted(node.func) or "").split(".")[-1]
        first = node.args[0] if node.args else None
        if name in _LIBRARY_LOADERS and isinstance(first, ast.Constant) and isinstance(first.value, str) \
                and ELF_LIBRARY.search(first.value):
            yield node, f"the ELF library {first.value!r}", "OSError"
        if name in _SUBPROCESS_CALLS and isinstance(first, (ast.List, ast.Tuple)) and first.elts:
            prog = first.elts[0]
            if isinstance(prog, ast.Constant) and prog.value in LINUX_PROGRAMS:
                yield node, f"the program {prog.value!r}", "FileNotFoundError"

    def _path_uses(self, node: ast.AST) -> Iterator[Tuple[ast.AST, str, str]]:
        parent = self.parent.get(node)
        if isinstance(parent, ast.JoinedStr) or isinstance(parent, ast.Expr):  # part of an f-string; a docstring
            return
        path = _linux_path_literal(node)
        # os.path.exists(path): the call is the parent; Path(path).exists(): two above that.
        above = [parent, self.parent.get(self.parent.get(parent))]
        if path is None or any(self.is_existence_probe(a) for a in above):
            return
        if isinstance(parent, ast.arguments):
            for name_node in self._parameter_reads(parent, node):
                yield name_node, f"the path {path!r} (the default of {name_node.id})", "FileNotFoundError"
            return
        yield node, f"the path {path!r}", "FileNotFoundError"

    def _parameter_reads(self, args: ast.arguments, default: ast.AST) -> Iterator[ast.Name]:
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        param = next(a.arg for a, d in pairs if d is default)
        func = self.parent[args]
        for n in ast.walk(func):
            if isinstance(n, ast.Name) and n.id == param and isinstance(n.ctx, ast.Load):
                yield n


def _catches(handler: ast.ExceptHandler, raises: str) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any((_dotted(n) or "").split(".")[-1] in CATCHES[raises] for n in names)


def scan_source(text: str, path: str) -> List[Finding]:
    """Every unguarded use in one file's source."""
    m = _Module(ast.parse(text, filename=path))
    found = {Finding(path, node.lineno, what) for node, what, raises in m.uses() if not m.guarded(node, raises)}
    return sorted(found, key=lambda f: (f.path, f.line, f.what))


def scan_tree(root: str, skip: FrozenSet[str] = frozenset()) -> List[Finding]:
    """Every unguarded use in the .py files under root (paths relative to root's parent)."""
    out: List[Finding] = []
    base = os.path.dirname(os.path.abspath(root))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, base)
            if name.endswith(".py") and rel not in skip:
                with open(full, encoding="utf-8") as f:
                    out.extend(scan_source(f.read(), rel))
    return out
