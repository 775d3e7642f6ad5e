"""Batched prefill: prompts waiting together enter their caches in one padded forward per chunk
(PREFILL_BATCH), as mlx-lm's PromptProcessingBatch does. End to end, four queued prompts
start in one engine turn and share every prefill forward, each answer still mlx-lm's for it
alone; in process, each session's cache after a batched prefill gives the logits of prefilling
it alone (a reused cache too, chunked or not, and the one-at-a-time fallback of a cache mlx-lm
cannot merge); a malformed PREFILL_BATCH is a FrameError naming what is wrong."""

from __future__ import annotations

import json
import math
import random
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import mlx_ds4tp.transport as tr
from mlx_ds4tp.errors import FrameError, TransportError
from mlx_ds4tp.lockstep.caches import session_caches as caches_mod
from mlx_ds4tp.lockstep.caches.prompt_cache import COPY, FRESH
from mlx_ds4tp.lockstep.compute import fill_cache, forward
from mlx_ds4tp.lockstep.protocol.commands import PrefillBatch, limits
from mlx_ds4tp.lockstep.protocol.table import SessionTable

F = tr.FrameType


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from serveutil import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("prefill-model"))


@pytest.fixture(scope="module")
def model(model_dir):
    from serveutil import _load

    return _load(model_dir)[0]


# ---------------------------------------------------------------------------------------------
# Four queued prompts, one batch, over the served pair
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [64, 8])
def test_four_queued_prompts_are_prefilled_in_one_batch_each_as_mlx_lm_alone(model_dir, tmp_path, step):
    pytest.importorskip("openai", reason="the openai package (pip install openai)")
    from mlx_ds4tp.synthetic.tiny_model import EOS_ID
    from serveutil import ServedPair, client, open_stream, post_raw, reference, text_ids

    warm = [5, 6, 7, 8, 9, 10]
    # One prompt shares the warm-up's first six tokens: it starts from a copy of that stored
    # cache, so a row with a non-empty cache joins the batch. The longest is fresh.
    prompts = [text_ids(model_dir, "a much longer prompt about the sea and the sky"),
               warm + [11, 12, 13], text_ids(model_dir, "one two"),
               text_ids(model_dir, "alpha beta gamma")]
    lengths = [12, 9, 14, 10]
    assert len({len(p) for p in prompts}) == 4 and max(len(p) for p in prompts) == len(prompts[0])
    want = [reference(model_dir, p, n) for p, n in zip(prompts, lengths)]
    holder_tokens = 4000
    # The holder (3 prompt tokens + 4000) leaves no room for any of the four while it runs;
    # once it ends, all four fit together.
    budget = 3 + holder_tokens + min(len(p) + n for p, n in zip(prompts, lengths)) - 1
    served = ServedPair(model_dir, tmp_path, extra=["--max-kv-tokens", str(budget),
                                                    "--prefill-step-size", str(step),
                                                    "--debug-hash", "1"])
    holder = None
    try:
        served.wait_healthy()
        code, _ = post_raw(served, "/v1/completions", json.dumps({"prompt": warm, "max_tokens": 2}).encode())
        assert code == 200
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": holder_tokens, "stream": True,
                           "logit_bias": {str(EOS_ID): -100}}).encode()
        holder = open_stream(served, body)
        before = served.health()[1]
        got, errors = [None] * 4, []

        def ask(i):
            try:
                got[i] = client(served, timeout=120).completions.create(
                    model=str(model_dir), prompt=prompts[i], max_tokens=lengths[i]).choices[0]
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while served.health()[1]["queued"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = served.health()[1]
        assert health["queued"] == 4 and health["decoding"] == 1, health
        holder.close()  # the holder is cancelled: its budget frees, and the four start at once
        holder = None
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert [c.text for c in got] == want
        after = served.health()[1]
        assert after["prefill_batch_rows"] == 4, after
        # A forward never takes more than one chunk's tokens, padding included: the four share
        # it. With 64: one forward of 16 tokens a row for the four, then the rest of the longest
        # alone; with 8, two tokens a row at first.
        assert after["prefill_padded_tokens"] <= step, after
        if step == 64:
            assert after["prefill_batches"] - before["prefill_batches"] == 2, after
        else:
            assert after["prefill_batches"] - before["prefill_batches"] >= math.ceil(
                sum(len(p) - 1 for p in prompts[1:]) / step), after
        assert after["cached_tokens"] - before["cached_tokens"] >= len(warm)
    finally:
        if holder is not None:
            holder.close()
        served.close()


# ---------------------------------------------------------------------------------------------
# One table: the batched rows equal each session prefilled alone
# ---------------------------------------------------------------------------------------------


def _tables(model, make_cache=None, rewind=True):
    """Two tables holding the same sessions: 1 and 2 fresh, 3 a copy of a stored cache of
    seven tokens, rewound to five (a reused prompt's cache)."""
    tables = []
    for _ in range(2):
        t = SessionTable(model)
        if make_cache is not None:
            t.caches.make_cache = make_cache
        t.caches.create(90, 0, FRESH)
        t.caches.prefill_batch([90], [np.array([30, 31, 32, 33, 34, 35, 36], "<i4")])
        t.destroy(90, 4)
        t.caches.create(1, 0, FRESH)
        t.caches.create(2, 0, FRESH)
        t.caches.create(3, 4, COPY)
        if rewind:
            t.caches.rewind(3, 5)
        tables.append(t)
    return tables


def _next_logits(table, session):
    return forward(table.model, [40], table.caches.sessions[session])


def _size(table, session):
    return table.caches.sessions[session][0].size()


def _prefill_alone(table, session, tokens):
    """The reference: the session's cache filled on its own (fill_cache)."""
    fill_cache(table.model, np.asarray(tokens).tolist(), table.caches.sessions[session])


def _count_single_prefills(monkeypatch) -> list:
    """The token counts of every single-session prefill (fill_cache) the table runs from now."""
    calls = []
    inner = caches_mod.fill_cache

    def counted(model, tokens, cache, *args, **kwargs):
        calls.append(len(tokens))
        return inner(model, tokens, cache, *args, **kwargs)

    monkeypatch.setattr(caches_mod, "fill_cache", counted)
    return calls


CHUNKS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]


