"""split/derive.py's check of a traced array: exact (every element is compared, never a sample),
whether the plan left it a broadcast view or copied it, along any axis, in int16 or int32."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ds4tp.split import derive


@pytest.mark.parametrize("shape,axis", [((6, 40), 0), ((6, 40), 1), ((3, 9, 7), 1), ((5, 2, 3), 0), ((70000,), 0)])
def test_a_selection_is_found_and_one_changed_element_anywhere_is_refused(shape, axis, monkeypatch):
    monkeypatch.setattr(derive, "_COMPARE_ELEMENTS", 16)  # several slices, the last one short
    tracer = derive._tracer(shape, axis)
    assert tracer.dtype == (mx.int16 if shape[axis] <= 1 << 15 else mx.int32)
    keep = [i for i in range(shape[axis]) if i % 3 != 1]
    index = [slice(None)] * len(shape)
    index[axis] = mx.array(keep)
    picked = tracer[tuple(index)]
    copied = mx.contiguous(picked)
    for cut in (picked, copied):
        kept = derive._kept_indices(cut, axis, shape[axis])
        assert kept is not None and kept.tolist() == keep
    values = np.array(copied)
    if values.ndim > 1:
        for flat in (values.size - 1, values.size // 2 + 1):  # the last element, one in the middle
            changed = values.copy()
            where = np.unravel_index(flat, changed.shape)
            if where[axis] == 0 or all(w == 0 for d, w in enumerate(where) if d != axis):
                continue  # on the line the indices are read from: a different selection, not a change
            changed[where] += 1
            assert derive._kept_indices(mx.array(changed), axis, shape[axis]) is None, where


def test_a_broadcast_view_is_read_as_its_line():
    line = mx.arange(8, dtype=mx.int16).reshape(1, 8)
    view = mx.broadcast_to(line, (1000, 8))
    assert derive._kept_indices(view, 1, 8).tolist() == list(range(8))
    assert derive._kept_indices(mx.broadcast_to(mx.array([[5], [9]], dtype=mx.int16), (2, 3)), 0, 8) is None
