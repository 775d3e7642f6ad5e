"""cffi API-mode build of ``mlx_ds4tp._verbs``.

The C lives in the .c files beside this script; ``setup.py`` names
``ffibuilder`` in ``cffi_modules``, and ``python mlx_ds4tp/_verbs_build.py``
builds the module in place. ``MLX_DS4TP_NO_IBVERBS=1`` builds without the
ibverbs provider (as on a machine lacking infiniband/verbs.h).
"""

import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["_verbs_core.c", "_verbs_ibv.c", "_verbs_ucsim.c", "_tcp_gate.c"]
STANDALONE = __name__ == "__main__"


def _path(name):
    # setuptools runs from the project root and wants relative paths; a
    # standalone build compiles from a temporary directory, so absolute.
    full = os.path.join(HERE, name)
    return full if STANDALONE else os.path.relpath(full)


def _prototypes():
    """The function declarations of _verbs.h, read from it (the one place they are written)."""
    with open(os.path.join(HERE, "_verbs.h")) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    found = re.findall(r"^(?:const )?\w+ \*?tp_\w+\([^;]*\);", text, flags=re.M)
    if not found:
        raise RuntimeError("no tp_* declarations found in _verbs.h")
    return "\n".join(found)


ffibuilder = FFI()
ffibuilder.cdef(
    """
    #define TP_MAX_MSG ...
    #define TP_RECV_WINDOW ...
    #define TP_GATE_MAX_CHUNKS ...
    #define TP_BULK_SLOTS ...
    #define TP_HAVE_IBVERBS_HEADER ...
    #define TP_OK ...
    #define TP_EINVAL ...
    #define TP_EUNAVAIL ...
    #define TP_ESYS ...
    #define TP_ETIMEOUT ...
    #define TP_EPEER ...
    #define TP_ECOMPLETION ...
    #define TP_ENOTSUP ...
    #define TP_ENOMEM ...
    #define TP_EDESYNC ...
    #define TP_ELOST ...
    #define TP_QPT_RC ...
    #define TP_QPT_UC ...
    #define TP_QPT_UD ...
    #define TP_OP_SEND ...
    #define TP_OP_WRITE ...
    #define TP_WC_SEND ...
    #define TP_WC_RECV ...
    #define TP_WC_SUCCESS ...
    #define TP_WC_LOC_LEN_ERR ...

    typedef struct {
        uint32_t qpn; uint32_t psn; uint32_t mtu; uint16_t lid; uint8_t link_layer;
        uint8_t gid[16];
        ...;
    } tp_info;
    typedef struct {
        uint64_t wr_id; int32_t status; int32_t opcode; uint32_t byte_len;
        uint32_t imm; int32_t has_imm;
        ...;
    } tp_wc;
    typedef struct {
        uint64_t sends, recvs, send_bytes, recv_bytes;
        uint64_t dropped_oversize, dropped_fault, dropped_unposted, dropped_stale;
        int direction_dead;
        uint64_t recv_done;
        int window_armed;
        ...;
    } tp_stats;
    typedef struct tp_dev tp_dev;
    """
    + _prototypes()
)

ffibuilder.set_source(
    "mlx_ds4tp._verbs",
    '#include "_verbs.h"',
    sources=[_path(name) for name in SOURCES],
    include_dirs=[_path(".")],
    define_macros=[("TP_FORCE_NO_IBVERBS", "1")] if os.environ.get("MLX_DS4TP_NO_IBVERBS") else [],
    libraries=["dl"] if sys.platform.startswith("linux") else [],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    depends=[_path(name) for name in ("_verbs.h", "_verbs_priv.h")],
)

if STANDALONE:
    import shutil

    built = ffibuilder.compile(tmpdir=os.path.join(HERE, "..", "build", "cffi"), verbose=True)
    shutil.copy(built, HERE)
    print("built", os.path.join(HERE, os.path.basename(built)))
