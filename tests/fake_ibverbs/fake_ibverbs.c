/* A fake libibverbs for the tests: rdma-core's ABI in front of ucsim's
 * engine (mlx_ds4tp/csrc/rdma/ucsim.c, linked in), so the real ibverbs provider
 * (mlx_ds4tp/csrc/rdma/ibv.c) runs end to end on a machine without RDMA. It
 * exports the entry points that provider dlsym's, and fills the context's
 * ops table, through which the header inlines ibv_post_send, ibv_post_recv
 * and ibv_poll_cq reach it. It behaves as Apple's Thunderbolt RDMA device:
 *   - devices named rdma_enN, port 1 ACTIVE, link layer Ethernet, MTU 1024;
 *   - GID index 0 link-local, the IPv4-mapped GID (::ffff:a.b.c.d) at index
 *     1, as once the Thunderbolt interface has its own IPv4 address;
 *   - UC queue pairs only (RC, UD: EOPNOTSUPP); RTR only with MTU 1024 and
 *     GRH addressing from the IPv4-mapped GID;
 *   - large work-request caps accepted at creation, then a post past
 *     post_cap (63) outstanding fails with -ENOMEM (negative, as Apple's
 *     driver returns it: "ibv_post_recv[63/256] ret=-12");
 *   - messages above 16 KiB never delivered, RDMA WRITE accepted and never
 *     executed, a message with no receive posted kills that direction, and
 *     every DS4_TP_UCSIM_FAULTS item (all of that is ucsim's engine);
 *   - at most 100 memory regions.
 * The port's LID is the engine's datagram port (a real LID is 16 bits too).
 *
 * Configuration (environment; the device list is read at each
 * ibv_get_device_list, the rest when a device is opened):
 *   DS4_TP_FAKE_IBV_DEVICES  comma-separated devices, each name[:down]
 *                            [:nogid][:ip=A.B.C.D] (default "rdma_en1",
 *                            address 127.0.0.1): port DOWN, no IPv4-mapped
 *                            GID, the address its datagrams use;
 *   DS4_TP_FAKE_IBV_ROLE     leader (default) or worker: which way l2w/w2l
 *                            faults point (a verbs device knows no roles);
 *   DS4_TP_FAKE_IBV_REFUSE   comma-separated: send_imm (SEND_WITH_IMM is
 *                            EINVAL), reg_mr (every ibv_reg_mr fails with
 *                            ENOMEM), qp_wr=N (ibv_create_qp with more than
 *                            N send or receive work requests fails ENOMEM,
 *                            though ibv_query_device says 32768);
 *   DS4_TP_UCSIM_FAULTS      the engine's faults, as for ucsim.
 * Built by build.py beside this file. */

#include "_verbs_priv.h"

#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

/* rdma-core spells these as macros over inline wrappers; the library
 * exports the plain names, and so does this one. */
#undef ibv_get_device_list
#undef ibv_query_port
#undef ibv_reg_mr

#define EXPORT __attribute__((visibility("default")))
#define FAKE_LOG "fake_ibverbs: "
#define FAKE_MAX_DEVICES 8
#define FAKE_MAX_MRS 100   /* Apple's stack allows about 100 regions */
#define FAKE_MAX_QP_WR 32768

/* ------------------------------------------------------------------------
 * Configuration.
 * --------------------------------------------------------------------- */

typedef struct {
    struct ibv_device dev; /* first: the pointer handed out */
    int port_down, no_gid;
    char ip[INET_ADDRSTRLEN];
} fake_device;

/* One device list per DS4_TP_FAKE_IBV_DEVICES value seen, kept for the
 * process's life: an open context points at its device, and a test may
 * change the variable between opens. */
typedef struct fake_config {
    char spec[1024];
    int ndevs;
    fake_device devs[FAKE_MAX_DEVICES];
    struct fake_config *next;
} fake_config;

