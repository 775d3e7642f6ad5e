"""50/50 tensor-parallel split of mlx-lm models (llama, mistral, qwen2, qwen3; float or quantized).

Every transformer block is cut the Megatron way: q/k/v and gate/up projections are column
parallel (each rank keeps half the output features, so half the heads and half the MLP), o and
down projections are row parallel (each rank keeps the matching half of the input features and
produces a partial sum) followed by the gate, which adds the two partials. The vocabulary is cut
by rows: the embedding looks up the ids it holds and the gate fills in the rest, the vocabulary
projection computes half the logits and the halves are gathered. Per generated token and rank:
2 * layers + 1 gates of one hidden vector each and one gather of half the logits.

The collectives are called in one place, `all_sum` and `all_gather` below, which accept either
our own group (mlx_ds4tp.gate_ops) or an `mx.distributed.Group`, so the same split model runs
over Thunderbolt RDMA, TCP or MLX's ring backend.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import gate_ops

# The model architectures whose blocks look like llama's (self_attn.{q,k,v,o}_proj with n_heads
# and n_kv_heads, mlp.{gate,up,down}_proj). mistral is loaded by mlx-lm's llama module.
SUPPORTED_MODULES = {
    "mlx_lm.models.llama": "llama, mistral",
    "mlx_lm.models.qwen2": "qwen2",
    "mlx_lm.models.qwen3": "qwen3",
}


def _log(msg: str) -> None:
    from .transport import log  # one writer for every ds4-tp line

    log(msg)


# ---------------------------------------------------------------------------------------------
# The collective seam: the only place the split model talks to the other rank
# ---------------------------------------------------------------------------------------------


def all_sum(x: mx.array, group: Any) -> mx.array:
    """x summed over the group's ranks, same shape and dtype, identical on every rank.

    `group` is ours (mlx_ds4tp.init), an mx.distributed.Group, or any object with rank(),
    size(), all_sum(x) and all_gather(x) methods (a collective of the user's own)."""
    if isinstance(group, mx.distributed.Group):
        return mx.distributed.all_sum(x, group=group)
    if isinstance(group, gate_ops.Group):
        return gate_ops.all_sum(x, group=group)
    return _own_collective(group, "all_sum")(x)


def all_gather(x: mx.array, group: Any) -> mx.array:
    """The ranks' x concatenated along axis 0, in rank order."""
    if isinstance(group, mx.distributed.Group):
        return mx.distributed.all_gather(x, group=group)
    if isinstance(group, gate_ops.Group):
        return gate_ops.all_gather(x, group=group)
    return _own_collective(group, "all_gather")(x)


def _own_collective(group: Any, name: str) -> Callable[[mx.array], mx.array]:
    method = getattr(group, name, None)
    if not callable(method):
        raise TypeError(
            f"group={group!r} is neither an mlx_ds4tp Group nor an mx.distributed.Group and has "
            f"no {name}(x) method; pass the group from mlx_ds4tp.init(...) or "
            f"mx.distributed.init(...)"
        )
    return method


def _gather_last_axis(x: mx.array, group: Any) -> mx.array:
    """The ranks' x concatenated along the last axis (the vocabulary), in rank order."""
    # all_gather stacks along axis 0: [size * B, ..., V / size]. Cut it back into the ranks'
    # pieces and lay them side by side, which is the unsplit logits' vocabulary order.
    pieces = mx.split(all_gather(x, group), group.size(), axis=0)
    return mx.concatenate(pieces, axis=-1)


# ---------------------------------------------------------------------------------------------
# Cutting a layer's arrays
# ---------------------------------------------------------------------------------------------

# The arrays a Linear / QuantizedLinear / Embedding / QuantizedEmbedding holds. The quantized
# ones store the weight packed along the input axis, with one scale (and bias) per group of
# `group_size` inputs, so all three cut along the same axis as a float weight. "bias" is the
# layer's additive bias: cut with the outputs, never with the inputs.
_WEIGHT_ARRAYS = ("weight", "scales", "biases")
_CUTTABLE = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)

