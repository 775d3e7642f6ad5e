"""--split auto|even|A:B between two ranks: the share arithmetic (split/auto.py), the figures the
hello carries, the leader's share sent to the worker (split/agree.py), and `ds4tp run` with a
share (tokens equal the unsplit model's, the memory cap refused before loading)."""

from __future__ import annotations

import json

import pytest

from mlx_ds4tp.errors import FrameError, HelloMismatchError
from mlx_ds4tp.link.hello import Hello, ModelIdentity, RankFigures
from mlx_ds4tp.split.auto import (
    RESERVE_BYTES,
    ModelNeed,
    choose_share,
    fitting_range,
    model_need,
    speed_fraction,
)
from mlx_ds4tp.split.errors import ShareRefusedError
from mlx_ds4tp.split.share import EVEN, SplitSettings, SplitShare
from pairutil import both_ok, free_port, reference_text

GB = 10**9
BIG = 512 * GB


def figures(memory: int, speed: int) -> RankFigures:
    return RankFigures(memory_bytes=memory, speed=speed)


# ---- the arithmetic ---------------------------------------------------------------------------

def test_shares_follow_the_speeds():
    # 819 and 546 GB/s (an M3 Ultra beside an M4 Pro-class Mac): 60/40.
    assert choose_share(figures(BIG, 819 * GB), figures(BIG, 546 * GB), ModelNeed(10 * GB)) == SplitShare((3, 2))
    assert choose_share(figures(BIG, 100 * GB), figures(BIG, 300 * GB), ModelNeed(10 * GB)) == SplitShare((1, 3))


def test_machines_within_ten_percent_split_evenly():
    assert speed_fraction(figures(BIG, 109), figures(BIG, 100)) == 0.5
    assert choose_share(figures(BIG, 100 * GB), figures(BIG, 109 * GB), ModelNeed(GB)) == EVEN
    assert choose_share(figures(BIG, 112 * GB), figures(BIG, 100 * GB), ModelNeed(GB)) != EVEN


def test_memory_bounds_the_share():
    # Equal speeds, but the worker holds only a quarter of the model: the leader takes the rest.
    need = ModelNeed(40 * GB)
    worker_memory = int(0.25 * need.total * 1.1) + RESERVE_BYTES
    lowest, highest = fitting_range(need, figures(BIG, 100 * GB), figures(worker_memory, 100 * GB))
    assert lowest == pytest.approx(0.75) and highest == 1.0
    share = choose_share(figures(BIG, 100 * GB), figures(worker_memory, 100 * GB), need)
    assert share.parts[0] / sum(share.parts) >= 0.75
    assert int(share.parts[1] / sum(share.parts) * need.total * 1.1) + RESERVE_BYTES <= worker_memory


def test_a_model_that_fits_no_share_is_refused_naming_the_sizes():
    with pytest.raises(ShareRefusedError) as err:
        choose_share(figures(8 * GB, 100 * GB), figures(6 * GB, 100 * GB), ModelNeed(20 * GB, GB))
    text = str(err.value)
    assert "21.00 GiB" not in text  # sizes are in GiB of 2^30
    assert "19.56 GiB" in text and "7.45 GiB" in text and "5.59 GiB" in text, text


def test_auto_picks_among_the_shares_the_models_counts_allow():
    # Speeds 2:1 want 2/3; counts that cut into quarters give 3/4 (nearest), never 2:1.
    fast, slow = figures(BIG, 200 * GB), figures(BIG, 100 * GB)
    assert choose_share(fast, slow, ModelNeed(GB), granules=4) == SplitShare((3, 1))
    assert choose_share(fast, slow, ModelNeed(GB), granules=1) == EVEN


def test_auto_takes_the_quicker_share_not_the_nearest():
    # Speeds 2.1:1 want 0.68; eighths give 5:3 (0.625, nearer) and 3:1 (0.75). At 5:3 the slow
    # worker sets the step (0.375 x 2.1 = 0.79 of the leader's whole step), at 3:1 the leader
    # does (0.75): 3:1 is quicker. Stood in on this machine: 5.44 tok/s at 3:1, 5.14 at 5:3.
    fast, slow = figures(BIG, 210 * GB), figures(BIG, 100 * GB)
    assert choose_share(fast, slow, ModelNeed(GB), granules=8) == SplitShare((3, 1))
    # The other way round: the worker faster, the leader's part the smaller.
    assert choose_share(slow, fast, ModelNeed(GB), granules=8) == SplitShare((1, 3))
    # Speeds 1.7:1 want 0.63: 5:3 is both nearer and quicker.
    assert choose_share(figures(BIG, 170 * GB), slow, ModelNeed(GB), granules=8) == SplitShare((5, 3))


