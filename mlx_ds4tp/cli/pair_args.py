"""The flags that say how this process joins its group (a pair, or N ranks), defined here once for every command that
takes them (`ds4tp run`, `serve`, `bench`, `doctor`, `demo` and the spawned ranks): --role,
--listen/--coordinator, --interface, --ranks (for the commands that run on N machines: the
leader's group size, which a worker that dials it learns, and the size discovery looks for),
--transport, --rdma-device, --rdma-gid-index, --secret and --insecure; and their one check, which
turns them into a PairAddress and a LinkSettings (with DiscoverySettings when the rank finds its
peers itself), the secret resolved once for every way of joining and an open address refused
without one (link/exposure.py)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Dict, Optional, Sequence, Tuple

from ..base.log import log
from ..link.config import (
    MAX_MESH_SIZE,
    MLX,
    TRANSPORTS,
    DiscoverySettings,
    LinkSettings,
    PairAddress,
    pair_address,
)

TRANSPORT_HELP = ("gates over 'rdma' (error if either machine lacks a device), 'tcp', 'auto': "
                  "RDMA when both ranks have a usable device, else TCP (default auto), or 'mlx': "
                  "MLX's own group (ring or JACCL) where the command can use one")
RDMA_DEVICE_HELP = ("verbs device (e.g. rdma_en1), or 'ucsim' for the emulated Thunderbolt "
                    "device (default: the first device with an active port)")
# Why `ds4tp run` and `serve` cannot run over MLX's own group: what they need of a pair.
LOCKSTEP_NEEDS_PAIR = ("the leader drives the worker over the pair's control channel (sessions, "
                       "prompts, decode steps), which MLX's own group does not have")


def add_pair_args(p: argparse.ArgumentParser, role_help: str) -> None:
    """--role, --listen and --coordinator; `role_help` says what --role means for this command
    (required, or what happens without it)."""
    p.add_argument("--role", choices=("leader", "worker"), help=role_help)
    p.add_argument("--listen", nargs=2, metavar=("HOST", "PORT"),
                   help="leader: the address it listens on for the worker (e.g. 10.99.0.1 9911)")
    p.add_argument("--coordinator", nargs=2, metavar=("HOST", "PORT"),
                   help="worker: the leader's --listen address")


def add_interface_arg(p: argparse.ArgumentParser) -> None:
    """--interface, for the commands that find their peer by themselves, and on Linux the
    interfaces an explicit address may be on without a secret (link/exposure.py)."""
    p.add_argument("--interface", action="append", default=None, metavar="NAME",
                   help="without --listen/--coordinator: find the other rank by multicast DNS on "
                        "this interface (repeat for several; default on a Mac: the members of the "
                        "Thunderbolt Bridge; required on Linux; lo for both ranks on this machine). "
                        "With --listen/--coordinator: the cables to the other ranks (each link runs on "
                        "the cable it shares with its peer, its address and RDMA device; on Linux also "
                        "where the group may form without a secret, as a Thunderbolt link is on a Mac)")


def add_ranks_arg(p: argparse.ArgumentParser) -> None:
    """--ranks N: how many machines the model runs on (the leader's: default 2; a worker that
    dials its leader with --coordinator takes the leader's without it). With --interface (no
    --listen/--coordinator) each rank looks for the other N-1 with the same model and secret
    (link/findgroup.py for N > 2, link/meet.py for a pair)."""
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help=f"how many machines (ranks) the model runs on, 2 to {MAX_MESH_SIZE}: the leader's "
                        "(default 2); a worker started with --coordinator takes the leader's without it "
                        "(with it, the two must agree). Found by discovery (--interface), every rank "
                        "gives the same N (default 2): they find each other, elect one leader (rank 0) "
                        "and number the others")


def ranks_from_args(args: argparse.Namespace, command: str) -> Optional[int]:
    """--ranks checked: 2 .. MAX_MESH_SIZE, else exit naming the value and the range. Without it:
    None (the leader's) for a worker that dials its leader (--role worker --coordinator), else 2."""
    n = args.ranks
    if n is None:
        return None if takes_leaders_size(args) else 2
    if not 2 <= n <= MAX_MESH_SIZE:
        raise SystemExit(f"ds4tp {command}: --ranks {n}: give the number of machines, 2 to {MAX_MESH_SIZE}")
    return n


def takes_leaders_size(args: argparse.Namespace) -> bool:
    """Whether this rank learns the group's size from its leader: a worker that dials it at an
    address (--role worker --coordinator) without --ranks."""
    return (getattr(args, "ranks", None) is None and getattr(args, "role", None) == "worker"
            and getattr(args, "coordinator", None) is not None)


def add_transport_args(p: argparse.ArgumentParser, transport_help: str = TRANSPORT_HELP,
                       rdma_device_help: str = RDMA_DEVICE_HELP, extra_choice: Optional[str] = None,
                       default: str = "auto") -> None:
    """--transport (auto, tcp, rdma, mlx, and `extra_choice`, a value the command handles
    itself), --rdma-device, --rdma-gid-index and --secret: how the gates travel."""
    choices = TRANSPORTS + ((extra_choice,) if extra_choice else ())
    p.add_argument("--transport", choices=choices, default=default, help=transport_help)
    p.add_argument("--rdma-device", default=None, help=rdma_device_help)
    p.add_argument("--rdma-devices", default=None, metavar="PEER=DEVICE,...",
                   help="the RDMA device towards each peer rank (e.g. 1=rdma_en3,2=rdma_en5, or "
                        "1=ucsim:eth1), checked against the cable each link finds with --interface; "
                        "default: each link's own cable's device")
    p.add_argument("--rdma-gid-index", type=int, default=None, metavar="N",
                   help="the verbs GID index to use (default: the device's IPv4-mapped GID)")
    p.add_argument("--secret", default=None,
                   help="shared secret every rank must hold (default DS4_TP_SECRET, else the code "
                        "`ds4tp pair` stored; the variable and the stored code keep it out of `ps`)")
    p.add_argument("--insecure", action="store_true",
                   help="with an address (--listen/--coordinator, --peer): form the group with no "
                        "secret where others can reach it (not loopback or a Thunderbolt link), with "
                        "a warning; without it such a rank stops (discovery always needs the secret there)")


def refuse_mlx(args: argparse.Namespace, command: str, why: str) -> None:
    """Exit naming why `command` cannot run over --transport mlx, when it was given."""
    if args.transport == MLX:
        raise SystemExit(f"ds4tp {command}: --transport mlx (MLX's own group) cannot carry this "
                         f"command: {why}; give --transport auto, tcp or rdma")


def link_from_args(args: argparse.Namespace, address: PairAddress, command: str,
                   transport: Optional[str] = None,
                   discovery: Optional[DiscoverySettings] = None,
                   size: Optional[int] = 2) -> LinkSettings:
    """The checked LinkSettings of add_transport_args' flags for this rank's `address`
    (`transport`: what the command made of its own --transport value; `discovery`: how it finds
    its peer, when it does; `size`: ranks_from_args' group size, None: the leader's); a bad value exits naming it and
    the fix. Every rank, at an address or discovering, proves one secret: --secret, else
    DS4_TP_SECRET, else the code `ds4tp pair` stored. At an address others can reach (not
    loopback or a Thunderbolt link) a rank without one exits naming the address and the fixes,
    unless --insecure (then one warning line)."""
    from ..link import exposure
    from ..link.pair_secret import join_secret

    insecure = getattr(args, "insecure", False)
    if insecure and discovery is not None:
        raise SystemExit(f"ds4tp {command}: --insecure is for ranks given addresses (--listen/"
                         "--coordinator); ranks that find each other on an open network need the pair "
                         "secret: run `ds4tp pair` on each Mac")
    try:
        secret = join_secret(args.secret)
        # The interfaces named are the cables, at an address or discovering (a Mac's default
        # discovery interfaces, the bridge's members, hold no address: no cable named then).
        cables = tuple(getattr(args, "interface", None) or ()) if discovery is None else discovery.interfaces
        link = LinkSettings(address, transport or args.transport, rdma_device=args.rdma_device,
                            gid_index=args.rdma_gid_index, secret=secret, discovery=discovery,
                            size=size, cables=cables,
                            rdma_devices=parse_rdma_devices(getattr(args, "rdma_devices", None))).check()
        if discovery is None and link.transport != MLX:
            warning = exposure.check_join(address, secret is not None, insecure,
                                          exposure.cable_interfaces(getattr(args, "interface", None) or ()))
            if warning:
                log(warning)
    except ValueError as exc:
        raise SystemExit(f"ds4tp {command}: {exc}") from None
    return link


def parse_rdma_devices(text: Optional[str]) -> Optional[Dict[int, str]]:
    """--rdma-devices PEER=DEVICE,... as {peer rank: device}; None when not given. A bad item is
    a ValueError naming it and the form."""
    if text is None:
        return None
    out: Dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        peer, sep, device = item.partition("=")
        if not sep or not peer.strip().isdigit() or not device.strip():
            raise ValueError(f"--rdma-devices {text}: {item!r} is not PEER=DEVICE; give e.g. "
                             "1=rdma_en3,2=rdma_en5")
        out[int(peer)] = device.strip()
    return out


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


def discovering(args: argparse.Namespace) -> bool:
    """Whether this rank finds its peer itself: neither --listen nor --coordinator given."""
    return args.listen is None and args.coordinator is None


def discovery_from_args(args: argparse.Namespace, command: str, want: str,
                        http_url: str = "") -> DiscoverySettings:
    """The interfaces to look on (--interface, else the Thunderbolt Bridge's members on a Mac)
    and what this rank wants to be; exits saying what to give when there is no interface."""
    from ..link.exposure import thunderbolt_members

    names = tuple(args.interface or ()) or tuple(thunderbolt_members())
    if not names:
        raise SystemExit(f"ds4tp {command}: give --interface NAME, the link to find the other rank "
                         "on (e.g. the Thunderbolt interface, or lo for both ranks on this machine; "
                         "on a Mac the Thunderbolt Bridge's members are the default, and there are "
                         "none: enable Thunderbolt Bridge), or --role with --listen/--coordinator")
    return DiscoverySettings(names, want, http_url)


def one_rank_address(args: argparse.Namespace, command: str, what: str) -> PairAddress:
    """address_from_args for a command that runs one rank only: without --role it exits
    saying what to give (`what`: what the leader does besides listening)."""
    address = address_from_args(args, command)
    if address is None:
        raise SystemExit(f"ds4tp {command}: give --role leader --listen HOST PORT{what} or "
                         f"--role worker --coordinator HOST PORT (`ds4tp demo` runs both ranks "
                         f"on this machine)")
    return address


@dataclasses.dataclass(frozen=True)
class LockstepJoin:
    """How a `ds4tp run` or `serve` rank joins its group, its flags checked: its address, how it
    finds its peers (None: it was given an address), the group's size (None: its leader's) and
    the LinkSettings it connects with."""

    address: PairAddress
    discovery: Optional[DiscoverySettings]
    ranks: Optional[int]
    link: LinkSettings


def add_lockstep_rank_args(p: argparse.ArgumentParser, role_help: str) -> None:
    """Every flag of how a `ds4tp run` or `serve` rank joins its group (lockstep_join checks them):
    the transport's, --role/--listen/--coordinator (`role_help`: what --role means), --ranks and
    --interface."""
    add_transport_args(p)
    add_pair_args(p, role_help)
    add_ranks_arg(p)
    add_interface_arg(p)


def lockstep_join(args: argparse.Namespace, command: str, want: str, what: str,
                  http_url: str = "") -> LockstepJoin:
    """add_lockstep_rank_args' flags checked: the rank's address and, without
    --listen/--coordinator, how it finds its peers (`want`: what it wants to be; `http_url`: what
    a leader found by discovery serves); one_rank_address's `what` otherwise. Refuses --transport
    mlx: the lockstep needs the pair's control channel."""
    if discovering(args):
        address = PairAddress(args.role, None, None)
        discovery: Optional[DiscoverySettings] = discovery_from_args(args, command, want, http_url)
    else:
        address, discovery = one_rank_address(args, command, what), None
    refuse_mlx(args, command, LOCKSTEP_NEEDS_PAIR)
    ranks = ranks_from_args(args, command)  # None: a worker that takes its leader's
    link = link_from_args(args, address, command, discovery=discovery, size=ranks)
    return LockstepJoin(address, discovery, ranks, link)


def check_at_least(command: str, checks: Sequence[Tuple[str, int, int]]) -> None:
    """Each (flag, value, low): exit naming the first flag whose value is under its low."""
    for flag, value, low in checks:
        if value < low:
            raise SystemExit(f"ds4tp {command}: {flag} {value} must be >= {low}")
