"""The package built for Apple silicon Macs, from this Linux box: zig's clang for aarch64-macos
(macOS 14, the oldest MLX's wheels are for) against MLX's own macOS arm64 wheel.

Checked:
  - every C source of mlx_ds4tp/csrc compiles for macOS with _verbs_build.py's flags against
    macOS's libc headers (a Linux-only call, ppoll or accept4, is an undeclared function there,
    and an error: -Werror=implicit-function-declaration, as Apple clang has by default), and so
    does the C file cffi generates for the _verbs module;
  - those objects link into a macOS dylib with no undefined symbol (-undefined error) against
    libSystem (zig's stub of it): every libc call they make exists on a Mac;
  - the C++ backend (csrc/mlx/*.cpp) compiles with setup.py's flags (-std=c++20, ...) against the
    headers of the pinned MLX's macOS wheel, and group.cpp, the backend proper, links into a
    dylib against that wheel's libmlx.dylib with no undefined symbol;
  - the nanobind module (module.cpp, nanobind's nb_combined.cpp and group.cpp) links as a
    macOS extension module does, with ``-undefined dynamic_lookup`` for Python's C API, which the
    interpreter that loads it provides; the check then reads the image's bind information and
    fails if any symbol but Python's (``Py*``, ``_Py*``) is left to that lookup, so every MLX and
    libc symbol it uses is bound to libmlx.dylib or libSystem. The same for the _verbs module.

Not checked (a Mac's own build covers them):
  - Python's headers are this machine's CPython's, whose pyconfig.h describes Linux: the two
    Python modules' own code and cffi's and nanobind's compile against macOS's libc, libc++ and
    MLX's headers, but how Python.h configures itself on a Mac is not checked;
  - libc++ is zig's (LLVM's libc++, linked statically), where Apple's clang uses the Mac's
    /usr/lib/libc++.1.dylib: the same library, another build;
  - zig's macOS headers have no <infiniband/verbs.h> (macOS 26.2's SDK has), so csrc/rdma/ibv.c
    compiles as its no-header branch, without the ibverbs provider's body;
  - the extension links as MH_DYLIB (-shared): zig's linker crashes on -bundle, which setuptools
    uses on a Mac (a Python module loads either way); nothing runs (no Mac here), and Metal's
    kernels (mlx.metallib) are not downloaded.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sysconfig
from pathlib import Path
from typing import Optional

import pytest

import mac_toolchain as mt
from linux_only import C_NAMES, GLIBC_ATTRS, PRESENT_ON_MAC, PROBE_HEADERS, PYTHON_ATTRS
from macho_binds import FLAT_LOOKUP, bound_symbols

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "mlx_ds4tp" / "csrc"
C_SOURCES = sorted(p.relative_to(REPO).as_posix() for p in CSRC.rglob("*.c"))
CPP_SOURCES = sorted(p.relative_to(REPO).as_posix() for p in (CSRC / "mlx").glob("*.cpp"))
# The backend proper: every C++ source but the nanobind module (group.cpp and the ring's steps).
BACKEND_SOURCES = [s for s in CPP_SOURCES if not s.endswith("/module.cpp")]
NB_COMBINED = "nanobind/src/nb_combined.cpp"
CFFI_SOURCE = "mlx_ds4tp/_verbs.c (cffi)"
# -Werror=implicit-function-declaration: an undeclared function is an error in C99 and later, as
# Apple clang and zig's clang already make it; said here so no compiler default can weaken it.
STRICT_C = ("-Werror=implicit-function-declaration",)


def _zig() -> list:
    z = mt.zig()
    if z is None:
        pytest.skip("ziglang not installed: pip install ziglang (the test extra has it)")
    return z


def _python_api(symbol: str) -> bool:
    return symbol.startswith(("_Py", "__Py"))  # Mach-O names: C's name after an underscore


class MacBuild:
    """The whole cross build, once for the module: each step's outcome by name."""

    def __init__(self, out: Path):
        self.zig = _zig()
        self.out = out
        self.mlx = mt.macos_mlx(importlib.metadata.version("mlx"))
        cffi_kw = mt.literal_keywords(REPO / "mlx_ds4tp" / "_verbs_build.py", "set_source")
        ext_kw = mt.literal_keywords(REPO / "setup.py", "Extension")
        self.c_flags = [*cffi_kw["extra_compile_args"], *STRICT_C, "-I", str(CSRC)]
        defines = [f"-D{k}={v}" for k, v in ext_kw["define_macros"]]
        import nanobind

        nb_inc = Path(nanobind.include_dir())
        self.cpp_flags = [*ext_kw["extra_compile_args"], *defines, "-I", str(CSRC), "-I", str(self.mlx.include),
                          "-I", str(nb_inc), "-I", str(nb_inc.parent / "ext" / "robin_map" / "include"),
                          "-I", sysconfig.get_paths()["include"]]
        self.nb_combined = Path(nanobind.source_dir()) / "nb_combined.cpp"
        self.outcomes = mt.run_steps(self._compile_steps())
        self.outcomes.update(mt.run_steps(self._link_steps()))

    def obj(self, name: str) -> Path:
        return self.out / (re.sub(r"[^\w.]+", "_", name) + ".o")

    def c_step(self, name: str, source: Path, extra=(), obj: Optional[Path] = None) -> mt.Step:
        return mt.Step(name, (*self.zig, "cc", "-target", mt.ZIG_TARGET, *self.c_flags, *extra, "-c",
                              str(source), "-o", str(obj or self.obj(name))))

    def cpp_step(self, name: str, source: Path, extra=(), obj: Optional[Path] = None) -> mt.Step:
        return mt.Step(name, (*self.zig, "c++", "-target", mt.ZIG_TARGET, *self.cpp_flags, *extra, "-c",
                              str(source), "-o", str(obj or self.obj(name))))

    def link_step(self, name: str, objects, strict: bool, with_mlx: bool, into: Optional[Path] = None) -> mt.Step:
        """A macOS dylib of the objects: -undefined error (strict) or dynamic_lookup."""
        driver = "c++" if any(o in CPP_SOURCES or o == NB_COMBINED for o in objects) else "cc"
        mlx = ["-L", str(self.mlx.lib), "-lmlx"] if with_mlx else []
        return mt.Step(name, (*self.zig, driver, "-target", mt.ZIG_TARGET, "-shared", "-undefined",
                              "error" if strict else "dynamic_lookup", "-o", str((into or self.out) / name),
                              *[str(self.obj(o)) for o in objects], *mlx))

    def _compile_steps(self):
        cffi_c = self.out / "_verbs.c"
        mt.emit_cffi_source(REPO / "mlx_ds4tp" / "_verbs_build.py", cffi_c)
        steps = [self.c_step(s, REPO / s) for s in C_SOURCES]
        steps.append(self.c_step(CFFI_SOURCE, cffi_c, extra=("-I", sysconfig.get_paths()["include"])))
        # The C++ first: the longest, started while the C files fill the other worker.
        return [*(self.cpp_step(s, REPO / s) for s in CPP_SOURCES),
                self.cpp_step(NB_COMBINED, self.nb_combined), *steps]

    def _link_steps(self):
        return [
            self.link_step("libgroup.dylib", BACKEND_SOURCES, strict=True, with_mlx=True),
            self.link_step("libverbs_c.dylib", C_SOURCES, strict=True, with_mlx=False),
            self.link_step("_verbs.abi3.so", [*C_SOURCES, CFFI_SOURCE], strict=False, with_mlx=False),
            self.link_step("_pairgroup.so", [*CPP_SOURCES, NB_COMBINED], strict=False, with_mlx=True),
        ]

    def require(self, name: str) -> None:
        outcome = self.outcomes[name]
        assert outcome.ok, outcome.report()


