"""The pieces of `ds4tp serve` one by one: the prompt-cache decisions, stop strings, seeded
sampling, the request checks, --model resolution, and the two ranks' session tables driven
in lockstep (the leader's here, the worker's in its own process; batched rows equal each
session alone)."""

from __future__ import annotations

import contextlib
import json
import os

import mlx.core as mx
import pytest

import mlx_ds4tp as tp
from mlx_ds4tp.lockstep.caches.prompt_cache import COPY, FRESH, MOVE, PromptCacheIndex
from mlx_ds4tp.lockstep.sampling.options import SamplingOptions
from mlx_ds4tp.lockstep.sampling.row_sampling import RowSampler, sample_batch
from mlx_ds4tp.serve.engine.events import ENDING_EVENTS, DoneEvent, FailedEvent, StartedEvent, TextEvent


def test_prompt_cache_decisions():
    index = PromptCacheIndex(max_size=2)
    assert index.lookup([1, 2, 3]).mode == FRESH
    a, evicted = index.insert([1, 2, 3, 4])
    assert evicted == []
    # A longer prompt starting with the stored tokens moves that cache (no copy).
    reuse = index.lookup([1, 2, 3, 4, 5, 6])
    assert (reuse.cache_id, reuse.mode, reuse.keep, reuse.needs_rewind) == (a, MOVE, 4, False)
    assert len(index) == 0
    b, _ = index.insert([1, 2, 3, 4, 5, 6, 7])
    # A prompt that diverges inside the stored tokens copies it and trims at the divergence.
    reuse = index.lookup([1, 2, 3, 9])
    assert (reuse.cache_id, reuse.mode, reuse.keep, reuse.needs_rewind) == (b, COPY, 3, True)
    # The same prompt again: everything but the last token is reused.
    reuse = index.lookup([1, 2, 3, 4, 5, 6, 7])
    assert (reuse.mode, reuse.keep) == (COPY, 6)
    # A stored prefix of a new entry is covered by it and dropped; the LRU bound holds.
    c, evicted = index.insert([1, 2, 3, 4, 5, 6, 7, 8])
    assert evicted == [b]
    d, _ = index.insert([9, 9, 9])
    e, evicted = index.insert([8, 8, 8])
    assert evicted == [c] and index.ids() == [d, e]
    assert PromptCacheIndex(max_size=0).insert([1, 2]) == (0, [])


def test_untrimmable_caches_are_only_moved():
    index = PromptCacheIndex(max_size=4, trimmable=False)
    index.insert([1, 2, 3, 4])
    assert index.lookup([1, 2, 9]).mode == FRESH
    assert index.lookup([1, 2, 3, 4, 5]).mode == MOVE


def test_caches_that_forget_their_oldest_tokens_are_untrimmable():
    # mlx-lm calls a fresh RotatingKVCache or ChunkedKVCache trimmable; once the prompt is past
    # its window or chunk it cannot drop tokens, so the index must never plan to trim it.
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

    from mlx_ds4tp.lockstep.compute import trims_at_any_length

    assert trims_at_any_length([KVCache(), CacheList(KVCache(), KVCache())])
    for other in (RotatingKVCache(max_size=8), ChunkedKVCache(8), CacheList(KVCache(), ChunkedKVCache(8)),
                  ArraysCache(2)):
        assert not trims_at_any_length([KVCache(), other]), other


def test_stop_strings_are_cut_and_never_half_sent():
    from mlx_ds4tp.serve.engine.text_stream import TextStream

    class Pieces:
        """A detokenizer whose token i is the string pieces[i]."""

        def __init__(self, pieces):
            self.pieces, self.last_segment = pieces, ""

        def reset(self):
            self.last_segment = ""

        def add_token(self, token):
            self.last_segment = self.pieces[token]

        def finalize(self):
            self.last_segment = ""

    stream = TextStream(Pieces(["hel", "lo EN", "D more"]), ["END"])
    sent = [stream.add(0), stream.add(1), stream.add(2)]
    assert "".join(t for t, _ in sent) == "hello "
    assert [s for _, s in sent] == [False, False, True]
    plain = TextStream(Pieces(["a", "b"]), [])
    assert plain.add(0) == ("a", False) and plain.add(1) == ("b", False) and plain.finish() == ""


