"""The wire format's one home (_wire.py, its table true to the code), every
DS4_TP_* knob resolved once by LinkSettings.resolved(), and connect() handing out a
complete pair (its RDMA gates brought up, or TCP chosen)."""

from __future__ import annotations

import ast
import dataclasses
import os
import re

import pytest

import mlx_ds4tp
from mlx_ds4tp import transport as tr
from mlx_ds4tp.link import wire
from mlx_ds4tp.link.config import DiscoverySettings, LinkSettings
from pairutil import both_ok, exchange, free_port, groups_of, run_both

PKG = os.path.dirname(mlx_ds4tp.__file__)
KNOBS = ("DS4_TP_UCSIM_FAULTS", "DS4_TP_RDMA_NO_IMM", "DS4_TP_DISABLE_RDMA_WARMUP", "DS4_TP_HELLO_TIMEOUT_SEC",
         "DS4_TP_TIMEOUT_SEC", "DS4_TP_TCP_SPIN_US", "DS4_TP_SECRET", "DS4_TP_VERBS_LIBRARY")


def leader_config(**kw) -> tr.LinkSettings:
    return tr.LinkSettings.of("leader", listen=("127.0.0.1", 1), **kw)


# ============================================================================
# _wire.py
# ============================================================================


def test_size_bounds_match_the_c_module():
    # _wire.py keeps these as Python constants so it imports without the
    # compiled module; the C hot paths size their buffers from TP_*.
    from mlx_ds4tp._verbs import lib

    assert wire.RDMA_MAX_MSG == lib.TP_MAX_MSG
    assert wire.GATE_MAX_BYTES == lib.TP_GATE_MAX_CHUNKS * lib.TP_MAX_MSG
    # The largest decode gate, as the collectives' exchange (csrc/exchange_codes.h) cuts it.
    assert wire.GATE_MAX_BYTES == lib.TP_GATE_BYTES


def test_the_table_lists_every_transport_frame_with_its_bound():
    """wire's table is true to its bounds; every other frame type is a lockstep command,
    which declares its bound in its class and registers it with the transport."""
    from mlx_ds4tp.lockstep.protocol.commands import COMMANDS

    rows = {}
    for line in wire.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in tr.FrameType.__members__:
            rows[cells[0]] = int(cells[2])
    assert set(rows).isdisjoint(c.name for c in COMMANDS)
    assert rows == {f.name: tr.FRAME_MAX_BYTES[f] for f in tr.FrameType if f not in COMMANDS}
    assert {f: tr.FRAME_MAX_BYTES[f] for f in COMMANDS} == {f: c.bound for f, c in COMMANDS.items()}
    assert set(rows) | {c.name for c in COMMANDS} == set(tr.FrameType.__members__)


def test_a_frame_nothing_bounds_is_refused_at_its_header(monkeypatch):
    """A lockstep command's frame in a process that never registered its bound is refused
    before its payload is read, naming why."""
    from mlx_ds4tp.link.control import decode_frame_header

    monkeypatch.delitem(tr.FRAME_MAX_BYTES, tr.FrameType.HASH, raising=False)
    with pytest.raises(tr.FrameError, match="HASH frame: no bound for it in this process"):
        decode_frame_header(tr.MAGIC, int(tr.FrameType.HASH), 8)


def test_a_frame_type_cannot_be_bounded_twice_differently():
    from mlx_ds4tp.lockstep.protocol.commands import Hash

    wire.register_frame_bound(tr.FrameType.HASH, Hash.bound)  # the same bound again: no change
    with pytest.raises(ValueError, match="HASH is bounded twice: 64 and 65 bytes"):
        wire.register_frame_bound(tr.FrameType.HASH, Hash.bound + 1)


