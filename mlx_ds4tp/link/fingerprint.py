"""A model directory's fingerprint: what the two ranks compare in the hello so
a worker holding another model (other weights of the same shapes, another
dtype, another quantization, another config) is refused before any weight
is loaded.

It is made from what loading reads anyway, and cheap on a 200 GB model: the
config (config.json, quantization settings included), every tensor's name,
dtype, shape and byte size from the safetensors headers, and a hash of a
small fixed sample of each tensor's bytes (SAMPLE_WINDOWS windows of
SAMPLE_BYTES: its start, two inner points and its end). Files are found the
way mlx-lm finds them (``model*.safetensors``); how the tensors are sharded
over files does not enter, so the same weights saved in other shards match.

The hello carries the 52-byte summary (FINGERPRINT_SUMMARY in wire.py);
only when two summaries differ do the ranks swap the details (config and
tensor table) to name the first difference.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from ..checkpoint.header import read_header  # the one safetensors header reader, with its size bound
from ..errors import FrameError
from .wire import FINGERPRINT_DETAIL_VERSION, FINGERPRINT_SUMMARY, MAX_FINGERPRINT_DETAIL_EXPANDED

SAMPLE_BYTES = 256
SAMPLE_WINDOWS = 4
_DIGEST = 16
_PART_DIGEST = 8


@dataclasses.dataclass(frozen=True)
class TensorPrint:
    """One tensor as the fingerprint sees it; sample is the hex hash of its sampled bytes."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int
    sample: str


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """config: (dotted key, canonical JSON value) pairs, sorted; tensors:
    sorted by name. bytes_read (what computing it read from disk) is not part
    of the identity."""

    config: Tuple[Tuple[str, str], ...]
    tensors: Tuple[TensorPrint, ...]
    bytes_read: int = dataclasses.field(default=0, compare=False)

    # -- digests ----------------------------------------------------------------
    def _part(self, rows) -> bytes:
        # One canonical JSON text for the whole list: a single C-speed dump even for a
        # checkpoint of 100,000s of tensors.
        text = json.dumps(list(rows), separators=(",", ":"))
        return hashlib.blake2b(text.encode("utf-8"), digest_size=_PART_DIGEST).digest()

    # Cached: a checkpoint of 100,000s of tensors takes a moment to hash.
    @functools.cached_property
    def config_digest(self) -> bytes:
        return self._part(list(kv) for kv in self.config)

    @functools.cached_property
    def table_digest(self) -> bytes:
        """Names, dtypes, shapes and sizes."""
        return self._part([t.name, t.dtype, list(t.shape), t.nbytes] for t in self.tensors)

    @functools.cached_property
    def sample_digest(self) -> bytes:
        return self._part([t.name, t.sample] for t in self.tensors)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @functools.cached_property
    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=_DIGEST)
        for part in (self.config_digest, self.table_digest, self.sample_digest):
            h.update(part)
        return h.digest()

    @property
    def label(self) -> str:
        """What messages and `doctor` print: the first 12 hex digits of the digest."""
        return self.digest.hex()[:12]

    # -- wire forms ---------------------------------------------------------------
    def summary(self) -> bytes:
        """The FINGERPRINT_SUMMARY the hello carries."""
        return FINGERPRINT_SUMMARY.pack(self.digest, self.config_digest, self.table_digest,
                                        self.sample_digest, len(self.tensors), self.weight_bytes)

    def details(self) -> bytes:
        """Config and tensor table, compressed: swapped only when summaries differ."""
        doc = {"v": FINGERPRINT_DETAIL_VERSION, "config": [list(kv) for kv in self.config],
               "tensors": [[t.name, t.dtype, list(t.shape), t.nbytes, t.sample] for t in self.tensors]}
        return zlib.compress(json.dumps(doc, separators=(",", ":")).encode("utf-8"), 6)

    @classmethod
    def from_details(cls, payload: bytes) -> "Fingerprint":
        """Parse a peer's details; FrameError if malformed or over the expanded bound."""
        try:
            inflater = zlib.decompressobj()
            raw = inflater.decompress(payload, MAX_FINGERPRINT_DETAIL_EXPANDED)
            if inflater.unconsumed_tail:
                raise FrameError(f"fingerprint details expand past {MAX_FINGERPRINT_DETAIL_EXPANDED} bytes")
            doc = json.loads(raw)
            if doc.get("v") != FINGERPRINT_DETAIL_VERSION:
                raise FrameError(f"fingerprint details version {doc.get('v')!r}, "
                                 f"this side reads {FINGERPRINT_DETAIL_VERSION}")
            config = tuple((str(k), str(v)) for k, v in doc["config"])
            tensors = tuple(TensorPrint(str(n), str(d), tuple(int(x) for x in s), int(b), str(h))
                            for n, d, s, b, h in doc["tensors"])
        except FrameError:
            raise
        except (zlib.error, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise FrameError(f"malformed fingerprint details from the peer: {exc}") from None
        return cls(config=config, tensors=tensors)


def summary_label(summary: bytes) -> str:
    """The label of a hello's fingerprint summary, or "none" for a hello without one."""
    if not summary:
        return "none"
    return FINGERPRINT_SUMMARY.unpack(summary)[0].hex()[:12]


# ============================================================================
# Computing it
# ============================================================================


def _flatten(prefix: str, value, out: Dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key in value:
            _flatten(f"{prefix}.{key}" if prefix else str(key), value[key], out)
    else:
        out[prefix] = json.dumps(value, sort_keys=True, separators=(",", ":"))


def _windows(nbytes: int) -> List[Tuple[int, int]]:
    """(offset, length) of the sampled windows inside a tensor of nbytes."""
    if nbytes <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        return [(0, nbytes)] if nbytes else []
    last = nbytes - SAMPLE_BYTES
    return [(last * i // (SAMPLE_WINDOWS - 1), SAMPLE_BYTES) for i in range(SAMPLE_WINDOWS)]


def model_fingerprint(path: Union[str, Path]) -> Fingerprint:
    """The fingerprint of an mlx-lm model directory (config.json and
    model*.safetensors). ValueError naming the file when one is missing,
    damaged or points outside its file."""
    root = Path(path)
    config_path = root / "config.json"
    try:
        config_text = config_path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {config_path} ({exc.strerror}); give an mlx-lm model directory") from None
    try:
        config = json.loads(config_text)
    except ValueError as exc:
        raise ValueError(f"{config_path} is not JSON ({exc})") from None
    flat: Dict[str, str] = {}
    _flatten("", config, flat)
    files = sorted(root.glob("model*.safetensors"))
    if not files:
        raise ValueError(f"no model*.safetensors in {root}; give an mlx-lm model directory")
    bytes_read = len(config_text)
    tensors: List[TensorPrint] = []
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            header, start, nread = read_header(fd, file)
            bytes_read += nread
            for name in header:
                if name == "__metadata__":
                    continue
                entry = header[name]
                try:
                    begin, end = (int(x) for x in entry["data_offsets"])
                    dtype, shape = str(entry["dtype"]), tuple(int(x) for x in entry["shape"])
                except (KeyError, TypeError, ValueError):
                    raise ValueError(f"{file}: tensor {name!r} has a malformed header entry") from None
                if not 0 <= begin <= end or start + end > size:
                    raise ValueError(f"{file}: tensor {name!r} spans bytes {begin}..{end} past the "
                                     f"file's end; the file is cut short")
                h = hashlib.blake2b(digest_size=_PART_DIGEST)
                for offset, length in _windows(end - begin):
                    chunk = os.pread(fd, length, start + begin + offset)
                    bytes_read += len(chunk)
                    h.update(chunk)
                tensors.append(TensorPrint(name, dtype, shape, end - begin, h.hexdigest()))
        finally:
            os.close(fd)
    tensors.sort(key=lambda t: t.name)
    for a, b in zip(tensors, tensors[1:]):
        if a.name == b.name:
            raise ValueError(f"tensor {a.name!r} is in two safetensors files of {root}")
    return Fingerprint(config=tuple(sorted(flat.items())), tensors=tuple(tensors), bytes_read=bytes_read)


# ============================================================================
# Comparing two
# ============================================================================


def first_difference(mine: Fingerprint, theirs: Fingerprint, peer: str) -> Optional[str]:
    """The first difference in a fixed order both ranks share (config keys,
    tensor names, then each tensor's dtype, shape, size and sample), or None."""
    here_cfg, there_cfg = dict(mine.config), dict(theirs.config)
    for key in sorted(set(here_cfg) | set(there_cfg)):
        a, b = here_cfg.get(key), there_cfg.get(key)
        if a != b:
            return (f"config key {key} is {a if a is not None else 'absent'} here and "
                    f"{b if b is not None else 'absent'} on the {peer}")
    here_t = {t.name: t for t in mine.tensors}
    there_t = {t.name: t for t in theirs.tensors}
    for name in sorted(set(here_t) | set(there_t)):
        if name not in there_t:
            return f"tensor {name} exists here but not on the {peer}"
        if name not in here_t:
            return f"tensor {name} exists on the {peer} but not here"
    for name in sorted(here_t):
        a, b = here_t[name], there_t[name]
        if a.dtype != b.dtype:
            return f"tensor {name} is {a.dtype} here and {b.dtype} on the {peer}"
        if a.shape != b.shape:
            return f"tensor {name} has shape {a.shape} here and {b.shape} on the {peer}"
        if a.nbytes != b.nbytes:
            return f"tensor {name} is {a.nbytes} bytes here and {b.nbytes} on the {peer}"
    for name in sorted(here_t):
        if here_t[name].sample != there_t[name].sample:
            return f"same shapes, different weights (first differing tensor: {name})"
    return None


__all__ = ["Fingerprint", "TensorPrint", "model_fingerprint", "first_difference", "summary_label",
           "SAMPLE_BYTES", "SAMPLE_WINDOWS"]