def test_auto_checks_the_memory_of_the_share_the_load_takes():
    # The worker holds at most a third: 3:1 fits, but a plan that only splits evenly would
    # take 1:1, which does not fit: refused before loading rather than loaded over the memory.
    need = ModelNeed(40 * GB)
    worker = figures(int(0.34 * need.total * 1.1) + RESERVE_BYTES, 100 * GB)
    assert choose_share(figures(BIG, 100 * GB), worker, need, granules=4) == SplitShare((3, 1))
    with pytest.raises(ShareRefusedError, match="no share fits"):
        choose_share(figures(BIG, 100 * GB), worker, need, granules=4, kept=lambda share: 0.5)


def test_model_cuts_reads_the_shares_off_the_model(tmp_path):
    from mlx_ds4tp.split.apply import ModelCuts
    from mlx_ds4tp.synthetic.tiny_model import LlamaSizes, save_llama, save_qwen3_moe

    # Two KV heads: only 1:1 keeps whole KV-head groups on both ranks.
    two = save_qwen3_moe(tmp_path / "kv2", "moe-tiny", seed=1)
    cuts = ModelCuts(two)
    assert cuts.granules == 2 and cuts.kept(SplitShare((3, 1))) == 0.5
    fast, slow = figures(BIG, 300 * GB), figures(BIG, 100 * GB)
    assert choose_share(fast, slow, model_need(two, 0), granules=cuts.granules, kept=cuts.kept) == EVEN
    # Four KV heads, 128 MLP columns (four groups of 32): quarters, so 2:1 keeps 3:1.
    four = save_llama(tmp_path / "kv4", LlamaSizes(layers=1, hidden=64, heads=4, kv_heads=4,
                                                   intermediate=128, vocab=512), seed=1)
    cuts = ModelCuts(four)
    assert cuts.granules == 4 and cuts.kept(SplitShare((2, 1))) == 0.75
    # Four KV heads, 384 MLP columns (twelve groups): the attention keeps 3:1, the MLP's columns
    # and the vocabulary 2:1, so rank 0 keeps between the two of the bytes.
    mixed = save_llama(tmp_path / "kv4-mlp12", LlamaSizes(layers=1, hidden=64, heads=4, kv_heads=4,
                                                          intermediate=384, vocab=512), seed=1)
    cuts = ModelCuts(mixed)
    assert cuts.granules == 12 and 2 / 3 < cuts.kept(SplitShare((2, 1))) < 0.75


def test_unmeasured_figures_are_refused():
    with pytest.raises(ValueError, match="rank 1 reported no figures"):
        choose_share(figures(BIG, 100), RankFigures(), ModelNeed(GB))


def test_model_need_reads_the_weights_and_the_kv_cache(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "hidden_size": 128, "torch_dtype": "float32"}))
    need = model_need(tmp_path, kv_tokens=10)
    assert need.weight_bytes == 1000
    assert need.kv_bytes == 10 * 2 * 4 * 16 * 2 * 4


def test_who_measures():
    assert SplitSettings().measures("worker") and not SplitSettings().measures("leader")
    assert SplitSettings(SplitShare.parse("auto")).measures("leader")


# ---- the hello and the leader's share ---------------------------------------------------------

def test_the_hello_carries_the_figures():
    hello = Hello(role=0, transport="tcp", rdma_ok=False, rdma_reason="", session_id=7,
                  identity=ModelIdentity(), figures=figures(3 * GB, 5 * GB))
    assert Hello.unpack(hello.pack()).figures == figures(3 * GB, 5 * GB)
    with pytest.raises(ValueError, match="memory_bytes"):
        RankFigures(memory_bytes=-1)


def _pair_groups(leader_figures: RankFigures, worker_figures: RankFigures):
    from mlx_ds4tp import gate_ops
    from mlx_ds4tp.link.config import LinkSettings, pair_address

    port = free_port()

    def join(role, listen, coordinator, figs):
        link = LinkSettings(pair_address(role, listen, coordinator), "tcp", timeout=20.0, figures=figs)
        return gate_ops.init_pair(link)

    return both_ok(lambda: join("leader", ("127.0.0.1", port), None, leader_figures),
                   lambda: join("worker", None, ("127.0.0.1", port), worker_figures))


