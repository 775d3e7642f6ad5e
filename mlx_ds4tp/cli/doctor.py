"""`ds4tp doctor`: check what a pair (or a group of N ranks, --ranks N) needs and say what to fix.

Each check prints one line: ok, warn (works, but slower or degraded) or FAIL
(a pair cannot run), with the fix. The exit code is 1 when anything FAILs.
The checks of a formed group (any N, 2 by default) are doctor_mesh.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
from typing import List, Optional

from ..errors import MissingCableError, RdmaUnavailableError, TransportError
from ..link.config import VERBS_LIBRARY_ENV, LinkSettings, PairAddress, default_timeout, pair_address, verbs_library
from ..link.native import load_verbs
from ..link.rdma import UCSIM, rdma_probe
from ..split.measure import measure_rank, memory_limit
from .doctor_cables import CableProbe, cable_checks
from .doctor_lines import FAIL, OK, WARN, Check, line as _line
from .doctor_mesh import add_ranks_arg, check_ucsim_group, group_checks, group_size
from .model_arg import add_model_arg
from .pair_args import (
    TRANSPORT_HELP,
    add_interface_arg,
    add_transport_args,
    discovery_from_args,
    link_from_args,
    parse_address,
    refuse_mlx,
)

HELP = "check what a pair (or --ranks N machines) needs and say what to fix"
# The build switch of _verbs_build.py: the C module without the ibverbs provider.
NO_IBVERBS_ENV = "MLX_DS4TP_NO_IBVERBS"


def check_python() -> List[Check]:
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


# Where a compiler finds infiniband/verbs.h on Linux (rdma-core's libibverbs-dev).
VERBS_HEADER_DIRS = ("/usr/include", "/usr/local/include")


def verbs_header() -> Optional[str]:
    """The infiniband/verbs.h a build would compile against here, or None."""
    for d in VERBS_HEADER_DIRS:
        path = os.path.join(d, "infiniband", "verbs.h")
        if os.path.isfile(path):
            return path
    return None


def no_provider_cause(reason: str) -> str:
    """Why a C module without the ibverbs provider has none, and the fix. The C module only
    knows it was built without infiniband/verbs.h (and says to install the header); when the
    header is installed, the real cause is the build switch (or a build from before the
    header), and the fix is a rebuild."""
    header = verbs_header()
    if header is None:
        return reason
    cause = reason.split(";")[0]
    switch = (f"{NO_IBVERBS_ENV}={os.environ[NO_IBVERBS_ENV]} is set here: the module was built "
              f"with that switch on purpose" if os.environ.get(NO_IBVERBS_ENV)
              else f"the module was built with {NO_IBVERBS_ENV}=1 or before the header was installed")
    return (f"{cause}, yet {header} is installed: {switch}; to get the ibverbs provider, rebuild "
            f"without it: `env -u {NO_IBVERBS_ENV} pip install -e .`")


def check_verbs() -> List[Check]:
    out = []
    try:
        _, lib = load_verbs()
    except RdmaUnavailableError as exc:
        return [_line(FAIL, "C module", str(exc))]
    built_with = bool(lib.tp_built_with_ibverbs())
    out.append(_line(OK, "C module", "mlx_ds4tp._verbs is built" + (
        "" if built_with else " (ucsim only: without the ibverbs provider)")))
    # Resolved once here and passed to every probe, as LinkSettings.resolved() does for a pair.
    library = verbs_library()
    if library:
        out.append(_line(OK, "verbs library", f"{library} (from {VERBS_LIBRARY_ENV})"))
    ok, reason = rdma_probe(None, library)
    if ok:
        out.append(_line(OK, "verbs device", reason or "a device with an active port and an IPv4-mapped GID"))
    else:
        if not built_with:
            reason = no_provider_cause(reason)
        out.append(_line(WARN, "verbs device", f"{reason} -- gates will use TCP"))
    ok, reason = rdma_probe(UCSIM, library)
    out.append(_line(OK if ok else FAIL, "ucsim (emulated Thunderbolt UC)", reason or "available"))
    return out


def check_macos() -> List[Check]:
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


def peer_round_trip(args: argparse.Namespace, link: LinkSettings) -> List[Check]:
    """A short run of the model's collective (the all_sum its gates call) against the other
    machines' `ds4tp doctor`: the group's links, with --model both sides' model fingerprints
    (compared at the hello) and the shares, then the timed all_sums (doctor_mesh.group_checks)."""
    from .. import gate_ops
    from ..link.identity import model_identity

    # A doctor should answer soon: at most 30 s (a worker of two ranks, or of its leader's size,
    # dialing) / 120 s (listening, or a worker of a group of N, which waits for all N), less when
    # DS4_TP_TIMEOUT_SEC says so.
    limit = default_timeout()
    identity = model_identity(args.model) if args.model else None
    where = "{0}:{1}".format(*link.address.address) if link.discovery is None else "the group discovery found"
    short = link.address.role == "worker" and (link.size or 2) == 2
    wait = min(30.0 if short else 120.0, limit)
    g = gate_ops.init_pair(dataclasses.replace(link, timeout=wait, figures=measure_rank(memory_limit())),
                           identity)
    with g:
        return group_checks(g, args.model, where)


def check_split(size: int = 2) -> List[Check]:
    """This Mac's figures for `--split auto`, alone (no peer to pick a share with)."""
    from ..split.auto import figures_line

    figures = measure_rank(memory_limit())
    return [_line(OK, "split auto", f"local figures only, no peer ({figures_line('this Mac', figures)}): "
                  "beside a Mac within 10% of it, auto splits evenly; `--peer`/`--listen` with --model "
                  f"prints the share for the {size} ranks")]


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp doctor`."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--peer", nargs=2, metavar=("HOST", "PORT"),
                       help="run a short gate round trip against `ds4tp doctor --listen` on the peer")
    where.add_argument("--listen", nargs=2, metavar=("HOST", "PORT"),
                       help="wait for the peer's `ds4tp doctor --peer` and answer its gates")
    add_transport_args(p, "with --peer/--listen: " + TRANSPORT_HELP,
                       "with --peer/--listen: verbs device (e.g. rdma_en1) or 'ucsim'")
    add_model_arg(p, "with --peer/--listen: compare this model directory's fingerprint with the "
                     "peer's at the hello and print both", required=False, metavar="PATH")
    # Only when named: a plain `ds4tp doctor` checks this Mac alone and never waits for a peer.
    add_interface_arg(p)
    add_ranks_arg(p)


def check_args(args: argparse.Namespace) -> Optional[LinkSettings]:
    """The round trip's link (the --peer side dials as the worker, the --listen side
    answers as the leader, with --ranks N the group's size), or None without either; bad
    flags exit naming the flag."""
    no_mlx = ("its round trip times a pair's exchange, and MLX's own group is no pair (`ds4tp bench "
              "--transport mlx` times MLX's ring)")
    if not (args.peer or args.listen):
        size = group_size(args)
        if args.interface:
            # Every Mac runs `ds4tp doctor --interface NAME [--ranks N]`: they find each other as
            # run and serve do.
            refuse_mlx(args, "doctor", no_mlx)
            discovery = discovery_from_args(args, "doctor", "any")
            return link_from_args(args, PairAddress(None, None, None), "doctor", discovery=discovery,
                                  size=size)
        if args.model is not None:
            raise SystemExit("ds4tp doctor: --model is compared with the peer's: give --peer, --listen "
                             "or --interface")
        return None
    flag = "--peer" if args.peer else "--listen"
    here = parse_address(args.peer or args.listen, flag)
    try:
        address = pair_address("worker", None, here) if args.peer else pair_address("leader", here, None)
    except ValueError as exc:
        raise SystemExit(f"ds4tp doctor: {flag}: {exc}") from None
    # The --peer side takes the leader's group size where a worker can (doctor_mesh.group_size).
    size = group_size(args, peer=bool(args.peer))
    refuse_mlx(args, "doctor", no_mlx)
    return link_from_args(args, address, "doctor", size=size)


def main(args: argparse.Namespace) -> int:
    """Every check, one line each; 1 when any FAILs."""
    link = check_args(args)
    # A --peer that takes the leader's size (None) checks a pair here: it knows no N yet.
    size = (group_size(args) if link is None else link.size) or 2
    results = check_python() + check_verbs() + check_macos()
    if not any(s == FAIL and w == "C module" for s, w in results):
        results += check_ucsim_group(size)
    if link is None:
        results += check_split(size)
    else:
        probe = CableProbe(link.cables or ())  # the cables named: each diagnosed at its port
        probe.start()
        try:
            results += peer_round_trip(args, link)
        except MissingCableError as exc:
            results.append(_line(FAIL, "missing cable", f"{exc}"))
        except (TransportError, ValueError, FileNotFoundError) as exc:
            results.append(_line(FAIL, "all_sum round trip", str(exc)))
        finally:
            results += cable_checks(probe)
            probe.close()
    failed = [w for s, w in results if s == FAIL]
    print(f"doctor: {len(results)} checks, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
