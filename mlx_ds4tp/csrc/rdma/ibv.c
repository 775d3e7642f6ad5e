/* mlx_ds4tp._verbs provider "ibverbs": the real verbs stack, AppleThunderboltRDMA
 * on macOS (/usr/lib/librdma.dylib) or rdma-core on Linux (libibverbs.so.1).
 *
 * The library is dlopen'ed at run time, so the module builds and imports on
 * machines without RDMA and such a machine simply reports "no verbs
 * devices". Only the setup entry points need dlsym: ibv_post_send,
 * ibv_post_recv and ibv_poll_cq are header inlines over the context's ops
 * table, which is why this provider is compiled C and not cffi ABI mode.
 *
 * Quirks of AppleThunderboltRDMA this follows (ucsim, csrc/rdma/ucsim.c, and the
 * tests' fake library, tests/fake_ibverbs/, model the same):
 *   - only UC queue pairs exist (RC/UD: ENOTSUP);
 *   - RDMA WRITE is accepted and never executed: data moves by SEND/RECV;
 *   - messages above 16 KiB are not delivered;
 *   - RTR needs GRH addressing with the IPv4-mapped GID (::ffff:a.b.c.d),
 *     which exists only once the Thunderbolt member interface has an IPv4
 *     address of its own, MTU 1024 and hop limit 1;
 *   - ibv_post_send/ibv_post_recv fail with -ENOMEM (a negative errno, not
 *     the positive one rdma-core's providers return) at the 64th outstanding
 *     work request, whatever depths the queue pair was created with. */

#include "_verbs_priv.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if TP_HAVE_IBVERBS_HEADER

#include <arpa/inet.h> /* htonl/ntohl: immediate data is big-endian on the wire */
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <pthread.h>

/* ------------------------------------------------------------------------
 * Run-time loading. rdma-core defines several ibv_ names as macros over
 * inline wrappers (ibv_reg_mr, ibv_query_port, ibv_get_device_list), so the
 * library is always called through these pointers, never by those names.
 * --------------------------------------------------------------------- */

typedef struct {
    void *handle;
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
    /* The exported symbol fills the older (prefix) layout of the struct. */
    int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *,
                                int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*destroy_qp)(struct ibv_qp *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
} verbs_api;

#if defined(__APPLE__)
#define TP_VERBS_LIB "/usr/lib/librdma.dylib"
#define TP_VERBS_HINT "this macOS has no Thunderbolt RDMA library"
#else
#define TP_VERBS_LIB "libibverbs.so.1"
#define TP_VERBS_HINT "install rdma-core (Debian: apt install libibverbs1 ibverbs-providers)"
#endif

/* One loaded library per path asked for (tp_set_verbs_library): a device
 * keeps pointers into the library it was opened with, so a library is never
 * unloaded, and switching the path affects only later opens. */
#define TP_MAX_LIBS 8
typedef struct {
    char path[512]; /* "" = the system library */
    verbs_api api;
    char load_err[640];
} verbs_lib;

static verbs_lib g_libs[TP_MAX_LIBS];
static int g_nlibs;
static char g_want_path[512];
static pthread_mutex_t g_lib_lock = PTHREAD_MUTEX_INITIALIZER;

int tp_set_verbs_library(const char *path, char *err, size_t errlen) {
    if (path && strlen(path) >= sizeof(g_want_path)) {
        tp_errf(err, errlen, "tp_set_verbs_library: path of %zu characters is too long (at most "
                "%zu)", strlen(path), sizeof(g_want_path) - 1);
        return TP_EINVAL;
    }
    pthread_mutex_lock(&g_lib_lock);
    snprintf(g_want_path, sizeof(g_want_path), "%s", path ? path : "");
    pthread_mutex_unlock(&g_lib_lock);
    return TP_OK;
}

static void load_api(verbs_lib *lib) {
    const char *file = lib->path[0] ? lib->path : TP_VERBS_LIB;
    void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *why = dlerror();
        if (lib->path[0])
            snprintf(lib->load_err, sizeof(lib->load_err), "tp rdma: cannot load the verbs "
                     "library %s (DS4_TP_VERBS_LIBRARY): %s", file, why ? why : "?");
        else
            snprintf(lib->load_err, sizeof(lib->load_err), "tp rdma: cannot load %s (%s); %s",
                     file, why ? why : "?", TP_VERBS_HINT);
        return;
    }
    verbs_api *api = &lib->api;
