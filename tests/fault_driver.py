"""Drive one rank up to a phase of a pair's life, print ``AT <phase>`` on
stdout, then block there, so a test can SIGKILL or SIGSTOP it at exactly that
point (tests/test_faults.py, tests/test_cable_pull.py). Built only from the
library's own pieces; nothing in the shipped package knows about it.

    python tests/fault_driver.py PHASE ROLE HOST PORT TRANSPORT MODEL

TRANSPORT: tcp, rdma (over ucsim) or rdma-fake (the ibverbs provider, no device
named, over the library DS4_TP_VERBS_LIBRARY names: the tests' fake).

PHASE (and the role that can take it):
  before-listen   leader: started, never listens (a leader that died early)
  backlog         leader: listens, a worker's connection is pending, never accepts
  accepted        leader: accepted the control connection, never answers the JOIN
  dialed          worker: connected, never JOINs
  hello-sent      worker: joined, sent its link's valid hello, never opens the data connection
  rdma-info       either: pair up and RDMA device status exchanged, never sends RDMA_INFO
  rdma-info-sent  either: sent RDMA_INFO, never reads the peer's or says READY
  warmup          either: queue pair connected, warm-up receive posted and the
                  receives-posted barrier passed, never sends the warm message
  bulk            either: all_sum of 1 MiB partials (bulk exchanges) in a loop,
                  every sum checked; AT after the first
  gates           either: all_sum of one 16 KiB hidden vector (decode gates) in a loop
  between-prompts leader: one generation done with the `ds4tp run` worker, then
                  waits for a line on stdin before the second; prints DONE at the end

Errors go to stderr as `ds4-tp: error: ...` with exit 1, like the CLI; a wrong
sum exits 2.
"""

from __future__ import annotations

import select
import sys
import time


def block() -> None:
    while True:
        time.sleep(3600)


def at(phase: str) -> None:
    print(f"AT {phase}", flush=True)


def before_pair(phase: str, host: str, port: int, transport: str, identity) -> None:
    """The phases before a group forms: a leader that never listens, never accepts or never
    answers; a worker that dials and never JOINs. Blocks there."""
    from mlx_ds4tp import transport as tr

    deadline = time.monotonic() + tr.default_timeout()
    if phase == "before-listen":
        at(phase)
        block()
    if phase in ("backlog", "accepted"):
        listener = tr.listen_socket(host, port)
        print("LISTENING", flush=True)  # the test starts the survivor worker now
        if phase == "backlog":
            select.select([listener], [], [])  # a connection is pending
        else:
            conn, _ = listener.accept()
        at(phase)
        block()
    tr.dial(host, port, deadline, "control")
    at(phase)
    block()


def form_with(config, link_step) -> None:
    """The group of two formed as the shipped ranks form it (form_mesh: JOIN, ROSTER, one link),
    its one link made by link_step(settings, **form_mesh's seams)."""
    from mlx_ds4tp import transport as tr

    tr.form_mesh(config, link_step)


def hello_sent(host: str, port: int, transport: str, device, identity) -> None:
    """A worker that joins and says its link's hello (and the secret's proofs), then never opens
    the gate data connection. Blocks there."""
    from mlx_ds4tp import transport as tr

    def link_step(config, dial=tr.dial, **seams):
        def dial_until_data(h: str, p: int, deadline: float, what: str):
            if what == "gate data":
                at("hello-sent")
                block()
            return dial(h, p, deadline, what)

        return tr.connect(config, rdma_probe=lambda: tr.rdma_probe(device, config.verbs_library),
                          dial=dial_until_data, **seams)

    form_with(tr.LinkSettings.of("worker", coordinator=(host, port), transport=transport,
                                 rdma_device=device, identity=identity), link_step)