def test_seeded_session_draws_what_it_would_draw_alone():
    from mlx_lm.sample_utils import make_sampler

    logits = mx.random.normal((6, 64), key=mx.random.key(0))
    options = SamplingOptions(temperature=1.0, seed=77)
    mx.random.seed(77)
    alone_sampler = make_sampler(1.0)
    alone = [int(alone_sampler(logits[i : i + 1] - mx.logsumexp(logits[i : i + 1], axis=-1,
                                                                keepdims=True)).item())
             for i in range(6)]
    a, b = RowSampler(options, [1], 77, 64), RowSampler(SamplingOptions(temperature=1.0, seed=5), [1], 5, 64)
    interleaved = []
    for i in range(6):
        interleaved.append(a.draw(logits[i : i + 1]).item())
        b.draw(logits[i : i + 1])
    assert interleaved == alone


def test_top_k_past_the_vocabulary_keeps_every_token():
    logits = mx.random.normal((1, 64), key=mx.random.key(1))
    options = SamplingOptions(temperature=1.0, top_k=1000, seed=3)
    assert RowSampler(options, [1], 3, 64).draw(logits).item() == \
        RowSampler(SamplingOptions(temperature=1.0, seed=3), [1], 3, 64).draw(logits).item()


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("top_k", -2),
                                          ("min_p", 1.5), ("repetition_penalty", -0.1)])
def test_sampling_options_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingOptions(**{field: value}).check()


def test_request_checks_name_the_field():
    from mlx_ds4tp.serve.dialects.openai import ApiError, parse_request

    class Tok:
        def encode(self, text):
            return [ord(c) % 50 for c in text]

    kw = dict(model_ids=["m"], default_max_tokens=8, context_length=16, vocab_size=50,
              defaults=SamplingOptions())
    ok = parse_request({"prompt": "abc", "max_tokens": 100}, "text", Tok(), **kw)
    assert ok.request.max_tokens == 13 and ok.request.prompt == (47, 48, 49)
    # The server's sampling defaults under the request's fields; 0 draft tokens: none.
    served = dict(kw, defaults=SamplingOptions(temperature=0.5, top_k=4))
    asked = parse_request({"prompt": "a", "top_k": 2, "num_draft_tokens": 0}, "text", Tok(), **served)
    request = asked.request
    assert (request.options.temperature, request.options.top_k, request.num_draft_tokens) == (0.5, 2, 0)
    for body, param in [({"prompt": "x" * 20}, "prompt"), ({"prompt": "a", "top_k": 1.5}, "top_k"),
                        ({"prompt": "a", "stop": [1]}, "stop"), ({"prompt": "a", "n": 2}, "n"),
                        ({"prompt": "a", "max_tokens": True}, "max_tokens"), ({}, "prompt"),
                        ({"prompt": "a", "seed": -1}, "seed"), ({"prompt": [3, 50]}, "prompt"),
                        ({"prompt": [-1]}, "prompt"), ({"prompt": []}, "prompt"),
                        ({"prompt": "a", "top_p": 0}, "top_p"), ({"prompt": "a", "min_p": 1.5}, "min_p"),
                        ({"prompt": "a", "logit_bias": {"3": 101}}, "logit_bias"),
                        ({"prompt": "a", "num_draft_tokens": 65}, "num_draft_tokens"),
                        ({"prompt": "a", "num_draft_tokens": -1}, "num_draft_tokens")]:
        with pytest.raises(ApiError) as info:
            parse_request(body, "text", Tok(), **kw)
        assert info.value.param == param and 400 <= info.value.status < 500


