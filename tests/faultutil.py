"""Helpers for the multi-process fault tests: output watched as it arrives
(with the time each byte came), exit times measured, strays found."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import List, Optional

TESTS = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(TESTS, "fault_driver.py")
TAG_ENV = "DS4_TP_FAULT_TAG"

# Lowers the leader's hello timeout of the shipped `ds4tp` command in the cases that need it.
HELLO_TIMEOUT_ENV = "DS4_TP_HELLO_TIMEOUT_SEC"


class Stream:
    """A child's pipe, read by a thread as bytes arrive; remembers when."""

    def __init__(self, fileobj, name: str = "output") -> None:
        self.fd = fileobj.fileno()
        self.name = name
        # The process's other pipe (set by Watched): a wait that fails shows both,
        # so a child that died early says why (its error is on stderr).
        self.other: Optional["Stream"] = None
        self.buf = bytearray()
        self.marks: List[tuple] = []  # (monotonic time, buffer length after the chunk)
        self.lock = threading.Lock()
        self.eof = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            with self.lock:
                if not chunk:
                    self.eof = True
                    return
                self.buf += chunk
                self.marks.append((time.monotonic(), len(self.buf)))

    def text(self) -> str:
        with self.lock:
            return bytes(self.buf).decode("utf-8", "replace")

    def find(self, needle: str, start: int = 0) -> Optional[float]:
        """When needle (first at or after byte offset start) had fully arrived, else None."""
        raw = needle.encode()
        with self.lock:
            i = self.buf.find(raw, start)
            if i < 0:
                return None
            end = i + len(raw)
            for t, n in self.marks:
                if n >= end:
                    return t
        return None

    def wait_for(self, needle: str, timeout: float, proc: Optional[subprocess.Popen] = None,
                 start: int = 0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            t = self.find(needle, start)
            if t is not None:
                return t
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} did not appear within {timeout} s; got:\n{self.both()}")
            if proc is not None and proc.poll() is not None and self.eof:
                if self.other is not None:
                    self.other.thread.join(2.0)  # the exited process's last stderr lines
                raise AssertionError(f"the process exited ({proc.returncode}) before printing "
                                     f"{needle!r}:\n{self.both()}")
            time.sleep(0.005)

    def both(self) -> str:
        """This stream's last 3000 characters and its sibling's, labelled."""
        text = f"--- {self.name} ---\n{self.text()[-3000:]}"
        if self.other is not None:
            text += f"\n--- {self.other.name} ---\n{self.other.text()[-3000:]}"
        return text


class Watched:
    """A spawned process with both pipes watched."""

    def __init__(self, proc: subprocess.Popen, name: str) -> None:
        self.proc = proc
        self.name = name
        self.out = Stream(proc.stdout, f"{name} stdout")
        self.err = Stream(proc.stderr, f"{name} stderr")
        self.out.other, self.err.other = self.err, self.out

    def wait_exit(self, timeout: float) -> Optional[float]:
        """The time the process was seen gone (5 ms resolution), None on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return time.monotonic()
            time.sleep(0.005)
        return None

    def signal(self, sig: int) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe(self) -> str:
        return (f"--- {self.name} (rc {self.proc.returncode}) stdout ---\n{self.out.text()[-2000:]}\n"
                f"--- {self.name} stderr ---\n{self.err.text()[-4000:]}")


def wait_all_exit(ranks: List[Watched], timeout: float) -> List[Optional[float]]:
    """Each process's exit time (seen within 5 ms), None for one still running."""
    seen: List[Optional[float]] = [None] * len(ranks)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and None in seen:
        now = time.monotonic()
        for i, w in enumerate(ranks):
            if seen[i] is None and w.proc.poll() is not None:
                seen[i] = now
        time.sleep(0.005)
    return seen


def dials(pid: int, port: int) -> bool:
    """Whether process `pid` holds an IPv4 TCP socket connected, or connecting, to `port`
    (read off /proc), so a test waits for its own rank's connection rather than anyone's."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
        with open(f"/proc/{pid}/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return False
    for row in rows:
        cols = row.split()
        # remote address, state (01 established, 02 SYN sent), inode
        if cols[9] in inodes and int(cols[2].split(":")[1], 16) == port and cols[3] in ("01", "02"):
            return True
    return False


def tagged_processes(tag: str) -> List[int]:
    """Live processes (not zombies) whose environment carries TAG_ENV=tag."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != b"Z":
            found.append(int(entry))
    return found


def reap(w: Watched) -> None:
    """Kill (after SIGCONT, so a stopped one can die) and wait."""
    if w.proc.poll() is None:
        try:
            w.proc.send_signal(signal.SIGCONT)
        except OSError:
            pass
        w.proc.kill()
    w.proc.wait(timeout=10)
