"""`ds4tp doctor --ranks N` (mlx_ds4tp/cli/doctor_mesh.py): alone, a mesh of N over ucsim in
one process; `--listen ... --ranks 3` and two `--peer`s on 127.0.0.1, each printing its links,
an exact all_sum round trip and, with --model (a llama of 8 KV heads), the share auto would pick
for the 3 and even's nearest (3:3:2, uneven), and a peer with other weights stops the group
naming both fingerprints; the same found by discovery (`--interface --ranks
3` in three network namespaces); bad --ranks values refused naming the value.

Every doctor is a child process, killed when the test ends (the procs fixture); every wait has
a timeout.
"""

from __future__ import annotations

import re
from typing import List

import pytest

from pairutil import free_port
from test_discovery_link import spawn

SECRET = "doctor-group-secret"
WAIT_SEC = 240  # three doctors, each measuring this Mac and tracing the model, on two cores


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    """A random-weight llama of 8 KV heads (8 do not divide by 3: even takes 3:3:2)."""
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    return save_llama(tmp_path_factory.mktemp("doctor-mesh") / "llama8", "tiny8", seed=0)


def test_doctor_ranks_3_alone_checks_a_ucsim_mesh(procs):
    p = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--ranks", "3"])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert re.search(r"\[  ok\] ucsim group of 3: bring-up, warm-up and 200 all_sums in \d+\.\d+ s", out), out
    assert "ucsim group of 2" not in out, out
    assert "prints the share for the 3 ranks" in out
    assert "doctor: 9 checks, 0 failed" in out


def check_group_lines(outs: List[str], size: int, where: str) -> None:
    """Each doctor's lines for a group of `size` over tcp with the 8-KV-head llama: its own rank
    (0 .. size-1 once each), a tcp link to every other rank, the same model everywhere, the same
    auto share everywhere, even's 3:3:2 said to be uneven, and an exact all_sum round trip."""
    ranks, shares = [], set()
    for out in outs:
        mesh = re.search(rf"\[  ok\] group of {size}: this Mac is rank (\d); links (.*)", out)
        assert mesh, out
        rank = int(mesh.group(1))
        ranks.append(rank)
        assert mesh.group(2) == ", ".join(f"{rank}<->{p} tcp" for p in range(size) if p != rank), out
        fingerprint = re.search(r"\[  ok\] model fingerprint: (\w+) here; (.*) \(", out)
        assert fingerprint, out
        assert fingerprint.group(2) == ", ".join(f"rank {p} {fingerprint.group(1)}" for p in range(size)
                                                 if p != rank), out
        auto = re.search(rf"\[  ok\] split auto: would pick (\S+) \(rank 0's part first\) for the {size} ranks: "
                         rf"rank 0: .*; rank {size - 1}: ", out)
        assert auto, out
        shares.add(auto.group(1))
        assert ("[  ok] split even: 3:3:2 (rank 0's part first): the model's counts do not divide by 3, "
                "so --split even takes the nearest cut they allow, which is uneven") in out, out
        assert re.search(rf"\[  ok\] all_sum round trip with {re.escape(where)}: {size} ranks, transport tcp, "
                         r"16 KiB p50 [\d.]+ us p99 [\d.]+ us over 1800, exact on every rank", out), out
        for peer in (p for p in range(size) if p != rank):
            # The wiring table's row of each of this rank's links: at an address (no --interface)
            # the route; found by discovery, the interface named (on Linux: the cable) at both ends.
            ends = (rf"(no cable: over the route to rank {peer} at [\d.]+|rank {rank} \S+ [\d.]+ <-> rank {peer} "
                    r"\S+ [\d.]+ \(no RDMA device on this link\))")
            assert re.search(rf"\[  ok\] wiring rank {rank} <-> rank {peer}: {ends}; transport tcp; gate 16 KiB "
                             r"p50 [\d.]+ us p99 [\d.]+ us; bulk 4 MiB [\d.]+ GB/s", out), out
        # The whole wiring table on every rank (each link once), and a line per cable named.
        cable_lines = len(re.findall(r"^\[(  ok|warn)\] cable ", out, re.M))
        assert f"doctor: {13 + size * (size - 1) // 2 + cable_lines} checks, 0 failed" in out, out
    assert sorted(ranks) == list(range(size)), outs
    assert len(shares) == 1, shares  # the same figures, the same arithmetic: one share on every rank


