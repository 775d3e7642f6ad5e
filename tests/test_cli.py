"""The `ds4tp` command line: one module per command, flags checked once, bad flags a clear
exit that names the flag. In process: nothing here joins a pair."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from mlx_ds4tp.cli import COMMANDS, build_parser
from mlx_ds4tp.link.config import PairAddress
from mlx_ds4tp.lockstep.sampling.options import SamplingOptions


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def exit_message(fn, *args) -> str:
    with pytest.raises(SystemExit) as info:
        fn(*args)
    return str(info.value)


LEADER = ("--role", "leader", "--listen", "127.0.0.1", "9911")
WORKER = ("--role", "worker", "--coordinator", "127.0.0.1", "9911")


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "my-model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_every_command_is_its_own_module_with_parser_checks_and_main():
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"mlx_ds4tp.cli.{module_name}")
        assert module.HELP and callable(module.add_args) and callable(module.main), name
        assert parse(name, *(["--model", "m"] if name in ("run", "serve") else [])).func is module.main


# -- run ----------------------------------------------------------------------------------


def test_run_check_makes_the_address_and_the_sampling_options_once(model_dir):
    from mlx_ds4tp.cli import run

    args = parse("run", "--model", str(model_dir), "--prompt", "hi", "--temp", "0.5", "--top-k", "7",
                 *LEADER)
    link, model, settings = run.check_args(args)
    assert link.address == PairAddress("leader", ("127.0.0.1", 9911), None) and link.transport == "auto"
    assert settings.sampling == SamplingOptions(temperature=0.5, top_k=7, seed=0) and settings.prompt == "hi"
    assert model == str(model_dir)
    link, _, _ = run.check_args(parse("run", "--model", str(model_dir), *WORKER))
    assert link.address == PairAddress("worker", None, ("127.0.0.1", 9911)) and link.address.rank == 1


def test_run_and_serve_without_addresses_find_the_peer(model_dir, monkeypatch, tmp_path):
    """No --listen/--coordinator: the rank finds its peer on --interface; `run --prompt` leads,
    `run` works, `serve` either (the worker rejoins by default); the stored pair secret is the
    secret when no --secret or DS4_TP_SECRET is given."""
    from mlx_ds4tp.cli import run, serve
    from mlx_ds4tp.link.config import DiscoverySettings
    from mlx_ds4tp.link.pair_secret import new_code, store_code

    monkeypatch.delenv("DS4_TP_SECRET", raising=False)
    monkeypatch.setenv("DS4_TP_CONFIG_DIR", str(tmp_path / "cfg"))
    lead, _, _ = run.check_args(parse("run", "--model", str(model_dir), "--prompt", "hi", "--interface", "lo"))
    assert lead.discovery == DiscoverySettings(("lo",), "lead") and lead.address == PairAddress(None, None, None)
    assert lead.secret is None  # nothing stored: loopback needs none
    code = new_code()
    store_code(code)
    work, _, _ = run.check_args(parse("run", "--model", str(model_dir), "--interface", "lo",
                                      "--interface", "eth9"))
    assert work.discovery == DiscoverySettings(("lo", "eth9"), "work") and work.secret == code
    assert run.check_args(parse("run", "--model", str(model_dir), "--interface", "lo",
                                "--secret", "s"))[0].secret == "s"
    settings = serve.check_args(parse("serve", "--model", str(model_dir), "--interface", "lo",
                                      "--port", "8123"))
    assert settings.link.discovery == DiscoverySettings(("lo",), "any", "http://127.0.0.1:8123/v1")
    assert settings.rejoin


def test_ranks_are_the_leaders_and_a_worker_that_dials_it_without_ranks_learns_them(model_dir):
    """--ranks N: the leader's (default 2); a worker with --coordinator and no --ranks takes the
    leader's (size None, its --split not checked against a count it does not know yet); a worker
    given --ranks keeps it; ranks that find each other (--interface) all give N (default 2)."""
    from mlx_ds4tp.cli import run, serve

    def run_link(*flags):
        return run.check_args(parse("run", "--model", str(model_dir), *flags))[0]

    assert run_link(*LEADER, "--prompt", "p").size == 2
    assert run_link(*LEADER, "--prompt", "p", "--ranks", "3").size == 3
    assert run_link(*WORKER).size is None
    assert run_link(*WORKER, "--ranks", "3").size == 3
    assert run_link("--interface", "lo", "--secret", "s").size == 2
    assert run_link("--role", "worker", "--interface", "lo", "--secret", "s").size == 2
    worker = serve.check_args(parse("serve", "--model", str(model_dir), *WORKER, "--split", "2:1:1"))
    assert worker.link.size is None and worker.split.share.parts == (2, 1, 1)
    says = exit_message(serve.check_args, parse("serve", "--model", str(model_dir), *LEADER, "--split", "2:1:1"))
    assert "--split 2:1:1 names 3 parts for 2 ranks" in says, says
    for command in ("run", "serve"):
        assert "a worker started with --coordinator takes the leader's without it" in help_of(command)


@pytest.mark.parametrize("flags, says", [
    ((), "ds4tp run: give --interface NAME, the link to find the other rank on"),
    (("--role", "leader", "--prompt", "x"), "give --interface NAME"),
    (("--role", "leader", "--interface", "lo"), "the leader needs --prompt TEXT"),
    (("--role", "leader", "--interface", "lo", "--transport", "mlx"), "--transport mlx (MLX's own group)"),
    (("--role", "worker", "--listen", "h", "1"), "--role worker --coordinator HOST PORT, without --listen"),
    (("--listen", "h", "1", "--prompt", "x"), "(--role leader|worker)"),
    (("--role", "leader", "--listen", "h", "x", "--prompt", "p"), "--listen h x: PORT must be an integer"),
    (("--role", "leader", "--listen", "h", "70000", "--prompt", "p"), "(--listen HOST PORT, PORT 0-65535)"),
    (LEADER, "the leader needs --prompt TEXT"),
    ((*LEADER, "--prompt", "p", "--max-tokens", "0"), "--max-tokens 0 must be >= 1"),
    ((*LEADER, "--prompt", "p", "--debug-hash", "-1"), "--debug-hash -1 must be >= 0"),
    ((*LEADER, "--prompt", "p", "--temp", "-1"), "--temp: temperature=-1.0 must be >= 0"),
    ((*LEADER, "--prompt", "p", "--top-p", "2"), "--top-p: top_p=2.0 must be in (0, 1]"),
    ((*LEADER, "--prompt", "p", "--top-k", "-3"), "--top-k: top_k=-3"),
    ((*LEADER, "--prompt", "p", "--min-p", "1.5"), "--min-p: min_p=1.5"),
    ((*LEADER, "--prompt", "p", "--repetition-penalty", "-1"), "--repetition-penalty:"),
    ((*LEADER, "--prompt", "p", "--seed", "-1"), "--seed: seed=-1"),
])
def test_bad_run_flags_exit_naming_the_flag(model_dir, flags, says):
    from mlx_ds4tp.cli import run

    msg = exit_message(run.check_args, parse("run", "--model", str(model_dir), *flags))
    assert says in msg, msg


def test_run_json_schema_is_the_sampling_options_grammar(model_dir, tmp_path):
    pytest.importorskip("llguidance", reason="the llguidance package (pip install llguidance)")
    import json

    from mlx_ds4tp.cli import run

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
    _, _, settings = run.check_args(parse("run", "--model", str(model_dir), "--prompt", "p", *LEADER,
                                          "--json-schema", str(schema)))
    assert '"ok"' in settings.sampling.grammar and settings.sampling.processed
    (tmp_path / "list.json").write_text("[1, 2]")
    for bad, says in ((tmp_path / "none.json", "No such file"), (tmp_path / "list.json", "must be an object")):
        msg = exit_message(run.check_args, parse("run", "--model", str(model_dir), "--prompt", "p", *LEADER,
                                                 "--json-schema", str(bad)))
        assert f"--json-schema {bad}" in msg and says in msg, msg
    msg = exit_message(run.check_args, parse("run", "--model", str(model_dir), "--prompt", "p", *LEADER,
                                             "--json-schema", str(schema), "--prompt-lookup", "2"))
    assert "--json-schema" in msg, msg


def test_run_model_demo_is_the_demo_model(monkeypatch, tmp_path):
    import mlx_ds4tp.synthetic.demo_model as demo_model
    from mlx_ds4tp.cli import run

    monkeypatch.setattr(demo_model, "demo_model_dir", lambda: tmp_path / "built-demo")
    args = parse("run", "--model", "demo", *WORKER)
    _, model, _ = run.check_args(args)
    assert model == str(tmp_path / "built-demo")


def test_run_model_that_is_not_there_names_it(tmp_path):
    from mlx_ds4tp.cli import run

    msg = exit_message(run.check_args, parse("run", "--model", str(tmp_path / "none"), *WORKER))
    assert "none: no such directory" in msg


# -- serve --------------------------------------------------------------------------------


@pytest.fixture
def served(monkeypatch):
    """What cli.serve hands the serving layer, instead of serving."""
    import mlx_ds4tp.serve.serving_rank as serve_rank

    got = {}

    def run(settings):
        got.update(settings=settings)
        return 0

    monkeypatch.setattr(serve_rank, "run", run)
    return got


def serve_main(*argv: str) -> int:
    args = parse(*argv)
    return args.func(args)


def test_serve_passes_values_down(served, model_dir):
    from mlx_ds4tp.link.config import LinkSettings
    from mlx_ds4tp.serve.limits import ServeLimits
    from mlx_ds4tp.serve.settings import HttpSettings

    assert serve_main("serve", "--model", str(model_dir), "--temp", "0.7", "--seed", "5",
                      "--transport", "tcp", "--rdma-gid-index", "2", "--secret", "s", *LEADER) == 0
    settings = served["settings"]
    assert settings.link == LinkSettings(PairAddress("leader", ("127.0.0.1", 9911), None), "tcp",
                                         gid_index=2, secret="s")
    assert settings.model.path == model_dir
    assert settings.http == HttpSettings(sampling=SamplingOptions(temperature=0.7, seed=5))
    assert settings.limits == ServeLimits() and settings.kv_budget_from_memory
    assert not settings.rejoin


def test_serve_limits_come_from_the_flags(served, model_dir):
    from mlx_ds4tp.serve.limits import ServeLimits

    serve_main("serve", "--model", str(model_dir), "--max-batch", "4", "--prefill-step-size", "64",
               "--prompt-concurrency", "2", "--prompt-cache-size", "3", "--prompt-cache-bytes", "1MB",
               "--max-kv-tokens", "900", "--max-queued", "5", "--kv-bits", "4", "--kv-group-size", "32",
               "--mixed-prefill", "8", "--mixed-prefill-when", "always", "--debug-hash", "7", *LEADER)
    assert served["settings"].limits == ServeLimits(
        prompt_cache_size=3, prompt_cache_bytes=10**6, prefill_step=64, prompt_concurrency=2,
        max_batch=4, kv_budget=900, max_queued=5, kv_bits=4, kv_group_size=32, mixed_prefill=8,
        mixed_when="always", debug_hash=7)
    assert not served["settings"].kv_budget_from_memory
    serve_main("serve", "--model", str(model_dir), "--max-kv-tokens", "0", *LEADER)
    assert served["settings"].limits.kv_budget == 0 and not served["settings"].kv_budget_from_memory
    serve_main("serve", "--model", str(model_dir), "--rejoin", "--prompt-lookup", "2", *WORKER)
    assert served["settings"].rejoin and served["settings"].model.draft.prompt_lookup == 2


def test_the_prompt_cache_dir_and_its_bound(served, model_dir, tmp_path):
    serve_main("serve", "--model", str(model_dir), "--prompt-cache-dir", str(tmp_path / "c"),
               "--prompt-cache-disk-bytes", "2GB", *WORKER)
    limits = served["settings"].limits
    assert (limits.prompt_cache_dir, limits.prompt_cache_disk_bytes) == (str(tmp_path / "c"), 2 * 10**9)
    serve_main("serve", "--model", str(model_dir), "--prompt-cache-dir", str(tmp_path / "c"), *LEADER)
    assert served["settings"].limits.prompt_cache_disk_bytes == 20 * 10**9
    with pytest.raises(SystemExit, match="give the directory too"):
        serve_main("serve", "--model", str(model_dir), "--prompt-cache-disk-bytes", "1GB", *LEADER)
    with pytest.raises(SystemExit, match="leaves no room"):
        serve_main("serve", "--model", str(model_dir), "--prompt-cache-dir", "d",
                   "--prompt-cache-disk-bytes", "0", *LEADER)


def test_served_model_name_defaults_to_a_short_id(served, model_dir, monkeypatch, tmp_path):
    import mlx_ds4tp.checkpoint.source as source
    import mlx_ds4tp.synthetic.demo_model as demo_model

    def name() -> str:
        return served["settings"].model.name

    serve_main("serve", "--model", str(model_dir), *WORKER)
    assert name() == "my-model"  # the directory's own name
    serve_main("serve", "--model", str(model_dir) + "/", *WORKER)
    assert name() == "my-model"
    monkeypatch.setattr(demo_model, "demo_model_dir", lambda: tmp_path / "built-demo")
    serve_main("serve", "--model", "demo", *LEADER)
    assert name() == "demo"
    assert served["settings"].model.path == tmp_path / "built-demo"
    assert served["settings"].model.ids == ("demo", str(tmp_path / "built-demo"))
    monkeypatch.setattr(source, "resolve_model_arg", lambda model, download=False: tmp_path / "hub" / "snapshot")
    serve_main("serve", "--model", "mlx-community/Qwen3-0.6B-4bit", *LEADER)
    assert name() == "mlx-community/Qwen3-0.6B-4bit"  # the repo id
    serve_main("serve", "--model", str(model_dir), "--served-model-name", "tiny", *LEADER)
    assert name() == "tiny"


@pytest.mark.parametrize("flags, says", [
    ((), "ds4tp serve: give --interface NAME, the link to find the other rank on"),
    (("--role", "worker", "--listen", "h", "1"), "--role worker --coordinator HOST PORT"),
    ((*LEADER, "--max-batch", "0"), "ds4tp serve: --max-batch 0 must be >= 1"),
    ((*LEADER, "--prompt-cache-size", "-1"), "--prompt-cache-size -1 must be >= 0"),
    ((*LEADER, "--prefill-step-size", "0"), "--prefill-step-size 0 must be >= 1"),
    ((*LEADER, "--port", "70000"), "--port 70000 must be <= 65535"),
    ((*LEADER, "--served-model-name", " "), "--served-model-name must not be empty"),
    ((*LEADER, "--top-p", "0"), "--top-p: top_p=0.0"),
])
def test_bad_serve_flags_exit_naming_the_flag(served, model_dir, flags, says):
    msg = exit_message(serve_main, "serve", "--model", str(model_dir), *flags)
    assert says in msg, msg
    assert not served


# -- bench, demo, doctor ------------------------------------------------------------------


@pytest.mark.parametrize("flags, says", [
    (("--bytes", "6"), "--bytes 6 must be a positive multiple of 4"),
    (("--bytes", "70000"), "--bytes 70000 is over the 32768-byte gate limit"),
    (("--iters", "0"), "--iters 0 must be >= 1"),
    (("--transport", "auto"), "--transport auto is what a two-machine pair picks (with --role)"),
    (("--role", "leader"), "--role leader --listen HOST PORT"),
    (("--role", "leader", "--listen", "h", "p"), "--listen h p: PORT must be an integer"),
    (("--model", "m", *LEADER), "--role is for the two-machine gate bench"),
    (("--url", "http://x"), "--url needs --serve"),
    (("--model", "m", "--plot", "x.png"), "--plot draws the gate bench run with both ranks here"),
    (("--serve", "--url", "http://x", "--max-tokens", "1"), "--max-tokens 1 must be >= 2"),
    (("--serve", "--url", "http://x", "--rounds", "0"), "--rounds 0 must be >= 1"),
    (("--model", "/nowhere/m"), "ds4tp bench: --model /nowhere/m: /nowhere/m is not an mlx-lm model "
     "directory (no config.json)"),
    (("--model", "/nowhere/m"), "or give `demo` or a preset built once: 150m"),
])
def test_bad_bench_flags_exit_naming_the_flag(flags, says):
    msg = exit_message(serve_main, "bench", *flags)
    assert says in msg, msg


def test_demo_and_doctor_flags_are_checked(tmp_path):
    assert "ds4tp demo: --max-tokens 0 must be >= 1" in exit_message(serve_main, "demo", "--max-tokens", "0")
    msg = exit_message(serve_main, "doctor", "--peer", "127.0.0.1", "x")
    assert "--peer 127.0.0.1 x: PORT must be an integer" in msg
    msg = exit_message(serve_main, "doctor", "--listen", "127.0.0.1", "70000")
    assert "ds4tp doctor: --listen:" in msg and "PORT 0-65535" in msg
    assert "give --peer, --listen or --interface" in exit_message(serve_main, "doctor", "--model", str(tmp_path))
    with pytest.raises(SystemExit) as info:  # argparse: not allowed with each other
        parse("doctor", "--peer", "h", "1", "--listen", "h", "2")
    assert info.value.code == 2


def test_doctor_round_trip_address():
    from mlx_ds4tp.cli import doctor

    assert doctor.check_args(parse("doctor")) is None
    assert doctor.check_args(parse("doctor", "--peer", "10.0.0.1", "9", "--secret", "s")).address == \
        PairAddress("worker", None, ("10.0.0.1", 9))
    link = doctor.check_args(parse("doctor", "--listen", "0.0.0.0", "9", "--transport", "rdma",
                                   "--rdma-device", "ucsim", "--rdma-gid-index", "1", "--secret", "s"))
    assert link.address == PairAddress("leader", ("0.0.0.0", 9), None)
    assert (link.transport, link.rdma_device, link.gid_index) == ("rdma", "ucsim", 1)


# -- help texts ---------------------------------------------------------------------------


def help_of(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return " ".join(sub.choices[command].format_help().split())


def test_help_says_what_role_does():
    for command in ("run", "serve"):
        text = help_of(command)
        # One rank only: there is no default that runs both ranks; without addresses it finds
        # the other one.
        assert "--role {leader,worker} this process's rank" in text, text
        assert "--interface NAME without --listen/--coordinator: find the other rank" in text, text
        assert "default: both ranks" not in text, text
    assert "default: both ranks on 127.0.0.1" in help_of("bench")  # true there: it spawns both
    assert "--served-model-name NAME" in help_of("serve") and "'demo' for --model demo" in help_of("serve")
    assert "or 'demo'" in help_of("run")


def test_sampling_flags_live_in_the_cli_not_the_sampling_module():
    import mlx_ds4tp.lockstep.sampling.options as sampling

    assert not hasattr(sampling, "add_sampling_args") and not hasattr(sampling, "options_from_args")
    assert "argparse" not in Path(sampling.__file__).read_text()


def test_http_errors_live_with_the_server_and_stay_importable():
    import mlx_ds4tp
    import mlx_ds4tp.errors as errors
    from mlx_ds4tp.serve.errors import ApiError, ClientGoneError, PairUnavailableError

    assert mlx_ds4tp.ApiError is ApiError and mlx_ds4tp.ClientGoneError is ClientGoneError
    assert mlx_ds4tp.PairUnavailableError is PairUnavailableError
    assert not hasattr(errors, "ApiError") and not hasattr(errors, "ClientGoneError")
    assert ApiError(404, "gone", "model", "model_not_found").body()["error"]["param"] == "model"


# -- the shared flags and --transport mlx -------------------------------------------------


def _option(parser, flag: str):
    return next(a for a in parser._actions if flag in a.option_strings)


def test_every_transport_flag_is_the_one_definition():
    from mlx_ds4tp.cli.rank import build_parser as rank_parser
    from mlx_ds4tp.link.config import TRANSPORTS

    assert TRANSPORTS == ("auto", "tcp", "rdma", "mlx")
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    ranks = next(a for a in rank_parser()._actions if a.dest == "kind")
    # every command but `pair` (which makes the secret, no pair) joins one
    parsers = {**{n: p for n, p in sub.choices.items() if n != "pair"}, "rank gate": ranks.choices["gate"],
               "rank shard-model": ranks.choices["shard-model"], "rank run": ranks.choices["run"]}
    for name, parser in parsers.items():
        choices = tuple(_option(parser, "--transport").choices)
        # bench alone adds its own value, "all" (every transport of the pair in turn).
        assert choices == TRANSPORTS + (("all",) if name == "bench" else ()), name
        for flag in ("--rdma-device", "--rdma-gid-index", "--secret"):
            assert _option(parser, flag), (name, flag)


@pytest.mark.parametrize("command, extra, says", [
    ("run", ("--prompt", "p", *LEADER), "ds4tp run: --transport mlx (MLX's own group) cannot carry"),
    ("serve", LEADER, "the pair's control channel"),
    ("demo", (), "a `ds4tp run` pair"),
    ("doctor", ("--peer", "10.0.0.1", "9"), "times a pair's exchange"),
    ("bench", LEADER, "ds4tp bench --role: --transport mlx"),
    ("bench", ("--serve",), "ds4tp bench --serve: --transport mlx"),
])
def test_transport_mlx_is_refused_naming_why_where_a_command_needs_a_pair(
        served, model_dir, command, extra, says):
    model = ("--model", str(model_dir)) if command in ("run", "serve") else ()
    msg = exit_message(serve_main, command, *model, "--transport", "mlx", *extra)
    assert says in msg and "give --transport auto, tcp or rdma" in msg, msg
    assert not served


def test_bench_transport_mlx_times_mlx_own_group(monkeypatch):
    import mlx_ds4tp.bench.report as report

    calls = []
    monkeypatch.setattr(report, "gates_report", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(report, "model_report", lambda *a: calls.append(a) or 0)
    assert serve_main("bench", "--transport", "mlx", "--iters", "3") == 0
    assert calls[-1][0] == ("mlx",)  # MLX's ring alone, no pair transport
    assert serve_main("bench", "--transport", "all", "--iters", "3") == 0
    assert calls[-1][0] == ("tcp", "rdma")
    assert serve_main("bench", "--model", "demo", "--transport", "mlx") == 0
    assert calls[-1][0].transport == "mlx"


def test_spawned_shard_model_rank_takes_transport_mlx(monkeypatch):
    import mlx_ds4tp.bench.model as bench_model
    from mlx_ds4tp.cli import rank

    got = []
    monkeypatch.setattr(bench_model, "shard_model_rank", lambda *a: got.append(a) or [])
    argv = ["shard-model", "--model", "m", "--max-tokens", "2", "--prompt-tokens", "3"]
    assert rank.main([*argv, "--transport", "mlx"]) == 0
    assert got[-1] == ("m", 2, 3, None)  # MLX's ring, ranks from MLX_HOSTFILE / MLX_RANK
    assert rank.main([*argv, "--transport", "tcp", *WORKER]) == 0
    link = got[-1][3]
    assert (link.transport, link.address) == ("tcp", PairAddress("worker", None, ("127.0.0.1", 9911)))


def test_bad_link_flags_exit_naming_the_flag(served, model_dir):
    msg = exit_message(serve_main, "serve", "--model", str(model_dir), "--rdma-gid-index", "-1", *LEADER)
    assert "ds4tp serve: gid_index=-1 must be a non-negative integer or None (--rdma-gid-index N)" in msg
    msg = exit_message(serve_main, "serve", "--model", str(model_dir), "--rdma-device", "", *LEADER)
    assert "rdma_device='': give a verbs device name" in msg and "(--rdma-device)" in msg
