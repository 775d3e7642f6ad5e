"""What makes a prompt-cache file on disk this rank's to use (lockstep.caches.disk_cache): its
name, from this rank's key and the tokens' digest; its metadata, which repeats both with the
tokens themselves and a CRC of its data; and the checks a file passes before it is used, so
a file cut short, damaged, renamed or made for another model, share or rank is never used.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Dict, Sequence

import numpy as np

from ...checkpoint.header import read_header_file
from ..errors import ForeignFileError
from .cache_file import as_session_classes, data_crc

SUFFIX = ".safetensors"
# 2: the CRC covers the file's whole data section (1: the state's arrays only, read through
# MLX); a file of format 1 is skipped and removed, its prefix recomputed once.
_FORMAT = "ds4tp-prompt-cache-2"


def tokens_digest(tokens: Sequence[int]) -> bytes:
    """The 16-byte digest of a token sequence, the same on both ranks (DISK_LOAD carries it)."""
    return hashlib.blake2b(np.asarray(tokens, dtype="<i4").tobytes(), digest_size=16).digest()


def rank_key(fingerprint: str, share: str, rank: int) -> str:
    """What a file of this rank must have been made by: its model, split share and rank."""
    return f"{fingerprint}/{share}/{rank}"


def file_name(key: str, digest: bytes) -> str:
    """The file name of the rank of `key` for the tokens of `digest` (tokens_digest)."""
    return hashlib.blake2b(key.encode() + digest, digest_size=16).hexdigest() + SUFFIX


def file_metadata(key: str, tokens: Sequence[int]) -> Dict[str, str]:
    """Our metadata of a file (cache_file.snapshot adds its CRC): the format, the rank's key
    and the tokens the cache covers."""
    return {"format": _FORMAT, "key": key, "count": str(len(tokens)),
            "tokens": base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode()}


def checked_tokens(meta: dict, key: str, path: Path) -> np.ndarray:
    """The tokens of a file whose metadata is `meta`, once its format, key, token list and
    name check out; ForeignFileError for another model's, share's or rank's file, ValueError
    for a damaged one."""
    if meta.get("format") != _FORMAT:
        raise ValueError("it is not a ds4tp prompt-cache file")
    if meta.get("key") != key:
        raise ForeignFileError(f"it was made for another model, share or rank ({meta.get('key')}, "
                               f"this rank is {key})")
    tokens = np.frombuffer(base64.b64decode(meta.get("tokens", "")), dtype="<i4")
    if str(len(tokens)) != meta.get("count"):
        raise ValueError("its token list is damaged")
    if file_name(key, tokens_digest(tokens)) != path.name:
        raise ValueError("its name is not its tokens' (renamed or copied from another prefix)")
    return tokens.astype(np.int32)


def scanned_tokens(path: Path, key: str) -> np.ndarray:
    """The tokens of a file found in the directory, once its header and size check out (its
    arrays are checked when it is loaded: load_checked)."""
    header, start = read_header_file(path)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("its metadata is damaged")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if start + max(ends, default=0) != path.stat().st_size:
        raise ValueError("it is cut short or has bytes past its arrays")
    return checked_tokens(_our_metadata(meta), key, path)


def load_checked(path: Path, key: str, digest: bytes, count: int) -> list:
    """The cache of the `count` tokens of `digest` in `path`, checked against the rank's key,
    the tokens and the CRC of its data; an exception naming what is wrong otherwise."""
    from mlx_lm.models.cache import load_prompt_cache

    header, start = read_header_file(path)
    meta = _our_metadata(header.get("__metadata__") or {})
    if f"{data_crc(path, start):010d}" != meta.get("crc"):
        raise ValueError("its arrays fail their CRC: the file is damaged")
    cache, meta = load_prompt_cache(str(path), return_metadata=True)
    tokens = checked_tokens(meta, key, path)
    if len(tokens) != count or tokens_digest(tokens) != digest:
        raise ValueError(f"it holds another prefix ({len(tokens)} tokens, not {count})")
    return as_session_classes(cache)


def _our_metadata(header_metadata: dict) -> dict:
    """The metadata save_prompt_cache was given, out of the safetensors header's: it stores
    [ours, the layers' classes, scalars] flattened (mlx.utils.tree_flatten), ours as "0.<key>"."""
    from mlx.utils import tree_unflatten

    ours = tree_unflatten(list(header_metadata.items()))
    if not isinstance(ours, list) or not ours or not isinstance(ours[0], dict):
        raise ValueError("its metadata is not a prompt cache's")
    return ours[0]


def remove_file(path: Path) -> None:
    """Remove a file (gone already: nothing to do)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def touch(path: Path) -> None:
    """The file's time is its last use, so a restart keeps the LRU order."""
    try:
        os.utime(path)  # no times: now
    except OSError:
        pass