# read_part(key, whole, axis) -> this rank's part of the array saved under `key`, read from disk,
# or None to cut `whole` in memory instead. `whole` is the layer's (usually still lazy) array.
ReadPart = Callable[[str, mx.array, int], Optional[mx.array]]


def _rank_and_size(group: Any) -> tuple[int, int]:
    try:
        return int(group.rank()), int(group.size())
    except AttributeError:
        raise TypeError(
            f"group={group!r} has no rank()/size(); pass the group from mlx_ds4tp.init(...) "
            f"or mx.distributed.init(...)"
        ) from None


def _input_features(layer: nn.Module) -> int:
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return layer["weight"].shape[-1] * 32 // layer.bits
    return layer["weight"].shape[-1]


def check_cut(layer: nn.Module, axis: int, size: int, where: str) -> None:
    """Raise, naming the values and the fix, if `layer` cannot be cut `size` ways along `axis`.

    axis 0 cuts the output features (rows of the weight), axis -1 the input features.
    """
    if not isinstance(layer, _CUTTABLE):
        raise TypeError(
            f"{where} is a {type(layer).__name__}; split_model cuts only "
            f"{', '.join(c.__name__ for c in _CUTTABLE)}"
        )
    unknown = {k for k, v in layer.items() if isinstance(v, mx.array)} - {*_WEIGHT_ARRAYS, "bias"}
    if unknown:
        raise ValueError(
            f"{where} ({type(layer).__name__}) holds arrays {sorted(unknown)} that split_model "
            f"does not know how to cut; this quantization mode is not supported"
        )
    if axis == 0:
        rows = layer["weight"].shape[0]
        if rows % size:
            raise ValueError(
                f"{where}: {rows} output features cannot be split evenly across {size} ranks; "
                f"use a model whose sizes are multiples of {size}"
            )
        return
    inputs = _input_features(layer)
    if inputs % size:
        raise ValueError(
            f"{where}: {inputs} input features cannot be split evenly across {size} ranks; "
            f"use a model whose sizes are multiples of {size}"
        )
    group_size = getattr(layer, "group_size", None)
    if group_size is not None and (inputs // size) % group_size:
        raise ValueError(
            f"{where}: {inputs} input features split across {size} ranks give {inputs // size} "
            f"per rank, not a multiple of the quantization group_size={group_size}; quantize "
            f"with a group size that divides {inputs // size} (e.g. mlx_lm.convert "
            f"--q-group-size 32)"
        )


def _keep_rank_part(a: mx.array, axis: int, rank: int, size: int) -> mx.array:
    # contiguous() makes the part its own buffer: a plain slice is a view that would keep the
    # whole tensor alive, which is exactly the memory the split exists to save.
    return mx.contiguous(mx.split(a, size, axis=axis)[rank])


def cut_layer(
    layer: nn.Module,
    axis: int,
    group: Any,
    where: str = "layer",
    read_part: Optional[ReadPart] = None,
) -> nn.Module:
    """Keep this rank's part of `layer`'s arrays along `axis` (0: outputs, -1: inputs), in place.

    Each part is evaluated as soon as it is cut, and the whole array dropped, so a lazily
    loaded model never holds more than one whole tensor at a time (none with `read_part`).
    """
    rank, size = _rank_and_size(group)
    check_cut(layer, axis, size, where)
    for name in _WEIGHT_ARRAYS + (("bias",) if axis == 0 else ()):
        if layer.get(name) is None:
            continue
        part = read_part(f"{where}.{name}", layer[name], axis) if read_part else None
        if part is None:
            part = _keep_rank_part(layer[name], axis, rank, size)
        layer[name] = part
        mx.eval(part)
    return layer


# ---------------------------------------------------------------------------------------------
# The sharded layers
# ---------------------------------------------------------------------------------------------


class AllSumGate(nn.Module):
    """The gate: every rank passes its partial sum in, every rank gets the same total back.

    Drop it into model code wherever ranks hold partial sums of one tensor, e.g. after a row
    parallel matmul: `y = AllSumGate(group)(x @ w_part.T)`.
    """

    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return all_sum(x, self.group)


class ColumnParallelLinear(nn.Module):
    """A Linear (or QuantizedLinear) holding this rank's part of the output features.

    No communication: the output is this rank's slice of the features (its heads, its MLP
    channels), consumed by a RowParallelLinear. Build it from a whole layer with from_linear.
    """

    cut_axis = 0

    def __init__(self, linear: nn.Module, group: Any):
        super().__init__()
        self.linear = linear

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear(x)

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Any, where: str = "linear"):
        """Cut a whole layer in place and wrap it."""
        return cls(cut_layer(linear, cls.cut_axis, group, where), group)