def test_the_worker_takes_the_leaders_auto_share(capfd):
    from mlx_ds4tp.split.agree import agree_share

    auto = SplitSettings(SplitShare.parse("auto"))
    lg, wg = _pair_groups(figures(BIG, 300 * GB), figures(BIG, 100 * GB))
    with lg, wg:
        got = both_ok(lambda: agree_share(lg, auto, ModelNeed(GB)),
                      lambda: agree_share(wg, SplitSettings(SplitShare.parse("1:1"), given=True), ModelNeed(GB)))
    assert got == (SplitShare((3, 1)), SplitShare((3, 1)))
    err = capfd.readouterr().err
    assert "split auto: 3:1 (rank 0's part first), sent to rank 1" in err
    assert "split 3:1: the leader's share, rank 1 of 2 (rank 0: " in err
    assert "this side asked for even; the leader's share (3:1) decides" in err


def test_a_refused_auto_share_stops_both_ranks_naming_the_sizes():
    from mlx_ds4tp.errors import TransportError
    from mlx_ds4tp.split.agree import agree_share

    lg, wg = _pair_groups(figures(GB, 100 * GB), figures(GB, 100 * GB))
    with lg, wg:
        results = []

        def rank(group, split):
            try:
                agree_share(group, split, ModelNeed(4 * GB))
            except (ValueError, TransportError) as exc:
                results.append(str(exc))

        both_ok(lambda: rank(lg, SplitSettings(SplitShare.parse("auto"))), lambda: rank(wg, SplitSettings()))
    assert len(results) == 2 and all("no share fits" in r and "0.93 GiB" in r for r in results), results


def test_a_worker_taken_back_gets_the_held_share_and_a_held_worker_refuses_another():
    from mlx_ds4tp.split.agree import agree_share

    lg, wg = _pair_groups(RankFigures(), figures(BIG, GB))
    with lg, wg:
        # The leader's model is split 3:1 already: a worker taken back gets 3:1, not its even.
        assert both_ok(lambda: agree_share(lg, SplitSettings(), ModelNeed(0), held=SplitShare((3, 1))),
                       lambda: agree_share(wg, SplitSettings(), ModelNeed(0))) == (SplitShare((3, 1)),) * 2
        errors = []

        def held_worker():
            try:
                agree_share(wg, SplitSettings(), ModelNeed(0), held=SplitShare((2, 1)))
            except HelloMismatchError as exc:
                errors.append(str(exc))

        both_ok(lambda: agree_share(lg, SplitSettings(), ModelNeed(0), held=SplitShare((3, 1))), held_worker)
    assert errors and "split 2:1 and the leader's share is 3:1" in errors[0]


def test_a_split_frame_leaving_a_rank_nothing_is_refused():
    from mlx_ds4tp.link.hello import hear_share
    from mlx_ds4tp.link.wire import SPLIT_PAYLOAD, FrameType

    class Control:
        def recv(self, expect):
            return expect, SPLIT_PAYLOAD.pack(4, 0)

    assert FrameType.SPLIT == 39
    with pytest.raises(FrameError, match="leaves a rank with nothing"):
        hear_share(Control())


# ---- `ds4tp run` with a share -----------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import LlamaSizes, save_llama

    # Four KV heads and 256 MLP columns: every count cuts into quarters, so 3:1 is taken as is.
    sizes = LlamaSizes(layers=2, hidden=128, heads=8, kv_heads=4, intermediate=256, vocab=512)
    return save_llama(tmp_path_factory.mktemp("split-auto-model"), sizes, seed=5)


def _spawn(procs, model_dir, port, role, extra=(), env=None):
    where = ["--listen", "127.0.0.1", str(port)] if role == "leader" else ["--coordinator", "127.0.0.1", str(port)]
    prompt = ["--prompt", "Two different Macs"] if role == "leader" else []
    return procs.spawn(["-m", "mlx_ds4tp", "run", "--model", str(model_dir), "--max-tokens", "12",
                        "--no-chat-template", "--transport", "tcp", "--role", role, *where, *prompt,
                        *extra], env=env)


def test_run_with_split_3_1_gives_the_unsplit_models_tokens(procs, model_dir):
    port = free_port()
    leader = _spawn(procs, model_dir, port, "leader", ["--split", "3:1"])
    worker = _spawn(procs, model_dir, port, "worker")
    lout, lerr = leader.communicate(timeout=180)
    _, werr = worker.communicate(timeout=60)
    assert leader.returncode == 0, lerr
    assert worker.returncode == 0, werr
    text, _ = reference_text(model_dir, "Two different Macs", 12)
    assert lout.rsplit("\n", 2)[0] == text
    assert "split 3:1: the leader's share, sent to rank 1" in lerr
    assert "split 3:1: the leader's share" in werr
    assert "rank 0 keeps 3 of 4 units" in lerr and "rank 1 keeps 1 of 4 units" in werr