def test_layouts_and_magics_are_defined_only_in_the_wire_module():
    """A struct layout or a DS4x / WARM magic written anywhere else in the
    package is a second copy of the protocol; it belongs in _wire.py."""
    magic = re.compile(r"0x(4453|5741524D)", re.IGNORECASE)
    offenders = []
    for name in sorted(os.listdir(PKG)):
        if not name.endswith(".py") or name == "_wire.py":
            continue
        text = open(os.path.join(PKG, name)).read()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "Struct"):
                offenders.append(f"{name}:{node.lineno} struct.Struct")
        for i, line in enumerate(text.splitlines(), 1):
            if magic.search(line.split("#")[0]):
                offenders.append(f"{name}:{i} magic {magic.search(line).group(0)}")
    assert not offenders, "move these into mlx_ds4tp/_wire.py: " + ", ".join(offenders)


def test_every_exception_is_defined_in_errors_and_exported():
    from mlx_ds4tp import errors

    defined_elsewhere = []
    for name in sorted(os.listdir(PKG)):
        if name.endswith(".py") and name != "errors.py":
            tree = ast.parse(open(os.path.join(PKG, name)).read())
            defined_elsewhere += [f"{name}: {n.name}" for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                                  and any(getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception"))
                                          for b in n.bases)]
    assert not defined_elsewhere, defined_elsewhere
    classes = [n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)]
    assert set(classes) <= set(mlx_ds4tp.__all__), set(classes) - set(mlx_ds4tp.__all__)


# ============================================================================
# LinkSettings.resolved(): every knob once
# ============================================================================


def test_defaults_without_any_knob(monkeypatch):
    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)
    c = leader_config()
    assert (c.timeout, c.hello_timeout, c.secret) == (300.0, 10.0, None)
    assert (c.ucsim_faults, c.rdma_no_imm, c.disable_warmup) == ("", False, False)
    assert c.verbs_library == ""
    # The bring-up's test-only switches are seams in link/rdma_bringup.py, never config fields.
    assert not [f.name for f in dataclasses.fields(c) if f.name.startswith("test_")]