@pytest.mark.parametrize("step", [caches_mod.PREFILL_STEP, 3])
def test_batched_rows_give_the_logits_of_each_session_alone(model, monkeypatch, step):
    # step 3: the padded batch in several forwards, finalize joining the last one's evaluation.
    monkeypatch.setattr(caches_mod, "PREFILL_STEP", step)
    batched, alone = _tables(model)
    chunks = [np.array(c, "<i4") for c in CHUNKS]
    singles = _count_single_prefills(monkeypatch)
    batched.caches.prefill_batch([1, 2, 3], chunks)
    assert singles == []  # one padded batch, not three single-session prefills
    for sid, tokens in zip([1, 2, 3], chunks):
        _prefill_alone(alone, sid, tokens)
    for sid in (1, 2, 3):
        assert _size(batched, sid) == _size(alone, sid)
        mine, theirs = _next_logits(batched, sid), _next_logits(alone, sid)
        assert mx.allclose(mine, theirs, rtol=1e-4, atol=1e-4 * float(mx.abs(theirs).max())).item(), sid
    # Each row is its session's own cache again: it joins the decode batch and decodes as alone.
    rows = [(s, 41 + s) for s in (1, 2, 3)]
    got = batched.step([s for s, _ in rows], np.array([t for _, t in rows], "<i4"))
    ref = alone.step([s for s, _ in rows], np.array([t for _, t in rows], "<i4"))
    assert mx.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(mx.abs(ref).max())).item()


def test_a_batch_of_one_is_the_single_session_prefill_bit_for_bit(model, monkeypatch):
    batched, alone = _tables(model)
    singles = _count_single_prefills(monkeypatch)
    batched.apply(F.PREFILL_BATCH, PrefillBatch.pack([(3, CHUNKS[0])]))
    assert singles == [len(CHUNKS[0])]
    _prefill_alone(alone, 3, CHUNKS[0])
    for mine, theirs in zip(batched.caches.sessions[3], alone.caches.sessions[3]):
        assert mine.offset == theirs.offset and mx.array_equal(mine.keys, theirs.keys).item()
    assert mx.array_equal(_next_logits(batched, 3), _next_logits(alone, 3)).item()


