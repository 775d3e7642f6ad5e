"""How this rank joins its group (a pair, or a mesh of N ranks): ``LinkSettings``, as the user
gives it (tp.init's keywords, the command line's flags, made once in cli/), and, once
``resolved()``, what the link layer runs on: the same with every ``DS4_TP_*`` knob resolved once
and passed down explicitly. A bad value (argument or environment) is a ValueError naming it,
raised before any socket exists.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Sequence, Tuple

from .hello import ModelIdentity, RankFigures
from .wire import LEADER, TRANSPORT_CODES, WORKER

DEFAULT_TIMEOUT_SEC = 300.0
# Hello on a fresh connection has its own short deadline: a port scanner or a
# stray client must not hold the leader for the full DS4_TP_TIMEOUT_SEC.
DEFAULT_HELLO_TIMEOUT_SEC = 10.0
# How long a TCP gate polls for the peer's message before it sleeps in the kernel. Waits at a
# gate are mostly the other rank finishing its half of the layer, well under a millisecond; a
# rank that polls through them skips the wake-up. The gate runs on MLX's stream thread, beside
# the thread that feeds it the graph: with few cores (both ranks of a test pair on one small
# machine) a long poll takes the core the other rank is computing on, so there it polls only
# briefly (measured on 2 cores, 156M llama decode: 7.5-8.5 tok/s polling 5 ms, 11.3 polling
# 200 us or not at all); a machine with one core would starve the other rank, so it sleeps.
DEFAULT_TCP_SPIN_US = 5000
FEW_CORES_TCP_SPIN_US = 200
MANY_CORES = 8
MAX_TCP_SPIN_US = 1_000_000

TIMEOUT_ENV = "DS4_TP_TIMEOUT_SEC"
HELLO_TIMEOUT_ENV = "DS4_TP_HELLO_TIMEOUT_SEC"
TCP_SPIN_ENV = "DS4_TP_TCP_SPIN_US"
SECRET_ENV = "DS4_TP_SECRET"
UCSIM_FAULTS_ENV = "DS4_TP_UCSIM_FAULTS"
RDMA_NO_IMM_ENV = "DS4_TP_RDMA_NO_IMM"
DISABLE_WARMUP_ENV = "DS4_TP_DISABLE_RDMA_WARMUP"
VERBS_LIBRARY_ENV = "DS4_TP_VERBS_LIBRARY"
UCSIM_FAULT_LINKS_ENV = "DS4_TP_UCSIM_FAULT_LINKS"
TOPOLOGY_ENV = "DS4_TP_TOPOLOGY"
# Which links a group's collectives run over (collectives/topology.py).
TOPOLOGIES = ("auto", "mesh", "ring")
MAX_MESH_SIZE = 8


def _raw(env: Optional[Mapping[str, str]], name: str) -> Optional[str]:
    value = (os.environ if env is None else env).get(name)
    return None if value is None or value == "" else value


def _switch(env: Mapping[str, str], name: str) -> bool:
    """Set and not "0" means on."""
    return _raw(env, name) not in (None, "0")


def _env_seconds(env: Optional[Mapping[str, str]], name: str, default: float) -> float:
    raw = _raw(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; set it to seconds, e.g. 300") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be > 0 seconds")
    return value


def default_timeout(env: Optional[Mapping[str, str]] = None) -> float:
    """DS4_TP_TIMEOUT_SEC, default 300 s: connect and command waits."""
    return _env_seconds(env, TIMEOUT_ENV, DEFAULT_TIMEOUT_SEC)


def default_topology(env: Optional[Mapping[str, str]] = None) -> str:
    """DS4_TP_TOPOLOGY, default "auto": the links a group of 3 or more runs its collectives
    over ("mesh": every pair's, "ring": the ring's alone, "auto": as the links formed)."""
    raw = _raw(env, TOPOLOGY_ENV)
    if raw is None or raw == "":
        return "auto"
    if raw not in TOPOLOGIES:
        raise ValueError(f"{TOPOLOGY_ENV}={raw!r}: set it to one of {', '.join(TOPOLOGIES)} "
                         "(or unset it for auto)")
    return raw


def default_tcp_spin_us(cpu_count: Optional[int]) -> int:
    """5000 us with 8 cores or more (a Mac of the pair), 200 us with 2 to 7, 0 (never poll)
    on one."""
    cores = cpu_count or 1
    return DEFAULT_TCP_SPIN_US if cores >= MANY_CORES else FEW_CORES_TCP_SPIN_US if cores >= 2 else 0


def tcp_spin_us(env: Optional[Mapping[str, str]] = None, cpu_count: Optional[int] = None) -> int:
    """DS4_TP_TCP_SPIN_US, default default_tcp_spin_us(cores): microseconds a TCP gate polls
    before it blocks."""
    raw = _raw(env, TCP_SPIN_ENV)
    if raw is None:
        return default_tcp_spin_us(os.cpu_count() if cpu_count is None else cpu_count)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"{TCP_SPIN_ENV}={raw!r} is not a whole number of microseconds; set it to e.g. "
            f"5000, or 0 to never poll"
        ) from None
    if not 0 <= value <= MAX_TCP_SPIN_US:
        raise ValueError(
            f"{TCP_SPIN_ENV}={raw!r} is out of range; set 0 (never poll) to "
            f"{MAX_TCP_SPIN_US} microseconds"
        )
    return value


def verbs_library(env: Optional[Mapping[str, str]] = None) -> str:
    """DS4_TP_VERBS_LIBRARY: the verbs library the ibverbs provider loads instead of
    the system one (rdma-core installed elsewhere, or the tests' fake); "" when unset."""
    return _raw(env, VERBS_LIBRARY_ENV) or ""


def secret_bytes(secret, env: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """secret= (str or bytes) or DS4_TP_SECRET; None when neither is set."""
    if secret is None:
        secret = _raw(env, SECRET_ENV)
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)) or len(secret) == 0:
        raise ValueError("secret must be a non-empty str or bytes (or unset DS4_TP_SECRET)")
    return bytes(secret)