@pytest.fixture(scope="module")
def mac_build(tmp_path_factory) -> MacBuild:
    return MacBuild(tmp_path_factory.mktemp("mac-build"))


@pytest.mark.parametrize("source", C_SOURCES)
def test_c_source_compiles_for_macos(mac_build, source):
    mac_build.require(source)


def test_the_cffi_module_source_compiles_for_macos(mac_build):
    mac_build.require(CFFI_SOURCE)


@pytest.mark.parametrize("source", [*CPP_SOURCES, NB_COMBINED])
def test_backend_source_compiles_against_the_macos_mlx_wheel(mac_build, source):
    mac_build.require(source)


def test_the_c_sources_link_for_macos_with_nothing_undefined(mac_build):
    mac_build.require("libverbs_c.dylib")


def test_the_backend_links_against_libmlx_dylib_with_nothing_undefined(mac_build):
    mac_build.require("libgroup.dylib")
    binds = bound_symbols(str(mac_build.out / "libgroup.dylib"))
    from_mlx = sorted(s for s, lib in binds.items() if lib == "@rpath/libmlx.dylib")
    assert from_mlx, f"nothing bound to libmlx.dylib: {sorted(set(binds.values()))}"


@pytest.mark.parametrize("image", ["_pairgroup.so", "_verbs.abi3.so"])
def test_a_module_leaves_only_python_to_load_time(mac_build, image):
    mac_build.require(image)
    binds = bound_symbols(str(mac_build.out / image))
    left = sorted(s for s, lib in binds.items() if lib == FLAT_LOOKUP and not _python_api(s))
    assert not left, f"{image}: symbols no library provides, left to load time: {left[:40]}"
    assert any(_python_api(s) for s in binds), f"{image} uses no Python C API symbol: the check saw nothing"