static fake_config *g_configs;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static void add_device(fake_config *cfg, char *spec) {
    if (cfg->ndevs == FAKE_MAX_DEVICES || !*spec) return;
    fake_device *d = &cfg->devs[cfg->ndevs];
    snprintf(d->ip, sizeof(d->ip), "127.0.0.1");
    char *save = NULL;
    char *name = strtok_r(spec, ":", &save);
    snprintf(d->dev.name, sizeof(d->dev.name), "%s", name);
    snprintf(d->dev.dev_name, sizeof(d->dev.dev_name), "uverbs%d", cfg->ndevs);
    d->dev.node_type = IBV_NODE_RNIC;
    d->dev.transport_type = IBV_TRANSPORT_IWARP;
    for (char *f = strtok_r(NULL, ":", &save); f; f = strtok_r(NULL, ":", &save)) {
        if (!strcmp(f, "down")) d->port_down = 1;
        else if (!strcmp(f, "nogid")) d->no_gid = 1;
        else if (!strncmp(f, "ip=", 3)) snprintf(d->ip, sizeof(d->ip), "%s", f + 3);
        else fprintf(stderr, FAKE_LOG "ignoring unknown device flag '%s'\n", f);
    }
    cfg->ndevs++;
}

static fake_config *current_config(void) {
    const char *env = getenv("DS4_TP_FAKE_IBV_DEVICES");
    const char *spec = env && *env ? env : "rdma_en1";
    pthread_mutex_lock(&g_lock);
    fake_config *cfg = g_configs;
    while (cfg && strcmp(cfg->spec, spec) != 0) cfg = cfg->next;
    if (!cfg && (cfg = calloc(1, sizeof(*cfg)))) {
        snprintf(cfg->spec, sizeof(cfg->spec), "%s", spec);
        char buf[1024], *save = NULL;
        snprintf(buf, sizeof(buf), "%s", spec);
        for (char *s = strtok_r(buf, ",", &save); s; s = strtok_r(NULL, ",", &save))
            add_device(cfg, s);
        cfg->next = g_configs;
        g_configs = cfg;
    }
    pthread_mutex_unlock(&g_lock);
    return cfg;
}

/* What the device refuses (DS4_TP_FAKE_IBV_REFUSE), read at open. */
typedef struct {
    int imm, reg_mr, qp_wr;
} fake_refusals;

static fake_refusals read_refusals(void) {
    fake_refusals r = {0, 0, 0};
    const char *env = getenv("DS4_TP_FAKE_IBV_REFUSE");
    char buf[256], *save = NULL;
    snprintf(buf, sizeof(buf), "%s", env ? env : "");
    for (char *s = strtok_r(buf, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
        if (!strcmp(s, "send_imm")) r.imm = 1;
        else if (!strcmp(s, "reg_mr")) r.reg_mr = 1;
        else if (!strncmp(s, "qp_wr=", 6)) r.qp_wr = atoi(s + 6);
        else fprintf(stderr, FAKE_LOG "ignoring unknown refusal '%s'\n", s);
    }
    return r;
}

/* ------------------------------------------------------------------------
 * Objects: a context owns one ucsim engine (one datagram socket), at most
 * one completion queue and one queue pair at a time, like the provider's
 * use of a device.
 * --------------------------------------------------------------------- */

typedef struct {
    struct ibv_mr mr;
    int used;
} fake_mr;

typedef struct {
    struct ibv_context ctx; /* first: the pointer handed out */
    fake_device *fd;
    fake_refusals refuse;
    tp_dev eng;             /* ucsim's device object */
    fake_mr mrs[FAKE_MAX_MRS];
    int builds;             /* queue pairs created so far: ucsim's setup attempt */
    int has_qp;
    int sq_sig_all;
    uint32_t qp_state;
    int empty_polls;
} fake_ctx;

typedef struct {
    struct ibv_cq cq;
    int depth;
} fake_cq;

#define FCTX(c) ((fake_ctx *)(c))

static int fake_poll_cq(struct ibv_cq *cq, int num, struct ibv_wc *wc);
static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);

