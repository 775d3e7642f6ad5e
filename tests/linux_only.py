"""What exists only on Linux, for the platform checks (tests/test_platform_calls.py scans the
package with it; tests/test_mac_build.py checks the tables against macOS's own headers).

Every C name here was checked absent from macOS's SDK headers (zig's aarch64-macos libc, the
headers Apple ships): CPython defines a module attribute only where the C macro or function it
wraps exists (``#ifdef SOCK_CLOEXEC``, ``HAVE_SCHED_SETAFFINITY``), so each Python name below is
missing on a Mac, and using it there raises AttributeError. Names that exist on a Mac, however
new (MSG_NOSIGNAL, CLOCK_MONOTONIC_RAW, SO_REUSEPORT, F_OFD_SETLK), are not listed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Tuple


@dataclass(frozen=True)
class Missing:
    """A name CPython's `module` lacks on macOS, and the C name (a `kind`: "macro" or
    "function") whose absence from macOS's headers is why."""

    module: str
    attr: str
    c_name: str
    kind: str


def _entries(module: str, kind: str, names: str) -> Tuple[Missing, ...]:
    return tuple(Missing(module, n, n, kind) for n in names.split())


PYTHON_ATTRS: Tuple[Missing, ...] = (
    *_entries("os", "function", "sched_setaffinity sched_getaffinity sched_setscheduler "
              "sched_getscheduler sched_setparam sched_getparam sched_rr_get_interval memfd_create "
              "eventfd posix_fadvise posix_fallocate splice copy_file_range getrandom unshare setns"),
    Missing("select", "epoll", "epoll_create1", "function"),
    *_entries("select", "macro", "EPOLLIN EPOLLOUT EPOLLERR EPOLLHUP EPOLLET EPOLLONESHOT EPOLLRDHUP"),
    Missing("resource", "prlimit", "prlimit", "function"),
    *_entries("resource", "macro", "RLIMIT_MSGQUEUE RLIMIT_NICE RLIMIT_RTPRIO RLIMIT_RTTIME "
              "RLIMIT_SIGPENDING"),
    *_entries("socket", "macro", "SOCK_CLOEXEC SOCK_NONBLOCK AF_PACKET AF_NETLINK SO_RCVBUFFORCE "
              "SO_SNDBUFFORCE SO_PEERCRED SO_MARK SO_PRIORITY TCP_QUICKACK TCP_USER_TIMEOUT TCP_CORK"),
    *_entries("time", "macro", "CLOCK_BOOTTIME CLOCK_TAI"),
    *_entries("signal", "macro", "SIGRTMIN SIGRTMAX SIGPWR"),
    *_entries("fcntl", "macro", "F_SETPIPE_SZ F_GETPIPE_SZ F_ADD_SEALS F_GET_SEALS"),
)

# glibc's own allocator calls, reached through ctypes (ctypes.CDLL(None).mallopt): any attribute
# of that name, whatever object it is read from.
GLIBC_ATTRS: Tuple[Missing, ...] = _entries("ctypes", "function", "mallopt malloc_trim malloc_info")

# C identifiers the C sources must not use unguarded (tests/linux_only.c_uses).
C_NAMES: Tuple[Missing, ...] = (
    *_entries("c", "function", "ppoll accept4 epoll_create epoll_create1 epoll_ctl epoll_wait "
              "sched_setaffinity sched_getaffinity memfd_create eventfd mallopt malloc_trim getrandom "
              "posix_fadvise splice"),
    *_entries("c", "macro", "SOCK_CLOEXEC SOCK_NONBLOCK SO_RCVBUFFORCE SO_SNDBUFFORCE SO_RXQ_OVFL "
              "SO_TIMESTAMPNS CLOCK_BOOTTIME TCP_QUICKACK TCP_USER_TIMEOUT"),
)

# The headers a probe of the tables includes: between them they declare every name above on Linux.
# Each exists on a Mac (a header only Linux has, sys/epoll.h, would end the probe at once).
PROBE_HEADERS = ("sys/socket.h", "netinet/in.h", "netinet/tcp.h", "sys/resource.h", "sys/mman.h",
                 "sys/select.h", "sys/random.h", "malloc/malloc.h", "time.h", "fcntl.h", "signal.h",
                 "sched.h", "unistd.h", "stdlib.h", "poll.h")
# Names macOS has (the probe must report them present, or it proves nothing).
PRESENT_ON_MAC: Tuple[Missing, ...] = (
    Missing("c", "sched_yield", "sched_yield", "function"),
    Missing("c", "clock_gettime", "clock_gettime", "function"),
    Missing("c", "poll", "poll", "function"),
    Missing("c", "SO_REUSEPORT", "SO_REUSEPORT", "macro"),
    Missing("c", "CLOCK_MONOTONIC_RAW", "CLOCK_MONOTONIC_RAW", "macro"),
)

# Paths only Linux has: procfs and sysfs (a Mac has neither), and glibc's shared memory folder.
LINUX_PATH = re.compile(r"^/(proc|sys)(/|$)|^/dev/shm(/|$)")
# A library named the ELF way (libc.so.6): dlopen on a Mac looks for .dylib files.
ELF_LIBRARY = re.compile(r"\.so(\.\d+)*$")
# Programs a Mac does not have (it has ifconfig, sysctl, route instead).
LINUX_PROGRAMS: FrozenSet[str] = frozenset({"ip", "taskset", "numactl", "ethtool", "lscpu", "nproc",
                                            "ss", "free", "iptables", "tc"})


def python_attrs() -> Dict[str, FrozenSet[str]]:
    """module name -> its attributes missing on a Mac."""
    out: Dict[str, set] = {}
    for m in PYTHON_ATTRS:
        out.setdefault(m.module, set()).add(m.attr)
    return {k: frozenset(v) for k, v in out.items()}
