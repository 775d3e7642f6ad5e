"""The fault matrix: a peer SIGKILLed or SIGSTOPped in each phase of a pair's
life, for both roles and both transports (tcp, ucsim rdma) where the phase
exists, with two real processes. The phases where the RDMA provider runs
(bring-up, decode, bulk, between prompts) also run over the real ibverbs
provider and the tests' fake libibverbs ("rdma-fake": DS4_TP_VERBS_LIBRARY,
no device named).

The survivor is the shipped `ds4tp run` (or, for bulk exchanges and the pause
between prompts, a rank built from the library's Group / LeaderSessions; see
fault_driver.py); the victim is a driver that reaches the phase, prints
`AT <phase>` and blocks there, or a real rank caught mid-work. Each case
checks that the survivor exits non-zero with a `ds4-tp: error:` line naming
the cause, within 2 s of a SIGKILL or within the gate timeout
(DS4_TP_TIMEOUT_SEC=3) of a SIGSTOP; that a stopped rank woken up afterwards
also stops; and that no process of the case is left behind. Two cases are
not failures by design: a connection that dies before its hello is dropped
and the leader keeps waiting (a fresh worker then completes the run), and a
worker idle between prompts waits for its leader without a deadline.

Detection times are printed per case (pytest -s) and, with
DS4_TP_FAULT_REPORT=FILE, appended to FILE as JSON lines; tests/README.md
holds the worst seen.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid

import pytest

from faultutil import DRIVER, HELLO_TIMEOUT_ENV, TAG_ENV, Watched, dials, reap, tagged_processes
from pairutil import fake_verbs_library, free_port

STOP_TIMEOUT = 3.0  # DS4_TP_TIMEOUT_SEC for SIGSTOP cases: detection is the timeout
KILL_TIMEOUT = 30.0  # for SIGKILL cases: a detection must come from the death, not a timeout
KILL_LIMIT = 2.0
STOP_LIMIT = STOP_TIMEOUT + 2.0  # the timeout, then closing down: the leader waits up to 0.5 s for
# the worker's reason, and a process with MLX loaded takes a few 100 ms to exit on a busy machine
HELLO_TIMEOUT = 1.0  # the leader's hello timeout in the cases that lower it
DEAD = r"peer (closed|reset)|EOF|closed its control connection|Broken pipe|Connection reset"
STUCK = r"timed out|timeout|no progress|did not reach|sent no command"
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
BOTH = ["tcp", "rdma"]
# Phases where the RDMA provider runs: also over the real provider and the fake.
RDMA_ROWS = ["rdma", "rdma-fake"]
ALL = BOTH + ["rdma-fake"]
# Driver phases that block after `AT <phase>`: the driver is the victim, and what it waits for
# before its phase is set-up, not the detection a case measures.
PARKED = {"before-listen", "backlog", "accepted", "dialed", "hello-sent", "rdma-info",
          "rdma-info-sent", "warmup"}

RESULTS: list = []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    return save_llama(tmp_path_factory.mktemp("fault-model"), "tiny", seed=3)


@pytest.fixture(scope="module", autouse=True)
def detection_report():
    yield
    if not RESULTS:
        return
    print("\nfault matrix detection times (s):")
    for case, seconds, note in RESULTS:
        print(f"  {case:<40} {seconds:6.2f}  {note}")
    path = os.environ.get("DS4_TP_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            for case, seconds, note in RESULTS:
                f.write(json.dumps({"case": case, "seconds": round(seconds, 3), "note": note}) + "\n")


class Case:
    """One cell of the matrix: spawns the ranks, signals, checks, records."""

    def __init__(self, procs, model_dir, phase: str, victim: str, transport: str, sig: str,
                 timeout: float = None):
        self.procs, self.model = procs, str(model_dir)
        self.phase, self.victim_role, self.transport, self.sig = phase, victim, transport, sig
        self.id = f"{phase}/{victim}/{transport}/SIG{sig}"
        self.timeout = timeout if timeout is not None else (KILL_TIMEOUT if sig == "KILL" else STOP_TIMEOUT)
        self.port = free_port()
        self.tag = uuid.uuid4().hex
        self.env = {"DS4_TP_TIMEOUT_SEC": str(self.timeout), TAG_ENV: self.tag}
        if transport == "rdma-fake":
            self.env["DS4_TP_VERBS_LIBRARY"] = fake_verbs_library()
        self.watched = []

    def _spawn(self, args, name, role, env=None, **kw) -> Watched:
        # The fake's role only orients directional faults (l2w/w2l); set it as a real pair would.
        env = {**self.env, "DS4_TP_FAKE_IBV_ROLE": role, **(env or {})}
        w = Watched(self.procs.spawn(args, env=env, **kw), name)
        self.watched.append(w)
        return w

    def transport_args(self):
        if self.transport == "rdma-fake":
            return ["--transport", "rdma"]  # no device named: the provider picks the fake's
        args = ["--transport", self.transport]
        return args + ["--rdma-device", "ucsim"] if self.transport == "rdma" else args

    def cli(self, role: str, max_tokens: int = 8, hello_timeout: float = None) -> Watched:
        env = {} if hello_timeout is None else {HELLO_TIMEOUT_ENV: str(hello_timeout)}
        args = ["-m", "mlx_ds4tp", "run", "--model", self.model, "--max-tokens", str(max_tokens),
                "--no-chat-template", *self.transport_args()]
        if role == "leader":
            args += ["--prompt", "a long story", "--role", "leader", "--listen", "127.0.0.1", str(self.port)]
        else:
            args += ["--role", "worker", "--coordinator", "127.0.0.1", str(self.port)]
        return self._spawn(args, f"ds4tp run {role}", role, env=env)

    def driver(self, phase: str, role: str, **kw) -> Watched:
        """A driver rank. One that parks at its phase waits with KILL_TIMEOUT for
        its peer (on a loaded machine the survivor's start-up alone can take
        longer than STOP_TIMEOUT), and a parked leader is returned only once it
        listens, so the survivor's own dial timeout starts against a live port."""
        parked = phase in PARKED
        env = {"DS4_TP_TIMEOUT_SEC": str(KILL_TIMEOUT)} if parked else None
        w = self._spawn([DRIVER, phase, role, "127.0.0.1", str(self.port), self.transport, self.model],
                        f"driver {phase} {role}", role, env=env, **kw)
        if parked and role == "leader" and phase != "before-listen":
            if phase in ("backlog", "accepted"):
                w.out.wait_for("LISTENING", 60, w.proc)
            else:
                w.err.wait_for("waiting for rank 1", 60, w.proc)
        return w

    def fail(self, message: str) -> None:
        pytest.fail(f"{self.id}: {message}\n" + "\n".join(w.describe() for w in self.watched))

    def expect_stop(self, survivor: Watched, t_event: float, limit: float = None) -> float:
        """The survivor exits non-zero with a clear error within the limit."""
        if limit is None:
            limit = KILL_LIMIT if self.sig == "KILL" else STOP_LIMIT
        t_exit = survivor.wait_exit(limit + 10)
        if t_exit is None:
            self.fail(f"{survivor.name} still running {limit + 10:.0f} s after SIG{self.sig} (hang)")
        elapsed = t_exit - t_event
        err = survivor.err.text()
        if survivor.proc.returncode == 0:
            self.fail(f"{survivor.name} exited 0 after its peer's SIG{self.sig}")
        if "ds4-tp: error:" not in err or "Traceback" in err:
            self.fail(f"{survivor.name} did not stop with a clear ds4-tp error")
        pattern = DEAD if self.sig == "KILL" else STUCK
        if not re.search(pattern, err):
            self.fail(f"{survivor.name}'s error does not say why (expected /{pattern}/)")
        self.record(elapsed, survivor.err.text().strip().splitlines()[-1][:150])
        if elapsed >= limit:
            self.fail(f"{survivor.name} took {elapsed:.2f} s to stop, limit {limit} s")
        return elapsed

    def record(self, seconds: float, note: str = "") -> None:
        RESULTS.append((self.id, seconds, note))
        print(f"{self.id}: detected in {seconds:.2f} s ({note})")

    def wake_or_reap(self, victim: Watched, real: bool) -> None:
        """A stopped real rank, woken up with its peer gone, stops too; a
        driver parked at its phase is killed."""
        if real and self.sig == "STOP" and victim.alive():
            # Within the gate timeout, not 2 s: the survivor said goodbye (STOP
            # or ERROR) before closing, and the RDMA hot loop's dead-peer check
            # (a MSG_PEEK for EOF on the control socket) cannot see the close
            # behind that unread frame. Exit 0 is fine: STOP may be read first.
            t = victim.signal(signal.SIGCONT)
            t_exit = victim.wait_exit(STOP_LIMIT + 5)
            if t_exit is None or t_exit - t > STOP_LIMIT:
                self.fail("the woken-up victim did not stop within the gate timeout")
            RESULTS.append((self.id + " (woken victim)", t_exit - t, f"rc {victim.proc.returncode}"))
        reap(victim)

    def finish(self) -> None:
        for w in self.watched:
            reap(w)
        deadline = time.monotonic() + 5
        while tagged_processes(self.tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = tagged_processes(self.tag)
        if left:
            self.fail(f"stray processes left: {left}")


def cases(transports, roles=("leader", "worker"), sigs=("KILL", "STOP")):
    return [pytest.param(t, v, s, id=f"{v}-{t}-SIG{s}") for t in transports for v in roles for s in sigs]


# ============================================================================
# Connect and hello
# ============================================================================


@pytest.mark.parametrize("transport", BOTH)
def test_dial_leader_never_listens(procs, model_dir, transport):
    """The worker dials a leader that died before listening: it gives up at
    DS4_TP_TIMEOUT_SEC naming the address, not later."""
    c = Case(procs, model_dir, "dial", "leader", transport, "KILL", timeout=STOP_TIMEOUT)
    victim = c.driver("before-listen", "leader")
    victim.out.wait_for("AT before-listen", 30, victim.proc)
    t = victim.signal(signal.SIGKILL)
    worker = c.cli("worker")
    t_exit = worker.wait_exit(STOP_TIMEOUT + 15)
    if t_exit is None:
        c.fail("the worker kept dialing past its timeout")
    err = worker.err.text()
    if worker.proc.returncode == 0 or f"cannot connect control to 127.0.0.1:{c.port}" not in err:
        c.fail("the worker did not report the unreachable leader")
    c.record(t_exit - t, "worker gave up dialing (includes its start-up)")
    c.finish()


@pytest.mark.parametrize("transport, victim, sig", cases(BOTH))
def test_connect(procs, model_dir, transport, victim, sig):
    """Leader victim: it listens and a worker's connection is pending, never
    accepted. Worker victim: connected, no JOIN yet; the leader must drop it
    (within 2 s of a kill, or after its hello timeout when it goes silent) and
    keep waiting: a fresh worker then completes the run."""
    c = Case(procs, model_dir, "connect", victim, transport, sig,
             timeout=KILL_TIMEOUT if victim == "worker" else None)
    if victim == "leader":
        dead = c.driver("backlog", "leader")
        survivor = c.cli("worker")
        dead.out.wait_for("AT backlog", 30, dead.proc)
        # Any connection makes the driver say AT backlog; on a busy machine another test's dial
        # loop can reach this port before the worker does (it then hears the port refused after
        # the kill and waits for a leader to come): wait for the worker's own connection.
        deadline = time.monotonic() + 60
        while not dials(survivor.proc.pid, c.port):
            if time.monotonic() > deadline or not survivor.alive():
                c.fail("the worker never connected to the leader's port")
            time.sleep(0.05)
        t = dead.signal(SIGNALS[sig])
        c.expect_stop(survivor, t)
        c.wake_or_reap(dead, real=False)
    else:
        leader = c.cli("leader", hello_timeout=HELLO_TIMEOUT)
        leader.err.wait_for("waiting for rank 1", 30, leader.proc)
        dead = c.driver("dialed", "worker")
        dead.out.wait_for("AT dialed", 30, dead.proc)
        t = dead.signal(SIGNALS[sig])
        t_drop = leader.err.wait_for("it sent nothing this door reads", 15, leader.proc)
        limit = KILL_LIMIT if sig == "KILL" else HELLO_TIMEOUT + 1.5
        c.record(t_drop - t, "leader dropped it and kept waiting")
        if t_drop - t >= limit:
            c.fail(f"the leader took {t_drop - t:.2f} s to drop the connection, limit {limit}")
        worker = c.cli("worker")
        for w in (leader, worker):
            if w.wait_exit(90) is None or w.proc.returncode != 0:
                c.fail(f"{w.name} did not complete the run after the dropped connection")
        if "tok/s" not in leader.out.text():
            c.fail("the leader printed no closing line")
        reap(dead)
    c.finish()


@pytest.mark.parametrize("transport, victim, sig", cases(BOTH))
def test_hello(procs, model_dir, transport, victim, sig):
    """Leader victim: accepted the control connection, never answers the JOIN.
    Worker victim: joined and sent its link's valid hello, never opens the data
    connection (the leader watches the control stream while it waits for it)."""
    c = Case(procs, model_dir, "hello", victim, transport, sig)
    if victim == "leader":
        dead = c.driver("accepted", "leader")
        survivor = c.cli("worker")
        dead.out.wait_for("AT accepted", 30, dead.proc)
    else:
        # The driver first: it dials until the leader listens, so the leader's
        # connect timeout (STOP_TIMEOUT) never has to cover the driver's start-up.
        dead = c.driver("hello-sent", "worker")
        survivor = c.cli("leader")
        dead.out.wait_for("AT hello-sent", 30, dead.proc)
    t = dead.signal(SIGNALS[sig])
    c.expect_stop(survivor, t)
    c.wake_or_reap(dead, real=False)
    c.finish()


# ============================================================================
# RDMA bring-up (ucsim, and the real provider over the fake)
# ============================================================================


@pytest.mark.parametrize("phase", ["rdma-info", "rdma-info-sent", "warmup"])
@pytest.mark.parametrize("transport, victim, sig", cases(RDMA_ROWS))
def test_rdma_bring_up(procs, model_dir, phase, transport, victim, sig):
    """rdma-info: the victim never sends its queue pair info. rdma-info-sent:
    it sent it, never connects or says READY. warmup: queue pairs connected,
    barrier passed, the victim never sends its warm message."""
    c = Case(procs, model_dir, phase, victim, transport, sig)
    if victim == "leader":
        dead = c.driver(phase, "leader")
        survivor = c.cli("worker")
    else:
        # The driver first: it dials until the leader listens, so the leader's
        # connect timeout (STOP_TIMEOUT) never has to cover the driver's start-up.
        dead = c.driver(phase, "worker")
        survivor = c.cli("leader")
    dead.out.wait_for(f"AT {phase}", 30, dead.proc)
    t = dead.signal(SIGNALS[sig])
    c.expect_stop(survivor, t)
    c.wake_or_reap(dead, real=False)
    c.finish()


# ============================================================================
# Decode gates, bulk gates, between prompts
# ============================================================================


@pytest.mark.parametrize("transport, victim, sig", cases(ALL))
def test_decode(procs, model_dir, transport, victim, sig):
    """Both ranks are `ds4tp run`, caught while the leader streams tokens."""
    c = Case(procs, model_dir, "decode", victim, transport, sig)
    leader = c.cli("leader", max_tokens=1_000_000)
    worker = c.cli("worker")
    deadline = time.monotonic() + 60
    while not leader.out.text() and time.monotonic() < deadline:
        if not leader.alive():
            c.fail("the leader exited before streaming")
        time.sleep(0.01)
    if not leader.out.text():
        c.fail("the leader never streamed")
    time.sleep(0.3)
    dead, survivor = (leader, worker) if victim == "leader" else (worker, leader)
    t = dead.signal(SIGNALS[sig])
    c.expect_stop(survivor, t)
    c.wake_or_reap(dead, real=True)
    c.finish()


@pytest.mark.parametrize("transport, victim, sig", cases(ALL))
def test_bulk(procs, model_dir, transport, victim, sig):
    """Both ranks all_sum 1 MiB partials (bulk exchanges, every sum checked)."""
    c = Case(procs, model_dir, "bulk", victim, transport, sig)
    leader = c.driver("bulk", "leader")
    worker = c.driver("bulk", "worker")
    for w in (leader, worker):
        w.out.wait_for("AT bulk", 60, w.proc)
    time.sleep(0.3)
    dead, survivor = (leader, worker) if victim == "leader" else (worker, leader)
    t = dead.signal(SIGNALS[sig])
    c.expect_stop(survivor, t)
    c.wake_or_reap(dead, real=True)
    c.finish()


@pytest.mark.parametrize("transport, victim, sig", cases(ALL))
def test_between_prompts(procs, model_dir, transport, victim, sig):
    """One generation done; the leader (a driver built on lockstep.LeaderSessions)
    waits before the next, the `ds4tp run` worker idles for its command.
    A killed leader: the idle worker stops at once. A stopped leader: the idle
    worker waits without a deadline (by design), and the pair goes on when the
    leader resumes. A killed or stopped worker: the leader's next prompt fails
    (at once, or at the timeout)."""
    c = Case(procs, model_dir, "between-prompts", victim, transport, sig)
    leader = c.driver("between-prompts", "leader", stdin=subprocess.PIPE)
    worker = c.cli("worker")
    leader.out.wait_for("AT between-prompts", 60, leader.proc)
    if victim == "leader":
        t = leader.signal(SIGNALS[sig])
        if sig == "KILL":
            c.expect_stop(worker, t)
        else:
            time.sleep(STOP_TIMEOUT + 1.5)
            if not worker.alive():
                c.fail("the idle worker gave up on a paused leader")
            leader.signal(signal.SIGCONT)
            leader.proc.stdin.write("\n")
            leader.proc.stdin.flush()
            for w in (leader, worker):
                if w.wait_exit(60) is None or w.proc.returncode != 0:
                    c.fail(f"{w.name} did not finish the second prompt after the leader resumed")
            if "DONE" not in leader.out.text():
                c.fail("the leader did not finish")
            c.record(0.0, "no error by design: the idle worker waited, then served prompt 2")
    else:
        worker.signal(SIGNALS[sig])
        time.sleep(0.2)
        t = time.monotonic()
        leader.proc.stdin.write("\n")
        leader.proc.stdin.flush()
        c.expect_stop(leader, t)  # timed from the leader's next command
        c.wake_or_reap(worker, real=True)
    c.finish()
