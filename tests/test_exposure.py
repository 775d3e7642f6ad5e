"""link/exposure.py and the one secret resolution (link/pair_secret.join_secret), as the
commands use them: where a group may form without a secret (loopback, a Thunderbolt interface,
on Linux the interfaces named with --interface), the refusal naming the address and the two
fixes, --insecure's one warning line, `ds4tp serve`'s keyless HTTP warning, and the secret
kept out of reprs and command lines. The same end to end over network namespaces:
tests/test_join_secret.py."""

from __future__ import annotations

import os

import pytest

from mlx_ds4tp.cli import build_parser
from mlx_ds4tp.link import exposure
from mlx_ds4tp.link.config import LinkSettings, PairAddress, pair_address
from mlx_ds4tp.link.pair_secret import join_secret, store_code

CODE = "K7QF-2MZA-XR4D-PLWE"
LISTING = """Hardware Port: Wi-Fi
Device: en0
Ethernet Address: aa:bb:cc:dd:ee:ff

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: N/A

Hardware Port: Thunderbolt 1
Device: en1
Ethernet Address: aa:bb:cc:dd:ee:01
"""
# This machine's addresses as the tests give them: one on a cable-like interface, one on Wi-Fi.
HERE = {"127.0.0.1": "lo", "10.99.0.1": "en1", "192.168.1.20": "en0"}


@pytest.fixture(autouse=True)
def no_secret_here(monkeypatch, tmp_path):
    """No DS4_TP_SECRET and an empty config directory: the secret is what each test gives."""
    monkeypatch.delenv("DS4_TP_SECRET", raising=False)
    monkeypatch.setenv("DS4_TP_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setattr(exposure, "local_addresses", lambda: dict(HERE))


def test_thunderbolt_interfaces_are_the_bridge_its_members_and_the_thunderbolt_ports(monkeypatch):
    assert exposure.thunderbolt_ports(LISTING) == ["bridge0", "en1"]
    outputs = {"ifconfig": "bridge0: flags=...\n\tmember: en2 flags=3<LEARNING,DISCOVER>\n",
               "networksetup": LISTING}
    monkeypatch.setattr(exposure, "_output", lambda command: outputs[command[0]])
    assert exposure.cable_interfaces(("en0",), "darwin") == {"bridge0", "en1", "en2"}  # naming Wi-Fi: no
    assert exposure.cable_interfaces(("veth0",), "linux") == {"veth0"}  # Linux: the named ones
    assert exposure.thunderbolt_interfaces("linux") == frozenset()


def test_an_address_is_private_on_loopback_and_a_cable_and_open_elsewhere():
    cable = frozenset({"en1"})
    assert exposure.address_exposure("leader", "127.0.0.1", 9911, cable).where == "loopback"
    assert exposure.address_exposure("worker", "localhost", 9911, cable).private
    on_cable = exposure.address_exposure("leader", "10.99.0.1", 9911, cable)
    assert on_cable.private and on_cable.where == "interface en1"
    wifi = exposure.address_exposure("leader", "192.168.1.20", 9911, cable)
    assert not wifi.private and wifi.where == "interface en0" and wifi.address == "192.168.1.20:9911"
    anywhere = exposure.address_exposure("leader", "0.0.0.0", 9911, cable)
    assert not anywhere.private and anywhere.where == "every interface of this machine"
    assert not exposure.address_exposure("leader", "10.5.5.5", 9911, cable).private  # not ours
    assert not exposure.address_exposure("leader", "no-such-host.invalid", 9911, cable).private
    assert exposure.address_exposure("worker", "fe80::1%en1", 9911, cable).private
    assert not exposure.address_exposure("worker", "fe80::1%en0", 9911, cable).private


def test_a_worker_is_as_exposed_as_the_interface_its_dial_leaves_from(monkeypatch):
    monkeypatch.setattr(exposure, "_source_address", lambda ip, port: "10.99.0.1" if ip.startswith("10.99.") else None)
    assert exposure.address_exposure("worker", "10.99.0.2", 9911, frozenset({"en1"})).private
    nowhere = exposure.address_exposure("worker", "172.16.0.9", 9911, frozenset({"en1"}))
    assert not nowhere.private and nowhere.where == "no interface of this machine routes to it"


def test_check_join_refuses_naming_the_address_and_both_fixes_or_warns_with_insecure():
    leader = pair_address("leader", ("192.168.1.20", 9911), None)
    with pytest.raises(ValueError) as info:
        exposure.check_join(leader, False, False, frozenset())
    says = str(info.value)
    for part in ("listens on 192.168.1.20:9911", "interface en0", "`ds4tp pair`", "--secret", "--insecure"):
        assert part in says, says
    warning = exposure.check_join(leader, False, True, frozenset())
    assert warning.startswith("WARNING: --insecure") and "192.168.1.20:9911" in warning and "\n" not in warning
    assert exposure.check_join(leader, True, False, frozenset()) is None  # a secret: nothing to say
    assert exposure.check_join(leader, False, False, frozenset({"en0"})) is None  # a cable
    assert exposure.check_join(pair_address("leader", ("127.0.0.1", 9911), None), False, False, frozenset()) is None


def test_one_secret_for_every_join_flag_then_environment_then_the_stored_code(monkeypatch):
    assert join_secret(None) is None
    store_code(CODE)
    assert join_secret(None) == CODE
    monkeypatch.setenv("DS4_TP_SECRET", "from-env")
    assert join_secret(None) == "from-env"
    assert join_secret("from-flag") == "from-flag"
    monkeypatch.delenv("DS4_TP_SECRET")
    path = os.path.join(os.environ["DS4_TP_CONFIG_DIR"], "pair-secret")
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        join_secret(None)


def _exit(argv) -> str:
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit) as info:
        args.func(args)
    return str(info.value)


