"""A rank's part of a model as files: what the leader sends a worker started without --model, and
how that worker builds its split model from them.

The part is exactly the arrays load_split leaves on that rank (split_model's cut on a lazily
built model, for the worker's rank and the agreed share), saved under their dotted paths in
safetensors files of about PART_FILE_BYTES (`part-NNNNN.safetensors`, names mlx-lm's loader
does not glob), beside the model's config and tokenizer files and `part_config.json` (which
modules are quantized, and how: the worker's mlx-lm cannot infer it without the whole weights).

Both sides need the part's shapes before any weight is read: the model is built lazily, its
arrays replaced by placeholders (a broadcast zero: no memory, nothing read) and cut. The leader
lists the arrays from that; the worker loads its received files into that model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from ..base.log import log
from ..checkpoint.parts import SafetensorsParts
from ..checkpoint.parts_cache import new_digest
from ..checkpoint.tensor_runs import TensorRuns
from .apply import cut_arrays, cut_lazily, traced_layout
from .plans import saved_layout
from .share import SplitShare
from .units import Layout

PART_FILE_BYTES = 1 << 30
PART_CONFIG = "part_config.json"
PART_PREFIX = "part-"
# Files of the model's directory a worker does not need: the weights (its part replaces them)
# and their index, which names files it does not hold.
_NOT_SENT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".gguf")
MAX_PLAIN_FILE_BYTES = 256 << 20

_DTYPE_NAMES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32",
                mx.int32: "I32", mx.uint16: "U16", mx.int16: "I16", mx.uint8: "U8", mx.int8: "I8",
                mx.uint64: "U64", mx.int64: "I64", mx.bool_: "BOOL", mx.float64: "F64"}


@dataclasses.dataclass(frozen=True)
class PartTensor:
    key: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class PartFile:
    """One safetensors file of a part: its name, header bytes (length and JSON) and tensors in
    the order their bytes follow the header."""

    name: str
    header: bytes
    tensors: Tuple[PartTensor, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def _safetensors_header(tensors: List[PartTensor]) -> bytes:
    entries, offset = {}, 0
    for t in tensors:
        entries[t.key] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)  # the data starts 8-aligned, as safetensors writers pad it
    return len(text).to_bytes(8, "little") + text


def file_plan(arrays: List[Tuple[str, mx.array]]) -> List[PartFile]:
    """The part's arrays, in order, in files of about PART_FILE_BYTES (a larger array alone)."""
    files: List[PartFile] = []
    batch: List[PartTensor] = []
    held = 0
    for key, value in arrays:
        if value.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{key} is {value.dtype}, which a safetensors part cannot hold")
        tensor = PartTensor(key, _DTYPE_NAMES[value.dtype], tuple(value.shape), value.nbytes)
        if batch and held + tensor.nbytes > PART_FILE_BYTES:
            files.append(_part_file(len(files) + 1, batch))
            batch, held = [], 0
        batch.append(tensor)
        held += tensor.nbytes
    if batch:
        files.append(_part_file(len(files) + 1, batch))
    return files


def _part_file(number: int, tensors: List[PartTensor]) -> PartFile:
    return part_file(f"{PART_PREFIX}{number:05d}.safetensors", tensors)


def part_file(name: str, tensors: List[PartTensor]) -> PartFile:
    """The part file `name` holding `tensors` in this order (its header made from them)."""
    return PartFile(name, _safetensors_header(tensors), tuple(tensors))


def quantized_modules(model: nn.Module) -> dict:
    """{module path: its quantization} of every quantized module of a model built by mlx-lm's
    loader: what its quantize step infers from the whole weights, which a worker does not have."""
    found = {}
    for path, module in model.named_modules():
        if hasattr(module, "bits") and hasattr(module, "group_size") and "scales" in module:
            found[path] = {"group_size": int(module.group_size), "bits": int(module.bits),
                           "mode": str(getattr(module, "mode", "affine"))}
    return found


def _placeholders(model: nn.Module) -> None:
    """Every array of the model replaced by a broadcast zero of its shape: nothing behind it is
    read or computed (mlx-lm's lazily built arrays, a random init, are dropped unevaluated)."""
    model.update(tree_map(lambda a: mx.broadcast_to(mx.zeros((), a.dtype), a.shape), model.parameters()))


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """A rank's part of a model as files: the part files, the part's config (quantization), and
    where the model's files hold each array the part keeps as it is saved (by the array's dotted
    path: the key the cut read it by, and its byte runs): those are sent from the files as they
    are; the rest (the arrays left whole, any cut the files cannot give) go through MLX."""

    files: Tuple[PartFile, ...]
    part_config: bytes
    sources: Dict[str, Tuple[str, Tuple[TensorRuns, ...]]] = dataclasses.field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        return sum(f.size for f in self.files)


