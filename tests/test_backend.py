"""The MLX distributed backend (mlx_ds4tp._pairgroup, csrc/mlx/): our group (here of two) is an
mx.distributed.Group whose collectives are lazy primitives in MLX's graph.

Each case runs both ranks as processes (tests/backend_child.py): two ranks evaluating in
one process would share MLX's scheduler, whose cap on tasks in flight is global, so one
rank's blocked exchange could stall the other's graph before it reaches the matching one.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest

import mlx_ds4tp as tp
from pairutil import Procs, free_port

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backend_child.py")


def run_case(case: str, transport: str, timeout: float = 120.0, env=None):
    procs = Procs()
    port = str(free_port())
    try:
        ranks = [procs.spawn([CHILD, role, port, transport, case], env=env)
                 for role in ("leader", "worker")]
        out = []
        for p in ranks:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
        return out
    finally:
        procs.kill_all()


def reports(case: str, transport: str):
    out = []
    for rc, stdout, stderr in run_case(case, transport):
        assert rc == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_the_group_is_an_mlx_group_and_its_module_names_its_mlx():
    from mlx_ds4tp.collectives import backend
    from mlx_ds4tp.collectives.group import Group

    assert issubclass(Group, mx.distributed.Group) and tp.Group is Group
    assert backend._pairgroup.BUILT_AGAINST_MLX == mx.__version__
    assert backend.built_against(backend._extension_path()) == mx.__version__


def test_the_dtype_codes_are_one_table_seen_alike_from_c_cpp_and_python():
    from mlx_ds4tp import gate_ops
    from mlx_ds4tp.collectives import backend
    from mlx_ds4tp.link.native import load_verbs

    _, lib = load_verbs()
    codes = backend._pairgroup.dtype_codes()
    # The backend's table: every code of csrc/exchange_codes.h once, in order, each MLX dtype
    # under the header's name for it; Python's list of dtypes is that table's.
    assert [code for _, code in codes] == list(range(lib.TP_DTYPE_FIRST, lib.TP_DTYPE_LAST + 1))
    for dtype, code in codes:
        assert getattr(lib, "TP_DTYPE_" + str(dtype).split(".")[-1].upper()) == code, dtype
    assert gate_ops.SUPPORTED_DTYPES == tuple(dtype for dtype, _ in codes)


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_chain_of_100_gates_is_built_without_moving_a_byte(transport):
    for report in reports("chain", transport):
        assert report["transport"] == transport
        assert report["gates_while_building"] == 0
        # Building never waits for the peer, asleep for 1 s (it takes about 0.1 ms on a quiet
        # machine; the bound leaves a loaded one room).
        assert report["build_sec"] < 0.5, report
        assert report["gates_after"] == 100
        assert report["value"] == 1.5


def test_prefill_runs_only_the_gates_the_cache_needs():
    # 3 chunks of the prompt; each forward builds 2L + 1 gates (the embedding's, then the
    # attention's and the MLP's per block) and the logits gather, but evaluating only the
    # cache runs neither the last block's two gates nor the gather, on both ranks alike.
    for report in reports("prefill", "tcp"):
        assert report["prefill_gates"] == 3 * (2 * report["layers"] - 1), report


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_mlx_lm_shard_plans_run_over_the_pair(transport):
    for report in reports("shard", transport):
        for name in ("qwen3", "qwen3_moe"):
            assert report[name]["max_rel"] < 1e-4, (name, report)
            assert report[name]["identical_on_both"], (name, report)


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_peer_that_dies_inside_a_graph_is_an_error_and_the_survivor_lives(transport):
    (lrc, lout, lerr), (wrc, _, _) = run_case("die", transport, env={"CHILD_TIMEOUT": "20"})
    assert wrc == 3
    assert lrc == 0, lerr[-3000:]
    report = json.loads(lout.strip().splitlines()[-1])
    assert report["error"] and "peer" in report["error"], report
    assert report["elapsed"] < 20.0, report  # within the gate timeout, not at the test's
    assert "this group is closed" in report["later"], report
    assert report["alive"] == 3.0


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_group_rejoined_by_a_new_worker_runs_the_model_split_over_it(transport):
    procs = Procs()
    port = str(free_port())
    try:
        leader = procs.spawn([CHILD, "leader", port, transport, "rejoin"])
        first = procs.spawn([CHILD, "worker", port, transport, "rejoin"])
        first.communicate(timeout=120)
        assert first.returncode == 3
        second = procs.spawn([CHILD, "worker", port, transport, "rejoin"], env={"CHILD_SECOND": "1"})
        out = [p.communicate(timeout=120) + (p.returncode,) for p in (leader, second)]
    finally:
        procs.kill_all()
    (lout, lerr, lrc), (wout, werr, wrc) = out
    assert lrc == 0 and wrc == 0, (lerr[-3000:], werr[-3000:])
    lead, work = (json.loads(o.strip().splitlines()[-1]) for o in (lout, wout))
    assert lead["first_rel"] < 1e-4 and work["first_rel"] < 1e-4
    assert lead["lost"] and "peer" in lead["lost"], lead
    assert lead["bad_reattach"].startswith("TransportError") and "still open" in lead["bad_reattach"], lead
    assert lead["again_rel"] < 1e-4, lead
    assert lead["transport"] == work["transport"] == transport


def test_a_module_built_against_another_mlx_is_refused_naming_both(tmp_path, monkeypatch):
    from mlx_ds4tp.collectives import backend

    fake = tmp_path / "_pairgroup.cpython-fake.so"
    fake.write_bytes(b"\x7fELF....ds4tp-built-against-mlx=0.1.0;....")
    monkeypatch.setattr(backend, "_extension_path", lambda: str(fake))
    with pytest.raises(ImportError) as err:
        backend.load_pairgroup()
    message = str(err.value)
    assert "built against MLX 0.1.0" in message
    assert f"MLX {mx.__version__} is installed" in message
    assert "pip install" in message and "--no-build-isolation" in message


def test_reconnect_rejoins_with_the_settings_the_group_was_made_with():
    """No evaluation here (one process, one MLX scheduler): the pairs only."""
    from mlx_ds4tp import gate_ops
    from mlx_ds4tp.link.config import LinkSettings, PairAddress
    from pairutil import both_ok, make_groups

    lg, wg = make_groups("tcp", timeout=10.0)
    first = lg.link_to(1)
    lg.close()
    wg.close()
    # Nothing repeated: the address, transport, timeout and identity init was given.
    both_ok(lambda: gate_ops.reconnect(lg), lambda: gate_ops.reconnect(wg))
    with lg, wg:
        assert lg.link_to(1) is not first and (lg.transport, lg.rank(), wg.rank()) == ("tcp", 0, 1)
    bad = LinkSettings(PairAddress("leader", ("127.0.0.1", 1), None), "tcp", gid_index=-1)
    with pytest.raises(ValueError, match="gid_index=-1"):  # an override is checked as init's are
        gate_ops.reconnect(lg, bad)
