"""Both ranks of `ds4tp serve` on 127.0.0.1, as the serving benches start them (`--serve`, its
`--soak` and `--disk-cache`): started and waited on until healthy, stopped as Ctrl-C would stop
them, or killed; the worker killed and started again for the rejoin figure."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Optional, Sequence

from ..base.log import log
from ..onehost.localpair import child_env, free_port, reap

# After the kill, how long /health may still say 200 before the leader is taken to have missed
# the worker's death (a kill under load is seen within a gate exchange).
NOTICE_SEC = 30.0


def health(base: str) -> int:
    """GET /health's status; 0 while nothing answers."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def wait_healthy(base: str, procs: Sequence[subprocess.Popen], within: float) -> None:
    """Until GET /health answers 200; RuntimeError when a process exits first or `within` passes."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        exited = [p for p in procs if p.poll() is not None]
        if exited:
            raise RuntimeError(f"a process of the server at {base} exited during start-up with status "
                               f"{exited[0].returncode} (its error is above)")
        if health(base) == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the server at {base} was not healthy within {within:g} s")


class ServedPair:
    """`ds4tp serve`'s leader and worker here, both logs in one temporary file. extra: flags for
    both ranks; rank_extra: flags for one rank ("leader" or "worker"); ranks above 2: that many
    (--ranks N to the leader), the workers "worker", "worker2", ..."""

    def __init__(self, model: Path, transport: str, rdma_device: Optional[str] = None,
                 extra: Sequence[str] = (), rank_extra: Optional[Dict[str, Sequence[str]]] = None,
                 ranks: int = 2):
        self.env = child_env()
        pair_port, self.port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        common = [sys.executable, "-m", "mlx_ds4tp", "serve", "--model", str(model), "--transport",
                  transport, *(["--rdma-device", rdma_device] if rdma_device else []), *extra]
        self.cmds = {"leader": common + ["--role", "leader", "--listen", "127.0.0.1", str(pair_port),
                                         "--port", str(self.port)],
                     "worker": common + ["--role", "worker", "--coordinator", "127.0.0.1", str(pair_port)]}
        self.cmds["leader"] += ["--ranks", str(ranks)]
        for n in range(2, ranks):
            self.cmds[f"worker{n}"] = list(self.cmds["worker"])
        for name, flags in (rank_extra or {}).items():
            self.cmds[name] += list(flags)
        self.procs: Dict[str, subprocess.Popen] = {}
        self.log = tempfile.TemporaryFile()

    def _spawn(self, name: str) -> subprocess.Popen:
        return subprocess.Popen(self.cmds[name], env=self.env, stdout=self.log, stderr=self.log)

    def start(self, within: float = 300.0) -> "ServedPair":
        """Both ranks started and /health 200; on failure their log to stderr and both killed."""
        self.procs = {name: self._spawn(name) for name in self.cmds}
        try:
            wait_healthy(self.base, list(self.procs.values()), within)
        except BaseException:
            self.dump_log()
            self.close()
            raise
        return self

    def __enter__(self) -> "ServedPair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def kill(self, name: str) -> None:
        """SIGKILL one rank (a Mac lost), reaped."""
        reap(self.procs[name])

    def start_again(self, name: str) -> None:
        """One rank started again with its first command line (a lost Mac back)."""
        self.procs[name] = self._spawn(name)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def health_body(self) -> dict:
        """/health's JSON body."""
        with urllib.request.urlopen(self.base + "/health", timeout=30) as r:
            return json.loads(r.read())

    def dump_log(self, last: int = 80) -> None:
        """The ranks' last lines, to stderr (after a failure; nothing once closed)."""
        if self.log.closed:
            return
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").splitlines()
        sys.stderr.write("".join(line + "\n" for line in lines[-last:]))

    def restart_worker(self, within: float) -> Dict[str, object]:
        """SIGKILL the worker, start it again with the same command line and time the outage:
        kill to the first /health 200 after the leader said 503."""
        t_kill = time.perf_counter()
        reap(self.procs["worker"])
        self.procs["worker"] = self._spawn("worker")
        log(f"soak: worker killed and started again (pid {self.pid('worker')})")
        seen_down, why = False, ""
        while time.perf_counter() - t_kill < within:
            sent = time.perf_counter()
            code = health(self.base)
            if code == 503:  # not 0: a probe lost under load says nothing of the pair
                seen_down, last_down = True, sent
            elif seen_down:
                now = time.perf_counter()
                # outage_s is when this poll saw 200 (up to one poll late); down_seen_s is when
                # the last probe the leader answered 503 was sent: the pair was surely down then,
                # so no answer can end before it.
                return {"killed_at": t_kill, "rejoined_at": now, "rejoined": True,
                        "outage_s": round(now - t_kill, 3), "down_seen_s": round(last_down - t_kill, 3)}
            elif time.perf_counter() - t_kill > NOTICE_SEC:
                why = f"/health stayed 200 for {NOTICE_SEC:g} s after the kill"
                break
            if self.procs["worker"].poll() is not None:
                why = (f"the restarted worker exited with {self.procs['worker'].returncode}: the "
                       "leader did not take it back")
                break
            if self.procs["leader"].poll() is not None:
                why = f"the leader exited with {self.procs['leader'].returncode}"
                break
            time.sleep(0.05)
        return {"killed_at": t_kill, "rejoined_at": None, "rejoined": False, "outage_s": None,
                "why": why or f"/health was not 200 again within {within:g} s of the kill"}

    def stop(self, within: float = 600.0) -> None:
        """As Ctrl-C on the leader: it writes its stored caches and tells the worker to stop."""
        self.procs["leader"].send_signal(signal.SIGTERM)
        for p in self.procs.values():
            p.wait(within)
        self.close()

    def close(self) -> None:
        """Both ranks killed (those still running) and reaped; the log closed."""
        for p in self.procs.values():
            reap(p)
        self.log.close()
