"""The collectives' tables: the code on the wire of each dtype and the numpy
dtype its bytes are read as, and the code of each collective (both travel in
the gate signature, so two ranks that disagree fail naming both)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from ..link.wire import OP_GATHER, OP_MAX, OP_MIN, OP_P2P_FROM, OP_SCATTER, OP_SUM

# ============================================================================
# Dtypes: the code on the wire and the numpy dtype the bytes are read as
# ============================================================================

# Codes 1-3 are the gate's original three (peers compare them in the gate
# signature and the TCP gate header carries them), the rest follow.
_DTYPES = (
    (mx.float32, 1, np.float32, "float32"),
    (mx.float16, 2, np.float16, "float16"),
    # numpy has no bfloat16: its bits travel and are combined as uint16.
    (mx.bfloat16, 3, np.uint16, "bfloat16"),
    (mx.bool_, 4, np.bool_, "bool"),
    (mx.int8, 5, np.int8, "int8"),
    (mx.int16, 6, np.int16, "int16"),
    (mx.int32, 7, np.int32, "int32"),
    (mx.int64, 8, np.int64, "int64"),
    (mx.uint8, 9, np.uint8, "uint8"),
    (mx.uint16, 10, np.uint16, "uint16"),
    (mx.uint32, 11, np.uint32, "uint32"),
    (mx.uint64, 12, np.uint64, "uint64"),
    (mx.float64, 13, np.float64, "float64"),
    (mx.complex64, 14, np.complex64, "complex64"),
)
DTYPE_CODES = {dtype: code for dtype, code, _, _ in _DTYPES}
DTYPE_NAMES = {code: name for _, code, _, name in _DTYPES}
NUMPY_DTYPES = {dtype: np_dtype for dtype, _, np_dtype, _ in _DTYPES}
MLX_DTYPES = {code: dtype for dtype, code, _, _ in _DTYPES}

# The collectives' codes (in the gate signature, see _wire): two ranks calling
# different collectives at the same point is an error naming both.
SUM, GATHER, MAX, MIN, SCATTER, P2P_FROM = OP_SUM, OP_GATHER, OP_MAX, OP_MIN, OP_SCATTER, OP_P2P_FROM
OP_NAMES = {SUM: "all_sum", GATHER: "all_gather", MAX: "all_max", MIN: "all_min",
            SCATTER: "sum_scatter", P2P_FROM: "send/recv from rank 0", P2P_FROM + 1: "send/recv from rank 1"}


def describe(op: int, dtype_code: int, shape: Sequence[int]) -> str:
    """'all_sum float32 (4096,)': an operation as the mismatch errors name it."""
    dtype = DTYPE_NAMES.get(dtype_code, f"dtype#{dtype_code}")
    return f"{OP_NAMES.get(op, f'op#{op}')} {dtype} {tuple(shape)}"


def unsupported(dtype) -> TypeError:
    return TypeError(f"dtype {dtype} is not supported by the collectives; use one of "
                     f"{', '.join(DTYPE_NAMES.values())}")


def dtype_code(dtype) -> int:
    """The wire code of an MLX dtype; TypeError naming the supported ones otherwise."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise unsupported(dtype)
    return code


# The float dtypes whose sum runs in C, inside the gate (tp_sum_gate_run) or after a bulk
# exchange (tp_sum2): their wire codes are the C module's TP_SUM_* codes.
C_SUM_CODES = {mx.float32: 1, mx.float16: 2, mx.bfloat16: 3}
BF16_CODE = 3