def test_a_cache_mlx_lm_cannot_merge_is_prefilled_one_session_at_a_time(model, monkeypatch):
    from mlx_lm.models.cache import QuantizedKVCache

    # QuantizedKVCache has no merge: mlx-lm's _merge_caches refuses it (nor a size(), so the
    # reused cache is taken whole).
    def quantized():
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]

    batched, alone = _tables(model, quantized, rewind=False)
    chunks = [np.array(c, "<i4") for c in CHUNKS]
    singles = _count_single_prefills(monkeypatch)
    batched.caches.prefill_batch([1, 2, 3], chunks)
    assert singles == [len(c) for c in CHUNKS]
    for sid, tokens in zip([1, 2, 3], chunks):
        _prefill_alone(alone, sid, tokens)
    for sid in (1, 2, 3):
        assert mx.array_equal(_next_logits(batched, sid), _next_logits(alone, sid)).item(), sid


# ---------------------------------------------------------------------------------------------
# Malformed PREFILL_BATCH payloads
# ---------------------------------------------------------------------------------------------

HEADER, ROW = PrefillBatch.header, PrefillBatch.row


def _rows(*rows) -> bytes:
    return np.array([(s, n, 0) for s, n in rows], dtype=ROW).tobytes()


def _tokens(*ids) -> bytes:
    return np.array(ids, "<i4").tobytes()


@pytest.mark.parametrize("payload, says", [
    (b"\x01\x00", "PREFILL_BATCH payload of 2 bytes is shorter than its 16-byte header"),
    (HEADER.pack(0, 0, 0), "PREFILL_BATCH says 0 rows"),
    (HEADER.pack(limits.MAX_PREFILL_ROWS + 1, 0, 0), f"says {limits.MAX_PREFILL_ROWS + 1} rows (1 to"),
    (HEADER.pack(0xFFFFFFFF, 0, 0), "says 4294967295 rows"),
    (HEADER.pack(2, 0, 0) + _rows((1, 1)), "cannot hold their 2 x 16-byte entries"),
    (HEADER.pack(2, 0, 0) + _rows((1, 2), (2, 0)) + _tokens(5, 6), "row 1 (session 2) has 0 tokens"),
    (HEADER.pack(1, 0, 0) + _rows((1, 3)) + _tokens(5, 6), "rows say 3 tokens"),
    (HEADER.pack(1, 0, 0) + _rows((1, 1)) + _tokens(5, 6), "8 bytes follow them (4 expected)"),
    (HEADER.pack(1, 0, 0) + _rows((1, 0xFFFFFFFF)) + _tokens(5), "rows say 4294967295 tokens (at most"),
    (HEADER.pack(2, 0, 0) + _rows((1, 1), (1, 1)) + _tokens(5, 6), "names a session twice: [1, 1]"),
    (HEADER.pack(2, 0, 0) + _rows((1, 1), (7, 1)) + _tokens(5, 6), "session 7 does not exist"),
    (HEADER.pack(2, 0, 0) + _rows((1, 1), (2, 1)) + _tokens(5, 1 << 20), "token id 1048576, outside"),
    (HEADER.pack(2, 0, 0) + _rows((1, 1), (2, 1)) + _tokens(-3, 5), "token id -3, outside"),
])
def test_a_malformed_prefill_batch_is_a_frame_error_naming_it(model, payload, says):
    t = SessionTable(model)
    t.caches.create(1, 0, FRESH)
    t.caches.create(2, 0, FRESH)
    with pytest.raises(FrameError) as info:
        t.apply(F.PREFILL_BATCH, payload)
    assert says in str(info.value), str(info.value)
    # Nothing was prefilled: a refused command changes no session.
    assert _size(t, 1) == 0 and _size(t, 2) == 0


def test_a_damaged_prefill_batch_runs_or_is_refused_never_another_error(model):
    good = PrefillBatch.pack([(1, [5, 6, 7]), (2, [8, 9])])
    rng = random.Random(7)
    refused = 0
    for _ in range(200):
        payload = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
        payload = bytes(payload[: rng.choice([len(payload), rng.randrange(len(payload) + 1)])])
        t = SessionTable(model)
        t.caches.create(1, 0, FRESH)
        t.caches.create(2, 0, FRESH)
        try:
            t.apply(F.PREFILL_BATCH, payload)
        except TransportError:
            refused += 1
    assert refused > 100