def _link(argv) -> LinkSettings:
    from mlx_ds4tp.cli.pair_args import link_from_args, one_rank_address

    args = build_parser().parse_args([*argv, "--transport", "tcp"])
    return link_from_args(args, one_rank_address(args, "bench", ""), "bench")


OPEN_LEADER = ["bench", "--role", "leader", "--listen", "192.168.1.20", "9911"]


def test_explicit_addresses_use_the_stored_secret_and_an_open_one_without_any_stops(capfd):
    says = _exit(OPEN_LEADER)
    assert says.startswith("ds4tp bench: this rank listens on 192.168.1.20:9911") and "`ds4tp pair`" in says
    assert "with no pair secret" in _exit(["bench", "--role", "worker", "--coordinator", "192.168.1.20", "9911"])
    assert _link(["bench", "--role", "leader", "--listen", "127.0.0.1", "9911"]).secret is None  # loopback
    store_code(CODE)
    assert _link(OPEN_LEADER).secret == CODE  # `ds4tp pair`'s code, with no --secret
    assert _link([*OPEN_LEADER, "--secret", "given"]).secret == "given"
    assert CODE not in capfd.readouterr().err


def test_insecure_forms_with_one_warning_line_and_a_linux_interface_counts_as_the_cable(capfd):
    link = _link([*OPEN_LEADER, "--insecure"])
    assert link.secret is None
    lines = [line for line in capfd.readouterr().err.splitlines() if "WARNING" in line]
    assert len(lines) == 1 and lines[0].startswith("ds4-tp: WARNING: --insecure") and "192.168.1.20:9911" in lines[0]
    says = _exit(["doctor", "--interface", "lo", "--insecure"])
    assert "--insecure is for ranks given addresses" in says and "`ds4tp pair`" in says, says
    if os.uname().sysname == "Linux":
        from mlx_ds4tp.cli.doctor import check_args

        args = build_parser().parse_args(["doctor", "--listen", "192.168.1.20", "9911", "--interface", "en0"])
        assert check_args(args).secret is None
        assert "WARNING" not in capfd.readouterr().err


def test_serve_warns_once_of_a_keyless_http_api_off_loopback(capfd, tmp_path):
    from mlx_ds4tp.cli import serve

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["serve", "--model", str(model), "--role", "leader", "--listen", "127.0.0.1", "9911"]
    serve.check_args(build_parser().parse_args([*base, "--host", "0.0.0.0"]))
    lines = [line for line in capfd.readouterr().err.splitlines() if "WARNING" in line]
    assert len(lines) == 1 and "HTTP API on 0.0.0.0:8080" in lines[0] and "--api-key" in lines[0], lines
    serve.check_args(build_parser().parse_args([*base, "--host", "0.0.0.0", "--api-key", "k"]))
    serve.check_args(build_parser().parse_args(base))  # 127.0.0.1: this machine only
    assert "WARNING" not in capfd.readouterr().err


def test_the_secret_is_in_no_repr_and_the_demo_hands_it_over_in_the_environment(monkeypatch):
    from mlx_ds4tp.cli import demo

    link = LinkSettings(PairAddress("leader", ("127.0.0.1", 1), None), secret="hunter2-secret")
    assert "hunter2-secret" not in repr(link) and "hunter2-secret" not in repr(link.resolved())
    seen = {}

    def fake_run(run, timeout):
        seen["command"], seen["env"] = run.command(), os.environ.get("DS4_TP_SECRET")
        return None

    monkeypatch.setenv("DS4_TP_SECRET", "")  # the demo sets it: undone after the test
    monkeypatch.setattr(demo, "run_local_pair", fake_run)
    monkeypatch.setattr(demo, "demo_model_dir", lambda ranks: "/nowhere")
    args = build_parser().parse_args(["demo", "--transport", "tcp", "--secret", "hunter2-secret"])
    assert demo.main(args) == 1
    assert "hunter2-secret" not in " ".join(seen["command"]) and seen["env"] == "hunter2-secret"
