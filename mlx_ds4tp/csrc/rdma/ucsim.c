/* mlx_ds4tp._verbs provider "ucsim": an emulated Apple Thunderbolt RDMA UC
 * device, for machines without one. One UDP socket per device carries one
 * datagram per message; the device reproduces the Apple driver's behaviour
 * (docs/design.md's table of DS4_TP_UCSIM_FAULTS):
 *   - UC queue pairs only (RC and UD refused);
 *   - messages above max_msg (16 KiB) are never delivered, yet the send
 *     completes with SUCCESS;
 *   - RDMA WRITE is accepted, completes with SUCCESS, and never executes;
 *   - in-order delivery; a lost message is a PSN gap the receiver skips
 *     (no error anywhere: the next message takes the lost one's receive);
 *     datagrams for an old or other queue pair are dropped;
 *   - SEND_WITH_IMM: the 32-bit immediate rides in the datagram header and
 *     comes out in the receive completion (has_imm), as on verbs hardware;
 *   - a message that arrives while no receive is posted kills that
 *     direction for good (kill_unposted);
 *   - a post past post_cap (63) outstanding receives or sends in flight
 *     fails with ENOMEM, whatever depths the queue pair was created with;
 *   - the one-direction drop of a fresh pair, random loss, the loss of one
 *     chosen hot-path message (drop_nth), a receive queue cap at creation
 *     and a one-way delay, on request.
 *
 * There is no background thread (two processes on two cores must not
 * starve each other): datagrams are processed lazily inside poll, but each
 * carries its kernel arrival timestamp, and each posted receive the time it
 * was posted, so "was a receive posted when this message arrived?" is
 * decided on the arrival time, not on when we got round to looking. */

#include "_verbs_priv.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------
 * Wire format and state.
 * --------------------------------------------------------------------- */

#define UC_MAGIC UINT32_C(0x55435332) /* "UCS2": the header carries imm */
#define UC_MTU 1024u                  /* path MTU of the Apple recipe: PSNs count packets */
#define UC_SMALL 64u                  /* messages up to this size dodge the drop faults */
#define UC_LOSS_GRACE 64u             /* loss=P spares each build's first messages */
#define UC_MAX_DGRAM 65000u           /* what one UDP datagram can carry */
#define UC_SPIN_NS 50000u             /* spin this long before blocking in ppoll */
#define UC_RCVBUF (16 << 20)          /* holds a 2 MiB bulk burst many times over */
/* Why 63: Apple's driver takes ibv_create_qp with large work-request caps,
 * then fails ibv_post_recv with ENOMEM at the 64th outstanding receive
 * (measured: "ibv_post_recv[63/256] ret=-12") and ibv_post_send at the 64th
 * send in flight. MLX's JACCL caps its queues at 32 for this reason. */
#define UC_POST_CAP 63

/* Wire opcodes (uc_hdr.opcode). */
#define UC_WIRE_SEND 0u
#define UC_WIRE_SEND_IMM 2u

typedef struct {
    uint32_t magic, dst_qpn, src_qpn, psn, opcode, len, imm; /* network byte order */
} uc_hdr;

typedef struct {
    uintptr_t addr;
    uint32_t len;
    uint64_t wr_id;
    uint64_t posted_ns; /* CLOCK_REALTIME when posted */
} uc_rwr;

typedef struct {
    tp_wc wc;
    uint64_t send_index; /* sends: frees the send queue up to here when reaped */
} uc_cqe;

typedef struct {
    /* faults */
    int drop_l2w, drop_w2l; /* builds (setup_attempt < K) that drop > 64 B */
    uint64_t nth_l2w, nth_w2l; /* drop_nth: 1-based hot-path message index, 0 = off */
    int kill_unposted;
    double loss;
    uint64_t seed;
    uint32_t max_msg;
    int max_recv;
    int post_cap; /* outstanding receives / sends in flight a post may reach */
    uint64_t delay_ns;

    int fd;
    struct sockaddr_in self;
    uint32_t psn_base, last_qpn;

    int connected, attempt;
    uint32_t qpn, sq_psn, rq_psn, peer_qpn;
    struct sockaddr_in peer;
    uint64_t rtr_ns;
    uint64_t msgs_sent;
    uint64_t hot_sent; /* tagged (hot-path) messages over 64 bytes sent on this build */
    uint64_t rng;

    uc_rwr *rq;
    int rq_cap, rq_head, rq_count;
    uc_cqe *cq;
    int cq_cap, cq_head, cq_count, cq_overrun;
    uint64_t sq_posted, sq_freed;
    int sq_cap;

    uint8_t *scratch; /* one datagram: header + payload */
    int pending;      /* scratch holds a datagram not yet visible (delay_us) */
    size_t pending_len;
    uint64_t pending_at_ns; /* arrival + delay, CLOCK_REALTIME */
    uint32_t kernel_drops;
    uint64_t ctl_skip_until_ns;
} ucsim;

