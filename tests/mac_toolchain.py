"""Cross-compiling the package for Apple silicon Macs on this Linux box (tests/test_mac_build.py).

The compiler is zig's clang (PyPI ``ziglang``, run as ``python -m ziglang cc``), whose
``aarch64-macos`` target ships macOS's libc headers and libSystem's symbol list (a .tbd stub).
MLX comes from its macOS arm64 wheels on the package registry: ``mlx`` itself holds only the
Python side, and names (Requires-Dist, marked for Darwin) the wheel with ``include/`` and
``lib/libmlx.dylib`` (``mlx-metal`` for MLX 0.32). Only those two folders are kept, in
$XDG_CACHE_HOME/mlx_ds4tp (~/.cache/mlx_ds4tp), one folder per MLX version. zig caches what it
compiles by the hash of its inputs and flags (~/.cache/zig), so an unchanged source is not
compiled again, and libc++ (which zig builds from source for the target once, about a minute on
two cores) neither.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# The oldest macOS MLX's wheels are built for, and the deployment target this build compiles for.
MAC_PLATFORM = "macosx_14_0_arm64"
ZIG_TARGET = "aarch64-macos.14.0"
# Two compilers at a time: the machines this runs on have two cores.
WORKERS = 2
# The first C++ link builds libc++ for the target (a minute alone, more beside other tests).
STEP_TIMEOUT = 900.0
DOWNLOAD_TIMEOUT = 600.0


def zig() -> Optional[List[str]]:
    """The command that runs zig's compiler driver, or None without the ziglang package."""
    try:
        if importlib.util.find_spec("ziglang") is None:
            return None
    except (ImportError, ValueError):  # a broken or blocked install: as good as none
        return None
    return [sys.executable, "-m", "ziglang"]


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_ds4tp"


@dataclass(frozen=True)
class MacMLX:
    """MLX's macOS arm64 headers and libraries, for one version."""

    version: str
    include: Path
    lib: Path
    wheels: Tuple[Tuple[str, int], ...]  # (file name, bytes) of what was downloaded for them


def _pip_download(requirement: str, into: Path) -> Path:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
            MAC_PLATFORM, "--disable-pip-version-check", "-d", str(into), requirement]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT)
    if res.returncode != 0:
        raise RuntimeError(f"pip could not download {requirement} for {MAC_PLATFORM} "
                           f"({' '.join(argv)}):\n{res.stderr[-3000:]}")
    name = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in into.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement}: expected one wheel in {into}, found "
                           f"{[p.name for p in into.iterdir()]}")
    return wheels[0]


def _darwin_requirements(wheel: zipfile.ZipFile) -> List[str]:
    """The wheel's Requires-Dist entries that a Mac installs (marker true on Darwin, no extra)."""
    from packaging.requirements import Requirement

    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    env = {"platform_system": "Darwin", "sys_platform": "darwin", "platform_machine": "arm64", "extra": ""}
    out = []
    for line in wheel.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(str(req.name) + str(req.specifier))
    return out


def _kept(name: str) -> bool:
    parts = name.split("/")
    return len(parts) > 2 and parts[0] == "mlx" and (
        parts[1] == "include" or (parts[1] == "lib" and len(parts) == 3 and name.endswith(".dylib")))


def macos_mlx(version: str) -> MacMLX:
    """MLX `version`'s macOS arm64 include/ and lib/, downloaded once and cached."""
    final = cache_root() / f"mlx-{version}-{MAC_PLATFORM}"
    if (final / "wheels.txt").is_file():
        return _cached(version, final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".partial-") as tmp:
        tmp_path = Path(tmp)
        todo, seen, wheels = [f"mlx=={version}"], set(), []
        while todo:  # mlx, then what it requires on a Mac, until a wheel holds the headers
            req = todo.pop(0)
            if req in seen:
                continue
            seen.add(req)
            whl = _pip_download(req, tmp_path / "wheels")
            wheels.append((whl.name, whl.stat().st_size))
            with zipfile.ZipFile(whl) as z:
                members = [n for n in z.namelist() if _kept(n)]
                z.extractall(tmp_path / "out", members)
                if not members:
                    todo += [r for r in _darwin_requirements(z) if r.split("==")[0] not in ("mlx",)]
        out = tmp_path / "out" / "mlx"
        if not (out / "include" / "mlx" / "mlx.h").is_file() or not (out / "lib" / "libmlx.dylib").is_file():
            raise RuntimeError(f"no wheel of mlx=={version} for {MAC_PLATFORM} (downloaded: "
                               f"{[w for w, _ in wheels]}) holds mlx/include/mlx/mlx.h and "
                               "mlx/lib/libmlx.dylib: MLX's wheel layout changed; update tests/mac_toolchain.py")
        (out / "wheels.txt").write_text("".join(f"{w} {n}\n" for w, n in wheels))
        try:
            os.rename(out, final)
        except OSError:
            if not (final / "wheels.txt").is_file():  # not another process's finished copy
                raise
    return _cached(version, final)


def _cached(version: str, root: Path) -> MacMLX:
    wheels = tuple((w, int(n)) for w, n in (line.split() for line in (root / "wheels.txt").read_text().splitlines()))
    return MacMLX(version, root / "include", root / "lib", wheels)


# -- the package's own build settings, read from its build scripts (so this follows them) -----

def literal_keywords(path: Path, call: str) -> Dict[str, object]:
    """The literal keyword arguments of the one call to `call` (a name or attribute) in a script."""
    tree = ast.parse(path.read_text(), filename=str(path))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and (getattr(n.func, "id", None) == call or getattr(n.func, "attr", None) == call)]
    if len(calls) != 1:
        raise RuntimeError(f"{path}: expected one call to {call}, found {len(calls)}")
    out = {}
    for kw in calls[0].keywords:
        try:
            out[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            pass  # computed at build time (paths, an environment switch): not a flag to copy
    return out


def emit_cffi_source(build_script: Path, out: Path) -> None:
    """The C file cffi generates for the _verbs module (what `setup.py build_ext` compiles)."""
    spec = importlib.util.spec_from_file_location("_mlx_ds4tp_verbs_build", build_script)
    module = importlib.util.module_from_spec(spec)
    with redirect_stdout(io.StringIO()):  # cffi says "generating <file>"
        spec.loader.exec_module(module)
        module.ffibuilder.emit_c_code(str(out))


# -- running the compiler --------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    name: str  # what a failure is reported as: the source file, or the image linked
    argv: Tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    name: str
    ok: bool
    output: str

    def report(self) -> str:
        """The file and the compiler's diagnostics (its errors first), for an assertion message."""
        lines = self.output.splitlines()
        errors = [ln for ln in lines if "error" in ln]
        rest = [ln for ln in lines if "error" not in ln]
        text = "\n".join(errors + rest)
        return f"{self.name}: zig failed for {ZIG_TARGET}:\n{text[:6000]}"


def run_steps(steps: Sequence[Step], workers: int = WORKERS) -> Dict[str, Outcome]:
    def one(step: Step) -> Outcome:
        try:
            res = subprocess.run(step.argv, capture_output=True, text=True, timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            return Outcome(step.name, False, f"timed out after {STEP_TIMEOUT:.0f} s: {' '.join(step.argv)}")
        return Outcome(step.name, res.returncode == 0, (res.stderr + res.stdout).strip())

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return {o.name: o for o in pool.map(one, steps)}