def test_model_resolution_names_the_missing_repo(tmp_path, monkeypatch):
    from mlx_ds4tp.checkpoint.source import resolve_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="someone/not-here"):
        resolve_model("someone/not-here")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_model(str(tmp_path / "a" / "b" / "c"))


def _worker_process(procs, path, port: int):
    """The worker rank as its own process (tests/worker_child.py): one rank evaluates here."""
    return procs.spawn([os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_child.py"),
                        str(path), str(port)])


def test_session_tables_in_lockstep_equal_each_session_alone(tmp_path, procs):
    """The leader's table here, the worker's in its process: staggered joins and leaves, a
    moved cache and a copied, rewound cache; every session's greedy tokens equal mlx-lm's for
    it alone."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlx_ds4tp.lockstep.protocol.commands import Create, Destroy, EvalBatch, Invalidate, PrefillBatch, Rewind
    from mlx_ds4tp.lockstep.protocol.sessions import LeaderSessions
    from mlx_ds4tp.model_split import load_split
    from mlx_ds4tp.synthetic.tiny_model import save_llama
    from pairutil import free_port

    path = save_llama(tmp_path / "m", "tiny", seed=3)
    model, tokenizer = load(str(path))
    base = tokenizer.encode("once upon a time")
    prompts = [base + tokenizer.encode(" there"), tokenizer.encode("hi"), base,
               tokenizer.encode("a fox and a dog")]
    n = 8

    def alone(ids):
        return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n,
                                            sampler=make_sampler(0.0))]

    port = free_port()
    worker = _worker_process(procs, path, port)
    leader_group = tp.init(role="leader", listen=("127.0.0.1", port), transport="tcp", timeout=60.0)
    try:
        split, _ = load_split(str(path), leader_group)
        sessions = LeaderSessions(leader_group, split)

        def step(rows):
            return sessions.send(EvalBatch, sessions.step_count + 1, rows)

        # Session 1: the base prompt alone, stored as cache 7 when it ends.
        sessions.send(Create, 1, 0, FRESH, 0)
        sessions.send(PrefillBatch, [(1, base[:-1])])
        out = []
        nxt, sampler = base[-1], RowSampler(SamplingOptions(), base, 0, 0)
        for _ in range(n):
            (tok,) = sample_batch(step([(1, nxt)]), [sampler], {}).tolist()
            out.append(tok)
            nxt = tok
        assert out == alone(base)
        sessions.send(Destroy, 1, 7)
        sessions.send(Create, 100, 7, COPY, 0)  # a copy of cache 7 for session 2 ...
        sessions.send(Rewind, 100, len(base) - 1, 0)
        sessions.send(Destroy, 100, 8)  # ... stored as 8; 7 stays for session 4
        # Sessions 2..5 at once, joining one per step, leaving as they finish. Session 2
        # takes cache 7 (base + its answer) and trims it to the base; session 4 takes cache 8.
        plans = {2: (prompts[0], 7, MOVE, len(base)), 3: (prompts[1], 0, FRESH, 0),
                 4: (prompts[2], 8, MOVE, len(base) - 1), 5: (prompts[3], 0, FRESH, 0)}
        state = {}
        for sid, (ids, cache_id, mode, keep) in plans.items():
            sessions.send(Create, sid, cache_id, mode, 0)
            if mode != FRESH and keep < sessions.table.caches.sessions[sid][0].size():
                sessions.send(Rewind, sid, keep, 0)
            if ids[keep:-1]:
                sessions.send(PrefillBatch, [(sid, ids[keep:-1])])
            state[sid] = [ids[-1], RowSampler(SamplingOptions(), ids, 0, 0), []]
        rows, waiting = [], list(plans)
        while rows or waiting:
            if waiting:
                rows.append(waiting.pop(0))
            tokens = sample_batch(step([(s, state[s][0]) for s in rows]),
                                  [state[s][1] for s in rows], {}).tolist()
            for s, tok in zip(list(rows), tokens):
                state[s][0] = tok
                state[s][2].append(tok)
                if len(state[s][2]) == n:
                    sessions.send(Destroy, s, 9 if s == 3 else 0)
                    rows.remove(s)
        assert sessions.table.caches.stored.keys() == {9}
        sessions.send(Invalidate, 9)
        for sid, (ids, *_rest) in plans.items():
            assert state[sid][2] == alone(ids), sid
        assert sessions.table.caches.stored.keys() == set()
        sessions.stop()
        out, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["steps"] == sessions.table.batch.step_count
    finally:
        leader_group.close()


class _CheckedModel:
    """A model that checks every input it is handed: ids inside the vocabulary."""

    def __init__(self, inner, vocab: int):
        self.inner, self.args, self.layers, self.vocab = inner, inner.args, inner.layers, vocab
        # The prefill calls the inner model (embedding and blocks): checked alike.
        self.model = _CheckedModel(inner.model, vocab) if hasattr(inner, "model") else None

    def __call__(self, x, cache=None):
        import numpy as np

        ids = np.array(x)
        assert ids.size and ids.min() >= 0 and ids.max() < self.vocab, ids
        return self.inner(x, cache=cache)


def _damaged(rng, frames: list) -> list:
    """The script with one frame dropped, repeated, swapped, a payload bit flipped, or a
    payload cut short and padded."""
    frames = list(frames)
    kind = rng.randrange(5)
    i = rng.randrange(len(frames))
    if kind == 0:
        del frames[i]
    elif kind == 1:
        frames.insert(i, frames[rng.randrange(len(frames))])
    elif kind == 2:
        j = rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    elif kind == 3:
        ftype, payload = frames[i]
        if payload:
            b = bytearray(payload)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            frames[i] = (ftype, bytes(b))
    else:
        ftype, payload = frames[i]
        frames[i] = (ftype, payload[: rng.randrange(len(payload) + 1)] + b"\0" * rng.randrange(3))
    return frames


def test_damaged_command_scripts_end_in_a_frame_error(tmp_path):
    """A serving rank fed a leader's script with a frame dropped, repeated, swapped or with a
    payload byte changed either runs it or stops with a TransportError: never another
    exception, never an out-of-vocabulary token handed to the model."""
    import random

    from mlx_lm import load

    import mlx_ds4tp.transport as tr
    from mlx_ds4tp.errors import TransportError
    from mlx_ds4tp.lockstep.protocol.commands import Create, Destroy, EvalBatch, Invalidate, PrefillBatch, Rewind
    from mlx_ds4tp.lockstep.protocol.table import SessionTable
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    frame = tr.FrameType
    model, _ = load(str(save_llama(tmp_path / "m", "tiny", seed=1)))
    checked = _CheckedModel(model, model.args.vocab_size)

    def sync(session, tokens):
        return frame.PREFILL_BATCH, PrefillBatch.pack([(session, tokens)])

    script = [
        (frame.SESSION_CREATE, Create.pack(1, 0, FRESH, 0)), sync(1, [5, 6, 7]),
        (frame.SESSION_CREATE, Create.pack(2, 0, FRESH, 0)),
        (frame.EVAL_BATCH, EvalBatch.pack(1, [(1, 8), (2, 9)])),
        (frame.EVAL_BATCH, EvalBatch.pack(2, [(1, 10), (2, 11)])),
        (frame.SESSION_DESTROY, Destroy.pack(1, 4)), (frame.SESSION_CREATE, Create.pack(3, 4, COPY, 0)),
        (frame.REWIND, Rewind.pack(3, 2, 0)), sync(3, [12]),
        (frame.EVAL_BATCH, EvalBatch.pack(3, [(2, 13), (3, 14)])), (frame.SESSION_DESTROY, Destroy.pack(2, 0)),
        (frame.SESSION_DESTROY, Destroy.pack(3, 0)), (frame.INVALIDATE, Invalidate.pack(4)),
    ]

    clean = SessionTable(checked)
    for ftype, payload in script:
        clean.apply(ftype, payload)
    assert not clean.busy and not clean.caches.stored
    rng = random.Random(int(os.environ.get("DS4_TP_FUZZ_SEED", "12")))
    failures = 0
    for _ in range(150):
        table = SessionTable(checked)
        try:
            for ftype, payload in _damaged(rng, script):
                table.apply(ftype, payload)
        except TransportError:
            failures += 1
    assert failures > 50  # most damages are caught, the rest are scripts that still make sense


@contextlib.contextmanager
def _served_engine(tmp_path, procs, wrap=lambda model: model, **engine_args):
    """The serving engine here over the tiny llama, its worker rank in its own process:
    yields (engine, the unsplit model, tokenizer), not started; stopped and closed after.
    wrap: what the leader's table gets in place of its split model."""
    from mlx_lm import load

    from mlx_ds4tp.lockstep.protocol.sessions import LeaderSessions
    from mlx_ds4tp.model_split import load_split
    from mlx_ds4tp.serve.engine.loop import Engine
    from mlx_ds4tp.serve.limits import ServeLimits
    from mlx_ds4tp.synthetic.tiny_model import save_llama
    from pairutil import free_port

    path = save_llama(tmp_path / "m", "tiny", seed=2)
    model, tokenizer = load(str(path))
    port = free_port()
    worker = _worker_process(procs, path, port)
    leader_group = tp.init(role="leader", listen=("127.0.0.1", port), transport="tcp", timeout=60.0)
    engine = None
    try:
        split = wrap(load_split(str(path), leader_group)[0])
        engine = Engine(LeaderSessions(leader_group, split), tokenizer, ServeLimits(**engine_args))
        yield engine, model, tokenizer
    finally:
        if engine is not None:
            engine.stop()
        leader_group.close()
        worker.wait(30)


