"""Discovery's pure parts: the election rule, the advert's TXT record both ways, the pair
secret's file (mode 0600) and its code typed back, the refusal to discover on an open link
without a secret, and the settings the link layer takes. The ranks finding each other over a
link are tests/test_discovery_link.py."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest

from mlx_ds4tp.link import discovery as dsc, pair_secret
from mlx_ds4tp.link.config import DiscoverySettings, LinkSettings, PairAddress
from mlx_ds4tp.link.hello import RankFigures

DIGEST = "ab" * 16


def advert(instance: str, want: str = "any", state: str = dsc.SEEK, port: int = 0, **kw) -> dsc.Advert:
    return dsc.Advert(instance=instance, digest=kw.pop("digest", DIGEST), want=want, state=state,
                      port=port, **kw)


# -- who leads -------------------------------------------------------------------------------


def test_a_rank_that_may_work_joins_the_waiting_leader_with_the_lowest_id():
    me = advert("m5")
    leaders = [advert("z9", state=dsc.LEAD, port=2), advert("c3", state=dsc.LEAD, port=1)]
    assert dsc.elect(me, leaders, settled=False) == ("join", leaders[1])
    assert dsc.elect(advert("m5", want="work"), leaders, settled=False) == ("join", leaders[1])
    # `run --prompt` leads whatever it hears, at once.
    assert dsc.elect(advert("m5", want="lead"), leaders, settled=False) == ("lead", None)
    assert dsc.elect(advert("m5", want="lead"), [], settled=False) == ("lead", None)


def test_only_peers_of_the_same_model_and_protocol_count():
    me = advert("m5")
    others = [advert("a1", state=dsc.LEAD, port=1, digest="cd" * 16),
              advert("a2", state=dsc.LEAD, port=1, version=me.version + 1),
              advert("a3", state=dsc.PAIRED, port=1)]
    assert dsc.elect(me, others, settled=False) == ("wait", None)
    assert dsc.elect(me, others, settled=True) == ("lead", None)  # none of them is a rival


def test_two_any_ranks_settle_it_by_instance_id_once_settled():
    low, high = advert("1111"), advert("9999")
    assert dsc.elect(low, [high], settled=False) == ("wait", None)  # not yet heard everyone
    assert dsc.elect(low, [high], settled=True) == ("lead", None)
    assert dsc.elect(high, [low], settled=True) == ("wait", None)
    # Once the low one leads, the high one joins it.
    assert dsc.elect(high, [advert("1111", state=dsc.LEAD, port=5)], settled=True)[0] == "join"


def test_a_worker_never_leads_and_an_any_rank_waits_for_one_that_wants_to():
    assert dsc.elect(advert("0000", want="work"), [], settled=True) == ("wait", None)
    # A rank that only works (a rejoining worker) is no rival: the any rank leads for it.
    assert dsc.elect(advert("9999"), [advert("0000", want="work")], settled=True) == ("lead", None)
    # One about to lead (`run --prompt`, not yet in state lead): join it rather than compete.
    assert dsc.elect(advert("0000"), [advert("9999", want="lead")], settled=True) == ("wait", None)


def test_a_leader_without_a_port_is_not_joined_yet():
    assert dsc.elect(advert("m"), [advert("a", state=dsc.LEAD, port=0)], settled=False) == ("wait", None)


# -- the advert's TXT record -----------------------------------------------------------------


def test_txt_round_trip_as_zeroconf_hands_it_back():
    a = advert("0123456789abcdef", want="lead", state=dsc.LEAD, port=40123, rdma="rdma_en1",
               figures=RankFigures(64 << 30, 123456789), host="mac-a", http="http://127.0.0.1:8080/v1")
    # zeroconf's ServiceInfo.properties: bytes keys and values.
    wire = {k.encode(): v.encode() for k, v in a.txt().items()}
    assert all(len(k) + len(v) < 255 for k, v in wire.items())
    back = dsc.Advert.from_txt(wire, ("10.0.0.1", "fe80::1%en1"))
    assert back == a.__class__(**{**a.__dict__, "addresses": ("10.0.0.1", "fe80::1%en1")})


@pytest.mark.parametrize("broken", [
    {}, {"id": "x"},  # fields missing
    {"v": "one", "id": "x", "m": DIGEST, "w": "any", "st": "seek"},  # not a number
    {"v": "1", "id": "x", "m": DIGEST, "w": "boss", "st": "seek"},  # no such want
    {"v": "1", "id": "", "m": DIGEST, "w": "any", "st": "seek"},  # no instance
    {"v": "1", "id": "x", "m": DIGEST, "w": "any", "st": "seek", "fig": "1"},  # figures malformed
])
def test_a_stranger_record_is_ignored_not_an_error(broken):
    assert dsc.Advert.from_txt(broken) is None


def test_the_digest_tells_models_apart():
    assert dsc.model_digest(b"model a") != dsc.model_digest(b"model b")
    assert dsc.model_digest(b"model a") == dsc.model_digest(b"model a")


def test_the_dial_address_is_the_one_on_our_link():
    lo = dsc.Interface("lo", 1, (("127.0.0.1", 8),), ())
    veth = dsc.Interface("v0", 7, (("10.232.0.2", 24),), ("fe80::2",))
    peer = advert("a", state=dsc.LEAD, port=1, addresses=("192.168.1.5", "10.232.0.1"))
    assert dsc.dial_address(peer, [lo, veth]) == ("10.232.0.1", veth)
    v6 = advert("a", state=dsc.LEAD, port=1, addresses=("fe80::1",))
    assert dsc.dial_address(v6, [veth]) == ("fe80::1%v0", veth)  # link-local: our interface's scope
    with pytest.raises(ValueError, match="none on lo's subnet"):
        dsc.dial_address(peer, [lo])
    assert veth.listen_host() == "10.232.0.2" and lo.loopback and not veth.loopback
    assert dsc.Interface("en1", 9, (), ("fe80::9",)).listen_host() == "fe80::9%en1"


def test_an_interface_without_multicast_is_refused_with_the_command(tmp_path):
    (tmp_path / "lo").mkdir()
    (tmp_path / "lo" / "flags").write_text("0x9\n")  # Linux's loopback: UP|LOOPBACK
    with pytest.raises(ValueError, match=r"--interface lo does not carry multicast.*`sudo ip link set lo multicast"):
        dsc._check_multicast("lo", str(tmp_path))
    (tmp_path / "lo" / "flags").write_text("0x1009\n")
    dsc._check_multicast("lo", str(tmp_path))
    dsc._check_multicast("en1", str(tmp_path))  # no flags file (macOS): nothing to check


def test_an_unknown_interface_names_the_ones_there_are():
    with pytest.raises(ValueError, match=r"--interface nosuch0: no such interface here \(there are: .*lo"):
        dsc.interface("nosuch0")


# -- the pair secret -------------------------------------------------------------------------


def test_the_code_typed_back_in_any_case_with_spaces_is_the_same_secret(tmp_path):
    env = {pair_secret.CONFIG_DIR_ENV: str(tmp_path / "cfg")}
    code = pair_secret.new_code()
    assert len(code) == 19 and code.count("-") == 3
    typed = " ".join(code.lower().replace("-", " ").split()) + "\n"
    path = pair_secret.store_code(typed, env)
    assert pair_secret.stored_code(env) == code
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert pair_secret.new_code() != code


@pytest.mark.parametrize("bad, says", [("ABCD", "has 4 characters, not 16"),
                                       ("ABCD-EFGH-IJKL-MN01", "only A-Z and 2-7")])
def test_a_mistyped_code_is_named(bad, says):
    with pytest.raises(ValueError, match=says):
        pair_secret.parse_code(bad)


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    env = {pair_secret.CONFIG_DIR_ENV: str(tmp_path)}
    assert pair_secret.stored_code(env) is None
    path = pair_secret.store_code(pair_secret.new_code(), env)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by other users .*chmod 600"):
        pair_secret.stored_code(env)


def test_the_config_dir_is_the_platforms():
    home = {"HOME": "/home/u"}
    assert str(pair_secret.config_dir(home, "linux")) == "/home/u/.config/ds4tp"
    assert str(pair_secret.config_dir({**home, "XDG_CONFIG_HOME": "/x"}, "linux")) == "/x/ds4tp"
    assert str(pair_secret.config_dir(home, "darwin")) == "/home/u/Library/Application Support/ds4tp"


def test_ds4tp_pair_makes_then_stores_the_code(tmp_path, monkeypatch, capsys):
    from mlx_ds4tp.cli import main

    monkeypatch.setenv(pair_secret.CONFIG_DIR_ENV, str(tmp_path / "a"))
    assert main(["pair"]) == 0
    code = capsys.readouterr().out.strip()
    assert main(["pair"]) == 0 and capsys.readouterr().out.strip() == code  # kept, not replaced
    monkeypatch.setenv(pair_secret.CONFIG_DIR_ENV, str(tmp_path / "b"))
    assert main(["pair", code.lower()]) == 0
    assert pair_secret.stored_code() == code


# -- the settings and the secret rule --------------------------------------------------------


def test_discovery_settings_are_checked_by_name():
    nowhere = PairAddress(None, None, None)
    with pytest.raises(ValueError, match="name at least one interface"):
        LinkSettings(nowhere, discovery=DiscoverySettings(())).check()
    with pytest.raises(ValueError, match="want='boss'"):
        LinkSettings(nowhere, discovery=DiscoverySettings(("lo",), "boss")).check()
    with pytest.raises(ValueError, match="give no listen/coordinator"):
        LinkSettings(PairAddress("leader", ("h", 1), None), discovery=DiscoverySettings(("lo",))).check()
    found = LinkSettings(nowhere, discovery=DiscoverySettings(("lo",))).check()
    with pytest.raises(ValueError, match="link.meet finds the peer"):
        found.resolved()


def test_discovery_on_an_open_link_without_a_secret_is_refused_before_advertising(monkeypatch):
    from mlx_ds4tp.link import meet

    monkeypatch.delenv("DS4_TP_SECRET", raising=False)
    veth = dsc.Interface("v0", 7, (("10.232.0.2", 24),), ())
    lo = dsc.Interface("lo", 1, (("127.0.0.1", 8),), ())
    link = LinkSettings(PairAddress(None, None, None), discovery=DiscoverySettings(("v0",)))
    with pytest.raises(ValueError, match=r"discovery on v0 needs a pair secret .*`ds4tp pair`"):
        meet._check_secret(link, [lo, veth])
    meet._check_secret(link, [lo])  # loopback: only this machine
    meet._check_secret(dataclasses.replace(link, secret="s"), [veth])
    from mlx_ds4tp.link import exposure

    monkeypatch.setattr(exposure, "cable_interfaces", lambda named=(), platform=None: frozenset({"v0"}))
    meet._check_secret(link, [veth])  # a Thunderbolt cable: only the other Mac


def test_ipv4_advice_is_one_command():
    assert dsc.ipv4_advice("en1", True) == "sudo ifconfig en1 inet 10.99.0.1/30 alias"
    assert dsc.ipv4_advice("en2", False).endswith("10.99.0.2/30 alias")


def test_a_leader_not_reached_is_tried_again_after_the_ttl_and_never_led_against(monkeypatch):
    """meet()'s loop: a leader whose door did not answer (a stale record, or a door closed a
    moment while its group forms again) is not joined again for TTL_SEC, and meanwhile an `any`
    rank waits for it (it wants to lead) rather than leading a pair of its own; then it is
    joined. A peer with another secret is left out for good."""
    import time

    from mlx_ds4tp.errors import AuthenticationError, TransportError
    from mlx_ds4tp.link import meet

    lone_leader = advert("l1", want="lead", state=dsc.LEAD, port=4242)
    stranger = advert("l0", want="lead", state=dsc.LEAD, port=4343)

    class Finder:
        me, refused = advert("w9"), set()

        def publish(self, **changes) -> None:
            self.me = dataclasses.replace(self.me, **changes)

        def registered(self, timeout: float) -> bool:
            return True

        def peers(self):
            return [stranger, lone_leader]

    tries = []

    def join(link, identity, connect, finder, interfaces, leader):
        tries.append((leader.instance, time.monotonic()))
        if leader is stranger:
            raise AuthenticationError("another secret")
        if len(tries) == 2:
            raise TransportError("the door closed under this JOIN")
        return "the pair"

    def lead(*args):
        raise AssertionError("the rank led a pair of its own while a leader that must lead was heard")

    monkeypatch.setattr(dsc, "TTL_SEC", 0.5)
    monkeypatch.setattr(dsc, "interface", lambda name: dsc.Interface(name, 1, (("127.0.0.1", 8),), ()))
    monkeypatch.setattr(meet, "finder_for", lambda *args: Finder())
    monkeypatch.setattr(meet, "_join", join)
    monkeypatch.setattr(meet, "_lead", lead)
    link = LinkSettings(PairAddress(None, None, None), discovery=DiscoverySettings(("lo",)), timeout=30)
    assert meet.meet(link, None) == ("the pair", link)
    assert [who for who, _ in tries] == ["l0", "l1", "l1"]  # the stranger once, for good
    assert tries[2][1] - tries[1][1] >= 0.5