#define SYM(field, name)                                                                     \
    do {                                                                                     \
        api->field = (__typeof__(api->field))dlsym(h, name);                                 \
        if (!api->field) {                                                                   \
            snprintf(lib->load_err, sizeof(lib->load_err), "tp rdma: %s%s lacks %s", file,   \
                     lib->path[0] ? " (DS4_TP_VERBS_LIBRARY)" : "", name);                   \
            dlclose(h);                                                                      \
            return;                                                                          \
        }                                                                                    \
    } while (0)
    SYM(get_device_list, "ibv_get_device_list");
    SYM(free_device_list, "ibv_free_device_list");
    SYM(get_device_name, "ibv_get_device_name");
    SYM(open_device, "ibv_open_device");
    SYM(close_device, "ibv_close_device");
    SYM(query_device, "ibv_query_device");
    SYM(query_port, "ibv_query_port");
    SYM(query_gid, "ibv_query_gid");
    SYM(alloc_pd, "ibv_alloc_pd");
    SYM(dealloc_pd, "ibv_dealloc_pd");
    SYM(reg_mr, "ibv_reg_mr");
    SYM(dereg_mr, "ibv_dereg_mr");
    SYM(create_cq, "ibv_create_cq");
    SYM(destroy_cq, "ibv_destroy_cq");
    SYM(create_qp, "ibv_create_qp");
    SYM(destroy_qp, "ibv_destroy_qp");
    SYM(modify_qp, "ibv_modify_qp");
#undef SYM
    api->handle = h;
}

/* The library for the path currently asked for, loaded on first use. */
static const verbs_api *api_get(char *err, size_t errlen) {
    pthread_mutex_lock(&g_lib_lock);
    verbs_lib *lib = NULL;
    for (int i = 0; i < g_nlibs && !lib; i++)
        if (strcmp(g_libs[i].path, g_want_path) == 0) lib = &g_libs[i];
    if (!lib && g_nlibs < TP_MAX_LIBS) {
        lib = &g_libs[g_nlibs++];
        snprintf(lib->path, sizeof(lib->path), "%s", g_want_path);
        load_api(lib);
    }
    pthread_mutex_unlock(&g_lib_lock);
    if (!lib) {
        tp_errf(err, errlen, "tp rdma: %d verbs libraries loaded already; cannot load %s",
                TP_MAX_LIBS, g_want_path);
        return NULL;
    }
    if (lib->api.handle) return &lib->api;
    tp_errf(err, errlen, "%s", lib->load_err);
    return NULL;
}

/* ------------------------------------------------------------------------
 * Device selection (shared by probe and open).
 * --------------------------------------------------------------------- */

typedef struct {
    struct ibv_context *ctx;
    struct ibv_port_attr port;
    union ibv_gid gid;
    int gid_index;
    char name[64];
} verbs_sel;

/* By number (enum ibv_port_state): Apple's header need not spell them all. */
static const char *port_state_name(int s) {
    static const char *const names[] = {"NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER"};
    return s >= 0 && s < 6 ? names[s] : "UNKNOWN";
}

static int gid_is_v4mapped(const union ibv_gid *g) {
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(g->raw, prefix, 12) == 0;
}

static void append(char *buf, size_t n, const char *fmt, const char *a, const char *b) {
    size_t off = strlen(buf);
    if (off + 1 < n) snprintf(buf + off, n - off, fmt, off ? ", " : "", a, b);
}

/* The GID to connect from: the index asked for, or else the IPv4-mapped
 * one. Why that one: the Apple driver connects only through it, and it
 * appears once the Thunderbolt member interface (not the bridge) has an
 * IPv4 address. 0, or -1 with why in err. */