def _events(ticket) -> list:
    """A submitted request's events, through its last one."""
    events = []
    while not events or not isinstance(events[-1], ENDING_EVENTS):
        events.append(ticket.events.get(timeout=60))
    return events


def _cached(events) -> int:
    """The prompt tokens a request reused, as its StartedEvent says."""
    return next(e.cached_tokens for e in events if isinstance(e, StartedEvent))


def _greedy_alone(model, tokenizer, ids, n: int) -> tuple:
    """(tokens, text) mlx-lm's generate_step makes greedily for `ids` alone, to an eos or n."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    tokens = []
    for t, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(0.0)):
        tokens.append(t)
        if t in tokenizer.eos_token_ids:
            break
    detok = tokenizer.detokenizer
    detok.reset()
    for t in tokens:
        if t not in tokenizer.eos_token_ids:
            detok.add_token(t)
    detok.finalize()
    return tokens, detok.text


def test_one_requests_failure_leaves_the_pair_and_the_others_alone(tmp_path, monkeypatch, procs):
    """The engine here over a pair whose worker is its own process: a request whose
    (leader-only) sampling raises gets a "failed" event; the request decoding beside it, and
    the next one, get mlx-lm's tokens; the pair stays up."""
    from mlx_ds4tp.lockstep.request import GenerationRequest as Request
    from mlx_ds4tp.lockstep.sampling.row_sampling import RowSampler

    # The leader's sampler of one request fails at its fourth draw (the engine's rows are
    # sampled by the tables' RowSamplers: the pipelined decode).
    real_draw = RowSampler.draw

    def flaky(self, logits):
        if self.options.seed == 666:
            self.draws = getattr(self, "draws", 0) + 1
            if self.draws > 3:
                raise RuntimeError("injected")
        return real_draw(self, logits)

    monkeypatch.setattr(RowSampler, "draw", flaky)
    with _served_engine(tmp_path, procs) as (engine, model, tokenizer):
        engine.start()
        ids = [tokenizer.encode("one two three"), tokenizer.encode("four five")]
        bad = engine.submit(Request(ids[0], 8, SamplingOptions(temperature=0.5, seed=666)))
        good = engine.submit(Request(ids[1], 8))
        assert isinstance(_events(bad)[-1], FailedEvent)
        done = _events(good)[-1]
        assert done == DoneEvent("length" if done.completion_tokens == 8 else "stop", done.completion_tokens)
        assert engine.error is None
        events = _events(engine.submit(Request(ids[1], 8)))
        text = "".join(e.text for e in events if isinstance(e, TextEvent))
        assert text == _greedy_alone(model, tokenizer, ids[1], 8)[1] and _cached(events) > 0