class RecordedReads:
    """read_part for a cut of placeholders (split_model's cut_arrays): each read this rank's
    files can give as it is saved (checkpoint/parts.py's saved_part) answered with a placeholder
    of the part's shape and dtype, its byte runs kept by that placeholder's identity, so an
    array the cut yields unchanged is known to be exactly those bytes; None for the rest (the
    cut then takes them from the loaded arrays)."""

    def __init__(self, reader: SafetensorsParts):
        self.reader = reader
        self.made: Dict[int, Tuple[mx.array, str, Tuple[TensorRuns, ...]]] = {}

    def __call__(self, key: str, whole: mx.array, axis: int, runs=None):  # noqa: ANN001 - ReadPart's
        saved = self.reader.saved_part(key, whole.shape, whole.dtype, axis, runs)
        if saved is None:
            return None
        shape, _, parts = saved
        placeholder = mx.broadcast_to(mx.zeros((), whole.dtype), shape)
        self.made[id(placeholder)] = (placeholder, key, parts)
        return placeholder

    def runs_of(self, value: mx.array) -> Optional[Tuple[str, Tuple[TensorRuns, ...]]]:
        """(key read, byte runs) when `value` is one of this reader's placeholders, unchanged."""
        made = self.made.get(id(value))
        return (made[1], made[2]) if made is not None and made[0] is value else None


def plan_part(model_path: Path, group: Any, share: SplitShare) -> Tuple[PartPlan, Layout]:
    """The leader's plan of the part of the model at model_path that `group`'s rank keeps (a
    cut-only group: its rank of its size, `share`), and the traced layout of that cut (kept for
    a cut through MLX later: the same group object goes with it). Its arrays' names, dtypes,
    shapes and byte runs are read off the model built lazily and cut, split_model's cut_arrays,
    on placeholders: no weight is read."""
    from mlx_lm.utils import load_model

    model, config = load_model(Path(model_path), lazy=True)
    quantized = quantized_modules(model)
    _placeholders(model)
    rank, size = int(group.rank()), int(group.size())
    reads = RecordedReads(SafetensorsParts(Path(model_path), rank, size, **saved_layout(type(model).__module__)))
    layout = traced_layout(model, group, split=share)
    arrays, sources = [], {}
    for path, value in cut_arrays(model, group, split=share, read_part=reads, layout=layout):
        arrays.append((path, value))
        found = reads.runs_of(value)
        if found is not None:
            sources[path] = found
    quant = dict(config.get("quantization") or {})
    part_config = {"quantization": {**quant, **quantized}} if quantized else {}
    plan = PartPlan(tuple(file_plan(arrays)), json.dumps(part_config, sort_keys=True).encode("utf-8"), sources)
    return plan, layout


def plain_files(model_path: Path) -> List[Path]:
    """The model directory's files a worker receives whole: config, tokenizer, chat template,
    generation config (everything at its top but the weights)."""
    out = []
    for path in sorted(Path(model_path).iterdir()):
        if not path.is_file() or path.name.endswith(_NOT_SENT_SUFFIXES) or path.name == PART_CONFIG:
            continue
        if path.stat().st_size > MAX_PLAIN_FILE_BYTES:
            log(f"not sending {path.name} ({path.stat().st_size / 2**20:.0f} MiB): over "
                f"{MAX_PLAIN_FILE_BYTES >> 20} MiB, not a config or tokenizer file")
            continue
        out.append(path)
    return out


def bytes_digest(data: bytes) -> str:
    digest = new_digest()
    digest.update(data)
    return digest.hexdigest()


def load_part(parts_dir: Path, group: Any, share: SplitShare) -> Tuple[nn.Module, Any]:
    """(model, tokenizer) of this rank from its received part: the model built as the leader's
    lazily, cut as load_split cuts it, then every array taken from the part files (strict: an
    array missing or of another shape is an error naming it)."""
    from mlx_lm.utils import load_model, load_tokenizer

    parts_dir = Path(parts_dir)
    override = json.loads((parts_dir / PART_CONFIG).read_text())
    model, config = load_model(parts_dir, lazy=True, strict=False, model_config=override or None)
    _placeholders(model)
    cut_lazily(model, group, split=share)
    weights: dict = {}
    for file in sorted(parts_dir.glob(f"{PART_PREFIX}*.safetensors")):
        weights.update(mx.load(str(file)))
    model.load_weights(list(weights.items()), strict=True)
    del weights
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(parts_dir, eos_token_ids=config.get("eos_token_id"))
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    log(f"rank {group.rank()}/{group.size()} holds its part from {parts_dir}: {nbytes / 2**20:.1f} MiB of weights")
    return model, tokenizer


__all__ = ["PART_CONFIG", "PartFile", "PartPlan", "PartTensor", "RecordedReads", "bytes_digest", "file_plan",
           "load_part", "part_file", "plain_files", "plan_part", "quantized_modules"]