static int find_gid(const verbs_api *api, verbs_sel *s, int gid_index, char *err, size_t errlen) {
    if (gid_index >= 0) {
        if (api->query_gid(s->ctx, 1, gid_index, &s->gid) != 0) {
            tp_errf(err, errlen, "tp rdma: %s: query_gid(port 1, index %d) failed: %s; omit the "
                    "GID index to scan for the IPv4-mapped GID", s->name, gid_index,
                    strerror(errno));
            return -1;
        }
        s->gid_index = gid_index;
        return 0;
    }
    for (int i = 0; i < s->port.gid_tbl_len; i++) {
        union ibv_gid g;
        if (api->query_gid(s->ctx, 1, i, &g) == 0 && gid_is_v4mapped(&g)) {
            s->gid = g;
            s->gid_index = i;
            return 0;
        }
    }
    tp_errf(err, errlen, "tp rdma: %s port 1 (%s) has no IPv4-mapped GID (::ffff:a.b.c.d) among "
            "its %d GIDs; give the Thunderbolt interface its own IPv4, e.g. sudo ifconfig en1 "
            "inet 10.99.0.2/30 alias (the bridge's address does not count), on both machines",
            s->name, port_state_name(s->port.state), s->port.gid_tbl_len);
    return -1;
}

/* One verbs device per Thunderbolt port (rdma_enN). A named device is
 * taken even with its port down (warned: the user asked for it); without a
 * name, the first whose port is ACTIVE and that has the GID to connect
 * from (a port whose interface lacks its own IPv4 cannot connect). */
static int select_device(const verbs_api *api, const char *want, int gid_index, verbs_sel *out,
                         char *err, size_t errlen) {
    memset(out, 0, sizeof(*out));
    int num = 0;
    errno = 0;
    struct ibv_device **devs = api->get_device_list(&num);
    if (!devs || num <= 0) {
        if (devs) api->free_device_list(devs);
        tp_errf(err, errlen, "tp rdma: no verbs devices (ibv_get_device_list found 0); check "
                "`rdma_ctl status` (macOS: `sudo rdma_ctl enable` in recovery), `ibv_devices`, "
                "and that the Thunderbolt member interface has its own IPv4 address");
        return TP_EUNAVAIL;
    }
    char seen[768] = "", why[512] = "";
    for (int i = 0; i < num && !out->ctx; i++) {
        const char *name = api->get_device_name(devs[i]);
        if (!name) name = "?";
        if (want && strcmp(want, name) != 0) {
            append(seen, sizeof(seen), "%s%s%s", name, "");
            continue;
        }
        struct ibv_context *ctx = api->open_device(devs[i]);
        if (!ctx) {
            append(seen, sizeof(seen), "%s%s: open failed (%s)", name, strerror(errno));
            continue;
        }
        struct ibv_port_attr pa;
        memset(&pa, 0, sizeof(pa));
        if (api->query_port(ctx, 1, &pa) != 0) {
            append(seen, sizeof(seen), "%s%s: query_port failed (%s)", name, strerror(errno));
            api->close_device(ctx);
            continue;
        }
        if (pa.state != IBV_PORT_ACTIVE && !want) {
            append(seen, sizeof(seen), "%s%s: port 1 %s", name, port_state_name(pa.state));
            api->close_device(ctx);
            continue;
        }
        verbs_sel cand;
        memset(&cand, 0, sizeof(cand));
        cand.ctx = ctx;
        cand.port = pa;
        snprintf(cand.name, sizeof(cand.name), "%s", name);
        if (find_gid(api, &cand, gid_index, why, sizeof(why)) < 0) {
            append(seen, sizeof(seen), "%s%s: port 1 %s, no IPv4-mapped GID", name,
                   port_state_name(pa.state));
            api->close_device(ctx);
            if (want) {
                api->free_device_list(devs);
                tp_errf(err, errlen, "%s", why);
                return TP_EUNAVAIL;
            }
            continue;
        }
        if (pa.state != IBV_PORT_ACTIVE)
            fprintf(stderr, TP_LOG "rdma device %s: port 1 is %s, not ACTIVE; using it because "
                    "it was named\n", name, port_state_name(pa.state));
        *out = cand;
    }
    api->free_device_list(devs);
    if (out->ctx) return TP_OK;
    if (want)
        tp_errf(err, errlen, "tp rdma: no usable verbs device named %s (devices: %s); list them "
                "with `ibv_devices`", want, seen);
    else
        tp_errf(err, errlen, "tp rdma: no verbs device has an ACTIVE port and an IPv4-mapped GID "
                "(%s); check the Thunderbolt cable, that the peer is up, `rdma_ctl status` on "
                "both machines, and that each Thunderbolt interface has its own IPv4 address",
                seen);
    return TP_EUNAVAIL;
}