#define UC(dev) ((ucsim *)(dev)->impl)

/* Timestamps are compared at the granularity the kernel stamps with, so a
 * message stamped in the same tick as the post counts as posted in time. */
#if defined(SO_TIMESTAMPNS)
#define UC_TS_GRAIN 1u
#else
#define UC_TS_GRAIN 1000u
#endif

static uint64_t uc_now_stamp(void) { return tp_real_ns() / UC_TS_GRAIN * UC_TS_GRAIN; }

static uint32_t uc_pkts(uint32_t len) { return len ? (len + UC_MTU - 1) / UC_MTU : 1; }

static uint64_t uc_rand(ucsim *u) { /* xorshift64*: deterministic from seed */
    u->rng ^= u->rng >> 12;
    u->rng ^= u->rng << 25;
    u->rng ^= u->rng >> 27;
    return u->rng * UINT64_C(0x2545f4914f6cdd1d);
}

/* ------------------------------------------------------------------------
 * Fault string: DS4_TP_UCSIM_FAULTS.
 * --------------------------------------------------------------------- */

/* drop_nth=l2w:N / w2l:N loses exactly one message, for tests of a loss
 * that nothing follows: on every build, the sender's N-th hot-path message
 * over 64 bytes (counted from 1; tagged gate chunks and bulk chunks, not
 * the warm-up's plain sends, so warm-up resends never shift it). */
#define UC_FAULT_FORMS \
    "drop=l2w:K, drop=w2l:K, drop_nth=l2w:N, drop_nth=w2l:N (N >= 1), kill_unposted=0|1, " \
    "loss=P (0..1), seed=S, max_msg=N (1..65000), max_recv=N (>= 1), post_cap=N (>= 1), " \
    "delay_us=N"

static int parse_u64(const char *s, uint64_t *out) {
    if (!*s) return 0;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || *s == '-') return 0;
    *out = v;
    return 1;
}

static int uc_parse_faults(ucsim *u, const char *faults, char *err, size_t errlen) {
    u->kill_unposted = 1;
    u->max_msg = TP_MAX_MSG;
    u->post_cap = UC_POST_CAP;
    if (!faults) return TP_OK;
    char buf[512];
    if (strlen(faults) >= sizeof(buf)) {
        tp_errf(err, errlen, "tp ucsim: DS4_TP_UCSIM_FAULTS too long (%zu chars)", strlen(faults));
        return TP_EINVAL;
    }
    strcpy(buf, faults);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        while (*item == ' ' || *item == '\t') item++;
        char *tail = item + strlen(item);
        while (tail > item && (tail[-1] == ' ' || tail[-1] == '\t')) *--tail = '\0';
        if (!*item) continue;
        char *eq = strchr(item, '=');
        int ok = 0;
        uint64_t v = 0;
        if (eq) {
            *eq = '\0';
            const char *key = item, *val = eq + 1;
            if (!strcmp(key, "drop")) {
                if ((!strncmp(val, "l2w:", 4) || !strncmp(val, "w2l:", 4)) &&
                    parse_u64(val + 4, &v) && v <= 4096) {
                    *(val[0] == 'l' ? &u->drop_l2w : &u->drop_w2l) = (int)v;
                    ok = 1;
                }
            } else if (!strcmp(key, "drop_nth")) {
                if ((!strncmp(val, "l2w:", 4) || !strncmp(val, "w2l:", 4)) &&
                    parse_u64(val + 4, &v) && v >= 1) {
                    *(val[0] == 'l' ? &u->nth_l2w : &u->nth_w2l) = v;
                    ok = 1;
                }
            } else if (!strcmp(key, "kill_unposted")) {
                if (parse_u64(val, &v) && v <= 1) u->kill_unposted = (int)v, ok = 1;
            } else if (!strcmp(key, "loss")) {
                char *end = NULL;
                errno = 0;
                double p = strtod(val, &end);
                if (*val && !*end && !errno && p >= 0.0 && p <= 1.0) u->loss = p, ok = 1;
            } else if (!strcmp(key, "seed")) {
                if (parse_u64(val, &v)) u->seed = v, ok = 1;
            } else if (!strcmp(key, "max_msg")) {
                if (parse_u64(val, &v) && v >= 1 && v <= UC_MAX_DGRAM) u->max_msg = (uint32_t)v, ok = 1;
            } else if (!strcmp(key, "max_recv")) {
                if (parse_u64(val, &v) && v >= 1 && v <= 1u << 20) u->max_recv = (int)v, ok = 1;
            } else if (!strcmp(key, "post_cap")) {
                if (parse_u64(val, &v) && v >= 1 && v <= 1u << 20) u->post_cap = (int)v, ok = 1;
            } else if (!strcmp(key, "delay_us")) {
                if (parse_u64(val, &v) && v <= 10000000u) u->delay_ns = v * 1000u, ok = 1;
            }
            *eq = '=';
        }
        if (!ok) {
            tp_errf(err, errlen, "tp ucsim: bad DS4_TP_UCSIM_FAULTS item '%s'; valid forms: %s",
                    item, UC_FAULT_FORMS);
            return TP_EINVAL;
        }
    }
    return TP_OK;
}