def test_every_knob_is_read_from_the_environment(monkeypatch):
    env = {"DS4_TP_UCSIM_FAULTS": "drop=l2w:1", "DS4_TP_RDMA_NO_IMM": "1",
           "DS4_TP_DISABLE_RDMA_WARMUP": "yes", "DS4_TP_HELLO_TIMEOUT_SEC": "0.5",
           "DS4_TP_TIMEOUT_SEC": "7", "DS4_TP_TCP_SPIN_US": "10", "DS4_TP_SECRET": "s",
           "DS4_TP_VERBS_LIBRARY": "/opt/rdma/libibverbs.so.1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    c = leader_config()
    assert (c.ucsim_faults, c.rdma_no_imm, c.disable_warmup) == ("drop=l2w:1", True, True)
    assert (c.hello_timeout, c.timeout, c.tcp_spin_us, c.secret) == (0.5, 7.0, 10, b"s")
    assert c.verbs_library == "/opt/rdma/libibverbs.so.1"
    # "0" switches a switch off.
    monkeypatch.setenv("DS4_TP_RDMA_NO_IMM", "0")
    monkeypatch.setenv("DS4_TP_DISABLE_RDMA_WARMUP", "0")
    c = leader_config()
    assert (c.rdma_no_imm, c.disable_warmup) == (False, False)


def test_fields_given_override_the_environment(monkeypatch):
    monkeypatch.setenv("DS4_TP_UCSIM_FAULTS", "drop=l2w:1")
    monkeypatch.setenv("DS4_TP_DISABLE_RDMA_WARMUP", "1")
    monkeypatch.setenv("DS4_TP_HELLO_TIMEOUT_SEC", "3")
    c = leader_config(ucsim_faults="", disable_warmup=False, hello_timeout=0.25)
    assert (c.ucsim_faults, c.disable_warmup, c.hello_timeout) == ("", False, 0.25)


@pytest.mark.parametrize("kw, message", [
    ({"hello_timeout": 0}, "hello_timeout=0 must be > 0 seconds"),
    ({"hello_timeout": "5"}, "hello_timeout='5' must be > 0 seconds"),
    ({"timeout": True}, "timeout=True must be > 0 seconds"),
    ({"verbs_library": b"/x.so"}, "verbs_library=b'/x.so': give a path (str)"),
])
def test_bad_fields_are_refused(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        leader_config(**kw)


@pytest.mark.parametrize("name, raw, message", [
    ("DS4_TP_HELLO_TIMEOUT_SEC", "-1", "DS4_TP_HELLO_TIMEOUT_SEC='-1' must be > 0 seconds"),
    ("DS4_TP_TIMEOUT_SEC", "soon", "DS4_TP_TIMEOUT_SEC='soon' is not a number"),
])
def test_bad_environment_values_are_refused_before_connecting(monkeypatch, name, raw, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(message)):
        leader_config()


# ============================================================================
# LinkSettings: how a rank joins, as the user gives it, checked by name
# ============================================================================

LEADER_AT = tr.PairAddress("leader", ("127.0.0.1", 9911), None)


@pytest.mark.parametrize("kw, message", [
    ({"transport": "ib"}, "transport='ib': use 'auto', 'tcp', 'rdma' or 'mlx' (--transport auto|tcp|rdma|mlx)"),
    ({"address": ("127.0.0.1", 9911)}, "address=('127.0.0.1', 9911): make it with pair_address("),
    ({"address": tr.PairAddress("leader", None, ("h", 1))}, "the leader needs listen=(host, port)"),
    ({"address": tr.PairAddress("boss", None, None), "transport": "mlx"}, "role='boss': use 'leader'"),
    ({"rdma_device": ""}, "rdma_device='': give a verbs device name"),
    ({"gid_index": -2}, "gid_index=-2 must be a non-negative integer or None (--rdma-gid-index N)"),
    ({"gid_index": True}, "gid_index=True must be a non-negative integer"),
    ({"timeout": 0}, "timeout=0 must be > 0 seconds"),
    ({"tcp_spin_us": 2_000_000}, "tcp_spin_us=2000000: give 0 (never poll) to 1000000"),
    ({"secret": 5}, "secret must be a non-empty str or bytes"),
    ({"secret": b""}, "secret must be a non-empty str or bytes"),
])
def test_bad_link_settings_are_named(kw, message):
    link = LinkSettings(**{"address": LEADER_AT, **kw})
    with pytest.raises(ValueError, match=re.escape(message)):
        link.check()


def test_link_settings_resolve_for_the_pair(monkeypatch):
    monkeypatch.setenv("DS4_TP_TIMEOUT_SEC", "9")
    link = LinkSettings(LEADER_AT, "tcp", gid_index=1, secret="s", tcp_spin_us=0).check()
    identity = tr.ModelIdentity(layers=3)
    config = link.resolved(identity)
    assert config.address == tr.PairAddress("leader", ("127.0.0.1", 9911), None)
    assert (config.transport, config.gid_index, config.secret, config.tcp_spin_us) == ("tcp", 1, b"s", 0)
    assert config.timeout == 9.0 and config.identity is identity  # None: the environment's
    assert LinkSettings(LEADER_AT, timeout=2.5).resolved().timeout == 2.5
    mlx = LinkSettings(tr.PairAddress(None, None, None), "mlx").check()  # MLX's rank decides
    with pytest.raises(ValueError, match="transport='mlx' is MLX's own group, not a pair"):
        mlx.resolved()


WORKER_AT = tr.PairAddress("worker", None, ("127.0.0.1", 9911))


def test_the_leaders_size_is_a_worker_that_dials_its_leader_and_is_learned_at_the_join():
    worker = LinkSettings(WORKER_AT, "tcp", size=None, ask_rank=2).check()  # asks for rank 2 of whatever N
    assert worker.resolved().size is None  # form_mesh JOINs with size 0: the ROSTER says it
    refused = [LinkSettings(LEADER_AT, size=None),
               LinkSettings(tr.PairAddress("worker", None, None), size=None, discovery=DiscoverySettings(("lo",)))]
    for link in refused:
        with pytest.raises(ValueError, match=r"size=None \(the leader's size\) is for a worker that dials its "
                                             r"leader .*every rank that finds its group by discovery, gives the size"):
            link.check()
    with pytest.raises(ValueError, match=r"rank=8: give a rank 0 \.\. 7 of the 8"):
        LinkSettings(WORKER_AT, size=None, ask_rank=8).check()
    with pytest.raises(ValueError, match=r"size=1: give the number of ranks, 2 to 8 \(--ranks N\), or None"):
        LinkSettings(WORKER_AT, size=1).check()


# ============================================================================
# connect() hands out a complete pair: RDMA brought up, or TCP chosen
# ============================================================================


def connected_pairs(transport: str, bring_up=None):
    port = free_port()
    kw = {"transport": transport, "timeout": 10.0}
    probe = (lambda: tr.rdma_probe("ucsim", "")) if transport in ("rdma", "auto") else None
    seam = {} if bring_up is None else {"bring_up": bring_up}
    return both_ok(
        lambda: tr.connect(tr.LinkSettings.of("leader", listen=("127.0.0.1", port),
                                         rdma_device="ucsim", **kw), rdma_probe=probe, **seam),
        lambda: tr.connect(tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port),
                                         rdma_device="ucsim", **kw), rdma_probe=probe, **seam),
    )


