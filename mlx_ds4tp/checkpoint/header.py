"""The one reader of a safetensors file's header, used by the model
fingerprint (link/fingerprint.py) and the part reader (parts.py).

A safetensors file starts with its JSON header's length (8 bytes,
little-endian), then the header: a JSON object naming each tensor's dtype,
shape and byte range (offsets from the end of the header), plus an optional
"__metadata__" entry. The length is bounded before anything is read, so a
damaged file cannot make a rank read gigabytes of "header".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Tuple, Union

# Real headers are a few MiB at most (a tensor's entry is ~100 bytes; the largest
# checkpoints hold tens of thousands of tensors).
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
LENGTH_BYTES = 8


def read_header(fd: int, path: Union[str, Path]) -> Tuple[dict, int, int]:
    """(header, data start, bytes read) of the safetensors file open as fd; path
    names it in errors. header is the JSON object as written, "__metadata__"
    included; data start is the file offset the tensors' data_offsets count from.
    ValueError naming the file when it is cut, its length is over
    MAX_SAFETENSORS_HEADER_BYTES, or the header is not a JSON object."""
    head = os.pread(fd, LENGTH_BYTES, 0)
    if len(head) != LENGTH_BYTES:
        raise ValueError(f"{path}: shorter than a safetensors header; the file is cut or not safetensors")
    length = int.from_bytes(head, "little")
    if length > MAX_SAFETENSORS_HEADER_BYTES:
        raise ValueError(f"{path}: safetensors header claims {length} bytes, over "
                         f"{MAX_SAFETENSORS_HEADER_BYTES}; the file is damaged or not safetensors")
    text = os.pread(fd, length, LENGTH_BYTES)
    if len(text) != length:
        raise ValueError(f"{path}: safetensors header claims {length} bytes, the file holds "
                         f"{len(text)} after the length; the file is cut short")
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path}: the safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is JSON but not an object; "
                         "the file is damaged or not safetensors")
    return header, LENGTH_BYTES + length, LENGTH_BYTES + len(text)


def read_header_file(path: Union[str, Path]) -> Tuple[dict, int]:
    """(header, data start) of the safetensors file at path (read_header on it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header, start, _ = read_header(fd, path)
    finally:
        os.close(fd)
    return header, start