/* ------------------------------------------------------------------------
 * Open and queue-pair life cycle.
 * --------------------------------------------------------------------- */

static void uc_free(ucsim *u) {
    if (!u) return;
    if (u->fd >= 0) close(u->fd);
    free(u->rq);
    free(u->cq);
    free(u->scratch);
    free(u);
}

int tp_ucsim_open(tp_dev *dev, const char *bind_ipv4, const char *faults, char *err,
                  size_t errlen) {
    ucsim *u = calloc(1, sizeof(*u));
    if (!u) {
        tp_errf(err, errlen, "tp ucsim: out of memory");
        return TP_ESYS;
    }
    u->fd = -1;
    int rc = uc_parse_faults(u, faults, err, errlen);
    if (rc < 0) goto fail;
    const char *ip = bind_ipv4 && bind_ipv4[0] ? bind_ipv4 : "127.0.0.1";
    u->self.sin_family = AF_INET;
    if (inet_pton(AF_INET, ip, &u->self.sin_addr) != 1 || u->self.sin_addr.s_addr == INADDR_ANY) {
        /* The address becomes our GID, which the peer sends to. */
        tp_errf(err, errlen, "tp ucsim: bind address '%s' is not a specific IPv4 address (the "
                "peer sends to it); pass the control channel's local address", ip);
        rc = TP_EINVAL;
        goto fail;
    }
    u->scratch = malloc(sizeof(uc_hdr) + UC_MAX_DGRAM);
    u->fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (!u->scratch || u->fd < 0) {
        tp_errf(err, errlen, "tp ucsim: datagram socket: %s", strerror(errno));
        rc = TP_ESYS;
        goto fail;
    }
    if (bind(u->fd, (struct sockaddr *)&u->self, sizeof(u->self)) != 0) {
        tp_errf(err, errlen, "tp ucsim: bind %s:0: %s (is %s an address of this machine?)", ip,
                strerror(errno), ip);
        rc = TP_ESYS;
        goto fail;
    }
    socklen_t sl = sizeof(u->self);
    getsockname(u->fd, (struct sockaddr *)&u->self, &sl);
    int one = 1;
#if defined(SO_TIMESTAMPNS)
    setsockopt(u->fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof(one));
#else
    setsockopt(u->fd, SOL_SOCKET, SO_TIMESTAMP, &one, sizeof(one));
#endif
#if defined(SO_RXQ_OVFL)
    setsockopt(u->fd, SOL_SOCKET, SO_RXQ_OVFL, &one, sizeof(one));
#endif
    /* The receiver only reads while it polls, so a whole bulk burst must
     * fit in the kernel queue: an overflow would look like link loss. */
    int want = UC_RCVBUF, got = 0;
    socklen_t gl = sizeof(got);
#if defined(SO_RCVBUFFORCE)
    if (setsockopt(u->fd, SOL_SOCKET, SO_RCVBUFFORCE, &want, sizeof(want)) != 0)
#endif
        setsockopt(u->fd, SOL_SOCKET, SO_RCVBUF, &want, sizeof(want));
    getsockopt(u->fd, SOL_SOCKET, SO_RCVBUF, &got, &gl);
#if defined(__linux__)
    got /= 2; /* Linux reports twice what was granted (its bookkeeping share) */
#endif
    if (got < want)
        fprintf(stderr, TP_LOG "ucsim: datagram receive buffer is %d KiB, wanted %d KiB (run as "
                "root or raise net.core.rmem_max); a bulk burst may overflow it and look like "
                "loss\n", got >> 10, want >> 10);
    /* macOS caps a UDP datagram at the send buffer size (9216 by default). */
    int sb = 4 << 20;
    setsockopt(u->fd, SOL_SOCKET, SO_SNDBUF, &sb, sizeof(sb));

    u->psn_base = (uint32_t)tp_random64() & 0xffffff;
    /* A message is visible delay_us after it arrived, later than the TCP
     * word the peer wrote after sending it: not a loss (TP_LOST_GRACE_NS). */
    dev->lost_grace_ns += u->delay_ns;
    dev->prov = &tp_ucsim_provider;
    dev->impl = u;
    snprintf(dev->name, sizeof(dev->name), "ucsim");
    return TP_OK;
fail:
    uc_free(u);
    return rc;
}