int tp_ibv_probe(const char *device, char *err, size_t errlen) {
    const verbs_api *api = api_get(err, errlen);
    if (!api) return 0;
    verbs_sel sel;
    if (select_device(api, device, -1, &sel, err, errlen) < 0) return 0;
    tp_errf(err, errlen, "ibverbs device %s, port 1 %s, IPv4-mapped GID index %d", sel.name,
            port_state_name(sel.port.state), sel.gid_index);
    api->close_device(sel.ctx);
    return 1;
}

/* ------------------------------------------------------------------------
 * Open, queue pair, connect.
 * --------------------------------------------------------------------- */

typedef struct {
    const verbs_api *api;
    verbs_sel sel;
    struct ibv_device_attr attr;
    int have_attr;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    uint32_t psn_base;
    /* Hot-path sequence tags (SEND_WITH_IMM; "Sequence tags" in
     * _verbs_api.h): imm_ok once the device accepted one. When it refuses
     * the first, dev->no_imm is set and hot-path sends go untagged. */
    int imm_ok;
} verbs_dev;

#define VD(dev) ((verbs_dev *)(dev)->impl)

int tp_ibv_open(tp_dev *dev, const char *device, int gid_index, char *err, size_t errlen) {
    const verbs_api *api = api_get(err, errlen);
    if (!api) return TP_EUNAVAIL;
    verbs_dev *v = calloc(1, sizeof(*v));
    if (!v) {
        tp_errf(err, errlen, "tp rdma: out of memory");
        return TP_ESYS;
    }
    v->api = api;
    int rc = select_device(api, device, gid_index, &v->sel, err, errlen);
    if (rc < 0) {
        free(v);
        return rc;
    }
    v->have_attr = api->query_device(v->sel.ctx, &v->attr) == 0;
    v->pd = api->alloc_pd(v->sel.ctx);
    if (!v->pd) {
        tp_errf(err, errlen, "tp rdma: %s: alloc_pd failed: %s", v->sel.name, strerror(errno));
        api->close_device(v->sel.ctx);
        free(v);
        return TP_ESYS;
    }
    v->psn_base = (uint32_t)tp_random64() & 0xffffff;
    dev->prov = &tp_ibv_provider;
    dev->impl = v;
    snprintf(dev->name, sizeof(dev->name), "%s", v->sel.name);
    fprintf(stderr, TP_LOG "rdma device %s (port 1 %s, GID index %d)\n", v->sel.name,
            port_state_name(v->sel.port.state), v->sel.gid_index);
    return TP_OK;
}

static void destroy_qp_cq(verbs_dev *v) {
    if (v->qp) v->api->destroy_qp(v->qp);
    if (v->cq) v->api->destroy_cq(v->cq);
    v->qp = NULL;
    v->cq = NULL;
}

static int clamp(int want, int cap) { return cap > 0 && want > cap ? cap : want; }

