"""The `ds4tp` command line: one module per command, flags checked once, bad flags a clear
exit that names the flag. In process: nothing here joins a pair."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from mlx_ds4tp.cli import COMMANDS, build_parser
from mlx_ds4tp.link.config import PairAddress
from mlx_ds4tp.lockstep.sampling import SamplingOptions


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


@pytest.mark.parametrize("flags, says", [
    ((), "give --role leader --listen HOST PORT --prompt TEXT or --role worker --coordinator"),
    (("--role", "leader", "--prompt", "x"), "--role leader --listen HOST PORT"),
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


def test_run_model_demo_is_the_demo_model(monkeypatch, tmp_path):
    import mlx_ds4tp.testing.demo_model as demo_model
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
    import mlx_ds4tp.serve.pair as serve_pair

    got = {}

    def run(args, address, model_path, sampling):
        got.update(args=args, address=address, model_path=model_path, sampling=sampling)
        return 0

    monkeypatch.setattr(serve_pair, "run", run)
    return got


def serve_main(*argv: str) -> int:
    args = parse(*argv)
    return args.func(args)


def test_serve_passes_values_down(served, model_dir):
    assert serve_main("serve", "--model", str(model_dir), "--temp", "0.7", "--seed", "5", *LEADER) == 0
    assert served["address"] == PairAddress("leader", ("127.0.0.1", 9911), None)
    assert served["model_path"] == model_dir
    assert served["sampling"] == SamplingOptions(temperature=0.7, seed=5)


def test_served_model_name_defaults_to_a_short_id(served, model_dir, monkeypatch, tmp_path):
    import mlx_ds4tp.checkpoint.source as source
    import mlx_ds4tp.testing.demo_model as demo_model

    serve_main("serve", "--model", str(model_dir), *WORKER)
    assert served["args"].served_model_name == "my-model"  # the directory's own name
    serve_main("serve", "--model", str(model_dir) + "/", *WORKER)
    assert served["args"].served_model_name == "my-model"
    monkeypatch.setattr(demo_model, "demo_model_dir", lambda: tmp_path / "built-demo")
    serve_main("serve", "--model", "demo", *LEADER)
    assert served["args"].served_model_name == "demo"
    assert served["model_path"] == tmp_path / "built-demo"
    monkeypatch.setattr(source, "resolve_model_arg", lambda model: tmp_path / "hub" / "snapshot")
    serve_main("serve", "--model", "mlx-community/Qwen3-0.6B-4bit", *LEADER)
    assert served["args"].served_model_name == "mlx-community/Qwen3-0.6B-4bit"  # the repo id
    serve_main("serve", "--model", str(model_dir), "--served-model-name", "tiny", *LEADER)
    assert served["args"].served_model_name == "tiny"


@pytest.mark.parametrize("flags, says", [
    ((), "ds4tp serve: give --role leader --listen HOST PORT (it serves HTTP on --host/--port)"),
    (("--role", "worker"), "--role worker --coordinator HOST PORT"),
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
    assert "give --peer or --listen" in exit_message(serve_main, "doctor", "--model", str(tmp_path))
    with pytest.raises(SystemExit) as info:  # argparse: not allowed with each other
        parse("doctor", "--peer", "h", "1", "--listen", "h", "2")
    assert info.value.code == 2


def test_doctor_round_trip_address():
    from mlx_ds4tp.cli import doctor

    assert doctor.check_args(parse("doctor")) is None
    assert doctor.check_args(parse("doctor", "--peer", "10.0.0.1", "9")) == \
        PairAddress("worker", None, ("10.0.0.1", 9))
    assert doctor.check_args(parse("doctor", "--listen", "0.0.0.0", "9")) == \
        PairAddress("leader", ("0.0.0.0", 9), None)


# -- help texts ---------------------------------------------------------------------------


def help_of(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return " ".join(sub.choices[command].format_help().split())


def test_help_says_what_role_does():
    for command in ("run", "serve"):
        text = help_of(command)
        # One rank only: there is no default that runs both ranks.
        assert "--role {leader,worker} required:" in text, text
        assert "default: both ranks" not in text, text
    assert "default: both ranks on 127.0.0.1" in help_of("bench")  # true there: it spawns both
    assert "--served-model-name NAME" in help_of("serve") and "'demo' for --model demo" in help_of("serve")
    assert "or 'demo'" in help_of("run")


def test_sampling_flags_live_in_the_cli_not_the_sampling_module():
    import mlx_ds4tp.lockstep.sampling as sampling

    assert not hasattr(sampling, "add_sampling_args") and not hasattr(sampling, "options_from_args")
    assert "argparse" not in Path(sampling.__file__).read_text()


def test_http_errors_live_with_the_server_and_stay_importable():
    import mlx_ds4tp
    import mlx_ds4tp.errors as errors
    from mlx_ds4tp.serve.errors import ApiError, ClientGone, PairUnavailable

    assert mlx_ds4tp.ApiError is ApiError and mlx_ds4tp.ClientGone is ClientGone
    assert mlx_ds4tp.PairUnavailable is PairUnavailable
    assert not hasattr(errors, "ApiError") and not hasattr(errors, "ClientGone")
    assert ApiError(404, "gone", "model", "model_not_found").body()["error"]["param"] == "model"


def test_serve_restarts_itself_once_with_a_bounded_glibc_heap():
    from mlx_ds4tp.cli.heap import HEAP_ENV, bounded_heap_argv, bounded_heap_environ, exec_with_bounded_heap

    linux = dict(system="Linux", libc="glibc", executable="/usr/bin/python3")
    orig = ["python3", "-m", "mlx_ds4tp", "serve", "--model", "demo"]
    assert bounded_heap_argv(["serve", "--model", "demo"], {}, orig_argv=orig, **linux) == \
        ["/usr/bin/python3", "-m", "mlx_ds4tp", "serve", "--model", "demo"]
    # Once: the exec'd process has every variable; values the user set are kept, and one the
    # user left out is still added.
    assert bounded_heap_argv(["serve"], dict(HEAP_ENV), orig_argv=orig, **linux) is None
    assert bounded_heap_argv(["serve"], {"MALLOC_ARENA_MAX": "8"}, orig_argv=orig, **linux) == \
        ["/usr/bin/python3", "-m", "mlx_ds4tp", "serve", "--model", "demo"]
    assert bounded_heap_environ({"MALLOC_ARENA_MAX": "8", "PATH": "/bin"}) == \
        {"MALLOC_ARENA_MAX": "8", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
         "MALLOC_TRIM_THRESHOLD_": str(1 << 20), "PATH": "/bin"}
    # Only the long-running server, only glibc (a Mac's allocator has no such arenas).
    assert bounded_heap_argv(["run", "--model", "demo"], {}, orig_argv=orig, **linux) is None
    assert bounded_heap_argv(["serve"], {}, orig_argv=orig, system="Darwin", libc="",
                             executable="/usr/bin/python3") is None
    assert bounded_heap_argv(["serve"], {}, orig_argv=orig, system="Linux", libc="musl",
                             executable="/usr/bin/python3") is None
    calls = []
    exec_with_bounded_heap(["demo"], execve=lambda *a: calls.append(a))
    assert calls == []