static int uc_build(tp_dev *dev, int qp_type, int attempt, int *cq_depth, int *send_wr,
                    int *recv_wr, char *err, size_t errlen) {
    ucsim *u = UC(dev);
    u->connected = 0;
    if (qp_type != TP_QPT_UC) {
        /* Why: AppleThunderboltRDMA implements UC only; RC and UD queue
         * pairs fail with ENOTSUP, so ucsim refuses them the same way. */
        tp_errf(err, errlen, "tp rdma: ucsim refused a %s queue pair: Thunderbolt RDMA offers "
                "UC queue pairs only (use TP_QPT_UC)", qp_type == TP_QPT_RC ? "RC" : "UD");
        return TP_ENOTSUP;
    }
    int cq = *cq_depth > 65536 ? 65536 : *cq_depth;
    int swr = *send_wr > 16384 ? 16384 : *send_wr;
    int rwr = *recv_wr > 16384 ? 16384 : *recv_wr;
    if (u->max_recv && rwr > u->max_recv) rwr = u->max_recv;
    uc_rwr *rq = realloc(u->rq, sizeof(*rq) * (size_t)rwr);
    if (rq) u->rq = rq;
    uc_cqe *cqe = realloc(u->cq, sizeof(*cqe) * (size_t)cq);
    if (cqe) u->cq = cqe;
    if (!rq || !cqe) {
        tp_errf(err, errlen, "tp ucsim: out of memory for queues (cq %d, recv %d)", cq, rwr);
        return TP_ESYS;
    }
    u->rq_cap = rwr;
    u->rq_head = u->rq_count = 0;
    u->cq_cap = cq;
    u->cq_head = u->cq_count = u->cq_overrun = 0;
    u->sq_cap = swr;
    u->sq_posted = u->sq_freed = 0;
    u->msgs_sent = 0;
    u->hot_sent = 0;
    u->attempt = attempt;
    /* Loss is deterministic per (seed, role, build): reruns reproduce. */
    u->rng = (u->seed + 1) * UINT64_C(0x9e3779b97f4a7c15) ^
             ((uint64_t)dev->role << 40) ^ ((uint64_t)attempt << 20) ^ UINT64_C(0x5bd1e995);
    if (!u->rng) u->rng = 1;
    /* A new queue pair number on every build, so the peer's datagrams for
     * the previous pair are recognisably stale. */
    do {
        u->qpn = (uint32_t)tp_random64() & 0xffffff;
    } while (u->qpn == 0 || u->qpn == u->last_qpn);
    u->last_qpn = u->qpn;
    u->sq_psn = (u->psn_base + (uint32_t)attempt * 0x1000u) & 0xffffff;
    *cq_depth = cq;
    *send_wr = swr;
    *recv_wr = rwr;

    tp_info *li = &dev->local;
    memset(li, 0, sizeof(*li));
    li->qpn = u->qpn;
    li->psn = u->sq_psn;
    li->mtu = UC_MTU;
    li->lid = ntohs(u->self.sin_port);
    li->link_layer = 2; /* IBV_LINK_LAYER_ETHERNET: addressed by GID */
    li->gid[10] = li->gid[11] = 0xff;
    memcpy(&li->gid[12], &u->self.sin_addr, 4);
    return TP_OK;
}

static int uc_connect(tp_dev *dev, const tp_info *peer, char *err, size_t errlen) {
    ucsim *u = UC(dev);
    static const uint8_t v4prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (memcmp(peer->gid, v4prefix, 12) != 0 || peer->lid == 0) {
        /* Why: the Apple driver only connects through the IPv4-mapped GID. */
        tp_errf(err, errlen, "tp ucsim: peer GID is not IPv4-mapped (::ffff:a.b.c.d) or its "
                "port (lid) is 0 (lid %u); exchange tp_info from tp_local_info", peer->lid);
        return TP_EINVAL;
    }
    memset(&u->peer, 0, sizeof(u->peer));
    u->peer.sin_family = AF_INET;
    memcpy(&u->peer.sin_addr, &peer->gid[12], 4);
    u->peer.sin_port = htons(peer->lid);
    u->peer_qpn = peer->qpn & 0xffffff;
    u->rq_psn = peer->psn & 0xffffff;
    /* Before RTR the queue pair drops what arrives, as the hardware does. */
    u->rtr_ns = uc_now_stamp();
    u->connected = 1;
    return TP_OK;
}

