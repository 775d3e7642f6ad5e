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
READ_CHUNK_BYTES = 2 << 20  # whole rows read per step when the ranges are short
SEEK_MIN_BYTES = 16 << 10  # ranges at least this long are read one by one
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
        if self._readable(key, whole.shape, whole.dtype):
            part = self._read(key, axis, runs=runs)
        else:
            part = self._read_stacked(key, whole, axis, runs)
            if part is None:
                part = self._read_fused(key, whole, axis, runs)
            if part is None:
                return None
        out = mx.array(part)
        out = mx.view(out, whole.dtype) if out.dtype != whole.dtype else out
        # Evaluated now: MLX copies the scratch buffer, which the next tensor overwrites.
        mx.eval(out)
        self._scratch = {k: v for k, v in self._scratch.items() if v.nbytes < DROP_SCRATCH_BYTES}
        return out

    def _read_stacked(self, key: str, whole: mx.array, axis: int, runs: Optional[Runs]) -> Optional[np.ndarray]:
        """This rank's part of a [experts, ...] stack whose experts the files hold one by one."""
        axis = axis % whole.ndim
        if axis == 0:
            return None  # the expert axis itself is never cut
        for stacked, one in self.expert_keys:
            if stacked not in key:
                continue
            keys = [key.replace(stacked, one.format(e=e)) for e in range(whole.shape[0])]
            if not all(self._readable(k, whole.shape[1:], whole.dtype) for k in keys):
                continue
            first = self._read(keys[0], axis - 1, runs=runs)
            out = self._buffer("stack", first.nbytes * len(keys), first.dtype, (len(keys),) + first.shape)
            out[0] = first
            for e, k in enumerate(keys[1:], 1):
                out[e] = self._read(k, axis - 1, runs=runs)
            return out
        return None

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
            part = self._read(key[: -len(loaded)] + saved, axis, shape, saved_runs)
            if bytes_as_words:
                part = part.view(np.uint32)
            rows = [slice(None)] * part.ndim
            rows[axis] = slice(offset, None, step)
            picked = part[tuple(rows)]
            out = self._buffer("fused", picked.nbytes, picked.dtype, picked.shape)
            out[...] = picked
            return out
        return None

    def _read(self, key: str, axis: int, shape: Optional[tuple[int, ...]] = None,
              runs: Optional[Runs] = None) -> np.ndarray:
        """This rank's part of tensor `key` cut along `axis`, in the 'part' scratch buffer:
        its 1/size block, or the given [start, stop) runs of the axis one after the other.
        `shape` reads the tensor's bytes as that shape instead of the saved one."""
        file, dtype, saved_shape, start = self.tensors[key]
        shape = saved_shape if shape is None else shape
        np_dtype = _SAFETENSORS_DTYPES[dtype][0]
        itemsize = np.dtype(np_dtype).itemsize
        axis = axis % len(shape)
        outer = int(np.prod(shape[:axis]))
        mid, inner = shape[axis], int(np.prod(shape[axis + 1 :]))
        if runs is None:
            block = mid // self.size
            runs = ((self.rank * block, (self.rank + 1) * block),)
        kept = sum(b - a for a, b in runs)
        # (first item, items) of each run inside one row of the [outer, mid * inner] view
        spans = [(a * inner, (b - a) * inner) for a, b in runs]
        part = self._buffer("part", outer * kept * inner * itemsize, np_dtype, (outer, kept * inner))
        with open(file, "rb", buffering=0) as f:
            if outer == 1 or min(w for _, w in spans) * itemsize >= SEEK_MIN_BYTES:
                for o in range(outer):
                    col = 0
                    for lo, width in spans:
                        f.seek(start + (o * mid * inner + lo) * itemsize)
                        _read_exactly(f, part[o, col : col + width], key)
                        col += width
            else:
                row = mid * inner
                step = max(1, READ_CHUNK_BYTES // (row * itemsize))
                chunk = self._buffer("chunk", step * row * itemsize, np_dtype, (step, row))
                f.seek(start)
                for r in range(0, outer, step):
                    n = min(step, outer - r)
                    _read_exactly(f, chunk[:n], key)
                    col = 0
                    for lo, width in spans:
                        part[r : r + n, col : col + width] = chunk[:n, lo : lo + width]
                        col += width
        return part.reshape(shape[:axis] + (kept,) + shape[axis + 1 :])


def _read_exactly(f, buf: np.ndarray, key: str) -> None:
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError(f"{f.name} ends inside tensor {key}; the file is truncated, re-save the model")
        got += n


__all__ = ["SafetensorsParts"]