class RowParallelLinear(nn.Module):
    """A Linear (or QuantizedLinear) holding this rank's part of the input features, then the gate.

    Each rank multiplies its slice of the features by its slice of the weight, giving a partial
    sum of the whole output; the gate adds the partials. The bias is added once, after the gate:
    added to each partial it would be counted once per rank.
    """

    cut_axis = -1

    def __init__(self, linear: nn.Module, group: Any):
        super().__init__()
        if linear.get("bias") is not None:
            self.bias = linear["bias"]
            del linear["bias"]
        self.linear = linear
        self.gate = AllSumGate(group)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.gate(self.linear(x))
        return y + self["bias"] if "bias" in self else y

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Any, where: str = "linear"):
        """Cut a whole layer in place and wrap it."""
        return cls(cut_layer(linear, cls.cut_axis, group, where), group)


class VocabParallelEmbedding(nn.Module):
    """An Embedding (or QuantizedEmbedding) holding this rank's part of the vocabulary rows.

    Looking up an id gives its row on the rank that holds it and zeros on the others; the gate
    adds them, so every rank ends with the exact row (x + 0 is exact in floating point). As the
    tied vocabulary projection (`as_linear`) it computes this rank's logits and gathers them.
    """

    cut_axis = 0

    def __init__(self, embedding: nn.Module, group: Any):
        super().__init__()
        rank, _ = _rank_and_size(group)
        self.embedding = embedding
        self.rows = embedding["weight"].shape[0]
        self.first_id = rank * self.rows
        self.group = group
        self.gate = AllSumGate(group)

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.first_id
        mine = (local >= 0) & (local < self.rows)
        rows = self.embedding(mx.where(mine, local, 0))
        return self.gate(mx.where(mine[..., None], rows, 0))

    def as_linear(self, x: mx.array) -> mx.array:
        return _gather_last_axis(self.embedding.as_linear(x), self.group)

    @classmethod
    def from_embedding(cls, embedding: nn.Module, group: Any, where: str = "embedding"):
        """Cut a whole embedding in place and wrap it."""
        return cls(cut_layer(embedding, cls.cut_axis, group, where), group)


class VocabParallelHead(nn.Module):
    """The vocabulary projection holding this rank's part of the vocabulary; logits gathered."""

    cut_axis = 0

    def __init__(self, linear: nn.Module, group: Any):
        super().__init__()
        self.linear = linear
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return _gather_last_axis(self.linear(x), self.group)

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Any, where: str = "lm_head"):
        """Cut a whole layer in place and wrap it."""
        return cls(cut_layer(linear, cls.cut_axis, group, where), group)


_SHARDED = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)


# ---------------------------------------------------------------------------------------------
# Splitting a model
# ---------------------------------------------------------------------------------------------

# Which layer of each transformer block is cut which way (as mlx-lm's Model.shard()).
_BLOCK_CUTS = (
    ("self_attn.q_proj", ColumnParallelLinear),
    ("self_attn.k_proj", ColumnParallelLinear),
    ("self_attn.v_proj", ColumnParallelLinear),
    ("self_attn.o_proj", RowParallelLinear),
    ("mlp.gate_proj", ColumnParallelLinear),
    ("mlp.up_proj", ColumnParallelLinear),
    ("mlp.down_proj", RowParallelLinear),
)
# And of the model around the blocks. lm_head is absent when the embedding is tied: then the
# cut embedding's as_linear is the vocabulary projection.
_MODEL_CUTS = (
    ("model.embed_tokens", VocabParallelEmbedding),
    ("lm_head", VocabParallelHead),
)