@dataclasses.dataclass(frozen=True)
class PairAddress:
    """Where this rank meets its peer: the leader listens, the worker dials.
    Made by pair_address(), which checks the triple once for every caller."""

    role: str
    listen: Optional[Tuple[str, int]]
    coordinator: Optional[Tuple[str, int]]

    @property
    def address(self) -> Tuple[str, int]:
        """The one (host, port) this rank uses: listen for the leader, coordinator for the worker."""
        return self.listen if self.role == "leader" else self.coordinator  # type: ignore[return-value]

    @property
    def rank(self) -> int:
        """0 for the leader, 1 for the worker."""
        return LEADER if self.role == "leader" else WORKER


def pair_address(role: Optional[str], listen=None, coordinator=None) -> PairAddress:
    """The role/listen/coordinator triple checked (the one place it is): the leader
    needs listen=(host, port) and no coordinator, the worker the reverse. A bad
    triple is a ValueError that names the value and the fix, with the command
    line's spelling in brackets."""
    if role not in ("leader", "worker"):
        if role is None and (listen is not None or coordinator is not None):
            raise ValueError(
                "listen/coordinator need a role: role='leader' with listen=(host, port) or "
                "role='worker' with coordinator=(host, port) (--role leader|worker)"
            )
        raise ValueError(
            f"role={role!r}: use 'leader' (rank 0) or 'worker' (rank 1) (--role leader|worker)"
        )
    if role == "leader":
        if listen is None or coordinator is not None:
            raise ValueError("the leader needs listen=(host, port) and no coordinator "
                             "(--role leader --listen HOST PORT, without --coordinator)")
        return PairAddress(role, _checked_address(listen, "listen"), None)
    if coordinator is None or listen is not None:
        raise ValueError("the worker needs coordinator=(host, port) and no listen "
                         "(--role worker --coordinator HOST PORT, without --listen)")
    return PairAddress(role, None, _checked_address(coordinator, "coordinator"))