static int uc_reg(tp_dev *dev, tp_mr *mr, char *err, size_t errlen) {
    (void)err, (void)errlen;
    mr->lkey = (uint32_t)(mr - dev->mrs) + 0x100;
    mr->handle = NULL;
    return TP_OK;
}

static void uc_dereg(tp_dev *dev, tp_mr *mr) { (void)dev, (void)mr; }

static void uc_close(tp_dev *dev) {
    uc_free(UC(dev));
    dev->impl = NULL;
}

/* ------------------------------------------------------------------------
 * Completion queue.
 * --------------------------------------------------------------------- */

static void uc_push(ucsim *u, uint64_t wr_id, int status, int opcode, uint32_t byte_len,
                    uint64_t send_index, int has_imm, uint32_t imm) {
    if (u->cq_count == u->cq_cap) {
        /* Real hardware raises a CQ overrun and the queue pair stops. */
        u->cq_overrun = 1;
        return;
    }
    uc_cqe *e = &u->cq[(u->cq_head + u->cq_count++) % u->cq_cap];
    e->wc.wr_id = wr_id;
    e->wc.status = status;
    e->wc.opcode = opcode;
    e->wc.byte_len = byte_len;
    e->wc.imm = imm;
    e->wc.has_imm = has_imm;
    e->send_index = send_index;
}

/* ------------------------------------------------------------------------
 * Receive side: datagrams in, matched against posted receives.
 * --------------------------------------------------------------------- */

/* Decide the fate of the datagram in scratch, which arrived (and became
 * visible, after delay_us) at time t. */
static void uc_deliver(tp_dev *dev, ucsim *u, uint64_t t) {
    uc_hdr h;
    memcpy(&h, u->scratch, sizeof(h));
    const uint32_t dst = ntohl(h.dst_qpn), src = ntohl(h.src_qpn), psn = ntohl(h.psn);
    const uint32_t len = ntohl(h.len), wire_op = ntohl(h.opcode);
    if (ntohl(h.magic) != UC_MAGIC || len != u->pending_len - sizeof(h) ||
        (wire_op != UC_WIRE_SEND && wire_op != UC_WIRE_SEND_IMM)) {
        dev->stats.dropped_stale++; /* not ours */
        return;
    }
    /* A re-created pair has a new number: datagrams for the previous one,
     * from the peer's previous one, or from before our RTR are dropped. */
    if (!u->connected || dst != u->qpn || src != u->peer_qpn || t < u->rtr_ns) {
        dev->stats.dropped_stale++;
        return;
    }
    /* UC sequence rules: an older PSN is a duplicate; a newer one means
     * messages in between were lost, which UC skips silently. */
    const uint32_t ahead = (psn - u->rq_psn) & 0xffffff;
    if (ahead & 0x800000) {
        dev->stats.dropped_stale++;
        return;
    }
    u->rq_psn = (psn + uc_pkts(len)) & 0xffffff;
    if (dev->stats.direction_dead) {
        dev->stats.dropped_unposted++;
        return;
    }
    /* Receives are consumed in order, so the queue at time t held exactly
     * the not-yet-consumed receives posted at or before t: if the head was
     * posted after t (or there is none), nothing was posted on arrival. */
    uc_rwr *r = u->rq_count ? &u->rq[u->rq_head] : NULL;
    if (!r || r->posted_ns > t) {
        dev->stats.dropped_unposted++;
        if (u->kill_unposted) {
            /* Why: on Apple's Thunderbolt RDMA a UC message that reaches a
             * queue pair with no receive posted kills that direction for
             * good; only a new queue pair delivers again. */
            dev->stats.direction_dead = 1;
            fprintf(stderr, TP_LOG "ucsim: a %u-byte message arrived with no receive posted; "
                    "this direction of qpn 0x%06x is dead (as on Thunderbolt UC)\n", len, u->qpn);
        }
        return;
    }
    u->rq_head = (u->rq_head + 1) % u->rq_cap;
    u->rq_count--;
    if (len > r->len) {
        /* As on hardware, an error completion carries no immediate data. */
        uc_push(u, r->wr_id, TP_WC_LOC_LEN_ERR, TP_WC_RECV, len, 0, 0, 0);
        return;
    }
    memcpy((void *)r->addr, u->scratch + sizeof(h), len);
    uc_push(u, r->wr_id, TP_WC_SUCCESS, TP_WC_RECV, len, 0, wire_op == UC_WIRE_SEND_IMM,
            ntohl(h.imm));
}