def _plan(model: nn.Module, size: int) -> list[tuple[nn.Module, str, type, str]]:
    """Every cut split_model will make as (parent, attribute, class, dotted path), all checked."""
    module = type(model).__module__
    if module not in SUPPORTED_MODULES:
        raise ValueError(
            f"model_type={getattr(model, 'model_type', '?')!r} ({module}) is not supported by "
            f"split_model; supported families: {', '.join(SUPPORTED_MODULES.values())}"
        )
    already = [type(m).__name__ for m in model.modules() if isinstance(m, _SHARDED)]
    if already:
        raise ValueError(f"the model is already split (it holds {already[0]} layers); split a model once")
    cuts = []
    for i, block in enumerate(model.model.layers):
        attn = block.self_attn
        for label, value, kind in (
            ("n_heads", attn.n_heads, "attention heads"),
            ("n_kv_heads", attn.n_kv_heads, "KV heads"),
        ):
            if value % size:
                count = "an even number of" if size == 2 else f"a multiple of {size}"
                raise ValueError(
                    f"{label}={value} cannot be split across {size} ranks; "
                    f"use a model with {count} {kind}"
                )
        for dotted, cls in _BLOCK_CUTS:
            cuts.append((block, dotted, cls, f"model.layers.{i}.{dotted}"))
    for dotted, cls in _MODEL_CUTS:
        cuts.append((model, dotted, cls, dotted))

    plan = []
    for root, dotted, cls, where in cuts:
        *path, name = dotted.split(".")
        parent = root
        for part in path:
            parent = getattr(parent, part)
        layer = getattr(parent, name, None)
        if layer is None:  # lm_head of a tied model
            continue
        check_cut(layer, cls.cut_axis, size, where)
        plan.append((parent, name, cls, where))
    return plan


def split_model(
    model: nn.Module,
    group: Any,
    *,
    read_part: Optional[ReadPart] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> nn.Module:
    """Split a loaded mlx-lm model in place across the group's ranks; returns the model.

    `group` is ours (mlx_ds4tp.init) or an mx.distributed.Group; every rank calls this with the
    same model. All cuts are checked before any is made, so an error leaves the model whole.
    Each part is evaluated as it is cut and the whole array dropped, so a lazily loaded model
    never holds more than its part plus one whole tensor. `read_part` (load_split passes one)
    reads the parts straight from the model's files instead. `progress(done, total, where)` is
    called after each cut (the CLI draws its loading bar with it).
    """
    _, size = _rank_and_size(group)
    plan = _plan(model, size)
    for done, (parent, name, cls, where) in enumerate(plan, 1):
        layer = cut_layer(getattr(parent, name), cls.cut_axis, group, where, read_part)
        setattr(parent, name, cls(layer, group))
        if progress is not None:
            progress(done, len(plan), where)
    for block in model.model.layers:
        block.self_attn.n_heads //= size
        block.self_attn.n_kv_heads //= size
    return model


# ---------------------------------------------------------------------------------------------
# Loading only this rank's part
# ---------------------------------------------------------------------------------------------

# safetensors dtype -> (how the bytes are read, the MLX dtype they are viewed as). bfloat16 has
# no numpy type: its bytes travel as uint16 and are viewed as bfloat16 once inside MLX.
_SAFETENSORS_DTYPES = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, mx.uint32),
    "I32": (np.int32, mx.int32),
    "U16": (np.uint16, mx.uint16),
    "I16": (np.int16, mx.int16),
    "U8": (np.uint8, mx.uint8),
    "I8": (np.int8, mx.int8),
    "U64": (np.uint64, mx.uint64),
    "I64": (np.int64, mx.int64),
}
_READ_CHUNK_BYTES = 2 << 20  # whole rows read per step when cutting columns