def test_a_stored_cache_holds_only_its_own_memory(tmp_path):
    """A session stored from the merged batch keeps only its own keys and values: without the
    copy, the longest row of a just-merged batch is a view of the whole batch's buffer, and a
    server's memory grows with every batch it has held (the soak found it)."""
    import gc
    import random

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from mlx_ds4tp.lockstep.protocol.table import SessionTable
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    model, _ = load(str(save_llama(tmp_path / "m", "tiny", seed=2)))
    table = SessionTable(model)
    rng = random.Random(0)
    gc.collect()
    base = mx.get_active_memory()
    sid = store = 0
    for _ in range(6):
        sessions = []
        for _ in range(4):
            sid += 1
            table.caches.create(sid, 0, 0)
            tokens = np.array([rng.randrange(200) for _ in range(rng.randint(2, 300))], dtype=np.int32)
            table.caches.prefill_batch([sid], [tokens])
            sessions.append(sid)
        table.step(sessions, np.ones(4, dtype=np.int32))
        for s in sessions:
            store += 1
            table.destroy(s, store)
    table.batch.last_logits = None
    gc.collect()
    held = mx.get_active_memory() - base
    own = sum(c.nbytes for cache in table.caches.stored.values() for c in cache)
    assert held <= own * 1.1 + (1 << 20), (held, own)


