"""The byte runs of a tensor's part (checkpoint/tensor_runs.py): laid into buffers of any size
(rows split across buffers, long spans split mid-span, short spans gathered from whole rows),
the bytes are exactly numpy's slice of the saved tensor, in order; a file that ends inside a
tensor is an error naming the file."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_ds4tp.checkpoint import tensor_runs
from mlx_ds4tp.checkpoint.tensor_runs import RunsReader, read_runs


def saved(tmp_path, shape, dtype=np.float16, seed=0, lead=24):
    """A file holding `lead` bytes, then a random tensor: (path, tensor, its first byte)."""
    rng = np.random.default_rng(seed)
    tensor = rng.integers(0, 2**15, size=shape).astype(dtype)
    path = tmp_path / f"t{seed}.bin"
    path.write_bytes(b"x" * lead + tensor.tobytes())
    return path, tensor, lead


def expected(tensor, axis, runs):
    return np.concatenate([np.take(tensor, np.arange(a, b), axis=axis) for a, b in runs], axis=axis)


CASES = [
    ((20, 12), 0, ((5, 15),)),  # a vocabulary cut: one row, one span
    ((20, 12), 1, ((0, 6),)),  # the last axis: a short span of every row
    ((20, 12), 1, ((6, 9), (0, 2), (10, 12))),  # a finer share's runs, out of order
    ((4, 6, 8), 1, ((1, 3), (4, 6))),  # an expert stack cut on its middle axis
    ((3, 64, 256), 1, ((0, 32),)),  # spans of 16 KiB: read one by one
    ((9,), 0, ((2, 7),)),
]


@pytest.mark.parametrize("shape,axis,runs", CASES)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 1 << 20])
def test_runs_into_buffers_of_any_size_are_the_slice(tmp_path, monkeypatch, shape, axis, runs, chunk):
    monkeypatch.setattr(tensor_runs, "READ_CHUNK_BYTES", 100)  # several row blocks, a ragged last one
    path, tensor, start = saved(tmp_path, shape)
    part = tensor_runs.tensor_runs(str(path), start, shape, tensor.itemsize, axis, runs)
    want = expected(tensor, axis, runs).tobytes()
    assert part.nbytes == len(want)
    got = bytearray()
    with RunsReader(chunk, lambda: bytearray(chunk)) as reader:
        pieces = list(reader.add_bytes(memoryview(b"head"))) + list(reader.add(part)) + list(reader.flush())
    for piece in pieces[:-1]:
        assert len(piece) == chunk  # every buffer full but the last
    for piece in pieces:
        got += piece
    assert bytes(got) == b"head" + want


def test_parts_end_to_end_read_into_one_array(tmp_path):
    path, tensor, start = saved(tmp_path, (8, 10), np.int32, seed=3)
    parts = [tensor_runs.tensor_runs(str(path), start, (8, 10), 4, 1, ((0, 5),)),
             tensor_runs.tensor_runs(str(path), start, (8, 10), 4, 0, ((2, 4),))]
    out = read_runs(parts, np.empty(8 * 5 + 2 * 10, np.int32))
    want = np.concatenate([tensor[:, :5].ravel(), tensor[2:4].ravel()])
    assert np.array_equal(out, want)
    with pytest.raises(ValueError, match="room"):
        read_runs(parts, np.empty(7, np.int32))


def test_a_file_that_ends_inside_a_tensor_is_named(tmp_path):
    path, tensor, start = saved(tmp_path, (20, 12))
    part = tensor_runs.tensor_runs(str(path), start, (20, 12), 2, 0, ((10, 20),))
    with open(path, "r+b") as f:
        f.truncate(start + tensor.nbytes - 5)
    with pytest.raises(ValueError, match=f"{path.name} ends at byte .* truncated"):
        read_runs([part], np.empty(part.nbytes, np.uint8))