EXPORT struct ibv_device **ibv_get_device_list(int *num) {
    fake_config *cfg = current_config();
    if (!cfg) return NULL;
    struct ibv_device **out = calloc((size_t)cfg->ndevs + 1, sizeof(*out));
    if (!out) return NULL;
    for (int i = 0; i < cfg->ndevs; i++) out[i] = &cfg->devs[i].dev;
    if (num) *num = cfg->ndevs;
    return out;
}

EXPORT void ibv_free_device_list(struct ibv_device **list) { free(list); }

EXPORT const char *ibv_get_device_name(struct ibv_device *device) { return device->name; }

EXPORT struct ibv_context *ibv_open_device(struct ibv_device *device) {
    fake_device *fd = (fake_device *)device;
    fake_ctx *c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    c->fd = fd;
    c->refuse = read_refusals();
    c->ctx.device = device;
    c->ctx.ops.poll_cq = fake_poll_cq;
    c->ctx.ops.post_send = fake_post_send;
    c->ctx.ops.post_recv = fake_post_recv;
    c->ctx.cmd_fd = c->ctx.async_fd = -1;
    c->ctx.num_comp_vectors = 1;
    c->eng.control_fd = c->eng.barrier_fd = -1;
    const char *role = getenv("DS4_TP_FAKE_IBV_ROLE");
    c->eng.role = role && !strcmp(role, "worker") ? 1 : 0;
    char err[512] = "";
    if (tp_ucsim_open(&c->eng, fd->ip, getenv("DS4_TP_UCSIM_FAULTS"), err, sizeof(err)) < 0) {
        fprintf(stderr, FAKE_LOG "cannot open %s: %s\n", device->name, err);
        free(c);
        errno = EINVAL;
        return NULL;
    }
    snprintf(c->eng.name, sizeof(c->eng.name), "%s", device->name);
    return &c->ctx;
}

EXPORT int ibv_close_device(struct ibv_context *context) {
    fake_ctx *c = FCTX(context);
    c->eng.prov->close(&c->eng);
    free(c);
    return 0;
}

EXPORT int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *attr) {
    (void)context;
    memset(attr, 0, sizeof(*attr));
    snprintf(attr->fw_ver, sizeof(attr->fw_ver), "fake-1.0");
    attr->max_qp = 64;
    attr->max_qp_wr = FAKE_MAX_QP_WR; /* what Apple's says, not what it takes */
    attr->max_sge = 1;
    attr->max_cq = 64;
    attr->max_cqe = 65536;
    attr->max_mr = FAKE_MAX_MRS;
    attr->max_pd = 16;
    attr->phys_port_cnt = 1;
    return 0;
}

/* The exported symbol fills the older layout of struct ibv_port_attr, the
 * prefix up to link_layer (newer fields are reached through the extended
 * context ops, which the provider does not use). */
EXPORT int ibv_query_port(struct ibv_context *context, uint8_t port,
                          struct _compat_ibv_port_attr *out) {
    fake_ctx *c = FCTX(context);
    if (port != 1) {
        errno = EINVAL;
        return EINVAL;
    }
    struct ibv_port_attr full, *attr = &full;
    memset(attr, 0, sizeof(*attr));
    attr->state = c->fd->port_down ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
    attr->max_mtu = IBV_MTU_4096;
    attr->active_mtu = IBV_MTU_1024;
    attr->gid_tbl_len = 4;
    attr->max_msg_sz = TP_MAX_MSG;
    attr->pkey_tbl_len = 1;
    attr->lid = tp_ucsim_port(&c->eng);
    attr->link_layer = IBV_LINK_LAYER_ETHERNET;
    attr->phys_state = c->fd->port_down ? 3 : 5; /* disabled / link up */
    memcpy(out, attr, offsetof(struct ibv_port_attr, link_layer) + 1);
    return 0;
}

