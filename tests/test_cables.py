"""link/cables.py without sockets: which cable two ranks share, each link's device, the cable
addresses on the wire (JOIN, ROSTER), --rdma-devices checked against the cables found, a group
that --transport rdma cannot cable refused naming the two ranks. The same end to end in network
namespaces: tests/test_wiring.py."""

from __future__ import annotations

import pytest

from mlx_ds4tp.cli.pair_args import parse_rdma_devices
from mlx_ds4tp.errors import FrameError, RdmaUnavailableError
from mlx_ds4tp.link.cables import (
    CableAddress,
    Wiring,
    cable_device,
    check_named_devices,
    find_cable,
    local_cables,
    pack_cables,
    refuse_uncabled,
    unpack_cables,
)
from mlx_ds4tp.link.roster import pack_roster, unpack_roster

# Three Macs cabled as a full mesh, one /30 per cable; rank 2 also on a LAN.
R0 = [CableAddress("en3", "10.0.1.1", 30), CableAddress("en5", "10.0.2.1", 30)]
R1 = [CableAddress("en2", "10.0.1.2", 30), CableAddress("en4", "10.0.3.1", 30)]
R2 = [CableAddress("en0", "192.168.1.7", 24), CableAddress("en7", "10.0.2.2", 30),
      CableAddress("en6", "10.0.3.2", 30)]


def test_two_ranks_share_the_cable_whose_subnet_holds_both_ends():
    cable = find_cable(R0, R2)
    assert (cable.mine.interface, cable.theirs.interface, cable.theirs.ip) == ("en5", "en7", "10.0.2.2")
    assert find_cable(R1, R2).mine.interface == "en4"
    assert find_cable(R0[:1], R2) is None
    # The same address at both ends is this machine, not a cable; another prefix is another subnet.
    assert find_cable([CableAddress("a", "10.0.1.1", 30)], [CableAddress("b", "10.0.1.1", 30)]) is None
    assert find_cable([CableAddress("a", "10.0.1.1", 30)], [CableAddress("b", "10.0.1.2", 24)]) is None


def test_each_cable_opens_its_interfaces_device():
    assert cable_device("en3", None, platform="darwin") == "rdma_en3"
    assert cable_device("en3", "ucsim", platform="darwin") == "ucsim"
    assert cable_device("eth1", "ucsim", platform="linux") == "ucsim"
    assert cable_device("eth1", "mlx5_0", platform="linux") == "mlx5_0"
    assert cable_device("eth1", None, platform="linux") is None


def test_cable_addresses_cross_the_wire_in_join_and_roster_alike():
    packed = pack_cables(R2)
    assert unpack_cables(b"xx" + packed, 2) == (R2, 2 + len(packed))
    with pytest.raises(FrameError):
        unpack_cables(packed[:-1], 0)
    roster = [("", 9911), ("10.1.0.2", 40001), ("10.1.0.3", 40002)]
    assert unpack_roster(pack_roster(roster, 2, [R0, R1, R2])) == (roster, 2, [R0, R1, R2])
    assert unpack_roster(pack_roster(roster, 1, [[], [], []]))[2] == [[], [], []]


def test_loopback_is_no_cable_and_an_unknown_interface_has_no_address():
    assert local_cables(["lo", "no-such-interface-here"]) == []


def test_rdma_refuses_a_group_with_two_ranks_without_a_cable_naming_them_and_where_they_looked():
    refuse_uncabled(Wiring([R0, R1, R2]))
    with pytest.raises(RdmaUnavailableError) as err:
        refuse_uncabled(Wiring([R0, R1[:1], R2[:2]]))
    said = str(err.value)
    assert "rank 1 and rank 2 share no cable" in said
    assert "rank 1 looked on en2 10.0.1.2/30" in said and "rank 2 looked on en0 192.168.1.7/24, en7" in said
    with pytest.raises(RdmaUnavailableError, match="rank 2 looked on no interface with an IPv4 address"):
        refuse_uncabled(Wiring([R0, R1, []]))
    assert not Wiring([[], [], []]).named and Wiring([R0, [], []]).named