/* Read one datagram into scratch. 1: pending set, 0: nothing there. */
static int uc_read_one(ucsim *u, char *err, size_t errlen) {
    union {
        char buf[256];
        struct cmsghdr align;
    } cb;
    struct iovec iov = {u->scratch, sizeof(uc_hdr) + UC_MAX_DGRAM};
    struct msghdr mh;
    memset(&mh, 0, sizeof(mh));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cb.buf;
    mh.msg_controllen = sizeof(cb.buf);
    ssize_t n = recvmsg(u->fd, &mh, MSG_DONTWAIT);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNREFUSED)
            return 0;
        tp_errf(err, errlen, "tp ucsim: recvmsg: %s", strerror(errno));
        return TP_ESYS;
    }
    uint64_t at = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET) continue;
#if defined(SO_TIMESTAMPNS)
        if (c->cmsg_type == SCM_TIMESTAMPNS) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(c), sizeof(ts));
            at = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
        }
#else
        if (c->cmsg_type == SCM_TIMESTAMP) {
            struct timeval tv;
            memcpy(&tv, CMSG_DATA(c), sizeof(tv));
            at = (uint64_t)tv.tv_sec * 1000000000u + (uint64_t)tv.tv_usec * 1000u;
        }
#endif
#if defined(SO_RXQ_OVFL)
        if (c->cmsg_type == SO_RXQ_OVFL) {
            uint32_t drops;
            memcpy(&drops, CMSG_DATA(c), sizeof(drops));
            if (drops != u->kernel_drops)
                fprintf(stderr, TP_LOG "ucsim: the kernel dropped %u datagrams so far (receive "
                        "buffer full); they look like link loss\n", drops);
            u->kernel_drops = drops;
        }
#endif
    }
    /* No stamp (should not happen): now is later than the real arrival,
     * which can only excuse a race, never invent one. */
    if (!at) at = uc_now_stamp();
    if ((mh.msg_flags & MSG_TRUNC) || (size_t)n < sizeof(uc_hdr)) {
        u->pending = 0;
        return 1; /* garbage: skip it, keep reading */
    }
    u->pending = 1;
    u->pending_len = (size_t)n;
    u->pending_at_ns = at + u->delay_ns;
    return 1;
}

/* Process every datagram that has arrived and is visible by now. */
static int uc_ingest(tp_dev *dev, ucsim *u, char *err, size_t errlen) {
    for (int budget = 0; budget < 512; budget++) {
        if (!u->pending) {
            int rc = uc_read_one(u, err, errlen);
            if (rc <= 0) return rc;
            if (!u->pending) continue;
        }
        if (u->delay_ns && u->pending_at_ns > tp_real_ns()) return TP_OK;
        u->pending = 0;
        uc_deliver(dev, u, u->pending_at_ns);
    }
    return TP_OK;
}

static int uc_post_recv(tp_dev *dev, uintptr_t addr, uint32_t len, uint32_t lkey,
                        uint64_t wr_id, char *err, size_t errlen) {
    (void)lkey;
    ucsim *u = UC(dev);
    if (u->rq_count == u->rq_cap) {
        /* Arrived messages may already have consumed receives. */
        int rc = uc_ingest(dev, u, err, errlen);
        if (rc < 0) return rc;
    }
    if (u->rq_count == u->rq_cap) {
        tp_errf(err, errlen, "tp rdma: receive queue full: %d receives outstanding (granted "
                "depth %d%s)", u->rq_count, u->rq_cap, u->max_recv ? ", max_recv fault" : "");
        return TP_ENOMEM;
    }
    if (u->rq_count >= u->post_cap) {
        if (uc_ingest(dev, u, err, errlen) < 0) return TP_ESYS;
        if (u->rq_count >= u->post_cap) {
            tp_errf(err, errlen, "tp rdma: ucsim refused a receive: %d outstanding already "
                    "(post_cap %d; Apple's driver fails the post past 63 with ENOMEM whatever the "
                    "granted depth, here %d)", u->rq_count, u->post_cap, u->rq_cap);
            return TP_ENOMEM;
        }
    }
    uc_rwr *r = &u->rq[(u->rq_head + u->rq_count) % u->rq_cap];
    r->addr = addr;
    r->len = len;
    r->wr_id = wr_id;
    r->posted_ns = uc_now_stamp(); /* before the post returns: causality */
    u->rq_count++;
    return TP_OK;
}