def _checked_address(addr, name: str) -> Tuple[str, int]:
    ok = (
        isinstance(addr, (tuple, list))
        and len(addr) == 2
        and isinstance(addr[0], str)
        and isinstance(addr[1], int)
        and not isinstance(addr[1], bool)
        and 0 <= addr[1] < 65536
    )
    if not ok:
        raise ValueError(f"{name}={addr!r}: give (host, port), e.g. ('10.99.0.1', 9911) "
                         f"(--{name} HOST PORT, PORT 0-65535)")
    return (addr[0], addr[1])


# The transports a rank may ask for: the pair's three (the hello's TRANSPORT_CODES) and "mlx",
# MLX's own group (ring or JACCL) as MLX's launcher configures it, which never says hello.
MLX = "mlx"
TRANSPORTS = (*TRANSPORT_CODES, MLX)


@dataclasses.dataclass(frozen=True)
class DiscoverySettings:
    """How a rank finds its peer by itself (link/meet.py): on these interfaces (names), wanting
    to lead ("lead": `run --prompt`, --role leader), to work ("work": `run` without a prompt,
    --role worker, a worker rejoining) or either ("any": `serve`); http_url: what a serving
    leader tells its worker to print."""

    interfaces: Tuple[str, ...]
    want: str = "any"
    http_url: str = ""

    def check(self) -> "DiscoverySettings":
        if not self.interfaces or not all(isinstance(n, str) and n for n in self.interfaces):
            raise ValueError(f"interfaces={self.interfaces!r}: name at least one interface "
                             "(--interface NAME, e.g. en1, or lo for both ranks on this machine)")
        if self.want not in ("lead", "work", "any"):
            raise ValueError(f"want={self.want!r}: use 'lead', 'work' or 'any'")
        return self


@dataclasses.dataclass(frozen=True)
class Regrouping:
    """A serving leader forming its group again at another size (serve/resize.py), for its door
    (link/mesh.py): its members were each told their rank (RESIZE) and ask for it, so it takes
    `unasked` JOINs asking no rank (0 for a shrink; 1 for a grow: the rank back) and holds any
    other JOIN unanswered (Door.held: a rank started again never takes a member's place; the
    resizer grows with it once the group serves). The rank back must JOIN within
    `unasked_within` seconds (None: the connect timeout): it was let go at the old door and
    dials the new one at once (link/mesh.py's REDIAL_SEC), so a rank not there by then is gone."""

    unasked: int = 0
    unasked_within: Optional[float] = None

    def takes_unasked(self, asked: Sequence[int]) -> bool:
        """Whether a JOIN asking no rank (-1) still takes a place, the members so far having
        asked `asked`."""
        return sum(1 for rank in asked if rank < 0) < self.unasked


