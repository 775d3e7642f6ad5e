"""Nothing only Linux has is reached on a Mac: the package's Python (tests/platform_scan.py) and
its C sources (tests/c_guard_scan.py, which needs no compiler; tests/test_mac_build.py compiles
them for macOS), and the rules themselves, both ways."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from c_guard_scan import scan_c_source, scan_c_tree
from platform_scan import scan_source, scan_tree

REPO = Path(__file__).resolve().parent.parent


def test_the_package_reaches_nothing_linux_only_unguarded():
    found = scan_tree(str(REPO / "mlx_ds4tp"))
    assert not found, "\n".join(map(str, found))


def test_the_c_sources_use_nothing_linux_only_unguarded():
    found = scan_c_tree(str(REPO / "mlx_ds4tp" / "csrc"))
    assert not found, "\n".join(map(str, found))


def _found(src: str):
    return [f.what for f in scan_source(textwrap.dedent(src), "x.py")]


REACHED = {
    "a call": "import os\nos.sched_setaffinity(0, {1})",
    "through an alias": "import os as o\no.sched_getaffinity(0)",
    "an import": "from os import sched_getaffinity",
    "a procfs path": "open('/proc/meminfo')",
    "an f-string path": "def f(pid):\n    return open(f'/proc/{pid}/status')",
    "a sysfs path as a default": "def f(p='/sys/class/net'):\n    return open(p).read()",
    "an ELF library": "import ctypes\nctypes.CDLL('libc.so.6')",
    "glibc's mallopt": "import ctypes\nctypes.CDLL(None).mallopt(1, 2)",
    "a Linux program": "import subprocess\nsubprocess.run(['ip', 'link'])",
    "epoll": "import select\nselect.epoll()",
    "a socket flag": "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)",
    "the Mac's own branch": "import os, sys\nif sys.platform == 'darwin':\n    os.sched_getaffinity(0)",
    "an undecided test": "import os, sys\nif sys.platform == 'linux' or x:\n    os.sched_getaffinity(0)",
    "after an if that does not exit": "import os, sys\nif sys.platform != 'darwin':\n    pass\nos.sched_getaffinity(0)",
    "after an exit the Mac skips": "import os, sys\ndef f():\n    if sys.platform == 'linux':\n        return\n"
                                   "    os.sched_getaffinity(0)",
    "a handler that misses": "import os\ntry:\n    os.sched_getaffinity(0)\nexcept OSError:\n    pass",
    "a library's OSError as FileNotFoundError": "import ctypes\ntry:\n    ctypes.CDLL('libc.so.6')\n"
                                                "except FileNotFoundError:\n    pass",
    "a handler around a def": "import os\ntry:\n    def f():\n        return os.sched_getaffinity(0)\n"
                              "except AttributeError:\n    pass",
    "inside the handler itself": "try:\n    pass\nexcept OSError:\n    open('/proc/x')",
    "the wrong hasattr": "import os\nif hasattr(os, 'fork'):\n    os.sched_getaffinity(0)",
}

GUARDED = {
    "a linux branch": "import os, sys\nif sys.platform.startswith('linux'):\n    os.sched_getaffinity(0)",
    "an else of darwin": "import os, sys\nif sys.platform == 'darwin':\n    pass\nelse:\n    os.sched_getaffinity(0)",
    "an elif after darwin": "import os, sys\nif sys.platform == 'darwin':\n    pass\nelif x:\n"
                            "    os.sched_getaffinity(0)",
    "a membership test": "import os, sys\nif sys.platform in ('linux', 'linux2'):\n    os.sched_getaffinity(0)",
    "platform.system()": "import platform\nif platform.system() == 'Linux':\n    open('/proc/x')",
    "an early return": "import os, sys\ndef f():\n    if sys.platform == 'darwin':\n        return 0\n"
                       "    return os.sched_getaffinity(0)",
    "an early raise": "import os, sys\nif not sys.platform.startswith('linux'):\n    raise SystemExit(1)\n"
                      "os.sched_setaffinity(0, {1})",
    "an early raise on hasattr": "import os\ndef f(cpu):\n    if not hasattr(os, 'sched_setaffinity') or cpu < 0:\n"
                                 "        raise ValueError(cpu)\n    return lambda: os.sched_setaffinity(0, {cpu})",
    "hasattr": "import os\nif hasattr(os, 'sched_getaffinity'):\n    os.sched_getaffinity(0)",
    "a conditional expression": "import os\nx = os.sched_getaffinity(0) if hasattr(os, 'sched_getaffinity') else set()",
    "and": "import os\nok = hasattr(os, 'sched_setaffinity') and os.sched_setaffinity(0, {1})",
    "getattr with a default": "import os\ngetattr(os, 'sched_getaffinity', lambda _: ())(0)",
    "getattr as a test": "import os\nif getattr(os, 'sched_getaffinity', None):\n    os.sched_getaffinity(0)",
    "FileNotFoundError": "try:\n    open('/proc/meminfo')\nexcept FileNotFoundError:\n    pass",
    "a tuple with OSError": "try:\n    open('/proc/meminfo')\nexcept (OSError, ValueError):\n    pass",
    "AttributeError": "import os\ntry:\n    os.sched_getaffinity(0)\nexcept AttributeError:\n    pass",
    "a library's OSError": "import ctypes\ntry:\n    ctypes.CDLL('libc.so.6')\nexcept OSError:\n    pass",
    "a bare except": "import subprocess\ntry:\n    subprocess.run(['ip', 'link'])\nexcept Exception:\n    pass",
    "an existence test": "import os\nif os.path.exists('/proc/self/status'):\n    open('/proc/self/status')",
    "Path.exists": "from pathlib import Path\nif Path('/proc/self').exists():\n    open('/proc/self/status')",
    "a default read under try": "def f(p='/sys/class/net'):\n    try:\n        return open(p).read()\n"
                                "    except OSError:\n        return ''",
    "a docstring": "def f():\n    '''Reads /proc/meminfo.'''",
    "a path that is not Linux's": "open('/etc/hosts')",
}


@pytest.mark.parametrize("src", REACHED.values(), ids=REACHED.keys())
def test_a_use_a_mac_reaches_is_found(src):
    assert len(_found(src)) == 1, _found(src)


@pytest.mark.parametrize("src", GUARDED.values(), ids=GUARDED.keys())
def test_a_guarded_use_is_not(src):
    assert _found(src) == []


def test_a_finding_names_the_file_line_and_call():
    (f,) = scan_source("import os\n\nos.sched_setaffinity(0, {1})\n", "pkg/mod.py")
    assert str(f).startswith("pkg/mod.py:3: os.sched_setaffinity exists only on Linux")


PPOLL = "int f(void) { return ppoll(0, 0, 0, 0); }"

C_REACHED = {
    "bare": PPOLL,
    "true on a Mac": f"#if defined(__linux__) || defined(__APPLE__)\n{PPOLL}\n#endif",
    "undecided": f"#if defined(HAVE_PPOLL)\n{PPOLL}\n#endif",
    "the Mac's elif": f"#if defined(__linux__)\n#elif defined(__APPLE__)\n{PPOLL}\n#endif",
    "a flag": "int s = SOCK_CLOEXEC;",
    "after an #endif": "#ifdef __linux__\nint x;\n#endif\nint f(int fd) { return accept4(fd, 0, 0, 0); }",
}

C_GUARDED = {
    "__linux__": f"#if defined(__linux__)\n{PPOLL}\n#endif",
    "the else of __APPLE__": f"#ifdef __APPLE__\nint x;\n#else\n{PPOLL}\n#endif",
    "not Apple": f"#if !defined(__APPLE__)\n{PPOLL}\n#endif",
    "the macro's own ifdef": "#ifdef SO_RXQ_OVFL\nint o = SO_RXQ_OVFL;\n#endif",
    "a fallback definition": "#ifndef SOCK_CLOEXEC\n#define SOCK_CLOEXEC 0\n#endif\nint s = SOCK_CLOEXEC;",
    "a comment": "/* blocks in ppoll */\n// ppoll again\nint x;",
    "a string": "const char *s = \"ppoll\";",
    "nested": f"#if defined(__linux__)\n#if 1\n{PPOLL}\n#endif\n#endif",
}


@pytest.mark.parametrize("src", C_REACHED.values(), ids=C_REACHED.keys())
def test_a_c_use_a_mac_compiles_is_found(src):
    assert len(scan_c_source(src, "x.c")) == 1, scan_c_source(src, "x.c")


@pytest.mark.parametrize("src", C_GUARDED.values(), ids=C_GUARDED.keys())
def test_a_guarded_c_use_is_not(src):
    assert scan_c_source(src, "x.c") == []


def test_ppoll_without_its_guard_is_found_at_its_line():
    text = (REPO / "mlx_ds4tp" / "csrc" / "util.c").read_text()
    guarded = "#if defined(__linux__)\n    struct timespec ts"
    assert guarded in text, "csrc/util.c no longer guards ppoll as this test expects: update the test"
    line = text[:text.index("return ppoll(")].count("\n") + 1
    found = scan_c_source(text.replace(guarded, "#if 1\n    struct timespec ts"), "mlx_ds4tp/csrc/util.c")
    assert [(f.line, f.name) for f in found] == [(line, "ppoll")]
    assert str(found[0]).startswith(f"mlx_ds4tp/csrc/util.c:{line}: ppoll exists only on Linux")


# -- what the package does where the call is missing (mlx_ds4tp/onehost/localpair.py) -----------

def test_pinning_ranks_where_the_os_cannot_is_refused_before_any_starts(monkeypatch, tmp_path):
    from mlx_ds4tp.onehost import localpair

    marker = tmp_path / "started"
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    with pytest.raises(ValueError, match=r"cpus=\[1\]: pinning a rank to CPUs needs Linux"):
        localpair.run_ranks([[sys.executable, "-c", f"open({str(marker)!r}, 'w')"]] * 2,
                            cpus=(None, frozenset({1})), timeout=30)
    assert not marker.exists()
    with pytest.raises(RuntimeError, match="needs Linux"):
        with localpair.busy_core(0):
            pass
