"""The batched quantized KV cache (mlx_ds4tp.lockstep.caches.quantized_cache) against mlx-lm's own
QuantizedKVCache: every row of a batch decodes the tokens (and, within float noise, the logits)
that its sequence decodes alone, through merge, filter, extend, extract, trim and a padded
batched prefill; the session table batches quantized sessions unchanged.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)

from mlx_ds4tp.lockstep.caches.quantized_cache import (
    BatchQuantizedKVCache,
    SessionQuantizedKVCache,
    describe_unquantizable,
    quantize_session_cache,
)
from mlx_ds4tp.synthetic.tiny_model import LlamaSizes, save_llama

# head_dim 64: quantization groups run along the head dimension, so group size 64 needs it
# (the "tiny" preset's head_dim is 32). kv_heads < heads keeps grouped-query attention, whose
# mask broadcast is the part of mlx-lm's quantized attention a batch mask goes through.
SIZES = LlamaSizes(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=256, vocab=512)
GROUP = 64
STEPS = 8
RTOL = 1e-4  # of the largest |logit|: the batch's padding changes only summation order

PROMPTS = [
    [5, 17, 99, 3, 250, 41, 7],
    [300, 12, 8, 64, 77, 128, 9, 13, 401, 22, 55, 6, 19, 200, 31, 2, 88],
    [400, 44],
    [11, 23, 35, 47, 59, 71, 83, 95, 107, 119, 131],
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_lm import load

    path = save_llama(tmp_path_factory.mktemp("qkv") / "llama", SIZES, seed=7)
    return load(str(path))[0]


def _eval(cache):
    mx.eval([c.state for c in cache])


def prefill_alone(model, prompt, bits, route, mine):
    """A one-sequence cache holding prompt[:-1]. route "quantized": quantized from the first
    token; "float": filled in float, then quantized (as mlx-lm's maybe_quantize_kv_cache).
    `mine` picks our classes, else mlx-lm's own QuantizedKVCache: the reference."""
    n = len(model.layers)
    if route == "quantized":
        cache = (quantize_session_cache(make_prompt_cache(model), bits, GROUP) if mine
                 else [QuantizedKVCache(group_size=GROUP, bits=bits) for _ in range(n)])
    else:
        cache = make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array(prompt[:-1])[None], cache=cache)
        _eval(cache)
    if route == "float":
        cache = (quantize_session_cache(cache, bits, GROUP) if mine
                 else [c.to_quantized(group_size=GROUP, bits=bits) for c in cache])
    return cache


def step(model, cache, tokens):
    """One decode step for a batch (or a lone row): the logits [rows, vocab], float32."""
    logits = model(mx.array(tokens, dtype=mx.int32)[:, None], cache=cache)[:, -1].astype(mx.float32)
    mx.eval(logits)
    return np.array(logits)


def reference(model, prompt, bits, route, steps):
    """mlx-lm alone: the logits of each greedy decode step and the token fed at each."""
    cache = prefill_alone(model, prompt, bits, route, mine=False)
    fed, logits = [prompt[-1]], []
    for _ in range(steps):
        logits.append(step(model, cache, [fed[-1]])[0])
        fed.append(int(np.argmax(logits[-1])))
    return fed, logits


class Rows:
    """Compares each batch row's logits with its sequence's reference, step by step."""

    def __init__(self, refs):
        self.refs = refs  # sequence -> (fed, logits)
        self.pos = {}  # sequence -> steps it has decoded
        self.worst = 0.0

    def start(self, seq, pos=0):
        self.pos[seq] = pos

    def tokens(self, seqs):
        return [self.refs[s][0][self.pos[s]] for s in seqs]

    def check(self, seqs, logits):
        for s, row in zip(seqs, logits):
            ref = self.refs[s][1][self.pos[s]]
            assert int(np.argmax(row)) == int(np.argmax(ref)), f"sequence {s} step {self.pos[s]}"
            err = float(np.max(np.abs(row - ref)) / np.max(np.abs(ref)))
            self.worst = max(self.worst, err)
            assert err < RTOL, f"sequence {s} step {self.pos[s]}: relative error {err:.2e}"
            self.pos[s] += 1

    def run(self, model, cache, seqs, steps):
        for _ in range(steps):
            self.check(seqs, step(model, cache, self.tokens(seqs)))


def merged(caches):
    """Per-layer merge, as the decode batch's join does it."""
    return [caches[0][i].merge([c[i] for c in caches]) for i in range(len(caches[0]))]


