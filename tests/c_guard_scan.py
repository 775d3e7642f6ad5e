"""Finds Linux-only C names (tests/linux_only.C_NAMES: ppoll, accept4, epoll_*, SOCK_CLOEXEC, ...)
used where a macOS build compiles them (tests/test_platform_calls.py).

It needs no compiler: tests/test_mac_build.py compiles the same files for macOS with zig, which
is the authority (it also catches names not in the table); this scan runs everywhere and says
which line to guard. The rule: a use (the name in code, not in a comment, a string or a
preprocessor line) is guarded when a conditional around it is ruled out on a Mac. Conditions are
evaluated as macOS's compiler would: __APPLE__ and __MACH__ defined; __linux__, __linux, linux
and __gnu_linux__ not; each macro of the table not (it is missing on a Mac, which is why it is in
the table) unless the file itself #defines it where a Mac compiles; any other macro unknown. A
branch is ruled out when its condition is false, or (for #elif and #else) an earlier branch of
its chain is true; unknown rules nothing out.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from linux_only import C_NAMES

MAC_DEFINED = {"__APPLE__": 1, "__MACH__": 1, "__aarch64__": 1, "__arm64__": 1}
MAC_UNDEFINED = {"__linux__", "__linux", "linux", "__gnu_linux__", "__x86_64__", "_WIN32"}
SOURCE_SUFFIXES = (".c", ".h", ".cpp", ".hpp", ".cc")
_TOKEN = re.compile(r"\s*(defined|[A-Za-z_]\w*|0[xX][0-9a-fA-F]+|\d+|&&|\|\||==|!=|[!()])")
_DIRECTIVE = re.compile(r"^\s*#\s*(\w+)\s*(.*)$")


@dataclass(frozen=True)
class CFinding:
    path: str
    line: int
    name: str

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: {self.name} exists only on Linux and a macOS build compiles "
                "this line: put it under #if defined(__linux__) (or #ifdef of the macro) with a macOS "
                "branch (tests/c_guard_scan.py says which guards count)")


def strip_comments_and_strings(text: str) -> str:
    """The source with comments and string/char literals blanked (newlines kept, so lines count)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


class _Condition:
    """A #if expression evaluated on a Mac: True, False or None (unknown)."""

    def __init__(self, expr: str, known: Dict[str, Optional[int]]):
        self.tokens: List[str] = []
        pos = 0
        expr = expr.strip()
        while pos < len(expr):
            m = _TOKEN.match(expr, pos)
            if not m:
                self.tokens = ["?"]  # something this evaluator does not read: unknown
                break
            self.tokens.append(m.group(1))
            pos = m.end()
        self.known, self.i = known, 0

    def value(self) -> Optional[bool]:
        try:
            v = self._or()
        except (IndexError, ValueError):
            return None
        return v if self.i == len(self.tokens) else None

    def _next(self) -> str:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def _peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _or(self) -> Optional[bool]:
        v = self._and()
        while self._peek() == "||":
            self._next()
            w = self._and()
            v = True if True in (v, w) else (None if None in (v, w) else False)
        return v

    def _and(self) -> Optional[bool]:
        v = self._cmp()
        while self._peek() == "&&":
            self._next()
            w = self._cmp()
            v = False if False in (v, w) else (None if None in (v, w) else True)
        return v

    def _cmp(self) -> Optional[bool]:
        v = self._unary()
        if self._peek() in ("==", "!="):
            raise ValueError("comparison")  # not needed by any guard here: unknown
        return v

    def _unary(self) -> Optional[bool]:
        tok = self._next()
        if tok == "!":
            v = self._unary()
            return None if v is None else not v
        if tok == "(":
            v = self._or()
            if self._next() != ")":
                raise ValueError(")")
            return v
        if tok == "defined":
            paren = self._peek() == "("
            if paren:
                self._next()
            name = self._next()
            if paren and self._next() != ")":
                raise ValueError(")")
            if name not in self.known:
                return None
            return self.known[name] is not None
        if tok[0].isdigit():
            return int(tok, 0) != 0
        if tok in self.known:
            return bool(self.known[tok]) if self.known[tok] is not None else False
        return None


def _mac_macros() -> Dict[str, Optional[int]]:
    """name -> its value on a Mac (None: not defined there); absent names are unknown."""
    known: Dict[str, Optional[int]] = dict(MAC_DEFINED)
    known.update({n: None for n in MAC_UNDEFINED})
    known.update({m.c_name: None for m in C_NAMES if m.kind == "macro"})
    return known


def scan_c_source(text: str, path: str, names: Sequence[str] = ()) -> List[CFinding]:
    """Every unguarded use of a Linux-only name (default: the whole table) in one file."""
    names = list(names) or [m.c_name for m in C_NAMES]
    use = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    known = _mac_macros()
    # One frame per open conditional: (this branch ruled out on a Mac, an earlier branch true).
    stack: List[Tuple[bool, bool]] = []
    found: List[CFinding] = []
    lines = strip_comments_and_strings(text).split("\n")
    joined = _join_continuations(lines)
    for lineno, line in joined:
        ruled_out = any(frame[0] for frame in stack)
        d = _DIRECTIVE.match(line)
        if d:
            _directive(d.group(1), d.group(2), stack, known, ruled_out)
            continue
        if not ruled_out:  # a table name the file #defined itself (a fallback) is its own now
            found.extend(CFinding(path, lineno, m.group(1)) for m in use.finditer(line)
                         if known.get(m.group(1)) is None)
    return found


def _join_continuations(lines: List[str]) -> Iterator[Tuple[int, str]]:
    i = 0
    while i < len(lines):
        start, text = i + 1, lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i]
        yield start, text
        i += 1


def _directive(kind: str, rest: str, stack: List[Tuple[bool, bool]], known: Dict[str, Optional[int]],
               ruled_out: bool) -> None:
    word = rest.split()[0] if rest.split() else ""
    if kind in ("if", "ifdef", "ifndef"):
        expr = rest if kind == "if" else f"defined({word})" if kind == "ifdef" else f"!defined({word})"
        v = _Condition(expr, known).value()
        stack.append((v is False, v is True))
    elif kind == "elif" and stack:
        _, earlier_true = stack[-1]
        v = _Condition(rest, known).value()
        stack[-1] = (earlier_true or v is False, earlier_true or v is True)
    elif kind == "else" and stack:
        _, earlier_true = stack[-1]
        stack[-1] = (earlier_true, True)
    elif kind == "endif" and stack:
        stack.pop()
    elif kind == "define" and not ruled_out and word:
        known[re.match(r"\w+", word).group(0)] = 1  # defined here: known from now on
    elif kind == "undef" and not ruled_out and word:
        known[word] = None


def scan_c_tree(root: str) -> List[CFinding]:
    """Every unguarded use in the C and C++ sources under root (paths relative to root's parent)."""
    out: List[CFinding] = []
    base = os.path.dirname(os.path.abspath(root))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(SOURCE_SUFFIXES):
                full = os.path.join(dirpath, name)
                with open(full, encoding="utf-8") as f:
                    out.extend(scan_c_source(f.read(), os.path.relpath(full, base)))
    return out