static int ibv_build(tp_dev *dev, int qp_type, int attempt, int *cq_depth, int *send_wr,
                     int *recv_wr, char *err, size_t errlen) {
    verbs_dev *v = VD(dev);
    destroy_qp_cq(v);
    if (qp_type == TP_QPT_UD) {
        tp_errf(err, errlen, "tp rdma: UD queue pairs carry no connection for the gate stream; "
                "use TP_QPT_UC (Thunderbolt RDMA offers UC only)");
        return TP_ENOTSUP;
    }
    if (v->have_attr) {
        *cq_depth = clamp(*cq_depth, v->attr.max_cqe);
        *send_wr = clamp(*send_wr, v->attr.max_qp_wr);
        *recv_wr = clamp(*recv_wr, v->attr.max_qp_wr);
    }
    v->cq = v->api->create_cq(v->sel.ctx, *cq_depth, NULL, NULL, 0);
    if (!v->cq) {
        const int e = errno;
        tp_errf(err, errlen, "tp rdma: %s: create_cq(%d) failed: %s", v->sel.name, *cq_depth,
                strerror(e));
        return e == ENOMEM || e == EINVAL ? TP_ENOMEM : TP_ESYS;
    }
    struct ibv_qp_init_attr qia;
    memset(&qia, 0, sizeof(qia));
    qia.send_cq = v->cq;
    qia.recv_cq = v->cq;
    qia.qp_type = qp_type == TP_QPT_RC ? IBV_QPT_RC : IBV_QPT_UC;
    qia.cap.max_send_wr = (uint32_t)*send_wr;
    qia.cap.max_recv_wr = (uint32_t)*recv_wr;
    qia.cap.max_send_sge = 1;
    qia.cap.max_recv_sge = 1;
    qia.sq_sig_all = 0;
    v->qp = v->api->create_qp(v->pd, &qia);
    if (!v->qp) {
        const int e = errno;
        if (qp_type != TP_QPT_UC &&
            (e == ENOTSUP || e == EOPNOTSUPP || e == EINVAL || e == ENOSYS)) {
            /* Why: AppleThunderboltRDMA has UC queue pairs only. */
            tp_errf(err, errlen, "tp rdma: %s refused an RC queue pair (%s): Thunderbolt RDMA "
                    "offers UC queue pairs only (use TP_QPT_UC)", v->sel.name, strerror(e));
            return TP_ENOTSUP;
        }
        tp_errf(err, errlen, "tp rdma: %s: create_qp(%s, send %d, recv %d) failed: %s",
                v->sel.name, qp_type == TP_QPT_RC ? "RC" : "UC", *send_wr, *recv_wr,
                strerror(e));
        /* A device may say (ibv_query_device) it takes more work requests
         * than it does: TP_ENOMEM lets the caller ask for fewer. */
        return e == ENOMEM || e == EINVAL ? TP_ENOMEM : TP_ESYS;
    }
    *send_wr = (int)qia.cap.max_send_wr;
    *recv_wr = (int)qia.cap.max_recv_wr;

    tp_info *li = &dev->local;
    memset(li, 0, sizeof(*li));
    li->qpn = v->qp->qp_num;
    /* A fresh PSN space per build keeps stray packets of an earlier pair
     * from matching (seed recipe: base + setup_attempt * 0x1000). */
    li->psn = (v->psn_base + (uint32_t)attempt * 0x1000u) & 0xffffff;
    li->mtu = 1024;
    li->lid = v->sel.port.lid;
    li->link_layer = v->sel.port.link_layer;
    memcpy(li->gid, v->sel.gid.raw, 16);
    return TP_OK;
}

