"""Speculative sessions in `ds4tp serve`'s decode batch (lockstep/speculative.py, lockstep/batch.py,
lockstep/batch_verify.py): rows of different lengths verified in one forward, each row's cache
cut back to what its session kept. Greedy text is the plain greedy text whatever drafts."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serveutil import ServedPair, build_chat_model, client, reference, text_ids

PROMPTS = ["the cat sat on the mat and the cat sat on the", "one two three one two three one two",
           "a b c d a b c d a b", "tell me about the sea"]
LENGTHS = [40, 32, 36, 24]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("spec-model"))


def _four_at_once(served, model_dir, extra_body=None):
    got, errors = [None] * 4, []

    def ask(i):
        try:
            got[i] = client(served, timeout=120).completions.create(
                model=str(model_dir), prompt=PROMPTS[i], max_tokens=LENGTHS[i],
                extra_body=extra_body).choices[0].text
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    return got


def _want(model_dir):
    return [reference(model_dir, text_ids(model_dir, p), n) for p, n in zip(PROMPTS, LENGTHS)]


@pytest.mark.parametrize("drafter,transport", [("lookup", "tcp"), ("self", "tcp"), ("lookup", "rdma"),
                                               ("unrelated", "tcp")])
def test_four_speculative_clients_each_get_their_plain_greedy_text(model_dir, tmp_path, drafter, transport):
    pytest.importorskip("openai", reason="the openai package (pip install openai)")
    extra = {"lookup": ["--prompt-lookup", "2"], "self": ["--draft-model", str(model_dir)],
             "unrelated": ["--draft-model", str(build_chat_model(tmp_path / "draft", seed=11))]}[drafter]
    if transport == "rdma":
        extra += ["--transport", "rdma", "--rdma-device", "ucsim"]
    served = ServedPair(model_dir, tmp_path, extra=extra + ["--num-draft-tokens", "4", "--debug-hash", "2"])
    try:
        served.wait_healthy()
        assert _four_at_once(served, model_dir) == _want(model_dir)
        health = served.health()[1]
        assert health["verify_steps"] > 0 and health["drafted_tokens"] > 0, health
        if drafter == "self":
            # The target drafting for itself: nearly every draft is taken, several tokens a round.
            assert health["accepted_tokens"] >= 0.8 * health["drafted_tokens"], health
            assert health["decode_steps"] < sum(LENGTHS) / 2, health
        if drafter == "lookup":
            assert health["accepted_tokens"] > 0, health
    finally:
        served.close()


def test_requests_that_cannot_or_will_not_draft_share_the_batch(model_dir, tmp_path):
    """A logprobs request and one that asks num_draft_tokens 0 decode a token a step in the
    same verify forwards as drafting ones (a greedy and a sampled one), each with its own text."""
    pytest.importorskip("openai", reason="the openai package (pip install openai)")
    served = ServedPair(model_dir, tmp_path, extra=["--draft-model", str(model_dir), "--debug-hash", "1"])
    try:
        served.wait_healthy()
        c = client(served, timeout=120)
        ids = text_ids(model_dir, PROMPTS[0])
        results = {}

        def ask(name, **kw):
            results[name] = c.completions.create(model=str(model_dir), prompt=PROMPTS[0], max_tokens=30, **kw)

        jobs = [("greedy", {}), ("sampled", {"temperature": 0.8, "seed": 7}),
                ("plain", {"extra_body": {"num_draft_tokens": 0}}), ("logprobs", {"logprobs": 2})]
        threads = [threading.Thread(target=ask, args=(n,), kwargs=kw) for n, kw in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        want = reference(model_dir, ids, 30)
        assert results["greedy"].choices[0].text == want
        assert results["plain"].choices[0].text == want
        assert results["logprobs"].choices[0].text == want
        # The sampled one drafts too: its draws are plain sampling's in distribution, not draw
        # for draw (test_a_sampled_request_speculates checks it on its own, tests/test_acceptance
        # the distribution).
        assert results["sampled"].usage.completion_tokens == 30
        assert served.health()[1]["verify_steps"] > 0
        bad = c.with_options(max_retries=0)
        import openai

        with pytest.raises(openai.BadRequestError, match="num_draft_tokens"):
            bad.completions.create(model=str(model_dir), prompt="x", max_tokens=3,
                                   extra_body={"num_draft_tokens": 65})
    finally:
        served.close()


def test_a_sampled_request_speculates(model_dir, tmp_path):
    """temperature > 0 with a draft model: its drafts are verified and kept (the target
    drafting for itself: p and q agree, so nearly all), and the seed gives the same text again."""
    pytest.importorskip("openai", reason="the openai package (pip install openai)")
    served = ServedPair(model_dir, tmp_path, extra=["--draft-model", str(model_dir), "--num-draft-tokens", "4"])
    try:
        served.wait_healthy()
        c = client(served, timeout=120)
        texts = [c.completions.create(model=str(model_dir), prompt=PROMPTS[1], max_tokens=32, temperature=0.8,
                                      seed=11) for _ in range(2)]
        assert texts[0].choices[0].text == texts[1].choices[0].text
        assert texts[0].usage.completion_tokens == 32
        health = served.health()[1]
        assert health["verify_steps"] > 0 and health["accepted_tokens"] >= 0.8 * health["drafted_tokens"] > 0, health
        assert health["decode_steps"] < 2 * 32 / 2, health  # several tokens a round
    finally:
        served.close()


def test_a_model_whose_cache_cannot_forget_is_refused_speculation(tmp_path):
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from mlx_ds4tp.lockstep.batch_verify import speculation_blocker

    assert speculation_blocker([KVCache(), KVCache()]) is None
    why = speculation_blocker([KVCache(), RotatingKVCache(max_size=8), ArraysCache(2)])
    assert "ArraysCache, RotatingKVCache" in why and "--prompt-lookup" in why
    # The mixed batch's rows differ in length too, so the same caches refuse it.
    assert speculation_blocker([ArraysCache(2)], "--mixed-prefill").endswith("without --mixed-prefill")


# ---------------------------------------------------------------------------------------------
# The table in process: rows of different lengths, each cut back to what it kept
# ---------------------------------------------------------------------------------------------


def test_each_row_after_a_commit_continues_as_its_session_alone(model_dir):
    import mlx.core as mx

    from mlx_ds4tp.lockstep.compute import fill_cache, make_cache
    from mlx_ds4tp.lockstep.protocol.table import SessionTable
    from serveutil import _load

    model = _load(model_dir)[0]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
    table = SessionTable(model)
    for sid, p in enumerate(prompts, 1):
        table.caches.create(sid, 0, 0)
        table.caches.prefill_batch([sid], [np.array(p[:-1], dtype=np.int32)])
    table.step([1, 2, 3], np.array([p[-1] for p in prompts], dtype=np.int32))
    # Row 1 carries 4 drafts and keeps 3 positions, row 2 none (a plain row), row 3 two and all.
    rows = [np.array([40, 41, 42, 43, 44], dtype=np.int32), np.array([50], dtype=np.int32),
            np.array([60, 61, 62], dtype=np.int32)]
    table.batch.verify(rows)  # the rows of sessions 1, 2, 3, already in the batch
    keep = [3, 1, 3]
    table.batch.commit(table.batch.step_count, keep)
    nxt = np.array([70, 71, 72], dtype=np.int32)
    batched = table.step([1, 2, 3], nxt)
    for i, p in enumerate(prompts):
        alone = make_cache(model)
        fill_cache(model, p + rows[i][: keep[i]].tolist(), alone)
        want = model(mx.array([[int(nxt[i])]]), cache=alone)[0, -1]
        err = float(mx.max(mx.abs(batched[i] - want)) / mx.max(mx.abs(want)))
        assert err < 1e-4, (i, err)


def test_verify_and_commit_frames_are_checked(model_dir):
    from mlx_ds4tp.errors import FrameError
    from mlx_ds4tp.link.wire import FrameType as F
    from mlx_ds4tp.lockstep.protocol.commands import CommitBatch, VerifyBatch
    from mlx_ds4tp.lockstep.protocol.table import SessionTable
    from serveutil import _load

    step, sessions, rows = VerifyBatch.unpack(VerifyBatch.pack(7, [(1, [3, 4, 5]), (2, [9])]))
    assert (step, sessions, [r.tolist() for r in rows]) == (7, [1, 2], [[3, 4, 5], [9]])
    good = VerifyBatch.pack(1, [(1, [3, 4])])
    for payload, match in ((good[:10], "shorter than its header"), (good[:-4], "expected"),
                           (VerifyBatch.pack(1, [(1, list(range(66)))]), "width 66")):
        with pytest.raises(FrameError, match=match):
            VerifyBatch.unpack(payload)
    with pytest.raises(FrameError, match="shorter than its header"):
        CommitBatch.unpack(CommitBatch.pack(1, [1])[:8])
    with pytest.raises(FrameError, match="says 2 rows"):
        CommitBatch.unpack(CommitBatch.pack(1, [1, 1])[:-4])
    table = SessionTable(_load(model_dir)[0])
    table.caches.create(1, 0, 0)
    table.apply(F.VERIFY_BATCH, VerifyBatch.pack(1, [(1, [3, 4, 5])]))
    with pytest.raises(FrameError, match="before the COMMIT_BATCH"):
        table.apply(F.EVAL_BATCH, b"")
    with pytest.raises(FrameError, match="keeps 4 positions of row 0, which carried 3"):
        table.apply(F.COMMIT_BATCH, CommitBatch.pack(1, [4]))
    with pytest.raises(FrameError, match="for step 2 after step 1"):
        table.apply(F.COMMIT_BATCH, CommitBatch.pack(2, [1]))
    table.apply(F.COMMIT_BATCH, CommitBatch.pack(1, [2]))
    assert table.batch.batch_cache[0].size() == 2  # the lone row's own cache, cut back to 2