@pytest.mark.parametrize("bits,route", [(8, "quantized"), (8, "float"), (4, "quantized")])
def test_merged_batch_decodes_as_each_row_alone(model, bits, route):
    seqs = [0, 1, 2]
    rows = Rows({s: reference(model, PROMPTS[s], bits, route, STEPS) for s in seqs})
    caches = [prefill_alone(model, PROMPTS[s], bits, route, mine=True) for s in seqs]
    assert all(type(c) is SessionQuantizedKVCache for c in caches[0])
    assert caches[1][0].size() == len(PROMPTS[1]) - 1
    batch = merged(caches)
    assert all(type(c) is BatchQuantizedKVCache and c.bits == bits and c.group_size == GROUP
               for c in batch)
    assert batch[0].left_padding.tolist() == [10, 0, 15]
    for s in seqs:
        rows.start(s)
    rows.run(model, batch, seqs, STEPS)
    assert batch[0].offset.tolist() == [len(PROMPTS[s]) - 1 + STEPS for s in seqs]
    print(f"bits={bits} route={route}: worst relative logit error {rows.worst:.2e}")


def test_filter_extend_extract_trim(model):
    bits, route = 8, "quantized"
    rows = Rows({s: reference(model, PROMPTS[s], bits, route, 12) for s in range(4)})
    caches = [prefill_alone(model, PROMPTS[s], bits, route, mine=True) for s in (0, 1, 2)]
    batch, seqs = merged(caches), [0, 1, 2]
    for s in seqs:
        rows.start(s)
    rows.run(model, batch, seqs, 3)

    # Sequence 1 (the longest, so the others' padding shrinks) leaves; it decodes on alone.
    alone = [c.extract(1) for c in batch]
    assert all(type(c) is SessionQuantizedKVCache for c in alone)
    assert alone[0].size() == len(PROMPTS[1]) - 1 + 3 and alone[0].keys[0].shape[2] == alone[0].size()
    for c in batch:
        c.filter([0, 2])
    seqs = [0, 2]
    assert min(batch[0].left_padding.tolist()) == 0
    rows.run(model, batch, seqs, 3)
    rows.run(model, alone, [1], 4)

    # Sequence 3 joins: a batch of its own, extended into the running one.
    joining = merged([prefill_alone(model, PROMPTS[3], bits, route, mine=True)])
    for mine, new in zip(batch, joining):
        mine.extend(new)
    seqs = [0, 2, 3]
    rows.start(3)
    rows.run(model, batch, seqs, 3)

    # Trim the last step off every row, then decode it again: the same logits.
    assert all(c.is_trimmable() for c in batch)
    size = batch[0].size()
    assert [c.trim(1) for c in batch] == [1, 1]
    assert batch[0].size() == size - 1
    # What a cache-sharing layer reads: each component up to the trimmed size.
    keys, values = batch[0].keys_and_values()
    assert [k.shape[2] for k in keys] == [v.shape[2] for v in values] == [size - 1] * 3
    for s in seqs:
        rows.pos[s] -= 1
    rows.run(model, batch, seqs, 2)

    # The extracted row trims like mlx-lm's QuantizedKVCache and goes on decoding.
    assert trim_prompt_cache(alone, 2) == 2
    rows.pos[1] -= 2
    rows.run(model, alone, [1], 3)
    # The lone row joins the batch again through the session cache's merge.
    for mine, new in zip(batch, merged([alone])):
        mine.extend(new)
    rows.run(model, batch, [0, 2, 3, 1], 1)


def test_extend_and_extract_of_empty_caches(model):
    empty = merged([quantize_session_cache(make_prompt_cache(model), 8, GROUP) for _ in range(2)])
    assert empty[0].empty() and empty[0].nbytes == 0 and empty[0].size() == 0
    full = merged([prefill_alone(model, PROMPTS[0], 8, "quantized", mine=True)])
    for c, e in zip(full, empty):
        c.extend(e)
    assert full[0].offset.tolist() == [6, 0, 0] and full[0].left_padding.tolist() == [0, 6, 6]
    assert empty[0].extract(0).empty()
    other = BatchQuantizedKVCache([0], group_size=GROUP, bits=4)
    with pytest.raises(ValueError, match="quantized differently"):
        full[0].extend(other)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_padded_batched_prefill(model, padding):
    bits, seqs = 8, [0, 1, 2, 3]
    rows = Rows({s: reference(model, PROMPTS[s], bits, "quantized", STEPS) for s in seqs})
    bodies = [PROMPTS[s][:-1] for s in seqs]
    lengths = [len(b) for b in bodies]
    longest = max(lengths)
    pads = [longest - n for n in lengths]
    cache = [BatchQuantizedKVCache([0] * len(seqs), group_size=GROUP, bits=bits) for _ in model.layers]
    if padding == "right":
        tokens = [b + [0] * p for b, p in zip(bodies, pads)]
        for c in cache:
            c.prepare(lengths=lengths, right_padding=pads)
    else:
        tokens = [[0] * p + b for b, p in zip(bodies, pads)]
        for c in cache:
            c.prepare(left_padding=pads)
    model(mx.array(tokens), cache=cache)
    for c in cache:
        c.finalize()
    _eval(cache)
    assert cache[0].offset.tolist() == lengths and cache[0].left_padding.tolist() == pads
    for s in seqs:
        rows.start(s)
    rows.run(model, cache, seqs, STEPS)
    # Every row comes back out as its own session cache, decoding on as it would alone.
    more = Rows({s: reference(model, PROMPTS[s], bits, "quantized", STEPS + 2) for s in seqs})
    for i, s in enumerate(seqs):
        more.start(s, STEPS)
        more.run(model, [c.extract(i) for c in cache], [s], 2)