EXPORT int ibv_query_gid(struct ibv_context *context, uint8_t port, int index, union ibv_gid *gid) {
    fake_ctx *c = FCTX(context);
    if (port != 1 || index < 0 || index >= 4) {
        errno = EINVAL;
        return -1;
    }
    memset(gid, 0, sizeof(*gid));
    if (index == 0) { /* link-local fe80::, never used for the connection */
        gid->raw[0] = 0xfe;
        gid->raw[1] = 0x80;
        gid->raw[15] = 1;
    } else if (index == 1 && !c->fd->no_gid) {
        gid->raw[10] = gid->raw[11] = 0xff;
        inet_pton(AF_INET, c->fd->ip, &gid->raw[12]);
    }
    return 0;
}

EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *context) {
    struct ibv_pd *pd = calloc(1, sizeof(*pd));
    if (pd) pd->context = context;
    return pd;
}

EXPORT int ibv_dealloc_pd(struct ibv_pd *pd) {
    free(pd);
    return 0;
}

EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access) {
    (void)access;
    fake_ctx *c = FCTX(pd->context);
    if (c->refuse.reg_mr) {
        errno = ENOMEM;
        return NULL;
    }
    for (int i = 0; i < FAKE_MAX_MRS; i++) {
        fake_mr *m = &c->mrs[i];
        if (m->used) continue;
        memset(m, 0, sizeof(*m));
        m->used = 1;
        m->mr.context = pd->context;
        m->mr.pd = pd;
        m->mr.addr = addr;
        m->mr.length = length;
        m->mr.handle = (uint32_t)i;
        m->mr.lkey = m->mr.rkey = 0x1000u + (uint32_t)i;
        return &m->mr;
    }
    errno = ENOMEM;
    return NULL;
}

EXPORT int ibv_dereg_mr(struct ibv_mr *mr) {
    ((fake_mr *)mr)->used = 0;
    return 0;
}

/* 1 when [addr, addr + len) lies in the region lkey names. */
static int lkey_covers(const fake_ctx *c, uint32_t lkey, uint64_t addr, uint32_t len) {
    const uint32_t i = lkey - 0x1000u;
    if (i >= FAKE_MAX_MRS || !c->mrs[i].used) return 0;
    const uint64_t lo = (uint64_t)(uintptr_t)c->mrs[i].mr.addr;
    return addr >= lo && addr + len <= lo + c->mrs[i].mr.length;
}

EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                                    struct ibv_comp_channel *channel, int comp_vector) {
    (void)comp_vector;
    if (cqe < 1 || cqe > 65536) {
        errno = EINVAL;
        return NULL;
    }
    fake_cq *q = calloc(1, sizeof(*q));
    if (!q) return NULL;
    q->cq.context = context;
    q->cq.cq_context = cq_context;
    q->cq.channel = channel;
    q->cq.cqe = cqe;
    q->depth = cqe;
    return &q->cq;
}

EXPORT int ibv_destroy_cq(struct ibv_cq *cq) {
    free(cq);
    return 0;
}

EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr) {
    fake_ctx *c = FCTX(pd->context);
    if (c->has_qp) {
        errno = EBUSY;
        return NULL;
    }
    if (attr->send_cq != attr->recv_cq || !attr->send_cq) {
        errno = EINVAL; /* one engine, one completion queue */
        return NULL;
    }
    if (c->refuse.qp_wr && ((int)attr->cap.max_send_wr > c->refuse.qp_wr ||
                            (int)attr->cap.max_recv_wr > c->refuse.qp_wr)) {
        errno = ENOMEM;
        return NULL;
    }
    /* ucsim refuses RC and UD as Apple's driver does. */
    const int type = attr->qp_type == IBV_QPT_UC ? TP_QPT_UC
                     : attr->qp_type == IBV_QPT_RC ? TP_QPT_RC : TP_QPT_UD;
    int cq = ((fake_cq *)attr->send_cq)->depth;
    int swr = (int)attr->cap.max_send_wr, rwr = (int)attr->cap.max_recv_wr;
    char err[512] = "";
    int rc = c->eng.prov->build_qp(&c->eng, type, c->builds, &cq, &swr, &rwr, err, sizeof(err));
    if (rc < 0) {
        errno = rc == TP_ENOTSUP ? EOPNOTSUPP : ENOMEM;
        return NULL;
    }
    struct ibv_qp *qp = calloc(1, sizeof(*qp));
    if (!qp) return NULL;
    c->builds++;
    c->has_qp = 1;
    c->sq_sig_all = attr->sq_sig_all;
    c->qp_state = IBV_QPS_RESET;
    qp->context = pd->context;
    qp->pd = pd;
    qp->send_cq = attr->send_cq;
    qp->recv_cq = attr->recv_cq;
    qp->qp_num = c->eng.local.qpn;
    qp->qp_type = attr->qp_type;
    qp->state = IBV_QPS_RESET;
    attr->cap.max_send_wr = (uint32_t)swr; /* what was granted */
    attr->cap.max_recv_wr = (uint32_t)rwr;
    return qp;
}

EXPORT int ibv_destroy_qp(struct ibv_qp *qp) {
    FCTX(qp->context)->has_qp = 0;
    free(qp);
    return 0;
}

static int gid_is_v4mapped(const uint8_t *g) {
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(g, prefix, 12) == 0;
}

/* rdma-core returns the errno and sets it too. */
static int refuse(int e) {
    errno = e;
    return e;
}

EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
    fake_ctx *c = FCTX(qp->context);
    if (!(mask & IBV_QP_STATE)) return refuse(EINVAL);
    if (a->qp_state == IBV_QPS_INIT) {
        if ((mask & IBV_QP_PORT) && a->port_num != 1) return refuse(EINVAL);
    } else if (a->qp_state == IBV_QPS_RTR) {
        if (c->qp_state != IBV_QPS_INIT) return refuse(EINVAL);
        /* Apple's recipe: MTU 1024, GRH from the IPv4-mapped GID. */
        if (!(mask & IBV_QP_PATH_MTU) || a->path_mtu != IBV_MTU_1024) return refuse(EINVAL);
        if (!(mask & IBV_QP_AV) || !a->ah_attr.is_global) return refuse(EINVAL);
        if (a->ah_attr.grh.sgid_index != 1 || c->fd->no_gid) return refuse(EINVAL);
        if (!gid_is_v4mapped(a->ah_attr.grh.dgid.raw)) return refuse(EINVAL);
        tp_info peer;
        memset(&peer, 0, sizeof(peer));
        peer.qpn = a->dest_qp_num;
        peer.psn = a->rq_psn;
        peer.mtu = 1024;
        peer.lid = a->ah_attr.dlid;
        peer.link_layer = IBV_LINK_LAYER_ETHERNET;
        memcpy(peer.gid, a->ah_attr.grh.dgid.raw, 16);
        char err[512] = "";
        if (c->eng.prov->connect(&c->eng, &peer, err, sizeof(err)) < 0) {
            fprintf(stderr, FAKE_LOG "RTR refused: %s\n", err);
            return refuse(EINVAL);
        }
    } else if (a->qp_state == IBV_QPS_RTS) {
        if (c->qp_state != IBV_QPS_RTR || !(mask & IBV_QP_SQ_PSN)) return refuse(EINVAL);
        tp_ucsim_set_send_psn(&c->eng, a->sq_psn);
    } else if (a->qp_state != IBV_QPS_RESET && a->qp_state != IBV_QPS_ERR) {
        return refuse(EINVAL);
    }
    c->qp_state = a->qp_state;
    qp->state = a->qp_state;
    return 0;
}

/* ------------------------------------------------------------------------
 * Data path: what the header inlines call.
 * --------------------------------------------------------------------- */