@dataclasses.dataclass(frozen=True)
class LinkSettings:
    """How this rank joins its group (a pair, or N ranks): made once, from tp.init's keywords or the command line's
    --transport/--rdma-device/--rdma-gid-index/--secret (in cli/), and what the link layer runs
    on once resolved(). A field left as None takes its DS4_TP_* variable, else its default, when
    resolved() makes the pair's copy; a field given a value ignores the environment. check()
    refuses a bad value by name. With transport "mlx" only address.role counts (None: MLX's
    rank decides).

    address: role and listen/coordinator (pair_address). transport: "auto" (RDMA when both have
    it, else TCP), "tcp", "rdma" or "mlx". timeout: connect and gate waits (DS4_TP_TIMEOUT_SEC,
    300 s). hello_timeout: the leader's wait for a fresh connection's hello
    (DS4_TP_HELLO_TIMEOUT_SEC, 10 s). secret: both ranks prove they hold it (DS4_TP_SECRET;
    bytes once resolved). tcp_spin_us: TCP gate polling (DS4_TP_TCP_SPIN_US). ucsim_faults:
    faults of the emulated device (DS4_TP_UCSIM_FAULTS). rdma_no_imm: RDMA gates without the
    immediate-data tag (DS4_TP_RDMA_NO_IMM). disable_warmup: skip the RDMA warm-up
    (DS4_TP_DISABLE_RDMA_WARMUP). verbs_library: the library the ibverbs provider loads ("" =
    the system one; DS4_TP_VERBS_LIBRARY). figures: what this rank measured at start
    (split.measure), carried by its hello for `--split auto`. identity: the model the hello
    checks (resolved(identity) sets it). (The bring-up's test-only switches are seams in
    link/rdma_bringup.py, not fields.)
    discovery: find the peer by multicast DNS (link/meet.py) instead of listen/coordinator;
    with size > 2, the group (link/findgroup.py: the ranks and the leader's address, then the mesh).
    size: ranks in the group (2: a pair, as always; 3..8: a mesh, link/mesh.py: the leader
    listens with size=N, the workers dial it; None: the leader's, for a worker that dials its
    leader at an address: it learns it from the leader's ROSTER, and a rank that finds its
    group by discovery, or leads, always gives it). ask_rank: the rank a worker asks the leader for
    (None: any; the leader gives asked ranks first, the rest in the order the workers joined).
    rdma_devices: a mesh rank's device per peer rank ({peer: "rdma_en3"}; a peer not named uses
    rdma_device). ucsim_fault_links: the mesh links the emulated device's faults apply to,
    "0-1,2-3" (DS4_TP_UCSIM_FAULT_LINKS; "" or unset: every link).
    cables: the interfaces this rank's cables are on (--interface with an address): each link runs
    on the cable it shares with its peer, at that cable's addresses and device (link/cables.py);
    () : every link over the roster's route and rdma_device/rdma_devices as given.
    regrouping: a serving leader's group formed again at another size (Regrouping); None
    otherwise (the group it keeps for reconnect() drops it: a REFORM takes any rank back).
    """

    address: PairAddress
    transport: str = "auto"
    rdma_device: Optional[str] = None
    gid_index: Optional[int] = None
    secret: object = dataclasses.field(default=None, repr=False)  # never in a log or an error
    timeout: Optional[float] = None
    tcp_spin_us: Optional[int] = None
    figures: RankFigures = RankFigures()
    identity: ModelIdentity = ModelIdentity()
    hello_timeout: Optional[float] = None
    ucsim_faults: Optional[str] = None
    rdma_no_imm: Optional[bool] = None
    disable_warmup: Optional[bool] = None
    verbs_library: Optional[str] = None
    discovery: Optional[DiscoverySettings] = None
    size: Optional[int] = 2
    ask_rank: Optional[int] = None
    rdma_devices: Optional[Mapping[int, str]] = None
    ucsim_fault_links: Optional[str] = None
    cables: Tuple[str, ...] = ()
    regrouping: Optional[Regrouping] = None

    @classmethod
    def of(cls, role: Optional[str], listen=None, coordinator=None, **fields) -> "LinkSettings":
        """The resolved settings of a pair rank given as role/listen/coordinator and fields."""
        return cls(pair_address(role, listen, coordinator), **fields).resolved()

    @property
    def rank(self) -> int:
        """0 for the leader, 1 for the worker."""
        return self.address.rank

    @property
    def finds_a_lobby(self) -> bool:
        """Whether discovery finds this group in a leader's lobby (3 ranks or more,
        link/findgroup.py); a pair discovery finds needs none, its election is all (link/meet.py).
        Either way the leader's door keeps its address once found, as the group changes size."""
        return self.discovery is not None and self.size is not None and self.size > 2

    def check(self) -> "LinkSettings":
        """self, once every field is one a pair can be made with; else a ValueError naming the
        field, its value and the fix (the command line's flag in brackets)."""
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: use 'auto', 'tcp', 'rdma' or 'mlx' "
                             "(--transport auto|tcp|rdma|mlx)")
        if not isinstance(self.address, PairAddress):
            raise ValueError(f"address={self.address!r}: make it with pair_address(role, listen, "
                             "coordinator)")
        self._check_how_met()
        self._check_rdma()
        self._check_numbers()
        secret_bytes(self.secret, {})
        self._check_mesh()
        if self.verbs_library is not None and not isinstance(self.verbs_library, str):
            raise ValueError(
                f"verbs_library={self.verbs_library!r}: give a path (str), \"\" for the system "
                f"library, or None for {VERBS_LIBRARY_ENV}"
            )
        return self

    def _check_how_met(self) -> None:
        """The address or discovery: one way of meeting the peer, and a role that fits it."""
        if self.discovery is not None:
            self.discovery.check()
            if self.transport == MLX or self.address.listen or self.address.coordinator:
                raise ValueError("discovery finds the peer itself: give no listen/coordinator and "
                                 "not transport 'mlx' (--listen/--coordinator are for scripts)")
        if self.transport == MLX or self.discovery is not None:
            if self.address.role not in (None, "leader", "worker"):
                raise ValueError(f"role={self.address.role!r}: use 'leader' (rank 0), 'worker' "
                                 "(rank 1), or None to take MLX's rank (--role leader|worker)")
        else:
            pair_address(self.address.role, self.address.listen, self.address.coordinator)

    def _check_rdma(self) -> None:
        if self.rdma_device is not None and (not isinstance(self.rdma_device, str) or not self.rdma_device):
            raise ValueError(f"rdma_device={self.rdma_device!r}: give a verbs device name (e.g. "
                             "'rdma_en1'), 'ucsim', or None for the first active one (--rdma-device)")
        gid = self.gid_index
        if gid is not None and (not isinstance(gid, int) or isinstance(gid, bool) or gid < 0):
            raise ValueError(f"gid_index={gid!r} must be a non-negative integer or None (--rdma-gid-index N)")

    def _check_numbers(self) -> None:
        for name in ("timeout", "hello_timeout"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise ValueError(f"{name}={value!r} must be > 0 seconds")
        spin = self.tcp_spin_us
        if spin is not None and (not isinstance(spin, int) or isinstance(spin, bool)
                                 or not 0 <= spin <= MAX_TCP_SPIN_US):
            raise ValueError(f"tcp_spin_us={spin!r}: give 0 (never poll) to {MAX_TCP_SPIN_US} "
                             "microseconds, or None for DS4_TP_TCP_SPIN_US / the default")

    def _check_mesh(self) -> None:
        size = self.size
        if size is None:
            self._check_leaders_size()
        elif isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= MAX_MESH_SIZE:
            raise ValueError(f"size={size!r}: give the number of ranks, 2 to {MAX_MESH_SIZE} (--ranks N)"
                             + (", or None for the leader's" if self.address.role == "worker" else ""))
        # The ranks a group of this size has (the largest a mesh may have while the size is the leader's).
        most = MAX_MESH_SIZE if size is None else size
        ask = self.ask_rank
        if ask is not None:
            if isinstance(ask, bool) or not isinstance(ask, int) or not 0 <= ask < most:
                raise ValueError(f"rank={ask!r}: give a rank 0 .. {most - 1} of the {most}, or None to "
                                 "take the next free one (--rank N)")
            if (ask == 0) != (self.address.role == "leader"):
                raise ValueError(f"rank={ask!r} with role {self.address.role!r}: rank 0 is the leader, "
                                 "which listens; a worker dials it and asks for 1 .. "
                                 f"{most - 1} (or None)")
        if size is not None and size > 2 and self.transport == MLX:
            raise ValueError(f"size={size}: a mesh of more than two ranks is made at an address "
                             "(listen/coordinator) or by discovery, not over transport 'mlx'")
        for peer, device in (self.rdma_devices or {}).items():
            if (isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < most
                    or not isinstance(device, str) or not device):
                raise ValueError(f"rdma_devices={dict(self.rdma_devices)!r}: map each peer rank "
                                 f"(0 .. {most - 1}) to a verbs device name, e.g. {{1: 'rdma_en3'}}")
        parse_fault_links(self.ucsim_fault_links or "")
        if not isinstance(self.cables, tuple) or not all(isinstance(n, str) and n for n in self.cables):
            raise ValueError(f"cables={self.cables!r}: give a tuple of interface names, e.g. "
                             "('en3', 'en5') (--interface NAME, repeated)")

    def _check_leaders_size(self) -> None:
        """size=None is a worker's that dials its leader: the leader says the size at the join. A
        leader decides it, and discovery must know how many ranks to find."""
        if (self.address.role != "worker" or self.address.coordinator is None
                or self.discovery is not None or self.transport == MLX):
            raise ValueError("size=None (the leader's size) is for a worker that dials its leader "
                             "(role='worker' with coordinator=(host, port)); a leader, and every rank "
                             f"that finds its group by discovery, gives the size, 2 to {MAX_MESH_SIZE} "
                             "(--ranks N)")

    def resolved(self, identity: Optional[ModelIdentity] = None) -> "LinkSettings":
        """What the pair runs on: these settings checked, with every DS4_TP_* knob resolved
        once (here, and passed down explicitly from here), the secret as bytes, and the model
        `identity` the hello checks (None: keep this one's)."""
        self.check()
        if self.transport == MLX:
            raise ValueError("transport='mlx' is MLX's own group, not a pair: it has no pair "
                             "configuration (mx.distributed.init makes it)")
        if self.discovery is not None:
            raise ValueError("discovering settings have no address yet: link.meet finds the peer "
                             "(link.findgroup.find_group the group of N), then resolves the settings "
                             "with its address")
        env = os.environ
        return dataclasses.replace(
            self,
            identity=self.identity if identity is None else identity,
            secret=secret_bytes(self.secret, env),
            timeout=default_timeout(env) if self.timeout is None else float(self.timeout),
            hello_timeout=(_env_seconds(env, HELLO_TIMEOUT_ENV, DEFAULT_HELLO_TIMEOUT_SEC)
                           if self.hello_timeout is None else float(self.hello_timeout)),
            tcp_spin_us=tcp_spin_us(env) if self.tcp_spin_us is None else self.tcp_spin_us,
            ucsim_faults=env.get(UCSIM_FAULTS_ENV, "") if self.ucsim_faults is None else self.ucsim_faults,
            rdma_no_imm=_switch(env, RDMA_NO_IMM_ENV) if self.rdma_no_imm is None else self.rdma_no_imm,
            disable_warmup=(_switch(env, DISABLE_WARMUP_ENV) if self.disable_warmup is None
                            else self.disable_warmup),
            verbs_library=verbs_library(env) if self.verbs_library is None else self.verbs_library,
            ucsim_fault_links=(env.get(UCSIM_FAULT_LINKS_ENV, "") if self.ucsim_fault_links is None
                               else self.ucsim_fault_links),
        )


def parse_fault_links(text: str) -> frozenset:
    """DS4_TP_UCSIM_FAULT_LINKS: "0-1,2-3" as {(0, 1), (2, 3)} (each pair lower rank first);
    "" is every link (the empty set)."""
    links = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        ends = item.split("-")
        try:
            a, b = (int(e) for e in ends)
        except ValueError:
            raise ValueError(f"{UCSIM_FAULT_LINKS_ENV}={text!r}: give links as RANK-RANK, comma "
                             "separated, e.g. 0-1,2-3") from None
        if a == b or not (0 <= a < MAX_MESH_SIZE and 0 <= b < MAX_MESH_SIZE):
            raise ValueError(f"{UCSIM_FAULT_LINKS_ENV}={text!r}: {item!r} is not a link between two "
                             f"ranks 0 .. {MAX_MESH_SIZE - 1}")
        links.add((min(a, b), max(a, b)))
    return frozenset(links)