def test_quantized_batch_is_smaller(model):
    prompt = list(range(3, 303))
    floats = [prefill_alone(model, prompt, 8, "none", mine=True) for _ in range(2)]
    f_batch = merged(floats)
    assert type(f_batch[0]) is BatchKVCache
    for bits, bound in ((8, 0.3), (4, 0.17)):
        q = quantize_session_cache(floats[0], bits, GROUP)
        assert q[0].nbytes < bound * floats[0][0].nbytes, (bits, q[0].nbytes, floats[0][0].nbytes)
        q_batch = merged([q, quantize_session_cache(floats[1], bits, GROUP)])
        assert q_batch[0].nbytes < bound * f_batch[0].nbytes
        assert q_batch[0].nbytes == sum(x.nbytes for x in q_batch[0].keys + q_batch[0].values)


def test_state_round_trip(model):
    batch = merged([prefill_alone(model, PROMPTS[s], 8, "quantized", mine=True) for s in (0, 2)])
    again = BatchQuantizedKVCache.from_state(batch[0].state)
    assert (again.bits, again.group_size, again.size()) == (8, GROUP, batch[0].size())
    assert again.left_padding.tolist() == batch[0].left_padding.tolist()
    assert again.make_mask(1).shape == (2, 1, 1, batch[0].size() + 1)


def test_quantize_session_cache_leaves_other_layers(model):
    filled = prefill_alone(model, PROMPTS[0], 8, "none", mine=True)[0]
    rotating, arrays = RotatingKVCache(max_size=16), ArraysCache(2)
    layers = [filled, rotating, KVCache(), arrays, QuantizedKVCache(group_size=GROUP, bits=8)]
    out = quantize_session_cache(layers, 8, GROUP)
    assert type(out[0]) is SessionQuantizedKVCache and out[0].size() == filled.offset
    assert out[1] is rotating and out[3] is arrays
    assert type(out[2]) is SessionQuantizedKVCache and out[2].empty()
    assert type(out[4]) is SessionQuantizedKVCache
    assert layers[0] is filled  # the input list is not changed
    ref = filled.to_quantized(group_size=GROUP, bits=8)
    assert all(mx.array_equal(a, b) for a, b in zip(out[0].keys + out[0].values, ref.keys + ref.values))
    message = describe_unquantizable(layers)
    assert "RotatingKVCache (layers 1)" in message and "ArraysCache (layers 3)" in message
    assert "2 of 5 layers" in message
    assert describe_unquantizable(out[:1] + out[2:3]) is None


def test_session_table_batches_quantized_sessions(model):
    from mlx_ds4tp.lockstep.caches.prompt_cache import COPY, FRESH
    from mlx_ds4tp.lockstep.compute import make_cache
    from mlx_ds4tp.lockstep.protocol.table import SessionTable

    bits, seqs = 8, [0, 1, 2]
    rows = Rows({s: reference(model, PROMPTS[s], bits, "quantized", 6) for s in seqs})
    table = SessionTable(model)
    table.caches.make_cache = lambda: quantize_session_cache(make_cache(model), bits, GROUP)
    for s in seqs:
        table.caches.create(s + 1, 0, FRESH)
        table.caches.prefill_batch([s + 1], [np.array(PROMPTS[s][:-1], dtype=np.int32)])
        rows.start(s)
    # The first session decodes alone (its own cache), then the others join and merge in.
    rows.check([0], np.array(table.step([1], np.array(rows.tokens([0]), dtype=np.int32))))
    for _ in range(3):
        logits = table.step([1, 2, 3], np.array(rows.tokens(seqs), dtype=np.int32))
        rows.check(seqs, np.array(logits))
    assert table.batch.merged and type(table.batch.batch_cache[0]) is BatchQuantizedKVCache
    table.destroy(2, 77)  # the middle row leaves, its cache stored
    assert type(table.caches.stored[77][0]) is SessionQuantizedKVCache
    rows.check([0, 2], np.array(table.step([1, 3], np.array(rows.tokens([0, 2]), dtype=np.int32))))
    # A copy of the stored cache, rewound a step, decodes on as sequence 1 would.
    table.caches.create(9, 77, COPY)
    table.caches.rewind(9, table.caches.sessions[9][0].size() - 1)
    rows.pos[1] -= 1
    logits = table.step([1, 3, 9], np.array(rows.tokens([0, 2, 1]), dtype=np.int32))
    rows.check([0, 2, 1], np.array(logits))
    assert copy.deepcopy(table.caches.stored[77])[0].size() == table.caches.stored[77][0].size()