def test_the_engine_queues_the_next_step_before_it_reads_a_token(tmp_path, monkeypatch, procs):
    """Pipelined serving: when the engine takes a session's token in (its first excepted, which
    is read at once), the forward of the step after it has already been built and sent (the
    worker in its own process samples the same rows itself); the text is still mlx-lm's, and a
    second turn reuses the cache that holds every generated token."""
    from mlx_ds4tp.lockstep.request import GenerationRequest as Request
    from mlx_ds4tp.serve.engine import finishing

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __call__(self, *args, **kwargs):
            self.calls += 1
            return self.inner(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    counted = Counting(None)  # the leader's split model goes in when it is loaded
    seen = []
    real_take = finishing.Finishing.take_token

    def take_token(self, row, token, logprobs):
        seen.append(counted.calls)
        return real_take(self, row, token, logprobs)

    def wrap(split):
        counted.inner = split
        return counted

    monkeypatch.setattr(finishing.Finishing, "take_token", take_token)
    with _served_engine(tmp_path, procs, wrap) as (engine, model, tokenizer):
        engine.start()

        def run(ids):
            return _events(engine.submit(Request(ids, 6)))

        ids = tokenizer.encode("one two three four")
        events = run(ids)
        assert isinstance(events[-1], DoneEvent), events
        # One prefill forward of the prompt's head and step 1: the first token is read at once
        # (its time to first token waits for no other step). Every later token is read with
        # the step after it already built and sent: token 2 after step 3, token 3 after 4.
        assert seen[:3] == [2, 4, 5], seen
        want, text = _greedy_alone(model, tokenizer, ids, 6)
        assert "".join(e.text for e in events if isinstance(e, TextEvent)) == text
        events = run(ids + want)
        assert isinstance(events[-1], DoneEvent) and _cached(events) == len(ids) + len(want) - 1, events
        assert engine.error is None


def test_a_session_ending_at_a_read_before_a_prefill_chunk_leaves_no_empty_step(tmp_path, procs):
    """Pipelined serving reads the last step's tokens before a prefill chunk; when that ends
    the only running session while another prompt is still prefilling, the turn runs the
    chunk and no decode step (an empty one would stop the pair), and both answers are whole."""
    from mlx_ds4tp.lockstep.request import GenerationRequest as Request

    with _served_engine(tmp_path, procs, prefill_step=4) as (engine, _, _):
        short = engine.submit(Request([5], 2))  # nothing to prefill: it decodes from the first turns
        long = engine.submit(Request(list(range(10, 50)), 3))  # ten chunks of 4 tokens
        engine.start()  # both are admitted in its first turn
        assert _events(short)[-1] == DoneEvent("length", 2)
        assert _events(long)[-1] == DoneEvent("length", 3)
        assert engine.error is None


def test_an_idle_engine_hands_memory_back_once(tmp_path, procs):
    """Once the engine has had no work for IDLE_POLL_SEC it hands memory back: an array only a
    garbage cycle holds (a failed step's traceback holds its frames' arrays) is freed, and
    MLX's buffer cache is emptied after it. Python's collector is off here, as it in effect is
    at idle: it runs only after enough new allocations."""
    import gc
    import time

    from mlx_ds4tp.lockstep.request import GenerationRequest as Request

    with _served_engine(tmp_path, procs) as (engine, model, tokenizer):
        engine.start()
        gc.disable()
        try:
            cycle = [mx.ones((1 << 20,), dtype=mx.float32)]  # 4 MiB
            mx.eval(cycle[0])
            cycle.append(cycle)
            held = mx.get_active_memory()  # the array counted before anything can free it
            del cycle
            # A request ends the idle period the engine may already have released in.
            request = engine.submit(Request(tokenizer.encode("one two three"), 4))
            assert isinstance(_events(request)[-1], DoneEvent)
            deadline = time.monotonic() + 30
            # The array is freed into the cache, which is emptied a moment later: wait for both.
            while time.monotonic() < deadline and (mx.get_active_memory() > held - (3 << 20)
                                                   or mx.get_cache_memory() >= 1 << 20):
                time.sleep(0.05)
            assert mx.get_active_memory() <= held - (3 << 20), (held, mx.get_active_memory())
            assert mx.get_cache_memory() < 1 << 20, mx.get_cache_memory()
        finally:
            gc.enable()


def test_an_idle_worker_hands_memory_back_after_a_second_without_a_command(monkeypatch):
    """The worker's command loop hands memory back once when a second passes without a
    command between requests; a command that is already there, or one in the middle of a
    generation, is taken without it."""
    import socket
    import threading
    import time

    from mlx_ds4tp import transport as tr
    from mlx_ds4tp.lockstep.protocol import sessions

    calls = []
    monkeypatch.setattr(sessions, "release_memory", lambda: calls.append(time.monotonic()))
    a, b = socket.socketpair()
    try:
        leader, worker = tr.ControlChannel(a, 10.0), tr.ControlChannel(b, 10.0)
        leader.send(tr.FrameType.STOP)
        assert sessions._next_command(worker, False)[0] == tr.FrameType.STOP and calls == []
        leader.send(tr.FrameType.STOP)
        assert sessions._next_command(worker, True)[0] == tr.FrameType.STOP and calls == []
        late = threading.Thread(target=lambda: (time.sleep(2.5), leader.send(tr.FrameType.STOP)))
        late.start()
        assert sessions._next_command(worker, False)[0] == tr.FrameType.STOP
        late.join()
        assert len(calls) == 1
    finally:
        a.close()
        b.close()
