"""Speculative decoding on the pair (lockstep/speculative.py, lockstep/batch.py, VERIFY_BATCH +
COMMIT_BATCH): greedy output with any drafter is token for token the plain greedy output, over
tcp and the emulated RDMA device, and a sampled run with a draft model draws as plain sampling
draws (lockstep/sampling/acceptance.py: tests/test_acceptance.py measures the distributions)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlx_ds4tp.lockstep.generate import greedy_generate, pair_generate
from mlx_ds4tp.lockstep.one_rank import OneRank
from mlx_ds4tp.lockstep.settings import DraftSettings
from mlx_ds4tp.lockstep.speculative import PromptLookup, Speculation, load_draft
from mlx_ds4tp.onehost.local_run import LocalRun, run_local_pair
from mlx_ds4tp.synthetic.tiny_model import save_llama

PROMPT = "the quick brown fox jumps over the lazy dog and the quick brown fox"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    # The target, and an unrelated draft of the same vocabulary (other weights).
    return save_llama(root / "target", "tiny", seed=3), save_llama(root / "other", "tiny", seed=11)


def test_prompt_lookup_proposes_what_followed_the_last_match():
    lookup = PromptLookup(2)
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2], 3) == [3, 4, 9]
    assert lookup.propose([1, 2, 3, 1, 2, 5, 1, 2], 2) == [5, 1]  # the most recent match
    assert lookup.propose([1, 2, 3], 3) == []
    with pytest.raises(ValueError, match="--prompt-lookup 0"):
        PromptLookup(0)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_drafter_gives_the_plain_greedy_tokens(models, k):
    from mlx_lm.utils import load_model

    target_path, other_path = models
    model = load_model(target_path)[0]
    prompt = list(range(5, 40)) + list(range(5, 20))
    plain = greedy_generate(model, prompt, 24).tokens
    settings = DraftSettings(num_draft_tokens=k)
    drafters = {"lookup": Speculation(DraftSettings(prompt_lookup=2, num_draft_tokens=k)),
                "recorded": Speculation(settings, recorded=plain),
                "self": Speculation(settings, draft_model=load_model(target_path)[0]),
                "unrelated": Speculation(settings, draft_model=load_model(other_path)[0])}
    for name, speculation in drafters.items():
        stats = pair_generate(OneRank(model), prompt, 24, speculation=speculation)
        assert stats.tokens == plain, name
        assert stats.accepted <= stats.drafted
    # A drafter that knows the continuation has every draft accepted: k + 1 tokens a round.
    recorded = pair_generate(OneRank(model), prompt, 24, speculation=Speculation(settings, recorded=plain))
    assert recorded.accepted == recorded.drafted and recorded.rounds == -(-24 // (k + 1))


def test_a_draft_of_another_vocabulary_is_refused_naming_both(models, tmp_path):
    from mlx_lm.utils import load_model

    from mlx_ds4tp.synthetic.tiny_model import LlamaSizes

    target_path, _ = models
    other = save_llama(tmp_path / "narrow", LlamaSizes(layers=1, hidden=64, heads=2, kv_heads=1,
                                                        intermediate=128, vocab=300), seed=5)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens.*a draft must share"):
        load_draft(str(other), load_model(target_path)[0])


@pytest.mark.parametrize("transport,device", [("tcp", None), ("rdma", "ucsim")])
def test_the_pair_decodes_speculatively_with_the_plain_tokens(models, transport, device):
    target, other = models
    plain = run_local_pair(LocalRun(target, PROMPT, 20, transport, device, stop_at_eos=False), quiet=True)
    assert plain is not None
    for extra in (["--prompt-lookup", "2"], ["--draft-model", str(target)],
                  ["--draft-model", str(other), "--num-draft-tokens", "4"]):
        got = run_local_pair(LocalRun(target, PROMPT, 20, transport, device, stop_at_eos=False, extra=extra),
                             quiet=True)
        assert got is not None, extra
        assert got["tokens"] == plain["tokens"], extra
        assert got["rounds"] > 0 and got["accepted"] <= got["drafted"]
        if extra[1] == str(target):
            # The target drafting for itself: every draft accepted, 4 tokens a round.
            assert got["accepted"] == got["drafted"] and got["rounds"] == 5


@pytest.mark.parametrize("flags,message", [
    (["--prompt-lookup", "2", "--draft-model", "x"], "two ways to draft"),
    (["--prompt-lookup", "2", "--repetition-penalty", "1.2"], "takes no --repetition-penalty"),
    (["--prompt-lookup", "2", "--num-draft-tokens", "0"], "--num-draft-tokens 0 must be >= 1"),
])
def test_bad_speculative_flags_name_the_fix(models, flags, message):
    target, _ = models
    run = subprocess.run([sys.executable, "-m", "mlx_ds4tp", "run", "--model", str(target), "--prompt", "hi",
                          "--role", "leader", "--listen", "127.0.0.1", "1", *flags],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and message in run.stderr, run.stderr


def test_the_speculative_bench_prints_every_contender(models):
    import json

    target, other = models
    run = subprocess.run([sys.executable, "-m", "mlx_ds4tp", "bench", "--json", "--transport", "tcp",
                          "--model", str(target), "--draft-model", str(other), "--prompt-lookup", "2",
                          "--max-tokens", "8", "--prompt-tokens", "32", "--rounds", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    got = {r["name"]: r for r in map(json.loads, (ln for ln in run.stdout.splitlines() if ln.startswith("{")))}
    assert set(got) == {"tp2-tcp", "tp2-tcp-recorded-3", "tp2-tcp-draft-3", "tp2-tcp-lookup-2-3",
                        "mlx-lm-single", "mlx-lm-single-draft-3"}
    for name, rec in got.items():
        assert rec["tok_s"] > 0, name
        if name.startswith("tp2"):
            assert rec["tokens_match"] is True, name
    assert got["tp2-tcp-recorded-3"]["acceptance"] == 1.0
    assert got["tp2-tcp-recorded-3"]["rounds_of_gates"] == 2  # 8 tokens, 4 a round


def test_a_sampled_run_with_a_draft_model_speculates(models):
    """`ds4tp run --temp 0.8 --draft-model`: the target drafting for itself has nearly every
    draft kept (p and q agree), and a seed gives the same tokens again."""
    target, _ = models
    runs = [run_local_pair(LocalRun(target, PROMPT, 16, stop_at_eos=False,
                                    extra=("--draft-model", str(target), "--temp", "0.8", "--seed", "7")), quiet=True)
            for _ in range(2)]
    assert runs[0] is not None and runs[1] is not None
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) == 16
    assert runs[0]["rounds"] > 0 and runs[0]["accepted"] >= 0.8 * runs[0]["drafted"] > 0, runs[0]
