"""Discovery for a group of N, in process: the election among ranks of one group size, the rank
rule, the lobby over real sockets on 127.0.0.1 (the secret proven both ways, strangers refused
by name, a member that left dropped, the ranks given out), a leader stepping down for a lower
one, and the give-up message naming who was seen and how many were missing. The ranks finding
each other over a link are tests/test_discovery_group.py."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest

from mlx_ds4tp.errors import AuthenticationError, HelloMismatchError, PeerClosedError
from mlx_ds4tp.link import discovery as dsc, findgroup, lobby as lb
from mlx_ds4tp.link.config import DiscoverySettings, LinkSettings, PairAddress
from mlx_ds4tp.link.hello import ModelIdentity
from mlx_ds4tp.link.wire import PROTOCOL_VERSION

DIGEST = "ab" * 16
SECRET = b"group-secret"


def advert(instance: str, size: int = 3, state: str = dsc.SEEK, port: int = 0, **kw) -> dsc.Advert:
    return dsc.Advert(instance=instance, digest=kw.pop("digest", DIGEST), want=kw.pop("want", "any"),
                      state=state, port=port, size=size, **kw)


def knock(instance: str, host: str = "mac", ask: int = lb.NO_RANK, size: int = 3, **kw) -> lb.Knock:
    return lb.Knock(instance, host, kw.pop("digest", DIGEST), size, PROTOCOL_VERSION, ask, kw.pop("auth", True))


# -- the advert and the election for N -------------------------------------------------------


def test_a_groups_record_says_its_size_and_a_pairs_record_is_as_it_was():
    pair = advert("a", size=2)
    assert "n" not in pair.txt()
    group = advert("a", size=3)
    assert group.txt()["n"] == "3"
    wire = {k.encode(): v.encode() for k, v in group.txt().items()}
    assert dsc.Advert.from_txt(wire) == group
    assert dsc.Advert.from_txt({k.encode(): v.encode() for k, v in pair.txt().items()}).size == 2
    assert dsc.Advert.from_txt({**wire, b"n": b"1"}) is None  # not a group size: a stranger's record


def test_only_ranks_of_the_same_group_size_count_in_the_election():
    me = advert("m5")
    others = [advert("a1", size=2, state=dsc.LEAD, port=1), advert("a2", size=4, state=dsc.LEAD, port=1),
              advert("a3", size=4)]
    assert dsc.elect(me, others, settled=True) == ("lead", None)  # no rival, no leader of size 3
    leader = advert("z9", state=dsc.LEAD, port=7)
    assert dsc.elect(me, [*others, leader], settled=False) == ("join", leader)
    # Three `any` ranks settle on the lowest id; the others wait for it to lead, then join it.
    trio = [advert("1111"), advert("5555"), advert("9999")]
    assert [dsc.elect(t, trio, settled=True)[0] for t in trio] == ["lead", "wait", "wait"]


def test_ranks_are_the_leader_then_the_asked_then_by_host_and_instance():
    leader = knock("0000", "mac-z")
    members = [knock("f1", "mac-c"), knock("a2", "mac-b", ask=3), knock("e3", "mac-a"), knock("b4", "mac-a")]
    ranks = lb.assign(dataclasses.replace(leader, size=5), members)
    assert ranks == {"0000": 0, "a2": 3, "b4": 1, "e3": 2, "f1": 4}
    # The same machines meet again with new instance ids: the host names keep their ranks.
    again = lb.assign(dataclasses.replace(leader, size=5, instance="9"),
                      [knock("x", "mac-c"), knock("y", "mac-b", ask=3), knock("z", "mac-a"), knock("w", "mac-a")])
    assert [again[i] for i in ("z", "w", "y", "x")] == [2, 1, 3, 4]  # mac-a's two by instance


# -- the lobby over real sockets -------------------------------------------------------------


class LobbyAt:
    """A leader's lobby on 127.0.0.1 with members entering from threads."""

    def __init__(self, secret=SECRET, size: int = 3) -> None:
        self.lobby = lb.Lobby("127.0.0.1", knock("0000", "lead-mac", size=size), secret)
        self.results: dict = {}

    def enter(self, me: lb.Knock, secret=SECRET) -> threading.Thread:
        def go() -> None:
            sock = socket.create_connection(("127.0.0.1", self.lobby.port), timeout=5)
            try:
                entered = lb.enter(sock, me, secret)
                self.results[me.instance] = lb.wait_for_rank(entered, time.monotonic() + 10, lambda: True)
            except Exception as exc:  # noqa: BLE001 - the test reads what each member got
                self.results[me.instance] = exc

        t = threading.Thread(target=go, daemon=True)
        t.start()
        return t

    def admit_until(self, done, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while not done() and time.monotonic() < deadline:
            self.lobby.wait(0.05)
            self.lobby.admit()
        assert done(), (self.lobby.members, self.lobby.refused)


def test_the_lobby_admits_who_proves_the_secret_refuses_strangers_and_gives_out_ranks(capfd):
    at = LobbyAt()
    strangers = [at.enter(knock("s1", "other-secret"), secret=b"another-secret"),
                 at.enter(knock("s2", "other-model", digest="cd" * 16)),
                 at.enter(knock("s3", "other-size", size=4)),
                 at.enter(knock("s4", "no-secret", auth=False), secret=None)]
    at.admit_until(lambda: len(at.lobby.refused) == 4)
    for t in strangers:
        t.join(5)
    assert isinstance(at.results["s1"], AuthenticationError)
    assert "leader's proof does not match" in str(at.results["s1"])
    assert isinstance(at.results["s2"], HelloMismatchError) and "another model" in str(at.results["s2"])
    assert isinstance(at.results["s3"], HelloMismatchError) and "--ranks" in str(at.results["s3"])
    assert isinstance(at.results["s4"], AuthenticationError)
    assert not at.lobby.members
    # The right ones: one asks for rank 2, the other takes what is left.
    members = [at.enter(knock("m1", "mac-b", ask=2)), at.enter(knock("m2", "mac-c"))]
    at.admit_until(at.lobby.full)
    given = at.lobby.release(mesh_port=4242)
    for t in members:
        t.join(5)
    assert [(r, m.knock.instance) for r, m in given] == [(1, "m2"), (2, "m1")]
    assert at.results["m1"]["rank"] == 2 and at.results["m2"]["rank"] == 1
    assert at.results["m1"]["port"] == 4242 and at.results["m1"]["roster"] == at.results["m2"]["roster"]
    assert [r[0] for r in at.results["m1"]["roster"]] == [0, 1, 2]
    err = capfd.readouterr().err
    assert "this leader refused other-secret at 127.0.0.1 (instance s1): it refused this leader: " \
           "authentication failed" in err
    assert "this leader refused other-model" in err and "joined this group (2 of 2 workers" in err


def test_a_wrong_proof_from_a_member_is_refused_by_the_leader():
    at = LobbyAt()
    sock = socket.create_connection(("127.0.0.1", at.lobby.port), timeout=5)
    nonce = bytes(16)
    lb.send(sock, {"t": "knock", **knock("x").fields(), "nonce": nonce.hex()})
    at.lobby.wait(1)

    def lie() -> None:
        lb.recv(sock, time.monotonic() + 5)  # the leader's proof, unchecked: this one has no secret
        lb.send(sock, {"t": "prove", "proof": "00" * 32})
        at.results["x"] = lb.recv(sock, time.monotonic() + 5)

    t = threading.Thread(target=lie, daemon=True)
    t.start()
    at.lobby.admit()
    t.join(5)
    assert not at.lobby.members
    assert at.results["x"]["t"] == "error"
    assert "authentication failed: its proof does not match" in at.results["x"]["why"]


def test_a_second_asker_of_a_rank_is_refused_and_a_member_that_left_is_dropped():
    at = LobbyAt(size=4)
    first = socket.create_connection(("127.0.0.1", at.lobby.port), timeout=5)
    t = threading.Thread(target=lambda: at.results.update(a=lb.enter(first, knock("a", ask=2, size=4), SECRET)),
                         daemon=True)
    t.start()
    at.admit_until(lambda: "a" in at.lobby.members)
    t.join(5)
    at.enter(knock("b", ask=2, size=4))
    at.admit_until(lambda: at.lobby.refused)
    assert "rank 2 was asked for by" in at.lobby.refused[0]
    at.results["a"].sock.close()  # the member leaves (its process died)
    deadline = time.monotonic() + 5
    while "a" in at.lobby.members and time.monotonic() < deadline:
        at.lobby.check_members(lambda instance: True)
    assert not at.lobby.members and "its connection closed" in at.lobby.left[0]
    # A member whose advert went away (its TTL ran out: a Mac switched off) is dropped too.
    at.enter(knock("c", size=4))
    at.admit_until(lambda: "c" in at.lobby.members)
    assert [m.knock.instance for m in at.lobby.check_members(lambda instance: instance != "c")] == ["c"]
    assert "its advert is gone" in at.lobby.left[-1]
    at.lobby.close()


def test_a_member_hears_the_leader_close_its_group():
    at = LobbyAt()
    t = at.enter(knock("m"))
    at.admit_until(lambda: "m" in at.lobby.members)
    at.lobby.close(why="mac-x leads this group instead")
    t.join(5)
    assert at.results["m"] == {"t": "gone", "why": "mac-x leads this group instead"}
    # A leader whose advert went away is not waited for.
    at = LobbyAt()
    sock = socket.create_connection(("127.0.0.1", at.lobby.port), timeout=5)
    t = threading.Thread(target=lambda: at.results.update(e=lb.enter(sock, knock("m"), SECRET)), daemon=True)
    t.start()
    at.admit_until(lambda: "m" in at.lobby.members)
    t.join(5)
    with pytest.raises(PeerClosedError, match="advert is gone"):
        lb.wait_for_rank(at.results["e"], time.monotonic() + 5, lambda: False)
    at.lobby.close()


def test_a_stranger_that_speaks_no_lobby_is_refused_without_harm():
    at = LobbyAt()
    sock = socket.create_connection(("127.0.0.1", at.lobby.port), timeout=5)
    sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
    at.admit_until(lambda: at.lobby.refused)
    assert "not a ds4tp lobby message" in at.lobby.refused[0]
    at.lobby.close()


# -- the search: stepping down, giving up -------------------------------------------------------


class FakeFinder:
    def __init__(self, me: dsc.Advert, peers) -> None:
        self.me, self._peers, self.refused = me, list(peers), set()

    def peers(self):
        return list(self._peers)

    def publish(self, **changes) -> None:
        self.me = dataclasses.replace(self.me, **changes)


def search(me: dsc.Advert, peers, size: int = 3) -> findgroup._Search:
    s = findgroup._Search.__new__(findgroup._Search)
    s.finder, s.size, s.timeout = FakeFinder(me, peers), size, 10.0
    s.interfaces = [dsc.Interface("tb0", 3, (("10.233.0.1", 24),), ())]
    s.refused, s.why, s.seen, s.lobby, s.entered = s.finder.refused, {}, {}, None, None
    s.unreachable = set()
    s.knock, s.secret = knock(me.instance, me.host or "me", size=size), SECRET
    s.started, s.deadline = time.monotonic(), time.monotonic() + 10
    return s


def test_a_leader_steps_down_for_a_lower_leader_of_its_group_but_not_for_a_refused_one():
    me = advert("5555", state=dsc.LEAD, port=9)
    low = advert("1111", state=dsc.LEAD, port=7)
    s = search(me, [low, advert("0000", size=4, state=dsc.LEAD, port=1), advert("7777", state=dsc.LEAD, port=2)])
    assert s.lower_leader() == low
    s.refuse(low, "authentication failed")
    assert s.lower_leader() is None
    assert search(dataclasses.replace(me, want="lead"), [low]).lower_leader() is None  # must lead


def leading(s: findgroup._Search, out: dict) -> lb.Entered:
    """s leading in a thread on 127.0.0.1, with one member in its lobby (returned)."""
    s.interfaces = [dsc.Interface("lo", 1, (("127.0.0.1", 8),), ())]

    def lead() -> None:
        try:
            out["found"] = s.lead()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["found"] = exc

    threading.Thread(target=lead, daemon=True).start()
    deadline = time.monotonic() + 5
    while s.finder.me.state != dsc.LEAD and time.monotonic() < deadline:
        time.sleep(0.01)
    return lb.enter(socket.create_connection(("127.0.0.1", s.finder.me.port), timeout=5), knock("m1"), SECRET)


def test_a_leader_steps_down_into_a_lower_leaders_lobby_and_tells_its_members():
    s, out = search(advert("5555"), []), {}
    member = leading(s, out)
    lower = LobbyAt()  # instance 0000, host lead-mac
    s.finder._peers = [advert("0000", host="lead-mac", state=dsc.LEAD, port=lower.lobby.port,
                              addresses=("127.0.0.1",))]
    lower.admit_until(lambda: "5555" in lower.lobby.members)
    assert lb.wait_for_rank(member, time.monotonic() + 5, lambda: True) == \
        {"t": "gone", "why": "lead-mac (instance 0000) leads this group instead"}
    lower.lobby.release(mesh_port=4242)
    deadline = time.monotonic() + 5
    while "found" not in out and time.monotonic() < deadline:
        time.sleep(0.01)
    found = out["found"]
    assert (found.role, found.rank, found.address) == ("worker", 1, ("127.0.0.1", 4242)), found
    assert s.lobby is None


def test_a_leader_keeps_its_lobby_when_the_lower_leader_is_a_stranger():
    s, out = search(advert("5555"), []), {}
    member = leading(s, out)
    stranger = LobbyAt(secret=b"another-secret")
    s.finder._peers = [advert("0000", host="lead-mac", state=dsc.LEAD, port=stranger.lobby.port,
                              addresses=("127.0.0.1",))]
    stranger.admit_until(lambda: stranger.lobby.refused)
    deadline = time.monotonic() + 5
    while "0000" not in s.refused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "authentication failed" in s.why["0000"] and list(s.lobby.members) == ["m1"]
    s.deadline = time.monotonic()  # now it gives up: its member hears why
    message = lb.wait_for_rank(member, time.monotonic() + 5, lambda: True)
    assert message["t"] == "gone" and message["why"].startswith("the leader gave up: discovery on lo could not")
    assert "missing 1 of the 3 ranks" in message["why"] and "refused (authentication failed" in message["why"]
    deadline = time.monotonic() + 5
    while "found" not in out and time.monotonic() < deadline:
        time.sleep(0.01)
    assert type(out["found"]).__name__ == "GroupNotFoundError"


def test_a_closed_lobby_is_passed_over_but_its_rank_may_lead_again_on_another_port():
    me = advert("5555")
    old = advert("1111", state=dsc.LEAD, port=7)
    s = search(me, [old])
    s.pass_over(old, "could not be reached (connection refused)")
    assert s.peers() == []
    again = dataclasses.replace(old, port=8)  # it stepped down, then led again
    s.finder._peers = [again]
    assert s.peers() == [again] and dsc.elect(me, s.peers(), settled=True) == ("join", again)


def test_the_give_up_message_names_who_was_seen_and_how_many_were_missing():
    me = advert("5555")
    peers = [advert("1111", host="mac-a", addresses=("10.233.0.2",), state=dsc.LEAD, port=7),
             advert("2222", host="mac-b", addresses=("10.233.0.3",)),
             advert("3333", host="mac-c", digest="cd" * 16)]
    s = search(me, peers, size=4)
    s.refuse(peers[0], "authentication failed: the leader's proof does not match")
    message = s.missing()
    assert message.startswith("discovery on tb0 could not gather a group of 4 ranks with this model before "
                              "the timeout (10 s): no rank led a group this rank could join; missing 2 of "
                              "the 4 ranks; heard mac-a (instance 1111) at 10.233.0.2: refused "
                              "(authentication failed"), message
    assert "mac-b (instance 2222) at 10.233.0.3: looking" in message
    assert "and 1 rank(s) of another model, protocol or group size" in message
    assert "--ranks 4 and pair secret" in message
    s.finder._peers = peers[:1]  # mac-b went away
    assert "mac-b (instance 2222) at 10.233.0.3: left (its advert is gone)" in s.missing()
    # A member waiting in a leader's lobby names the leader and who was in.
    s.entered = lb.Entered(None, knock("1111", "mac-a"), ["mac-a", "mac-d", "mac-e"])
    assert "this rank joined mac-a's group, which had 3 of the 4 ranks (mac-a, mac-d, mac-e); missing 1 of " \
           "the 4 ranks" in s.missing()


# -- what the bring-up takes -------------------------------------------------------------------


def test_a_leader_on_several_interfaces_listens_on_all_of_them():
    en1 = dsc.Interface("en1", 5, (("10.99.0.1", 30),), ("fe80::1",))
    en2 = dsc.Interface("en2", 6, (("10.99.1.1", 30),), ())
    en3 = dsc.Interface("en3", 7, (), ("fe80::3",))
    assert findgroup.listen_host([en1]) == "10.99.0.1"
    assert findgroup.listen_host([en1, en2]) == "0.0.0.0"
    assert findgroup.listen_host([en1, en3]) == "::"


def test_found_makes_the_meshs_settings_and_inits_keywords():
    disc = LinkSettings(PairAddress(None, None, None), "tcp", secret="s",
                        discovery=DiscoverySettings(("tb0",)), size=3).check()
    lead = findgroup.Found("leader", 0, 3, ("10.233.0.1", 4242), "tb0", ((0, "a", "1"),), 1.0)
    work = dataclasses.replace(lead, role="worker", rank=2)
    assert lead.settings(disc).check().address == PairAddress("leader", ("10.233.0.1", 4242), None)
    settings = work.settings(disc).check()
    assert settings.address == PairAddress("worker", None, ("10.233.0.1", 4242))
    assert (settings.size, settings.ask_rank, settings.discovery, settings.secret) == (3, 2, None, "s")
    assert lead.init_kwargs() == {"role": "leader", "listen": ("10.233.0.1", 4242), "size": 3}
    assert work.init_kwargs() == {"role": "worker", "coordinator": ("10.233.0.1", 4242), "size": 3, "rank": 2}


def test_find_group_refuses_a_pair_and_settings_without_discovery():
    pair = LinkSettings(PairAddress(None, None, None), discovery=DiscoverySettings(("lo",)))
    with pytest.raises(ValueError, match=r"size=2: two ranks find each other by link.meet.meet"):
        findgroup.find_group(pair, ModelIdentity())
    with pytest.raises(ValueError, match="find_group needs discovery settings"):
        findgroup.find_group(LinkSettings(PairAddress("leader", ("h", 1), None), size=3), ModelIdentity())
    with pytest.raises(ValueError, match="not over transport 'mlx'"):
        LinkSettings(PairAddress(None, None, None), "mlx", size=3).check()


def test_the_ranks_flag_makes_a_discovering_groups_settings():
    import argparse

    from mlx_ds4tp.cli.pair_args import add_ranks_arg, add_transport_args, link_from_args, ranks_from_args

    p = argparse.ArgumentParser()
    add_ranks_arg(p)
    add_transport_args(p)
    assert ranks_from_args(p.parse_args([]), "serve") == 2
    args = p.parse_args(["--ranks", "3", "--secret", "s", "--transport", "tcp"])
    size = ranks_from_args(args, "serve")
    link = link_from_args(args, PairAddress(None, None, None), "serve", discovery=DiscoverySettings(("tb0",)),
                          size=size)
    assert (link.size, link.discovery.interfaces, link.secret) == (3, ("tb0",), "s")
    with pytest.raises(SystemExit, match=r"ds4tp serve: --ranks 9: give the number of machines, 2 to 8"):
        ranks_from_args(p.parse_args(["--ranks", "9"]), "serve")