static int ibv_connect(tp_dev *dev, const tp_info *peer, char *err, size_t errlen) {
    verbs_dev *v = VD(dev);
    const int rc_qp = dev->qp_type == TP_QPT_RC;
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = 1;
    a.qp_access_flags = (unsigned)access;
    if (v->api->modify_qp(v->qp, &a,
                          IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        tp_errf(err, errlen, "tp rdma: %s: modify_qp to INIT failed: %s", v->sel.name,
                strerror(errno));
        return TP_ESYS;
    }
    /* The recipe the Apple driver accepts (same as JACCL): MTU 1024, GRH
     * with the IPv4-mapped GIDs, hop limit 1 (one cable, no routers). */
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = peer->qpn;
    a.rq_psn = peer->psn & 0xffffff;
    a.ah_attr.dlid = peer->lid;
    a.ah_attr.port_num = 1;
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
    a.ah_attr.grh.sgid_index = (uint8_t)v->sel.gid_index;
    a.ah_attr.grh.hop_limit = 1;
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
    if (rc_qp) {
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    }
    if (v->api->modify_qp(v->qp, &a, mask)) {
        tp_errf(err, errlen, "tp rdma: %s: modify_qp to RTR failed: %s (peer qpn 0x%x, psn 0x%x, "
                "sgid index %d); both sides must use their IPv4-mapped GID", v->sel.name,
                strerror(errno), peer->qpn, peer->psn, v->sel.gid_index);
        return TP_ESYS;
    }
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = dev->local.psn;
    mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
    if (rc_qp) {
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.max_rd_atomic = 1;
        mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    }
    if (v->api->modify_qp(v->qp, &a, mask)) {
        tp_errf(err, errlen, "tp rdma: %s: modify_qp to RTS failed: %s", v->sel.name,
                strerror(errno));
        return TP_ESYS;
    }
    return TP_OK;
}

static int ibv_reg(tp_dev *dev, tp_mr *mr, char *err, size_t errlen) {
    verbs_dev *v = VD(dev);
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    struct ibv_mr *m = v->api->reg_mr(v->pd, (void *)mr->lo, mr->hi - mr->lo, access);
    if (!m) {
        tp_errf(err, errlen, "tp rdma: %s: reg_mr(%p, %llu bytes) failed: %s", v->sel.name,
                (void *)mr->lo, (unsigned long long)(mr->hi - mr->lo), strerror(errno));
        return errno == ENOMEM ? TP_ENOMEM : TP_ESYS;
    }
    mr->handle = m;
    mr->lkey = m->lkey;
    return TP_OK;
}

static void ibv_dereg(tp_dev *dev, tp_mr *mr) {
    if (mr->handle) VD(dev)->api->dereg_mr((struct ibv_mr *)mr->handle);
    mr->handle = NULL;
}

static void ibv_close_dev(tp_dev *dev) {
    verbs_dev *v = VD(dev);
    if (!v) return;
    destroy_qp_cq(v);
    if (v->pd) v->api->dealloc_pd(v->pd);
    if (v->sel.ctx) v->api->close_device(v->sel.ctx);
    free(v);
    dev->impl = NULL;
}

/* ------------------------------------------------------------------------
 * Data path: the header inlines.
 * --------------------------------------------------------------------- */

/* The errno a post returned, whatever its convention: rdma-core's providers
 * return it positive; Apple's returns it negated (ibv_post_recv ret=-12 at
 * its 64th outstanding receive, i.e. -ENOMEM); some return -1 and set errno. */
static int post_errno(int ret) {
    if (ret >= 0) return ret;
    if (ret == -1) return errno ? errno : EINVAL;
    return -ret;
}

/* A receive or send work request of one scatter-gather entry: every byte
 * zeroed (the fields this provider does not set stay 0 for any driver), then
 * its id and entry. A macro: ibv_recv_wr and ibv_send_wr are two types. */
#define ONE_SGE_WR(wr, id, sge)          \
    do {                                 \
        memset(&(wr), 0, sizeof(wr));    \
        (wr).wr_id = (id);               \
        (wr).sg_list = (sge);            \
        (wr).num_sge = 1;                \
    } while (0)

static int ibv_post_recv_one(tp_dev *dev, uintptr_t addr, uint32_t len, uint32_t lkey,
                             uint64_t wr_id, char *err, size_t errlen) {
    verbs_dev *v = VD(dev);
    struct ibv_sge sge = {.addr = addr, .length = len, .lkey = lkey};
    struct ibv_recv_wr wr, *bad = NULL;
    ONE_SGE_WR(wr, wr_id, &sge);
    int e = post_errno(ibv_post_recv(v->qp, &wr, &bad));
    if (e == 0) return TP_OK;
    tp_errf(err, errlen, "tp rdma: post_recv(%u bytes, wr_id 0x%llx) failed: %s", len,
            (unsigned long long)wr_id, strerror(e));
    return e == ENOMEM ? TP_ENOMEM : TP_ESYS;
}

static int ibv_post_send_one(tp_dev *dev, uintptr_t addr, uint32_t len, uint32_t lkey,
                             uint64_t wr_id, int opcode, uint32_t imm, int signaled, char *err,
                             size_t errlen) {
    verbs_dev *v = VD(dev);
    struct ibv_sge sge = {.addr = addr, .length = len, .lkey = lkey};
    struct ibv_send_wr wr, *bad = NULL;
    ONE_SGE_WR(wr, wr_id, &sge);
    /* RDMA WRITE is passed through for diagnostics only: the Apple driver
     * accepts it and never executes it (no remote address is known here). */
    wr.opcode = opcode == TP_OP_WRITE ? IBV_WR_RDMA_WRITE : IBV_WR_SEND;
    wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    const int tagged = opcode == TP_OP_SEND_IMM && !dev->no_imm;
    if (tagged) {
        wr.opcode = IBV_WR_SEND_WITH_IMM;
        wr.imm_data = htonl(imm);
    }
    int e = post_errno(ibv_post_send(v->qp, &wr, &bad));
    if (e != 0 && tagged && !v->imm_ok && (e == EINVAL || e == ENOTSUP || e == EOPNOTSUPP)) {
        /* Why: whether AppleThunderboltRDMA takes SEND_WITH_IMM on a UC queue
         * pair is unverified. A refused post queued nothing, so resend it as
         * a plain SEND and stay untagged: losing loss detection beats losing
         * RDMA. Only the first tagged post may do this; a refusal after
         * tagged posts succeeded is a real failure. */
        dev->no_imm = 1;
        fprintf(stderr, TP_LOG "rdma device %s refused SEND_WITH_IMM on a UC queue pair (%s): "
                "hot-path messages go untagged, so a message lost on the link cannot be "
                "detected at the gate; run with --debug-hash N to catch a divergence\n",
                v->sel.name, strerror(e));
        wr.opcode = IBV_WR_SEND;
        wr.imm_data = 0;
        bad = NULL;
        e = post_errno(ibv_post_send(v->qp, &wr, &bad));
    }
    if (e == 0) {
        if (tagged && !dev->no_imm) v->imm_ok = 1;
        return TP_OK;
    }
    tp_errf(err, errlen, "tp rdma: post_send(%u bytes, wr_id 0x%llx) failed: %s", len,
            (unsigned long long)wr_id, strerror(e));
    return e == ENOMEM ? TP_ENOMEM : TP_ESYS;
}

static int ibv_poll(tp_dev *dev, tp_wc *out, int max, char *err, size_t errlen) {
    verbs_dev *v = VD(dev);
    struct ibv_wc wc[32];
    if (max > 32) max = 32;
    int n = ibv_poll_cq(v->cq, max, wc);
    if (n < 0) {
        tp_errf(err, errlen, "tp rdma: %s: poll_cq failed (%d)", v->sel.name, n);
        return TP_ESYS;
    }
    for (int i = 0; i < n; i++) {
        out[i].wr_id = wc[i].wr_id;
        out[i].status = (int32_t)wc[i].status;
        out[i].opcode = (wc[i].opcode & IBV_WC_RECV) ? TP_WC_RECV : TP_WC_SEND;
        out[i].byte_len = wc[i].byte_len;
        /* imm_data is valid only on a successful completion flagged WITH_IMM. */
        out[i].has_imm = wc[i].status == IBV_WC_SUCCESS && (wc[i].wc_flags & IBV_WC_WITH_IMM);
        out[i].imm = out[i].has_imm ? ntohl(wc[i].imm_data) : 0;
    }
    return n;
}

/* Completions land in host memory without a syscall: just spin (the core
 * samples the control socket every millisecond). */
static int ibv_idle(tp_dev *dev, uint64_t deadline_ns, uint64_t waited_ns) {
    (void)dev, (void)deadline_ns, (void)waited_ns;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
    return TP_OK;
}

const tp_provider tp_ibv_provider = {
    "ibverbs", ibv_build, ibv_connect, ibv_reg, ibv_dereg, ibv_post_recv_one,
    ibv_post_send_one, ibv_poll, ibv_idle, ibv_close_dev,
};

#else /* !TP_HAVE_IBVERBS_HEADER */

#define TP_NO_HEADER_MSG                                                                     \
    "tp rdma: built without infiniband/verbs.h; install libibverbs-dev (Linux) or the macOS " \
    "SDK and reinstall"

/* Without the header there is no provider to load a library for. */
int tp_set_verbs_library(const char *path, char *err, size_t errlen) {
    (void)path, (void)err, (void)errlen;
    return TP_OK;
}

int tp_ibv_probe(const char *device, char *err, size_t errlen) {
    (void)device;
    tp_errf(err, errlen, TP_NO_HEADER_MSG);
    return 0;
}

int tp_ibv_open(tp_dev *dev, const char *device, int gid_index, char *err, size_t errlen) {
    (void)dev, (void)device, (void)gid_index;
    tp_errf(err, errlen, TP_NO_HEADER_MSG);
    return TP_EUNAVAIL;
}

const tp_provider tp_ibv_provider = {"ibverbs", 0, 0, 0, 0, 0, 0, 0, 0, 0};

#endif