def test_pip_found_the_headers_and_libmlx_of_the_pinned_version(mac_build):
    version = importlib.metadata.version("mlx")
    text = (mac_build.mlx.include / "mlx" / "version.h").read_text()
    major, minor, patch = (re.search(rf"#define MLX_VERSION_{p} (\d+)", text).group(1)
                           for p in ("MAJOR", "MINOR", "PATCH"))
    assert f"{major}.{minor}.{patch}" == version
    assert (mac_build.mlx.lib / "libmlx.dylib").stat().st_size > 1 << 20
    assert mac_build.mlx.wheels[0][0].startswith(f"mlx-{version}-")


def test_every_c_source_is_one_the_build_compiles():
    """A C file that _verbs_build.py does not list would never be built, on a Mac or here."""
    tree = ast.parse((REPO / "mlx_ds4tp" / "_verbs_build.py").read_text())
    sources = next(ast.literal_eval(n.value) for n in tree.body
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SOURCES")
    assert sorted(f"mlx_ds4tp/{s}" for s in sources) == C_SOURCES


# -- the check fails when it should --------------------------------------------------------------

def _without_ppoll_guard(text: str) -> str:
    guarded = "#if defined(__linux__)\n    struct timespec ts"
    assert guarded in text, "csrc/util.c no longer guards ppoll as this test expects: update the test"
    return text.replace(guarded, "#if 1\n    struct timespec ts")


LINUX_ONLY_C = [
    ("ppoll without its guard", "mlx_ds4tp/csrc/util.c", _without_ppoll_guard, "ppoll"),
    ("accept4 and SOCK_CLOEXEC", "mlx_ds4tp/csrc/tcp/gate.c",
     lambda t: t + "\nint tp_x(int fd) { return accept4(fd, 0, 0, SOCK_CLOEXEC); }\n", "accept4"),
    ("epoll", "mlx_ds4tp/csrc/rdma/dev.c", lambda t: "#include <sys/epoll.h>\n" + t, "sys/epoll.h"),
    ("sched_setaffinity", "mlx_ds4tp/csrc/rdma/ucsim.c",
     lambda t: t + "\nint tp_x(void) { return sched_setaffinity(0, 0, 0); }\n", "sched_setaffinity"),
    ("accept4 in the C++ backend", "mlx_ds4tp/csrc/mlx/group.cpp",
     lambda t: t + "\nint ds4tp_x(int fd) { return ::accept4(fd, nullptr, nullptr, 0); }\n", "accept4"),
]


@pytest.mark.parametrize("case", LINUX_ONLY_C, ids=[c[0] for c in LINUX_ONLY_C])
def test_a_linux_only_call_put_back_fails_the_mac_build(mac_build, tmp_path, case):
    _, source, edit, name = case
    copy = tmp_path / Path(source).name
    copy.write_text(edit((REPO / source).read_text()))
    # The copy's own folder is not the original's: its local headers (group.h) by -I.
    make = mac_build.cpp_step if source.endswith(".cpp") else mac_build.c_step
    step = make(source, copy, extra=("-I", str((REPO / source).parent)), obj=tmp_path / "x.o")
    outcome = mt.run_steps([step])[source]
    assert not outcome.ok, f"the edited {source} still compiled for macOS"
    # The compiler's own error line names the file and the call.
    errors = [ln for ln in outcome.output.splitlines() if "error" in ln]
    assert any(copy.name in ln and name in ln for ln in errors), outcome.report()
    assert outcome.report().startswith(f"{source}: "), outcome.report()


def test_a_module_symbol_no_library_has_fails_the_check(mac_build, tmp_path):
    """group.cpp linked without libmlx: MLX's symbols are left to load time, and named."""
    group = BACKEND_SOURCES
    loose = mac_build.link_step("no_mlx.so", group, strict=False, with_mlx=False, into=tmp_path)
    assert mt.run_steps([loose])["no_mlx.so"].ok  # dynamic_lookup links anything
    binds = bound_symbols(str(tmp_path / "no_mlx.so"))
    left = [s for s, lib in binds.items() if lib == FLAT_LOOKUP and not _python_api(s)]
    assert any("mlx" in s for s in left), left
    strict = mac_build.link_step("no_mlx.dylib", group, strict=True, with_mlx=False, into=tmp_path)
    outcome = mt.run_steps([strict])["no_mlx.dylib"]
    assert not outcome.ok and "undefined" in outcome.output and "mlx" in outcome.output, outcome.output[:3000]


# -- the Linux-only tables (tests/linux_only.py) against macOS's own headers -----------------------

def test_every_name_the_tables_call_linux_only_is_missing_from_macos_headers(tmp_path):
    zig = _zig()
    entries = {m.c_name: m for m in (*PYTHON_ATTRS, *GLIBC_ATTRS, *C_NAMES, *PRESENT_ON_MAC)}
    lines = [f"#include <{h}>" for h in PROBE_HEADERS]
    for name, m in entries.items():
        if m.kind == "macro":
            lines += [f"#ifdef {name}", f"#error present: {name}", "#endif"]
        else:
            lines.append(f"void *probe_{name} = (void *)&{name};")
    probe = tmp_path / "probe.c"
    probe.write_text("\n".join(lines) + "\n")
    res = mt.run_steps([mt.Step("probe.c", (*zig, "cc", "-target", mt.ZIG_TARGET, "-ferror-limit=0", "-c",
                                            str(probe), "-o", str(tmp_path / "probe.o")))])["probe.c"]
    present = set(re.findall(r"error: present: (\w+)", res.output))
    undeclared = set(re.findall(r"undeclared identifier '(\w+)'", res.output))
    other = [ln for ln in res.output.splitlines() if "error:" in ln
             and "present:" not in ln and "undeclared identifier" not in ln]
    assert not other, "the probe itself failed:\n" + "\n".join(other)
    on_mac = {m.c_name for m in PRESENT_ON_MAC}
    wrong = [f"{name} ({m.module}.{m.attr}): {'missing from' if missing else 'present in'} macOS's headers"
             for name, m in entries.items()
             for missing in [name in undeclared if m.kind == "function" else name not in present]
             if missing != (name not in on_mac)]
    assert not wrong, "tests/linux_only.py says otherwise of:\n" + "\n".join(wrong)