def test_doctor_listen_ranks_3_and_two_peers_round_trip_exactly(procs, llama8):

    port = free_port()
    common = ["--transport", "tcp", "--model", str(llama8)]
    leader = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--listen", "127.0.0.1", str(port), "--ranks", "3",
                          *common])
    # A peer takes the leader's size where a worker can (LinkSettings(size=None)); until then it
    # is told --ranks too.
    told: list = []
    peers = [procs.spawn(["-m", "mlx_ds4tp", "doctor", "--peer", "127.0.0.1", str(port), *told, *common])
             for _ in range(2)]
    outs = []
    for p in (leader, *peers):
        out, err = p.communicate(timeout=WAIT_SEC)
        assert p.returncode == 0, out + err
        outs.append(out)
    check_group_lines(outs, 3, f"127.0.0.1:{port}")


def test_a_peer_with_other_weights_stops_the_group_naming_both_fingerprints(procs, llama8, tmp_path):
    from mlx_ds4tp import model_fingerprint
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    other = save_llama(tmp_path / "other", "tiny8", seed=1)
    mine, theirs = model_fingerprint(llama8).label, model_fingerprint(other).label
    port = free_port()
    told: list = []
    env = {"DS4_TP_TIMEOUT_SEC": "30"}  # the peer the mismatch leaves waiting gives up within 30 s
    leader = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--listen", "127.0.0.1", str(port), "--ranks", "3",
                          "--transport", "tcp", "--model", str(llama8)], env=env)
    peers = [procs.spawn(["-m", "mlx_ds4tp", "doctor", "--peer", "127.0.0.1", str(port), *told,
                          "--transport", "tcp", "--model", str(model)], env=env) for model in (llama8, other)]
    outs = []
    for p in (leader, *peers):
        out, err = p.communicate(timeout=WAIT_SEC)
        assert p.returncode == 1, out + err
        # A peer that takes the leader's size names its round trip before it knows the size: a
        # pair's (gate) is its default.
        assert re.search(r"\[FAIL\] (all_sum|gate) round trip: ", out), out
        outs.append(out)
    assert "[FAIL] all_sum round trip: " in outs[0], outs[0]
    # The leader's link to the other model, and that peer, name both fingerprints; the third rank
    # fails with the mesh, whatever its link saw.
    for out in (outs[0], outs[2]):
        assert "model mismatch" in out and mine in out and theirs in out, out


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_doctor_interface_ranks_3_finds_the_group_and_round_trips(procs, bridge, llama8, tmp_path):
    doctors = [spawn(procs, bridge, i, ["doctor", "--ranks", "3", "--model", str(llama8)], SECRET, tmp_path)
               for i in range(3)]
    for d in doctors:
        if d.wait_exit(WAIT_SEC) is None:
            pytest.fail("doctor did not finish\n" + "\n".join(r.describe() for r in doctors))
    for d in doctors:
        assert d.proc.returncode == 0, d.describe()
    check_group_lines([d.out.text() for d in doctors], 3, "the group discovery found")


@pytest.mark.parametrize("flags, said", [
    (["--ranks", "9"], "--ranks 9: give the number of machines, 2 to 8"),
    (["--ranks", "1"], "--ranks 1: give the number of machines, 2 to 8"),
    (["--ranks", "9", "--peer", "127.0.0.1", "9911"], "--ranks 9: give the number of machines, 2 to 8"),
    (["--ranks", "3", "--transport", "mlx"], "--ranks 3 with --transport mlx: a group of more than two"),
    (["--ranks", "3", "--listen", "127.0.0.1", "9911", "--transport", "mlx"],
     "--ranks 3 with --transport mlx: a group of more than two"),
    (["--ranks", "3", "--model", "/nowhere"], "--model is compared with the peer's"),
])
def test_bad_ranks_values_are_refused_naming_the_value_and_the_fix(flags, said):
    from mlx_ds4tp.cli import build_parser, doctor

    args = build_parser().parse_args(["doctor", *flags])
    with pytest.raises(SystemExit) as refused:
        doctor.check_args(args)
    assert str(refused.value).startswith("ds4tp doctor: ") and said in str(refused.value)
    if "mlx" in flags:
        assert "give --transport auto, tcp or rdma, or --ranks 2" in str(refused.value)


def test_ranks_2_and_no_ranks_are_the_pair_as_before():
    from mlx_ds4tp.cli import build_parser, doctor

    for flags in ([], ["--ranks", "2"]):
        args = build_parser().parse_args(["doctor", "--listen", "127.0.0.1", "9911", *flags])
        assert doctor.check_args(args).size == 2
    assert doctor.check_args(build_parser().parse_args(["doctor", "--ranks", "2"])) is None
