"""`ds4tp doctor`: check what a pair needs and say what to fix.

Each check prints one line: ok, warn (works, but slower or degraded) or FAIL
(a pair cannot run), with the fix. The exit code is 1 when anything FAILs.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import threading
import time
from typing import List, Tuple

from .. import transport as tr

OK, WARN, FAIL = "ok", "warn", "FAIL"


def _line(status: str, what: str, detail: str) -> Tuple[str, str]:
    print(f"[{status:>4}] {what}: {detail}", flush=True)
    return status, what


def check_python() -> List[Tuple[str, str]]:
    out = [_line(OK, "python", f"{platform.python_version()} on {platform.system()} {platform.machine()}")]
    try:
        import mlx.core as mx

        out.append(_line(OK, "mlx", f"{mx.__version__} (default device {mx.default_device()})"))
    except ImportError as exc:
        out.append(_line(FAIL, "mlx", f"not importable ({exc}); pip install mlx (macOS) or 'mlx[cpu]' (Linux)"))
    try:
        import mlx_lm

        out.append(_line(OK, "mlx-lm", getattr(mlx_lm, "__version__", "installed")))
    except ImportError as exc:
        out.append(_line(FAIL, "mlx-lm", f"not importable ({exc}); pip install mlx-lm"))
    return out


def check_verbs() -> List[Tuple[str, str]]:
    out = []
    try:
        tr.load_verbs()
    except tr.RdmaUnavailableError as exc:
        return [_line(FAIL, "C module", str(exc))]
    out.append(_line(OK, "C module", "mlx_ds4tp._verbs is built"))
    # Resolved once here and passed to every probe, as PairConfig does for a pair.
    library = tr.verbs_library()
    if library:
        out.append(_line(OK, "verbs library", f"{library} (from {tr.VERBS_LIBRARY_ENV})"))
    ok, reason = tr.rdma_probe(None, library)
    if ok:
        out.append(_line(OK, "verbs device", reason or "a device with an active port and an IPv4-mapped GID"))
    else:
        out.append(_line(WARN, "verbs device", f"{reason} -- gates will use TCP"))
    ok, reason = tr.rdma_probe(tr.UCSIM, library)
    out.append(_line(OK if ok else FAIL, "ucsim (emulated Thunderbolt UC)", reason or "available"))
    return out


def check_macos() -> List[Tuple[str, str]]:
    if sys.platform != "darwin":
        return [_line(OK, "macOS checks", "skipped (not macOS)")]
    out = []
    rdma_ctl = shutil.which("rdma_ctl")
    if rdma_ctl is None:
        out.append(_line(WARN, "rdma_ctl", "not found: this macOS has no Thunderbolt RDMA (needs macOS 26.2+)"))
    else:
        res = subprocess.run([rdma_ctl, "status"], capture_output=True, text=True, timeout=10)
        text = (res.stdout + res.stderr).strip().replace("\n", " ")
        status = OK if "enabled" in text.lower() else WARN
        out.append(_line(status, "rdma_ctl status", text or f"exit {res.returncode}"
                         + ("" if status == OK else "; enable it with `rdma_ctl enable` in recovery mode")))
    res = subprocess.run(["ifconfig", "bridge0"], capture_output=True, text=True, timeout=10)
    if res.returncode == 0:
        out.append(_line(WARN, "Thunderbolt Bridge", "bridge0 exists: its address does not count; give the "
                         "Thunderbolt member interface (e.g. en1) its own IPv4 (sudo ifconfig en1 inet "
                         "10.99.0.1/30 alias)"))
    else:
        out.append(_line(OK, "Thunderbolt Bridge", "no bridge0"))
    return out


def check_ucsim_pair() -> List[Tuple[str, str]]:
    """Both ranks in this process over the emulated device: proves the whole
    RDMA path (bring-up, warm-up, gates) works on this machine."""
    import numpy as np

    from .. import gate_ops
    from ..testing.localpair import free_port

    port = free_port()
    groups: list = [None, None]
    errors: list = []

    def rank(i: int) -> None:
        try:
            if i == 0:
                groups[0] = gate_ops.init(role="leader", listen=("127.0.0.1", port), transport="rdma",
                                          rdma_device=tr.UCSIM, timeout=10.0)
            else:
                groups[1] = gate_ops.init(role="worker", coordinator=("127.0.0.1", port),
                                          transport="rdma", rdma_device=tr.UCSIM, timeout=10.0)
            g = groups[i]
            send = np.full(4096, i + 1.0, np.float32)
            recv = np.empty_like(send)
            for _ in range(200):
                g.pair.gate(send, recv)
            if not np.all(recv == 2.0 - i):
                errors.append(f"rank {i} received {recv[:2]}")
        except Exception as exc:  # noqa: BLE001 - reported as a doctor line
            errors.append(f"rank {i}: {exc}")

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in (0, 1)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for g in groups:
        if g is not None:
            g.close()
    if errors or any(t.is_alive() for t in threads):
        return [_line(FAIL, "ucsim pair", "; ".join(errors) or "did not finish in 30 s")]
    return [_line(OK, "ucsim pair", f"bring-up, warm-up and 200 gates in {time.perf_counter() - t0:.2f} s")]


def peer_round_trip(args) -> List[Tuple[str, str]]:
    """A short gate run against the other machine's `ds4tp doctor --listen`;
    with --model, both sides' model fingerprints are compared at the hello."""
    import numpy as np

    from .. import gate_ops
    from ..bench.gates import percentiles
    from ..link.identity import model_identity

    # A doctor should answer soon: at most 30 s (dial) / 120 s (listen), less
    # when DS4_TP_TIMEOUT_SEC says so.
    limit = tr.default_timeout()
    identity = model_identity(args.model) if getattr(args, "model", None) else None
    if args.peer:
        host, port = args.peer[0], int(args.peer[1])
        g = gate_ops.init(role="worker", coordinator=(host, port), transport=args.transport,
                          rdma_device=args.rdma_device, timeout=min(30.0, limit), secret=args.secret,
                          identity=identity)
    else:
        host, port = args.listen[0], int(args.listen[1])
        g = gate_ops.init(role="leader", listen=(host, port), transport=args.transport,
                          rdma_device=args.rdma_device, timeout=min(120.0, limit), secret=args.secret,
                          identity=identity)
    with g:
        out = []
        if identity is not None:
            here, there = g.pair.fingerprint_labels()
            out.append(_line(OK, "model fingerprint", f"{here} here, {there} on the {g.pair.peer_name} "
                             f"({args.model})"))
        send = np.full(4096, g.rank() + 1.0, np.float32)
        recv = np.empty_like(send)
        samples = []
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            g.pair.gate(send, recv)
            samples.append(time.perf_counter_ns() - t0)
        good = bool(np.all(recv == 2.0 - g.rank()))
        p = percentiles(samples[200:])
        return out + [_line(OK if good else FAIL, f"gate round trip with {host}:{port}",
                            f"transport {g.transport}, 16 KiB p50 {p['p50_us']} us p99 {p['p99_us']} us"
                            + ("" if good else ", WRONG DATA"))]


def run(args) -> int:
    results = check_python() + check_verbs() + check_macos()
    if not any(s == FAIL and w == "C module" for s, w in results):
        results += check_ucsim_pair()
    if args.peer or args.listen:
        try:
            results += peer_round_trip(args)
        except (tr.TransportError, ValueError, FileNotFoundError) as exc:
            results.append(_line(FAIL, "gate round trip", str(exc)))
    failed = [w for s, w in results if s == FAIL]
    print(f"doctor: {len(results)} checks, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