def test_the_frame_bound_holds_the_largest_batch_the_table_accepts():
    assert tr.FRAME_MAX_BYTES[F.PREFILL_BATCH] == (HEADER.size + ROW.itemsize * limits.MAX_PREFILL_ROWS
                                                  + 4 * limits.MAX_TOKENS_PER_FRAME)


# ---------------------------------------------------------------------------------------------
# The flag
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, says", [("0", "--prompt-concurrency 0 must be >= 1"),
                                         ("257", "--prompt-concurrency 257 must be <= 256")])
def test_prompt_concurrency_is_checked_and_passed_down(tmp_path, monkeypatch, value, says):
    import mlx_ds4tp.serve.serving_rank as serve_rank
    from mlx_ds4tp.cli import build_parser

    got = {}
    monkeypatch.setattr(serve_rank, "run", lambda args, *rest: got.update(args=args) or 0)
    (tmp_path / "config.json").write_text("{}")
    leader = ["serve", "--model", str(tmp_path), "--role", "leader", "--listen", "127.0.0.1", "9911"]
    args = build_parser().parse_args(leader)
    assert args.func(args) == 0 and got["args"].limits.prompt_concurrency == 8  # mlx_lm.server's default
    args = build_parser().parse_args(leader + ["--prompt-concurrency", value])
    with pytest.raises(SystemExit) as info:
        args.func(args)
    assert says in str(info.value)


# ---------------------------------------------------------------------------------------------
# The mixed batch: prompts ride in the decode steps
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["always", "cheaper"])
def test_prompts_ride_in_the_decode_steps_with_mixed_prefill(model_dir, tmp_path, when):
    """--mixed-prefill 4: prompts that arrive while a session decodes join its decode forwards,
    four prompt tokens a step, with drafting rows beside them; every text is mlx-lm's alone.
    Always: no prefill forward of their own runs. Cheaper (the default): the leader times a
    prefill forward of their own first, then tries the mixed step, and shows its estimates."""
    pytest.importorskip("openai", reason="the openai package (pip install openai)")
    from serveutil import ServedPair, client, reference, text_ids

    # Cheaper: chunks of 4 tokens, so the prompts are still prefilling when the mixed step is tried.
    extra = ["--prefill-step-size", "4"] if when == "cheaper" else []
    served = ServedPair(model_dir, tmp_path, extra=["--mixed-prefill", "4", "--prompt-lookup", "2",
                                                    "--debug-hash", "1", "--mixed-prefill-when", when,
                                                    *extra])
    try:
        served.wait_healthy()
        c = client(served, timeout=120)
        first_ids = text_ids(model_dir, "the cat sat on the mat")
        pieces: list = []
        stream = c.completions.create(model=str(model_dir), prompt=first_ids, max_tokens=80, stream=True)
        it = iter(stream)
        pieces.append(next(it).choices[0].text)
        before = served.health()[1]
        prompts = [text_ids(model_dir, "a much longer prompt about the sea and the sky and the wind"),
                   text_ids(model_dir, "alpha beta gamma delta")]
        got: list = [None, None]

        def ask(i):
            got[i] = c.completions.create(model=str(model_dir), prompt=prompts[i], max_tokens=12).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        pieces.extend(chunk.choices[0].text for chunk in it)
        assert got == [reference(model_dir, p, 12) for p in prompts]
        assert "".join(pieces) == reference(model_dir, first_ids, 80)
        after = served.health()[1]
        assert after["mixed_prefill_policy"] == when, after
        if when == "always":
            assert after["mixed_steps"] - before["mixed_steps"] >= math.ceil((len(prompts[0]) - 1) / 4), after
            assert after["prefill_batches"] == before["prefill_batches"], after  # none of their own
        else:
            # Measured on the first prompt's forwards; the mixed step is then tried (what it
            # is chosen after depends on this machine's costs: tests/test_serve_mixing.py).
            assert before["prefill_batches"] > 0 and after["separate_prefill_us_per_token"] > 0, after
            assert after["mixed_steps"] > before["mixed_steps"], after
    finally:
        served.close()
