"""cffi API-mode build of ``mlx_ds4tp._verbs``.

The C lives in csrc/ beside this script (shared headers at its top, the
transports by concern in csrc/tcp/ and csrc/rdma/). The cdef is
``exchange_codes.h`` and ``_verbs_api.h`` read whole: those headers are also what
the C files (and the C++ backend) include, so each declaration is written once,
and cffi checks at import that every constant and struct layout in them equals
what the compiler made of it. ``setup.py`` names
``ffibuilder`` in ``cffi_modules``; ``python mlx_ds4tp/_verbs_build.py``
builds the module in place. ``MLX_DS4TP_NO_IBVERBS=1`` builds without the
ibverbs provider, as on a machine lacking infiniband/verbs.h
(``lib.tp_built_with_ibverbs()`` then returns 0).
"""

import os
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [
    "csrc/util.c",  # helpers shared by everything below
    "csrc/rdma/dev.c",  # provider choice, queue pair life cycle, registrations, reaping
    "csrc/rdma/loss.c",  # hot paths: entering, failing, sequence tags, loss detection
    "csrc/rdma/flow.c",  # hot paths: receives-posted barrier, usable queue depth
    "csrc/rdma/window.c",  # hot paths: decode gate window and its drain
    "csrc/rdma/bulk.c",  # hot paths: bulk rounds
    "csrc/rdma/ibv.c",  # provider: the real verbs library, dlopen'ed
    "csrc/rdma/ucsim.c",  # provider: the emulated Thunderbolt UC device
    "csrc/tcp/gate.c",  # the TCP fallback's gate loop
    "csrc/sum.c",  # the gate's sum of the two partials (float32, float16, bfloat16)
    "csrc/exchange.c",  # one exchange of any collective, for the MLX backend (csrc/mlx/)
]
CDEF_HEADERS = ["csrc/exchange_codes.h", "csrc/_verbs_api.h"]
HEADERS = ["csrc/_verbs.h", *CDEF_HEADERS, "csrc/exchange_names.h", "csrc/_verbs_priv.h", "csrc/_verbs_hot.h"]
STANDALONE = __name__ == "__main__"


def _path(name: str) -> str:
    # setuptools runs from the project root and wants relative paths; a
    # standalone build compiles from a temporary directory, so absolute.
    full = os.path.join(HERE, name)
    return full if STANDALONE else os.path.relpath(full)


def _api_cdef() -> str:
    """The cdef headers, whole: the one place the API and its codes are declared."""
    texts = []
    for name in CDEF_HEADERS:
        with open(os.path.join(HERE, name)) as f:
            texts.append(f.read())
    return "\n".join(texts)


ffibuilder = FFI()
ffibuilder.cdef(_api_cdef())
ffibuilder.set_source(
    "mlx_ds4tp._verbs",
    '#include "_verbs.h"',
    sources=[_path(name) for name in SOURCES],
    include_dirs=[_path("csrc")],
    define_macros=[("TP_FORCE_NO_IBVERBS", "1")] if os.environ.get("MLX_DS4TP_NO_IBVERBS") else [],
    libraries=["dl"] if sys.platform.startswith("linux") else [],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    depends=[_path(name) for name in HEADERS],
)

if STANDALONE:
    import shutil

    built = ffibuilder.compile(tmpdir=os.path.join(HERE, "..", "build", "cffi"), verbose=True)
    shutil.copy(built, HERE)
    print("built", os.path.join(HERE, os.path.basename(built)))