def test_a_pair_without_proven_rdma_falls_back_to_tcp_gates():
    seen = []

    def bring_up_fails(joined):  # both ranks' bring-up gave up together (transport=auto)
        seen.append(joined.transport)
        return None

    lp, wp = connected_pairs("auto", bring_up=bring_up_fails)
    try:
        assert seen == ["rdma", "rdma"]  # agreed on RDMA, then the bring-up said no
        assert lp.transport == wp.transport == "tcp" and lp.rdma is None and wp.rdma is None
        lg, wg = groups_of(lp, wp)
        out = both_ok(lambda: _gate(lg, 1.0), lambda: _gate(wg, 2.0))
        assert out == (2.0, 1.0)
        # Nothing above the transport package attaches gates: there is no half-built pair.
        assert not hasattr(lp, "attach_rdma") and not hasattr(lp, "open_rdma")
    finally:
        lp.close()
        wp.close()


def test_connect_brings_rdma_up_and_the_pair_it_returns_is_complete():
    lp, wp = connected_pairs("rdma")
    try:
        for p in (lp, wp):
            assert p.transport == "rdma" and isinstance(p.rdma, tr.RdmaDevice)
            assert p.rdma.warmup_ms is not None  # both directions proven before the pair was handed out
        lg, wg = groups_of(lp, wp)
        assert both_ok(lambda: _gate(lg, 3.0), lambda: _gate(wg, 4.0)) == (4.0, 3.0)
    finally:
        lp.close()
        wp.close()


def test_a_bring_up_that_fails_hard_closes_both_connections():
    joined = []

    def bring_up_raises(j):
        joined.append(j)
        raise tr.TransportError("the device went away")

    port = free_port()
    kw = {"transport": "rdma", "timeout": 10.0, "rdma_device": "ucsim"}
    probe = lambda: tr.rdma_probe("ucsim", "")  # noqa: E731
    (lv, le), (wv, we) = run_both(
        lambda: tr.connect(tr.LinkSettings.of("leader", listen=("127.0.0.1", port), **kw),
                           rdma_probe=probe, bring_up=bring_up_raises),
        lambda: tr.connect(tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), **kw),
                           rdma_probe=probe, bring_up=bring_up_raises),
    )
    assert lv is None and wv is None
    assert all(isinstance(e, tr.TransportError) and "went away" in str(e) for e in (le, we)), (le, we)
    assert len(joined) == 2 and all(j.control.sock.fileno() == -1 and j.data.fileno() == -1 for j in joined)


def _gate(group, value: float) -> float:
    import numpy as np

    recv = exchange(group, np.full(4096, value, np.float32))
    assert np.all(recv == recv[0])
    return float(recv[0])