static int engine_errno(int rc) {
    /* Negative, as Apple's driver returns a full queue (ret=-12). */
    if (rc == TP_ENOMEM) return -ENOMEM;
    return rc == TP_EINVAL ? EINVAL : EIO;
}

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    fake_ctx *c = FCTX(qp->context);
    for (; wr; wr = wr->next) {
        int e = 0, op = TP_OP_SEND;
        uint32_t imm = 0;
        if (c->qp_state != IBV_QPS_RTS || wr->num_sge != 1) e = EINVAL;
        else if (!lkey_covers(c, wr->sg_list[0].lkey, wr->sg_list[0].addr, wr->sg_list[0].length))
            e = EINVAL;
        else if (wr->opcode == IBV_WR_RDMA_WRITE) op = TP_OP_WRITE;
        else if (wr->opcode == IBV_WR_SEND_WITH_IMM && c->refuse.imm) e = EINVAL;
        else if (wr->opcode == IBV_WR_SEND_WITH_IMM) op = TP_OP_SEND_IMM, imm = ntohl(wr->imm_data);
        else if (wr->opcode != IBV_WR_SEND) e = EINVAL;
        if (!e) {
            char err[512] = "";
            const int signaled = c->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
            int rc = c->eng.prov->post_send(&c->eng, (uintptr_t)wr->sg_list[0].addr,
                                            wr->sg_list[0].length, wr->sg_list[0].lkey,
                                            wr->wr_id, op, imm, signaled, err, sizeof(err));
            if (rc < 0) e = engine_errno(rc);
        }
        if (e) {
            if (bad) *bad = wr;
            return e;
        }
    }
    return 0;
}

static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
    fake_ctx *c = FCTX(qp->context);
    for (; wr; wr = wr->next) {
        int e = 0;
        if (wr->num_sge != 1 || c->qp_state == IBV_QPS_RESET) e = EINVAL;
        else if (!lkey_covers(c, wr->sg_list[0].lkey, wr->sg_list[0].addr, wr->sg_list[0].length))
            e = EINVAL;
        if (!e) {
            char err[512] = "";
            int rc = c->eng.prov->post_recv(&c->eng, (uintptr_t)wr->sg_list[0].addr,
                                            wr->sg_list[0].length, wr->sg_list[0].lkey,
                                            wr->wr_id, err, sizeof(err));
            if (rc < 0) e = engine_errno(rc);
        }
        if (e) {
            if (bad) *bad = wr;
            return e;
        }
    }
    return 0;
}

static int fake_poll_cq(struct ibv_cq *cq, int num, struct ibv_wc *wc) {
    fake_ctx *c = FCTX(cq->context);
    tp_wc got[64];
    if (num > 64) num = 64;
    char err[512] = "";
    int n = c->eng.prov->poll(&c->eng, got, num, err, sizeof(err));
    if (n < 0) {
        fprintf(stderr, FAKE_LOG "poll_cq: %s\n", err);
        return -1;
    }
    /* The provider spins on an empty queue (completions land in host
     * memory on hardware); here the peer may be a thread of this process
     * needing the core, so an empty poll now and then gives it up. */
    if (n == 0 && ++c->empty_polls % 16 == 0) sched_yield();
    for (int i = 0; i < n; i++) {
        memset(&wc[i], 0, sizeof(wc[i]));
        wc[i].wr_id = got[i].wr_id;
        wc[i].status = (enum ibv_wc_status)got[i].status;
        wc[i].opcode = got[i].opcode == TP_WC_RECV ? IBV_WC_RECV : IBV_WC_SEND;
        wc[i].byte_len = got[i].byte_len;
        wc[i].qp_num = c->eng.local.qpn;
        if (got[i].has_imm) {
            wc[i].wc_flags = IBV_WC_WITH_IMM;
            wc[i].imm_data = htonl(got[i].imm);
        }
    }
    return n;
}