class SafetensorsParts:
    """Reads one rank's part of a tensor straight from a model's .safetensors files.

    A cut along axis 0 is one contiguous byte range of the file. A cut along the last axis
    takes every row's slice: whole rows are read a couple of MiB at a time and their slices
    kept. The bytes land in two scratch buffers reused for every tensor (the largest part, one
    chunk of rows) before MLX copies them: fresh numpy arrays per tensor would leave their
    freed pages in the C heap, costing as much resident memory as the whole-tensor reads this
    class exists to avoid.
    """

    def __init__(self, model_path: Path, rank: int, size: int):
        self.rank, self.size = rank, size
        self.tensors: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
        for file in sorted(model_path.glob("model*.safetensors")):
            with open(file, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for key, info in header.items():
                if key != "__metadata__":
                    start = 8 + header_len + info["data_offsets"][0]
                    self.tensors[key] = (file, info["dtype"], tuple(info["shape"]), start)
        self._scratch: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        buf = self._scratch.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)

    def __call__(self, key: str, whole: mx.array, axis: int) -> Optional[mx.array]:
        found = self.tensors.get(key)
        # Anything unexpected (a renamed key, a weight mlx-lm transformed while loading, a dtype
        # numpy cannot hold) falls back to cutting the loaded array, which is always right.
        if found is None or found[1] not in _SAFETENSORS_DTYPES or found[2] != tuple(whole.shape):
            return None
        file, dtype, shape, start = found
        np_dtype, mx_dtype = _SAFETENSORS_DTYPES[dtype]
        if mx_dtype != whole.dtype:
            return None
        itemsize = np.dtype(np_dtype).itemsize
        if axis == 0:
            rows, row_items = shape[0] // self.size, int(np.prod(shape[1:]))
            part = self._buffer("part", rows * row_items * itemsize, np_dtype, (rows, row_items))
            with open(file, "rb", buffering=0) as f:
                f.seek(start + self.rank * rows * row_items * itemsize)
                _read_exactly(f, part, key)
            part_shape = (rows,) + shape[1:]
        else:
            rows, row_items = int(np.prod(shape[:-1])), shape[-1]
            width = row_items // self.size
            lo = self.rank * width
            part = self._buffer("part", rows * width * itemsize, np_dtype, (rows, width))
            step = max(1, _READ_CHUNK_BYTES // (row_items * itemsize))
            chunk = self._buffer("chunk", step * row_items * itemsize, np_dtype, (step, row_items))
            with open(file, "rb", buffering=0) as f:
                f.seek(start)
                for r in range(0, rows, step):
                    n = min(step, rows - r)
                    _read_exactly(f, chunk[:n], key)
                    part[r : r + n] = chunk[:n, lo : lo + width]
            part_shape = shape[:-1] + (width,)
        out = mx.array(part).reshape(part_shape)
        out = mx.view(out, mx_dtype) if out.dtype != mx_dtype else out
        # Evaluated now: MLX copies the scratch buffer, which the next tensor overwrites.
        mx.eval(out)
        return out


def _read_exactly(f, buf: np.ndarray, key: str) -> None:
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError(f"{f.name} ends inside tensor {key}; the file is truncated, re-save the model")
        got += n


def load_split(
    path: Union[str, Path],
    group: Any,
    *,
    lazy: bool = True,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> tuple[nn.Module, Any]:
    """Load an mlx-lm model directory holding only this rank's part of the split weights.

    Returns (model, tokenizer) like mlx_lm.load. With lazy=True (the default) the model is built
    by mlx-lm's own loader without reading the weights, then each cut weight's part is read
    straight from the .safetensors files: a rank reads and holds about half the model. With
    lazy=False mlx-lm reads the whole model first and it is cut in memory (same result, the
    whole model's peak memory).
    """
    from mlx_lm.utils import load_model, load_tokenizer

    model_path = Path(path)
    # Checked here because mlx-lm takes a path that does not exist for a Hugging Face repo id
    # and would try to download it.
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_path} is not an mlx-lm model directory (no config.json in it); give the "
            f"directory mlx_lm.convert or mlx_ds4tp.tiny_model wrote"
        )
    rank, size = _rank_and_size(group)
    model, config = load_model(model_path, lazy=lazy)
    split_model(model, group, read_part=SafetensorsParts(model_path, rank, size) if lazy else None,
                progress=progress)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))

    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    _log(f"rank {rank}/{size} holds its part of {model_path}: {nbytes / 2**20:.1f} MiB of weights")
    return model, tokenizer


__all__ = [
    "AllSumGate",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SafetensorsParts",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "all_gather",
    "all_sum",
    "check_cut",
    "cut_layer",
    "load_split",
    "split_model",
]