def in_bring_up(phase: str, role: str, address: tuple, transport: str, device, identity) -> None:
    """The RDMA bring-up's phases: the group formed with a link whose bring-up seam runs the
    shipped steps up to the phase, then blocks."""
    from mlx_ds4tp import transport as tr, warmup

    def bring_up_to_phase(joined):
        rdma = joined.open_rdma()
        rdma.build(0)
        warmup.exchange_status(joined, True, "")
        if phase == "rdma-info":
            at(phase)
            block()
        joined.control.send(tr.FrameType.RDMA_INFO, rdma.local_info())
        if phase == "rdma-info-sent":
            at(phase)
            block()
        _, payload = joined.control.recv(tr.FrameType.RDMA_INFO)
        rdma.connect_peer(payload)
        warmup.ready_barrier(joined)
        rdma.post_recv(rdma.warm_recv, warmup.WARM_BYTES, tr.WARM_WR_ID)
        warmup.posted_barrier(joined)
        at(phase)
        block()

    leader = role == "leader"
    config = tr.LinkSettings.of(role, listen=address if leader else None,
                                coordinator=None if leader else address, transport=transport,
                                rdma_device=device, identity=identity)
    form_with(config, lambda c, **seams: tr.connect(
        c, rdma_probe=lambda: tr.rdma_probe(device, c.verbs_library), bring_up=bring_up_to_phase, **seams))
    raise SystemExit(f"fault_driver: phase {phase} needs transport rdma, got tcp")


def gate_loop(group, phase: str) -> int:
    """all_sum of 1 MiB partials (bulk) or of one 16 KiB vector (gates) until killed, every sum
    checked: 2 on a wrong sum."""
    import mlx.core as mx
    import numpy as np

    from mlx_ds4tp import gate_ops

    shape = (64, 4096) if phase == "bulk" else (4096,)
    rank = group.rank()
    for k in range(1 << 62):
        y = gate_ops.all_sum(mx.full(shape, float(rank + 1)) + k, group=group)
        mx.eval(y)  # the collective runs (and fails) inside MLX's evaluation
        if not np.array_equal(np.array(y), np.full(shape, 3.0 + 2 * k, np.float32)):
            print(f"fault_driver: wrong sum at exchange {k}", file=sys.stderr, flush=True)
            return 2
        if k == 0:
            at(phase)
    return 0


def between_prompts(group, model: str, phase: str) -> int:
    """The leader of a `ds4tp run` pair: one generation, then a line on stdin, then another."""
    from pathlib import Path

    from mlx_ds4tp.lockstep.generate import encode_prompt, pair_generate
    from mlx_ds4tp.lockstep.protocol.sessions import LeaderSessions
    from mlx_ds4tp.model_split import load_split
    from mlx_ds4tp.split.agree import agree_share
    from mlx_ds4tp.split.auto import model_need
    from mlx_ds4tp.split.share import SplitSettings

    # The `ds4tp run` worker loads with the share its leader sends before any weight is read.
    share = agree_share(group, SplitSettings(), model_need(Path(model), 64))
    split, tokenizer = load_split(model, group, split=share)
    sessions = LeaderSessions(group, split)
    prompt = encode_prompt(tokenizer, "two machines", chat=False)
    try:
        pair_generate(sessions, prompt, 4)
        at(phase)
        sys.stdin.readline()
        pair_generate(sessions, prompt, 4)
    finally:
        sessions.stop()
    group.close()
    print("DONE", flush=True)
    return 0


def main(argv) -> int:
    phase, role, host, port, transport, model = argv[:6]
    port = int(port)
    from mlx_ds4tp import gate_ops
    from mlx_ds4tp.link.identity import model_identity

    identity = model_identity(model)
    device = "ucsim" if transport == "rdma" else None
    if transport == "rdma-fake":
        transport = "rdma"
    if phase in ("before-listen", "backlog", "accepted", "dialed"):
        before_pair(phase, host, port, transport, identity)
    if phase == "hello-sent":
        hello_sent(host, port, transport, device, identity)
    leader = role == "leader"
    address = (host, port)
    if phase in ("rdma-info", "rdma-info-sent", "warmup"):
        in_bring_up(phase, role, address, transport, device, identity)

    group = gate_ops.init(role=role, listen=address if leader else None,
                          coordinator=None if leader else address, transport=transport,
                          rdma_device=device, identity=identity)
    if phase in ("bulk", "gates"):
        return gate_loop(group, phase)
    if phase == "between-prompts" and leader:
        return between_prompts(group, model, phase)
    raise SystemExit(f"fault_driver: unknown phase {phase!r} for role {role}")


if __name__ == "__main__":
    from mlx_ds4tp.errors import TransportError

    try:
        sys.exit(main(sys.argv[1:]))
    # RuntimeError: what MLX's evaluation hands on from a collective that failed inside it.
    except (TransportError, ValueError, RuntimeError) as exc:
        print(f"ds4-tp: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
