"""cffi API-mode build of ``mlx_ds4tp._verbs``.

The C lives in the .c files beside this script; ``setup.py`` names
``ffibuilder`` in ``cffi_modules``, and ``python mlx_ds4tp/_verbs_build.py``
builds the module in place. ``MLX_DS4TP_NO_IBVERBS=1`` builds without the
ibverbs provider (as on a machine lacking infiniband/verbs.h).
"""

import os
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

    int tp_probe(const char *device, char *err, size_t errlen);
    tp_dev *tp_open(const char *device, int gid_index, const char *bind_ipv4, int role,
                    const char *faults, void *slab, uint64_t slab_bytes,
                    char *err, size_t errlen);
    int tp_build_qp(tp_dev *dev, int qp_type, int setup_attempt, int cq_depth,
                    int send_wr, int recv_wr, char *err, size_t errlen);
    void tp_depths(const tp_dev *dev, int *cq_depth, int *send_wr, int *recv_wr);
    int tp_local_info(const tp_dev *dev, tp_info *out);
    int tp_connect(tp_dev *dev, const tp_info *peer, char *err, size_t errlen);
    const char *tp_device_name(const tp_dev *dev);
    void tp_close(tp_dev *dev);
    void tp_set_fds(tp_dev *dev, int control_fd, int barrier_fd);
    int tp_reg(tp_dev *dev, void *addr, uint64_t len, char *err, size_t errlen);
    int tp_dereg(tp_dev *dev, int handle);
    int tp_post_recv(tp_dev *dev, void *addr, uint32_t len, uint64_t wr_id,
                     char *err, size_t errlen);
    int tp_post_send(tp_dev *dev, const void *addr, uint32_t len, uint64_t wr_id,
                     int opcode, int signaled, char *err, size_t errlen);
    int tp_poll(tp_dev *dev, tp_wc *wc, int max, double timeout_s, char *err, size_t errlen);
    int tp_gate(tp_dev *dev, const void *src, void *dst, uint32_t bytes, uint64_t seq,
                double timeout_s, char *err, size_t errlen);
    int tp_drain(tp_dev *dev, double timeout_s, char *err, size_t errlen);
    int tp_bulk(tp_dev *dev, const void *src, void *dst, uint64_t bytes, double timeout_s,
                char *err, size_t errlen);
    uint64_t tp_slab_bytes(void);
    void tp_get_stats(const tp_dev *dev, tp_stats *out);
    int tp_tcp_gate(int fd, const void *hdr_out, void *hdr_in, uint32_t hdr_len,
                    const void *src, void *dst, uint64_t bytes, uint64_t seq, uint64_t spin_ns,
                    char *err, size_t errlen);
    int tp_tcp_raw(int fd, const void *src, void *dst, uint64_t bytes, uint64_t spin_ns, char *err,
               size_t errlen);
    """
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