/* ------------------------------------------------------------------------
 * Send side: faults are applied here, where the role and build are known.
 * --------------------------------------------------------------------- */

static int uc_transmit(ucsim *u, uint32_t psn, const void *payload, uint32_t len, int with_imm,
                       uint32_t imm, char *err, size_t errlen) {
    uc_hdr h = {htonl(UC_MAGIC), htonl(u->peer_qpn), htonl(u->qpn), htonl(psn),
                htonl(with_imm ? UC_WIRE_SEND_IMM : UC_WIRE_SEND), htonl(len),
                htonl(with_imm ? imm : 0)};
    struct iovec iov[2] = {{&h, sizeof(h)}, {(void *)payload, len}};
    struct msghdr mh;
    memset(&mh, 0, sizeof(mh));
    mh.msg_name = &u->peer;
    mh.msg_namelen = sizeof(u->peer);
    mh.msg_iov = iov;
    mh.msg_iovlen = 2;
    const uint64_t give_up = tp_mono_ns() + 2000000000u;
    for (;;) {
        if (sendmsg(u->fd, &mh, MSG_DONTWAIT) >= 0) return TP_OK;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ENOBUFS)
            break;
        if (tp_mono_ns() > give_up) break;
        struct pollfd p = {u->fd, POLLOUT, 0};
        tp_poll_fds(&p, 1, 1000000u);
    }
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &u->peer.sin_addr, ip, sizeof(ip));
    tp_errf(err, errlen, "tp ucsim: sendmsg to %s:%u (%u bytes): %s", ip, ntohs(u->peer.sin_port),
            len, strerror(errno));
    return TP_ESYS;
}

static int uc_post_send(tp_dev *dev, uintptr_t addr, uint32_t len, uint32_t lkey,
                        uint64_t wr_id, int opcode, uint32_t imm, int signaled, char *err,
                        size_t errlen) {
    (void)lkey;
    ucsim *u = UC(dev);
    if (!u->connected) {
        tp_errf(err, errlen, "tp_post_send: queue pair not connected");
        return TP_EINVAL;
    }
    if (u->sq_posted - u->sq_freed >= (uint64_t)u->sq_cap) {
        tp_errf(err, errlen, "tp rdma: send queue full: %d work requests outstanding; reap send "
                "completions with tp_poll (unsignaled sends free only with a later signaled one)",
                u->sq_cap);
        return TP_ENOMEM;
    }
    if (u->sq_posted - u->sq_freed >= (uint64_t)u->post_cap) {
        tp_errf(err, errlen, "tp rdma: ucsim refused a send: %llu in flight already (post_cap %d; "
                "Apple's driver fails the post past 63 with ENOMEM whatever the granted depth, "
                "here %d); reap send completions with tp_poll",
                (unsigned long long)(u->sq_posted - u->sq_freed), u->post_cap, u->sq_cap);
        return TP_ENOMEM;
    }
    const uint32_t psn = u->sq_psn;
    u->sq_psn = (u->sq_psn + uc_pkts(len)) & 0xffffff;
    int transmit = 1;
    if (opcode == TP_OP_WRITE) {
        /* Why: the Apple driver accepts RDMA WRITE work requests and
         * completes them, but never executes them; the data plane must be
         * two-sided SEND/RECV. */
        transmit = 0;
    } else {
        const uint64_t index = u->msgs_sent++;
        const int drop_builds = dev->role == 0 ? u->drop_l2w : u->drop_w2l;
        const uint64_t nth = dev->role == 0 ? u->nth_l2w : u->nth_w2l;
        const uint64_t hot = opcode == TP_OP_SEND_IMM && len > UC_SMALL ? ++u->hot_sent : 0;
        if (len > u->max_msg) {
            /* Why: messages above 16 KiB are never delivered, and the
             * sender is not told: its completion still says SUCCESS. */
            transmit = 0;
            dev->stats.dropped_oversize++;
        } else if (len > UC_SMALL && u->attempt < drop_builds) {
            /* The one-direction drop of a fresh pair: full-size messages
             * vanish while 64-byte ones pass (hence full-size warm-up). */
            transmit = 0;
            dev->stats.dropped_fault++;
        } else if (nth && hot == nth) {
            transmit = 0;
            dev->stats.dropped_fault++;
        } else if (len > UC_SMALL && u->loss > 0 && index >= UC_LOSS_GRACE &&
                   (double)(uc_rand(u) >> 11) * 0x1p-53 < u->loss) {
            transmit = 0;
            dev->stats.dropped_fault++;
        }
    }
    if (transmit) {
        int rc = uc_transmit(u, psn, (const void *)addr, len, opcode == TP_OP_SEND_IMM, imm,
                             err, errlen);
        if (rc < 0) return rc;
    }
    const uint64_t index = u->sq_posted++;
    if (signaled) uc_push(u, wr_id, TP_WC_SUCCESS, TP_WC_SEND, len, index, 0, 0);
    return TP_OK;
}

