"""A quantized KV cache that can join the decode batch: `--kv-bits` with continuous batching.

mlx-lm quantizes a session's KV cache with QuantizedKVCache, but that class has no batched
twin (no `merge`), so mlx_lm.server turns batching off under --kv-bits. The decode batch
is built with `caches[0][i].merge(...)`, then `extend`, `filter` and `extract`
(lockstep.protocol.decode_batch), so a quantized layer needs exactly BatchKVCache's API over quantized storage:

- SessionQuantizedKVCache: mlx-lm's QuantizedKVCache (same update, same attention path) plus
  `size()` and `merge()`, the two calls made on a session's own cache.
- BatchQuantizedKVCache: a BatchKVCache whose keys and values are the (data, scales, biases)
  tuples of mx.quantize, every sequence-axis operation applied to each component. Quantization
  is per position (groups run along the head dimension), so copying quantized rows between
  caches is exact: a row decodes the same in the batch as alone.

The `bits` attribute is what sends mlx-lm's scaled_dot_product_attention to its quantized path;
the boolean (B, 1, N, K) causal mask with left padding that make_mask returns is one that path
broadcasts over grouped-query heads.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

Quantized = tuple  # (data uint32, scales, biases), as mx.quantize returns them


class SessionQuantizedKVCache(QuantizedKVCache):
    """One session's quantized KV cache: mlx-lm's QuantizedKVCache that can join a batch."""

    def size(self) -> int:
        # QuantizedKVCache inherits _BaseCache.size (always 0); REWIND and merge need the length.
        return self.offset

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        return BatchQuantizedKVCache.merge(caches)


def _check_same_quantization(caches: Sequence, group_size: int, bits: int) -> None:
    for c in caches:
        if (c.group_size, c.bits) != (group_size, bits):
            raise ValueError(f"cannot batch KV caches quantized differently: bits={c.bits}, "
                             f"group_size={c.group_size} beside bits={bits}, group_size={group_size}")


class BatchQuantizedKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache over quantized keys and values; rows are left-padded. What never
    touches the keys' storage (prepare, trim, make_mask, size, ...) is BatchKVCache's own."""

    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.keys: Optional[Quantized] = None
        self.values: Optional[Quantized] = None
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        batch, n_kv_heads, num_steps, k_head_dim = keys.shape
        v_head_dim = values.shape[-1]
        prev = self._idx
        if self.keys is None or prev + num_steps > self.keys[0].shape[2]:
            el_per_int = 8 * mx.uint32.size // self.bits
            new_steps = (self.step + num_steps - 1) // self.step * self.step
            shape = (batch, n_kv_heads, new_steps)

            def init_quant(dim):
                return (mx.zeros((*shape, dim // el_per_int), dtype=mx.uint32),
                        mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                        mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype))

            def expand_quant(x):
                return mx.concatenate([x, mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)], axis=2)

            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys, self.values = tree_map(expand_quant, (self.keys, self.values))
            else:
                self.keys, self.values = init_quant(k_head_dim), init_quant(v_head_dim)

        self.offset = self.offset + num_steps
        self._idx += num_steps
        q_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        q_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(len(self.keys)):
            self.keys[i][..., prev:self._idx, :] = q_keys[i]
            self.values[i][..., prev:self._idx, :] = q_values[i]
        return self.keys_and_values()

    def keys_and_values(self):
        # BatchKVCache's own slices one array; here each is a (data, scales, biases) tuple.
        return tree_map(lambda x: x[..., :self._idx, :], (self.keys, self.values))

    def finalize(self) -> None:
        # A right-padded prefill leaves each row's padding after its tokens; decoding appends
        # at one shared _idx, so the padding must move to the left, in every component.
        if self._right_padding is not None:
            padding = self._right_padding
            roll = lambda x: dynamic_roll(x, padding[:, None], axis=2)  # noqa: E731
            self.keys, self.values = tree_map(roll, (self.keys, self.values))
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    @property
    def state(self):
        return (self.keys, self.values, self.offset, self.left_padding, self._idx,
                self.group_size, self.bits)

    @state.setter
    def state(self, v):
        (self.keys, self.values, self.offset, self.left_padding, self._idx,
         self.group_size, self.bits) = v
        self._right_padding = None

    def filter(self, batch_indices) -> None:
        """Keep only the rows `batch_indices`, in place; padding every row shares is dropped."""
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        min_left_pad = min(self.left_padding.tolist())
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., min_left_pad:, :],
                                                  (self.keys, self.values))
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        """Append other's rows, in place, both right-justified at the longer _idx."""
        _check_same_quantization([other], self.group_size, self.bits)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return

        max_idx = max(self._idx, other._idx)
        template = self if self.keys is not None else other
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c):
            if c.keys is None:
                rows = c.offset.shape[0]
                k, v = tree_map(lambda t: mx.zeros((rows, t.shape[1], 0, t.shape[3]), dtype=t.dtype),
                                (template.keys, template.values))
            else:
                k, v = c.keys, c.values
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = tree_map(lambda x: x[..., :right, :], (k, v))
                right = 0
            if left != 0 or right != 0:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = tree_map(lambda x: mx.pad(x, widths), (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        join = lambda a, b: mx.concatenate([a, b])  # noqa: E731
        self.keys, self.values = tree_map(join, (k1, v1), (k2, v2))
        self.offset, self.left_padding = join(o1, o2), join(p1, p2)
        self._idx = max_idx

    def extract(self, idx: int) -> SessionQuantizedKVCache:
        """Row `idx` as a session cache of its own, its padding cut off."""
        cache = SessionQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None:
            return cache
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = tree_map(
            lambda x: mx.contiguous(x[idx:idx + 1, :, padding:self._idx]), (self.keys, self.values))
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        """Session caches (one row each) as one batch, left-padded to the longest."""
        group_size, bits = caches[0].group_size, caches[0].bits
        _check_same_quantization(caches, group_size, bits)
        lengths = [c.offset for c in caches]
        max_length = max(lengths)
        if max_length == 0:
            return cls([0] * len(caches), group_size=group_size, bits=bits)

        padding = [max_length - n for n in lengths]
        filled = [c for c in caches if c.keys is not None]
        batch = len(caches)

        def zeros_like_rows(parts):
            return tuple(mx.zeros((batch, t.shape[1], max_length, t.shape[3]), dtype=t.dtype) for t in parts)

        keys, values = zeros_like_rows(filled[0].keys), zeros_like_rows(filled[0].values)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for dst, src in zip(keys + values, c.keys + c.values):
                dst[i:i + 1, :, p:p + c.offset] = src[..., :c.offset, :]

        cache = cls(padding, group_size=group_size, bits=bits)
        cache.keys, cache.values = keys, values
        cache.offset += max_length
        cache._idx = max_length
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in self.keys + self.values)


def quantize_session_cache(cache: list, bits: int, group_size: int) -> list:
    """A session's per-layer caches with every plain KVCache quantized as mlx-lm's
    KVCache.to_quantized does, into SessionQuantizedKVCache so the session can still be batched.

    Other layer types (RotatingKVCache, ArraysCache, CacheList, ...) are returned as they are:
    each has its own batched twin in mlx-lm or none, and quantizing them is not mlx-lm's
    behaviour either (describe_unquantizable reports them). A plain QuantizedKVCache is
    rewrapped, unchanged, since without `merge` it would stop the batch from forming.
    """
    out = []
    for c in cache:
        if type(c) is KVCache:
            q = SessionQuantizedKVCache(group_size=group_size, bits=bits)
            q.offset = c.offset
            if c.keys is not None:
                q.keys = mx.quantize(c.keys, group_size=group_size, bits=bits)
                q.values = mx.quantize(c.values, group_size=group_size, bits=bits)
            out.append(q)
        elif type(c) is QuantizedKVCache:
            q = SessionQuantizedKVCache(group_size=c.group_size, bits=c.bits)
            q.keys, q.values, q.offset = c.keys, c.values, c.offset
            out.append(q)
        else:
            out.append(c)
    return out


def describe_unquantizable(cache: Sequence) -> Optional[str]:
    """A sentence for a log or an error naming the layers quantize_session_cache leaves in full
    precision (--kv-bits cannot quantize them), or None."""
    found: Dict[str, List[int]] = {}
    for i, c in enumerate(cache):
        if type(c) is not KVCache and not isinstance(c, QuantizedKVCache):
            found.setdefault(type(c).__name__, []).append(i)
    if not found:
        return None
    parts = ", ".join(f"{name} (layers {', '.join(map(str, idx))})" for name, idx in found.items())
    count = sum(len(v) for v in found.values())
    return (f"--kv-bits quantizes only plain KVCache layers; {count} of {len(cache)} layers "
            f"stay in full precision: {parts}")
