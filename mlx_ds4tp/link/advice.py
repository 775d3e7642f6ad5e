"""What a rank without RDMA tells its user: the cause in the log line of the
transport choice (short, both ranks), and advice for the platform this
process runs on, once per process (two ranks in one process, as in the demo
and the tests, say it once).

The provider writes its reasons as "cause; what to check"; the advice it
gives is for a Mac (rdma_ctl, the Thunderbolt interface), which means
nothing on Linux, where this package runs both ranks on loopback for
development and tests.
"""

from __future__ import annotations

import sys
import threading

from ..base.log import log

_lock = threading.Lock()
_advised = False


def short_reason(reason: str) -> str:
    """The cause of a probe's reason: without the "tp rdma: " prefix and the advice
    after its first "; "."""
    cause = reason.split("; ", 1)[0].strip()
    if cause.startswith("tp rdma: "):
        cause = cause[len("tp rdma: "):]
    return cause or "no device"


def platform_advice(reason: str, platform: str = sys.platform) -> str:
    """The line for a user whose side has no RDMA, for `platform` (sys.platform)."""
    if platform == "darwin":
        # The provider's own advice (rdma_ctl, the Thunderbolt interface's IPv4) is for a Mac.
        return f"RDMA is not usable on this Mac, so the gates run over TCP: {reason}"
    return ("no RDMA on this machine, so the gates run over TCP: expected on Linux, which runs "
            "the pair on loopback for development and tests (the tests emulate Thunderbolt RDMA "
            "with --rdma-device ucsim); RDMA is for two Macs joined by Thunderbolt")


def advise_once(reason: str) -> None:
    """Log platform_advice(reason) the first time this process calls it."""
    global _advised
    with _lock:
        if _advised:
            return
        _advised = True
    log(platform_advice(reason))
