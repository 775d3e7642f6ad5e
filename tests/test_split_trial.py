"""`--split auto`'s lockstep trial (split/trial.py): both ranks time the same stand-in steps over
the pair, and the leader loads the quicker share, which the worker takes."""

from __future__ import annotations

import pytest

from mlx_ds4tp.link.hello import RankFigures
from mlx_ds4tp.split import trial
from mlx_ds4tp.split.agree import agree_share
from mlx_ds4tp.split.auto import model_need
from mlx_ds4tp.split.share import SplitSettings, SplitShare
from pairutil import both_ok, free_port

GB = 10**9
BIG = 512 * GB


@pytest.fixture(autouse=True)
def few_layers(monkeypatch):
    # Two ranks in one process whose graphs chain more than 8 gates stall each other (seen with
    # MLX 0.32; 16 stall, 8 pass); in use each rank is a process of its own, where the stand-in
    # step's 32 pass (and `ds4tp bench --slow-worker` runs them). The step's logic is the same.
    monkeypatch.setattr(trial, "PIECES", 4)


def _pair_groups(leader_figures: RankFigures, worker_figures: RankFigures):
    from mlx_ds4tp import gate_ops
    from mlx_ds4tp.link.config import LinkSettings, pair_address

    port = free_port()

    def join(role, listen, coordinator, figures):
        return gate_ops.init_pair(LinkSettings(pair_address(role, listen, coordinator), "tcp", timeout=20.0,
                                               figures=figures))

    return both_ok(lambda: join("leader", ("127.0.0.1", port), None, leader_figures),
                   lambda: join("worker", None, ("127.0.0.1", port), worker_figures))


@pytest.fixture(scope="module")
def eighths_model(tmp_path_factory):
    """A llama whose counts cut in eighths (8 KV heads, 256 MLP columns), as the bench's."""
    from mlx_ds4tp.testing.tiny_model import LlamaSizes, save_llama

    return save_llama(tmp_path_factory.mktemp("eighths"), LlamaSizes(layers=1, hidden=64, heads=8, kv_heads=8,
                                                                     intermediate=256, vocab=512), seed=2)


def test_both_ranks_run_the_same_steps_at_an_uneven_share():
    lg, wg = _pair_groups(RankFigures(), RankFigures())
    with lg, wg:
        ms = both_ok(lambda: trial.step_ms(lg, SplitShare((3, 1)), 0.05),
                     lambda: trial.step_ms(wg, SplitShare((3, 1)), 0.05))
        # The pair still answers gates in step after it: no trial gate was left unanswered.
        again = both_ok(lambda: trial.step_ms(lg, SplitShare((1, 3)), 0.0),
                        lambda: trial.step_ms(wg, SplitShare((1, 3)), 0.0))
    assert all(m > 0 for m in ms + again), (ms, again)


@pytest.mark.parametrize("slower", ["5:3", "3:1"])
def test_the_leader_loads_the_share_its_trial_found_quicker_and_the_worker_takes_it(
        eighths_model, monkeypatch, capfd, slower):
    # Speeds 1.71:1: 5:3 and 3:1 both go to the trial. The leader's timer adds a second to one of
    # them (the steps themselves run on both ranks as they are): the other one is loaded.
    real = trial.step_ms
    monkeypatch.setattr(trial, "step_ms", lambda group, share, seconds=trial.TRIAL_SEC: (
        real(group, share, 0.02) + (1000.0 if str(share) == slower else 0.0)))
    lg, wg = _pair_groups(RankFigures(BIG, 171 * GB), RankFigures(BIG, 100 * GB))
    need = model_need(eighths_model, 0)
    with lg, wg:
        got = both_ok(lambda: agree_share(lg, SplitSettings(SplitShare.parse("auto")), need),
                      lambda: agree_share(wg, SplitSettings(), need))
    quicker = SplitShare((3, 1)) if slower == "5:3" else SplitShare((5, 3))
    assert got == (quicker, quicker)
    err = capfd.readouterr().err
    trial_lines = [line for line in err.splitlines() if "lockstep trial" in line]
    assert len(trial_lines) == 1 and trial_lines[0].endswith(f": {quicker}"), err
    assert f"split auto: {quicker} (rank 0's part first), sent to the worker" in err
    assert f"split {quicker}: the leader's share" in err


def test_a_trial_the_worker_leaves_is_an_error_on_the_leader_not_a_hang(eighths_model):
    from mlx_ds4tp.errors import TransportError

    lg, wg = _pair_groups(RankFigures(BIG, 171 * GB), RankFigures(BIG, 100 * GB))
    need = model_need(eighths_model, 0)
    errors = []

    def leader():
        try:
            agree_share(lg, SplitSettings(SplitShare.parse("auto")), need)
        except (TransportError, RuntimeError) as exc:
            errors.append(exc)

    def worker():
        from mlx_ds4tp.link.hello import hear_share

        hear_share(wg.pair.control)  # told the first share to try, and gone
        wg.close()

    with lg:
        both_ok(leader, worker, timeout=30.0)
    assert errors, "the leader's trial passed with no worker"


_RANK = """
import sys
from mlx_ds4tp import gate_ops
from mlx_ds4tp.link.config import LinkSettings, pair_address
from mlx_ds4tp.link.hello import RankFigures
from mlx_ds4tp.split.agree import agree_share
from mlx_ds4tp.split.auto import model_need
from mlx_ds4tp.split.share import SplitSettings, SplitShare

role, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
leader = role == "leader"
address = pair_address(role, ("127.0.0.1", port) if leader else None, None if leader else ("127.0.0.1", port))
figures = RankFigures(512 * 10**9, (171 if leader else 100) * 10**9)
group = gate_ops.init_pair(LinkSettings(address, "tcp", timeout=20.0, figures=figures))
split = SplitSettings(SplitShare.parse("auto")) if leader else SplitSettings()
print(agree_share(group, split, model_need(model, 0)))
"""


def test_two_rank_processes_agree_on_the_trials_share(procs, eighths_model):
    """The whole path in two processes, each rank's stand-in step at its full 32 gates."""

    port = free_port()
    leader = procs.spawn(["-c", _RANK, "leader", str(port), str(eighths_model)])
    worker = procs.spawn(["-c", _RANK, "worker", str(port), str(eighths_model)])
    lout, lerr = leader.communicate(timeout=120)
    wout, werr = worker.communicate(timeout=60)
    assert leader.returncode == 0 and worker.returncode == 0, (lerr, werr)
    assert lout.strip() == wout.strip() and lout.strip() in ("5:3", "3:1"), (lout, wout)
    trial_line = [line for line in lerr.splitlines() if "lockstep trial" in line]
    assert len(trial_line) == 1 and "5:3 " in trial_line[0] and "3:1 " in trial_line[0], lerr
    assert trial_line[0].endswith(f": {lout.strip()}"), lerr
