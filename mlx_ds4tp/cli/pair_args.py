"""The flags that say how this process joins the pair, shared by `ds4tp run`, `serve` and
`bench`: --role, --listen/--coordinator, --transport, --rdma-device, --rdma-gid-index and
--secret, and their one check (the address triple becomes a PairAddress here, once)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence, Tuple

from ..link.config import PairAddress, pair_address

TRANSPORT_HELP = ("gates over 'rdma' (error if either machine lacks a device), 'tcp', or 'auto': "
                  "RDMA when both ranks have a usable device, else TCP (default auto)")


RDMA_DEVICE_HELP = ("verbs device (e.g. rdma_en1), or 'ucsim' for the emulated Thunderbolt "
                    "device (default: the first device with an active port)")


def add_pair_args(p: argparse.ArgumentParser, role_help: str,
                  rdma_device_help: str = RDMA_DEVICE_HELP) -> None:
    """--role, --listen, --coordinator, --rdma-device and --secret; `role_help` says what
    --role means for this command (required, or what happens without it)."""
    p.add_argument("--role", choices=("leader", "worker"), help=role_help)
    p.add_argument("--listen", nargs=2, metavar=("HOST", "PORT"),
                   help="leader: the address it listens on for the worker (e.g. 10.99.0.1 9911)")
    p.add_argument("--coordinator", nargs=2, metavar=("HOST", "PORT"),
                   help="worker: the leader's --listen address")
    p.add_argument("--rdma-device", default=None, help=rdma_device_help)
    p.add_argument("--secret", default=None,
                   help="shared secret both ranks must hold (default DS4_TP_SECRET; the variable "
                        "keeps it out of `ps`)")


def add_transport_args(p: argparse.ArgumentParser) -> None:
    """--transport (auto, tcp, rdma) and --rdma-gid-index: how the gates travel."""
    p.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="auto", help=TRANSPORT_HELP)
    p.add_argument("--rdma-gid-index", type=int, default=None, metavar="N",
                   help="the verbs GID index to use (default: the device's IPv4-mapped GID)")


def parse_address(pair: Optional[Sequence[str]], flag: str) -> Optional[Tuple[str, int]]:
    """(HOST, PORT) of a `--listen HOST PORT` style flag; exits naming the flag when PORT
    is not an integer."""
    if pair is None:
        return None
    host, port = pair
    try:
        return host, int(port)
    except ValueError:
        raise SystemExit(f"ds4tp: {flag} {host} {port}: PORT must be an integer, e.g. 9911") from None


def address_from_args(args: argparse.Namespace, command: str) -> Optional[PairAddress]:
    """The checked address triple of add_pair_args' flags; None when none of them is given
    (both ranks on this machine, for the commands that can do that). A bad triple exits
    naming the flags and the fix."""
    if args.role is None and args.listen is None and args.coordinator is None:
        return None
    listen = parse_address(args.listen, "--listen")
    coordinator = parse_address(args.coordinator, "--coordinator")
    try:
        return pair_address(args.role, listen, coordinator)
    except ValueError as exc:
        raise SystemExit(f"ds4tp {command}: {exc}") from None


def one_rank_address(args: argparse.Namespace, command: str, what: str) -> PairAddress:
    """address_from_args for a command that runs one rank only: without --role it exits
    saying what to give (`what`: what the leader does besides listening)."""
    address = address_from_args(args, command)
    if address is None:
        raise SystemExit(f"ds4tp {command}: give --role leader --listen HOST PORT{what} or "
                         f"--role worker --coordinator HOST PORT (`ds4tp demo` runs both ranks "
                         f"on this machine)")
    return address


def check_at_least(command: str, checks: Sequence[Tuple[str, int, int]]) -> None:
    """Each (flag, value, low): exit naming the first flag whose value is under its low."""
    for flag, value, low in checks:
        if value < low:
            raise SystemExit(f"ds4tp {command}: {flag} {value} must be >= {low}")
