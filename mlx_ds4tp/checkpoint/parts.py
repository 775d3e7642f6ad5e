"""Reading one rank's part of a tensor straight from a model's .safetensors files.

A tensor of shape [A..., n, B...] cut along the n axis is, for each index of A..., one contiguous
byte range of the file: a vocabulary or output-feature cut (axis 0) is one range, an expert stack
[experts, out, in] cut on its middle axis one range per expert. When those ranges are short (a
cut along the last axis: a few elements per row), whole rows are read a couple of MiB at a time
and their slices kept instead of seeking per row.

Original Hugging Face checkpoints save experts one by one (`experts.N.gate_proj.weight`);
mlx-lm's sanitize() stacks them while loading. For such a stack this reader reads this rank's
part of each expert and stacks the parts, never a whole expert. gpt-oss's original checkpoints
fuse gate and up (`gate_up_proj_blocks`: their rows interleaved, mxfp4 bytes as [..., groups,
16]); this rank's rows of both are one contiguous run of the fused rows, read and de-interleaved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from .header import read_header_file
from .tensor_runs import TensorRuns, read_runs, tensor_runs

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
Runs = Sequence[tuple[int, int]]  # [start, stop) ranges of one axis, read one after the other
# (shape, numpy dtype, byte runs): a part as its files hold it, read by checkpoint/tensor_runs.py
SavedPart = tuple[tuple[int, ...], Any, tuple[TensorRuns, ...]]
# Scratch buffers at least this large are dropped after their tensor: the C library maps them
# on their own and unmaps them when freed (glibc above its 32 MiB mmap threshold, macOS's large
# allocations alike), so they leave no freed pages behind; kept, a vocabulary part's buffer
# would stay resident beside all the parts to the end of the load.
DROP_SCRATCH_BYTES = 32 << 20


class SafetensorsParts:
    """read_part for split_model: this rank's part of a saved tensor, or None when it cannot.

    The bytes land in scratch buffers reused for every tensor (the largest part, one chunk of
    rows, one stack of expert parts) before MLX copies them: fresh numpy arrays per tensor would
    leave their freed pages in the C heap, costing as much resident memory as the whole-tensor
    reads this class exists to avoid.
    """

    def __init__(
        self,
        model_path: Path,
        rank: int,
        size: int,
        expert_keys: Sequence[tuple[str, str]] = (),
        fused_keys: Sequence[tuple[str, str, int, int]] = (),
    ):
        """expert_keys: (stacked key fragment, one expert's fragment with {e}) pairs.
        fused_keys: (key ending as loaded, key ending as saved, row offset, row step): the
        loaded array is rows offset::step of the saved one (step 1: the same rows)."""
        self.rank, self.size = rank, size
        self.expert_keys = tuple(expert_keys)
        self.fused_keys = tuple(fused_keys)
        self.tensors: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
        for file in sorted(Path(model_path).glob("model*.safetensors")):
            header, data_start = read_header_file(file)
            for key, info in header.items():
                if key != "__metadata__":
                    start = data_start + info["data_offsets"][0]
                    self.tensors[key] = (file, info["dtype"], tuple(info["shape"]), start)
        self._scratch: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        buf = self._scratch.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)

    def _readable(self, key: str, shape: tuple[int, ...], dtype: mx.Dtype) -> bool:
        found = self.tensors.get(key)
        # Anything unexpected (a renamed key, a weight mlx-lm transformed while loading, a dtype
        # numpy cannot hold) is left to the in-memory cut of the loaded array, which is always right.
        return (
            found is not None
            and found[1] in _SAFETENSORS_DTYPES
            and found[2] == tuple(shape)
            and _SAFETENSORS_DTYPES[found[1]][1] == dtype
        )

    def __call__(self, key: str, whole: mx.array, axis: int, runs: Optional[Runs] = None) -> Optional[mx.array]:
        """This rank's part of the saved tensor `key` (loaded as `whole`) along `axis`: its
        1/size block, or the [start, stop) runs of that axis given, in their order."""
        saved = self.saved_part(key, whole.shape, whole.dtype, axis, runs)
        if saved is not None:
            shape, np_dtype, parts = saved
            part = read_runs(parts, self._buffer("part", sum(p.nbytes for p in parts), np_dtype, shape))
        else:
            part = self._read_fused(key, whole, axis, runs)
            if part is None:
                return None
        out = mx.array(part)
        out = mx.view(out, whole.dtype) if out.dtype != whole.dtype else out
        # Evaluated now: MLX copies the scratch buffer, which the next tensor overwrites.
        mx.eval(out)
        self._scratch = {k: v for k, v in self._scratch.items() if v.nbytes < DROP_SCRATCH_BYTES}
        return out

    def saved_part(self, key: str, shape: Sequence[int], dtype: mx.Dtype, axis: int,
                   runs: Optional[Runs] = None) -> Optional[SavedPart]:
        """(shape, numpy dtype, byte runs) of this rank's part of `key` (loaded as an array of
        `shape` and `dtype`) along `axis`, where the files hold it as it is loaded or as a stack
        of experts saved one by one; None otherwise (fused rows: read by __call__ itself)."""
        shape = tuple(shape)
        if self._readable(key, shape, dtype):
            return self._part_runs(key, axis, runs)
        axis = axis % len(shape)
        if axis == 0:
            return None  # the expert axis itself is never cut
        for stacked, one in self.expert_keys:
            if stacked not in key:
                continue
            keys = [key.replace(stacked, one.format(e=e)) for e in range(shape[0])]
            if not all(self._readable(k, shape[1:], dtype) for k in keys):
                continue
            # This rank's part of each expert, one after the other: never a whole expert.
            experts = [self._part_runs(k, axis - 1, runs) for k in keys]
            first_shape, np_dtype, _ = experts[0]
            return (len(keys),) + first_shape, np_dtype, tuple(r for _, _, e in experts for r in e)
        return None

    def _part_runs(self, key: str, axis: int, runs: Optional[Runs], shape: Optional[tuple[int, ...]] = None,
                   ) -> SavedPart:
        """This rank's part of tensor `key` cut along `axis`: its 1/size block, or the given
        [start, stop) runs of the axis one after the other. `shape` reads the tensor's bytes as
        that shape instead of the saved one."""
        file, dtype, saved_shape, start = self.tensors[key]
        shape = saved_shape if shape is None else shape
        np_dtype = _SAFETENSORS_DTYPES[dtype][0]
        axis = axis % len(shape)
        if runs is None:
            block = shape[axis] // self.size
            runs = ((self.rank * block, (self.rank + 1) * block),)
        kept = sum(b - a for a, b in runs)
        part_shape = shape[:axis] + (kept,) + shape[axis + 1:]
        return part_shape, np_dtype, (tensor_runs(str(file), start, shape, np.dtype(np_dtype).itemsize, axis, runs),)

    def _read_fused(self, key: str, whole: mx.array, axis: int, runs: Optional[Runs]) -> Optional[np.ndarray]:
        """This rank's part of an array mlx-lm's sanitize() takes as every step-th row of a
        saved one (gpt-oss's fused gate_up), or from mxfp4 blocks saved as [..., groups, 16]."""
        axis = axis % whole.ndim
        for loaded, saved, offset, step in self.fused_keys:
            found = self.tensors.get(key[: -len(loaded)] + saved) if key.endswith(loaded) else None
            if found is None or found[1] not in _SAFETENSORS_DTYPES:
                continue
            shape = found[2]
            bytes_as_words = found[1] == "U8" and whole.dtype == mx.uint32 and len(shape) == whole.ndim + 1
            if not bytes_as_words and _SAFETENSORS_DTYPES[found[1]][1] != whole.dtype:
                continue
            if bytes_as_words:  # mxfp4 blocks: the last two axes are the packed words' bytes
                shape = shape[:-2] + (shape[-2] * shape[-1],)
            want = list(whole.shape)
            want[-1] *= 4 if bytes_as_words else 1
            want[axis] *= step
            if list(shape) != want:
                continue
            # This rank's rows of every fused row set are one contiguous run of the saved rows.
            # Runs count loaded elements; along the last axis of mxfp4 blocks the saved ones are bytes.
            scale = step * (4 if bytes_as_words and axis == whole.ndim - 1 else 1)
            saved_runs = None if runs is None else tuple((a * scale, b * scale) for a, b in runs)
            part_shape, np_dtype, parts = self._part_runs(key[: -len(loaded)] + saved, axis, saved_runs, shape)
            part = read_runs(parts, self._buffer("part", parts[0].nbytes, np_dtype, part_shape))
            if bytes_as_words:
                part = part.view(np.uint32)
            rows = [slice(None)] * part.ndim
            rows[axis] = slice(offset, None, step)
            picked = part[tuple(rows)]
            out = self._buffer("fused", picked.nbytes, picked.dtype, picked.shape)
            out[...] = picked
            return out
        return None

__all__ = ["SafetensorsParts"]