def test_rdma_devices_are_checked_against_the_cables_found():
    wiring = Wiring([R0, R1, R2])
    assert check_named_devices({1: "ucsim:en3", 2: "ucsim"}, 0, wiring, "ucsim") == {1: "ucsim", 2: "ucsim"}
    with pytest.raises(RdmaUnavailableError) as err:  # the two cables swapped in the flag
        check_named_devices({1: "ucsim:en5"}, 0, wiring, "ucsim")
    assert "the cable to rank 1 is on interface en3 (10.0.1.1 to 10.0.1.2), whose device is ucsim:en3" in str(err.value)
    assert "a swapped cable" in str(err.value)
    with pytest.raises(RdmaUnavailableError, match="no cable to rank 2 was found"):
        check_named_devices({2: "mlx5_0"}, 0, Wiring([R0[:1], R1, R2]), None)
    with pytest.raises(RdmaUnavailableError, match="rank 0 is not a peer of rank 0"):
        check_named_devices({0: "ucsim"}, 0, wiring, "ucsim")


def test_rdma_devices_flag_parses_peer_device_pairs_and_names_a_bad_item():
    assert parse_rdma_devices(None) is None
    assert parse_rdma_devices("1=rdma_en3, 2=ucsim:eth1") == {1: "rdma_en3", 2: "ucsim:eth1"}
    for bad in ("1", "x=rdma_en3", "1="):
        with pytest.raises(ValueError, match="is not PEER=DEVICE"):
            parse_rdma_devices(bad)


def _cabled(pairs, size):
    """Every rank's cable addresses for cables `pairs` (a, b), cable k on 10.9.k.0/30."""
    out = [[] for _ in range(size)]
    for k, (a, b) in enumerate(pairs):
        out[a].append(CableAddress(f"en{k}a", f"10.9.{k}.1", 30))
        out[b].append(CableAddress(f"en{k}b", f"10.9.{k}.2", 30))
    return Wiring(out)


def test_cables_closing_one_ring_are_a_ring_and_rdma_takes_them():
    ring4 = _cabled([(0, 1), (1, 2), (2, 3), (3, 0)], 4)
    assert ring4.ring() == [0, 1, 2, 3]
    refuse_uncabled(ring4)  # the diagonals 0-2 and 1-3 have no cable: the ring is enough
    assert _cabled([(0, 2), (2, 1), (1, 3), (3, 0)], 4).ring() == [0, 2, 1, 3]
    assert _cabled([(0, 3), (3, 1), (1, 4), (4, 2), (2, 0)], 5).ring() == [0, 2, 4, 1, 3]
    # A full mesh is no ring (nothing is missing); three ranks' full mesh neither.
    assert _cabled([(a, b) for a in range(4) for b in range(a + 1, 4)], 4).ring() == []
    assert _cabled([(0, 1), (1, 2), (0, 2)], 3).ring() == []
    # Two triangles, a chain, a rank with three cables: refused naming two ranks without one.
    for pairs, size in (([(0, 1), (1, 2), (2, 0), (3, 4), (4, 5), (5, 3)], 6),
                        ([(0, 1), (1, 2), (2, 3)], 4), ([(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)], 4)):
        wiring = _cabled(pairs, size)
        assert wiring.ring() == []
        with pytest.raises(RdmaUnavailableError, match="share no cable.*closing one ring"):
            refuse_uncabled(wiring)


def test_a_cable_out_is_named_by_the_watch_with_both_ranks_and_both_ends():
    import threading

    from mlx_ds4tp.link.cable_watch import CableWatch, interface_trouble, watch_cables
    from mlx_ds4tp.link.cables import Cable

    assert interface_trouble("no-such-if0", "10.0.1.1") == "interface no-such-if0 is gone"
    cable = Cable(CableAddress("no-such-if0", "10.0.1.1", 30), CableAddress("en5", "10.0.1.2", 30))
    said, fired = [], threading.Event()
    watch = CableWatch(2, {0: cable}, lambda text: (said.append(text), fired.set()), period=0.01)
    watch.start()
    assert fired.wait(10), "the watch never noticed the cable out"
    watch.close()
    assert said == [watch.fault] == [watch.explain()]
    assert said[0].startswith("rank 0 and rank 2 have no cable now: the cable between rank 2 (no-such-if0 "
                              "10.0.1.1) and rank 0 (en5 10.0.1.2) stopped: interface no-such-if0 is gone")
    # A pair keeps its gate timeout (no watch); a group of three without cables has none to watch.
    assert watch_cables(0, 2, {1: cable}, []) is None
    assert watch_cables(0, 3, {1: None, 2: None}, []) is None