/* ------------------------------------------------------------------------
 * Polling and waiting.
 * --------------------------------------------------------------------- */

static int uc_poll(tp_dev *dev, tp_wc *wc, int max, char *err, size_t errlen) {
    ucsim *u = UC(dev);
    int rc = uc_ingest(dev, u, err, errlen);
    if (rc < 0) return rc;
    if (u->cq_overrun) {
        tp_errf(err, errlen, "tp ucsim: completion queue overrun (depth %d): poll more often or "
                "build a deeper queue", u->cq_cap);
        return TP_ESYS;
    }
    int n = 0;
    while (n < max && u->cq_count) {
        const uc_cqe *e = &u->cq[u->cq_head];
        u->cq_head = (u->cq_head + 1) % u->cq_cap;
        u->cq_count--;
        /* A reaped signaled send frees its slot and every unsignaled one
         * before it, as on hardware. */
        if (e->wc.opcode == TP_WC_SEND) u->sq_freed = e->send_index + 1;
        wc[n++] = e->wc;
    }
    return n;
}

/* Spin briefly (a gate's answer usually comes within microseconds), then
 * block in ppoll on the datagram socket and the control socket, so two
 * processes on two cores do not starve each other and a closed control
 * socket wakes us at once.
 * The spin yields: both ranks of an emulated pair are processes of one
 * machine, and when the scheduler puts them on the same core (the other
 * cores busy) the peer whose message we wait for can only run once we stop.
 * A bare spin held the core for all of UC_SPIN_NS on every gate, each way:
 * about 88 us a gate instead of about 10. sched_yield hands the core to the
 * peer at once when it is runnable here, and costs one syscall otherwise; a
 * yield that gave the core away blocks at once (tp_yield_lost, csrc/util.c). */
static int uc_idle(tp_dev *dev, uint64_t deadline_ns, uint64_t waited_ns) {
    ucsim *u = UC(dev);
    if (waited_ns < UC_SPIN_NS && !tp_yield_lost()) return TP_OK;
    const uint64_t now = tp_mono_ns();
    uint64_t slice = deadline_ns > now ? deadline_ns - now : 0;
    if (slice > 1000000u) slice = 1000000u;
    struct pollfd p[2] = {{u->fd, POLLIN, 0}, {dev->control_fd, POLLIN, 0}};
    if (u->pending) {
        /* The datagram in hand becomes visible at a known time. */
        const uint64_t rnow = tp_real_ns();
        const uint64_t until = u->pending_at_ns > rnow ? u->pending_at_ns - rnow : 0;
        if (until < slice) slice = until;
        p[0].events = 0;
    }
    const int watch_ctl = dev->control_fd >= 0 && now >= u->ctl_skip_until_ns;
    int r = tp_poll_fds(p, watch_ctl ? 2 : 1, slice);
    if (r > 0 && watch_ctl && p[1].revents) {
        if (tp_fd_closed(dev->control_fd)) return TP_EPEER;
        /* Unread control frames keep the fd readable; stop watching it for
         * a while (the core still samples it every millisecond). */
        u->ctl_skip_until_ns = now + 1000000u;
    }
    return TP_OK;
}

/* ------------------------------------------------------------------------
 * For the tests' fake libibverbs (tests/fake_ibverbs/), which runs this
 * engine behind rdma-core's ABI: there the verbs caller picks the PSNs
 * (ibv_modify_qp to RTS) and the port's LID names the datagram port.
 * --------------------------------------------------------------------- */

void tp_ucsim_set_send_psn(tp_dev *dev, uint32_t psn) { UC(dev)->sq_psn = psn & 0xffffff; }

uint16_t tp_ucsim_port(const tp_dev *dev) { return ntohs(UC(dev)->self.sin_port); }

const tp_provider tp_ucsim_provider = {
    "ucsim", uc_build, uc_connect, uc_reg, uc_dereg, uc_post_recv, uc_post_send,
    uc_poll, uc_idle, uc_close,
};