def test_run_auto_over_a_memory_cap_is_refused_before_loading(procs, model_dir):
    import os

    port = free_port()
    capped = {**os.environ, "DS4_TP_MEMORY_LIMIT_BYTES": "1000"}
    leader = _spawn(procs, model_dir, port, "leader", ["--split", "auto"], env=capped)
    worker = _spawn(procs, model_dir, port, "worker", env=capped)
    _, lerr = leader.communicate(timeout=120)
    _, werr = worker.communicate(timeout=60)
    assert leader.returncode != 0 and worker.returncode != 0
    for err in (lerr, werr):
        assert "no share fits" in err and "rank 0 may use 0.00 GiB, rank 1 may use 0.00 GiB" in err, err
        assert "holds its part" not in err and "weights loaded" not in err


def test_run_auto_over_ucsim_on_a_moe_model_gives_a_share_that_fits_and_the_unsplit_tokens(procs, tmp_path):
    """The leader's memory capped at a third of the model: auto gives the worker the larger
    part (the nearest share the model's counts allow), both ranks load it and the tokens are
    the unsplit model's, over the emulated Thunderbolt device."""
    import os

    from mlx_ds4tp.split.auto import MARGIN_SHARE
    from mlx_ds4tp.synthetic.tiny_model import MoeSizes, save_qwen3_moe

    sizes = MoeSizes(layers=2, hidden=128, heads=8, kv_heads=4, head_dim=16, experts=4,
                     experts_per_token=2, expert_intermediate=128, vocab=512)
    model = save_qwen3_moe(tmp_path / "moe-kv4", sizes, seed=3)
    # The run reserves KV room for under 1000 tokens here, so the leader may hold at most a
    # third of what it needs with 1000: the share must favour the worker.
    cap = RESERVE_BYTES + int(model_need(model, 1000).total * (1 + MARGIN_SHARE) / 3)
    port = free_port()
    ucsim = ["--transport", "rdma", "--rdma-device", "ucsim"]
    common = ["-m", "mlx_ds4tp", "run", "--model", str(model), "--max-tokens", "12", "--no-chat-template", *ucsim]
    leader = procs.spawn([*common, "--split", "auto", "--role", "leader", "--listen", "127.0.0.1", str(port),
                          "--prompt", "Two different Macs"], env={**os.environ, "DS4_TP_MEMORY_LIMIT_BYTES": str(cap)})
    worker = procs.spawn([*common, "--role", "worker", "--coordinator", "127.0.0.1", str(port)])
    lout, lerr = leader.communicate(timeout=180)
    _, werr = worker.communicate(timeout=60)
    assert leader.returncode == 0, lerr
    assert worker.returncode == 0, werr
    text, _ = reference_text(model, "Two different Macs", 12)
    assert lout.rsplit("\n", 2)[0] == text
    picked = [line for line in lerr.splitlines() if "split auto:" in line and "sent to rank 1" in line]
    assert len(picked) == 1, lerr
    share = SplitShare.parse(picked[0].split("split auto: ")[1].split(" ")[0])
    assert share.parts and share.parts[0] < share.parts[1], picked
    assert f"split {share}: the leader's share" in werr
    units = sum(share.parts)
    assert f"rank 0 keeps {share.parts[0]} of {units} units" in lerr
    assert f"rank 1 keeps {share.parts[1]} of {units} units" in werr
    assert "rdma" in lerr


def test_split_flag_is_checked(procs, model_dir):
    bad = _spawn(procs, model_dir, free_port(), "leader", ["--split", "3:0"])
    _, err = bad.communicate(timeout=60)
    assert bad.returncode != 0 and "leaves a rank with nothing" in err


def test_doctor_prints_the_share_it_would_pick(procs, model_dir):
    port = free_port()
    common = ["-m", "mlx_ds4tp", "doctor", "--transport", "tcp", "--model", str(model_dir)]
    listener = procs.spawn(common + ["--listen", "127.0.0.1", str(port)])
    dialer = procs.spawn(common + ["--peer", "127.0.0.1", str(port)])
    outs = [p.communicate(timeout=120)[0] for p in (listener, dialer)]
    picks = [line for out in outs for line in out.splitlines() if "split auto: would pick" in line]
    assert len(picks) == 2, outs
    # The same arithmetic on the same two hellos: both sides name the same share.
    assert picks[0].split(" with the peer")[0] == picks[1].split(" with the peer")[0]
