/* mlx_ds4tp._verbs core: the public API of _verbs.h on top of a provider
 * (_verbs_ibv.c or _verbs_ucsim.c), the memory-registration table, and the
 * hot loops (decode gate window, window drain, bulk rounds).
 *
 * The hot loops exist to respect two facts of Apple's Thunderbolt RDMA
 * (UC queue pairs; see DESIGN.md and the seeds):
 *   1. a message that reaches a queue pair with no receive posted does not
 *      just vanish, that direction stops delivering for good, so every send
 *      must be preceded by a receive the peer provably posted;
 *   2. UC never reports loss: no error completion anywhere, the receive
 *      meant for the lost message stays posted and the peer's next message
 *      lands in it. Every hot-path message therefore carries a sequence tag
 *      (immediate data, "Sequence tags" in _verbs.h) that the receiver checks
 *      against what the receive was posted for (TP_ELOST on a mismatch); a
 *      loss with nothing behind it on the queue pair is revealed by the
 *      peer's next word on the TCP data socket ("Loss with nothing behind
 *      it", above hp_pump); every wait is bounded and names what it waited
 *      for.
 * Both ranks run the same gate sequence, so all matching is by order: the
 * k-th message the peer sends lands in the k-th receive we posted. */

#include "_verbs_priv.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#if defined(__linux__) || defined(__APPLE__)
#include <sys/random.h> /* getentropy */
#endif

/* ------------------------------------------------------------------------
 * Small helpers shared with the providers.
 * --------------------------------------------------------------------- */

void tp_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

uint64_t tp_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t tp_real_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t tp_random64(void) {
    uint64_t v = 0;
#if defined(__linux__) || defined(__APPLE__)
    if (getentropy(&v, sizeof(v)) == 0 && v) return v;
#endif
    /* Fallback: mix clocks, pid and a counter (splitmix64 finaliser). */
    static uint64_t counter;
    v = tp_real_ns() ^ (tp_mono_ns() << 17) ^ ((uint64_t)getpid() << 40) ^ ++counter;
    v = (v ^ (v >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    v = (v ^ (v >> 27)) * UINT64_C(0x94d049bb133111eb);
    return v ^ (v >> 31);
}

int tp_fd_closed(int fd) {
    if (fd < 0) return 0;
    char byte;
    ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return 1;
    if (n > 0) return 0;
    return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

int tp_poll_fds(void *pfds, int nfds, uint64_t ns) {
#if defined(__linux__)
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    return ppoll((struct pollfd *)pfds, (nfds_t)nfds, &ts, NULL);
#else
    int ms = (int)((ns + 999999u) / 1000000u);
    return poll((struct pollfd *)pfds, (nfds_t)nfds, ms);
#endif
}

/* Names as ibv_wc_status_str() prints them (numbering is ibv_wc_status). */
const char *tp_wc_status_name(int status) {
    static const char *const names[] = {
        "SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR",
        "WR_FLUSH_ERR", "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR",
        "REM_ACCESS_ERR", "REM_OP_ERR", "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR",
        "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR", "REM_ABORT_ERR", "INV_EECN_ERR",
        "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR", "GENERAL_ERR",
    };
    if (status >= 0 && status < (int)(sizeof(names) / sizeof(names[0]))) return names[status];
    return "UNKNOWN_STATUS";
}

/* ------------------------------------------------------------------------
 * Open, build, connect, close.
 * --------------------------------------------------------------------- */

static int is_ucsim(const char *device) { return device && strcmp(device, "ucsim") == 0; }

int tp_probe(const char *device, char *err, size_t errlen) {
    if (err && errlen) err[0] = '\0';
    if (is_ucsim(device)) {
        tp_errf(err, errlen, "ucsim: emulated Thunderbolt UC device (datagrams over IPv4)");
        return 1;
    }
    return tp_ibv_probe(device && device[0] ? device : NULL, err, errlen);
}

tp_dev *tp_open(const char *device, int gid_index, const char *bind_ipv4, int role,
                const char *faults, void *slab, uint64_t slab_bytes, char *err, size_t errlen) {
    if (err && errlen) err[0] = '\0';
    if (role != 0 && role != 1) {
        tp_errf(err, errlen, "tp_open: role %d is neither 0 (leader) nor 1 (worker)", role);
        return NULL;
    }
    if (!slab || slab_bytes == 0) {
        tp_errf(err, errlen, "tp_open: a slab is required (got %p, %llu bytes); size it with "
                "tp_slab_bytes() plus the caller's own area", slab,
                (unsigned long long)slab_bytes);
        return NULL;
    }
    tp_dev *dev = calloc(1, sizeof(*dev));
    if (!dev) {
        tp_errf(err, errlen, "tp_open: out of memory");
        return NULL;
    }
    dev->role = role;
    dev->control_fd = dev->barrier_fd = -1;
    dev->lost_grace_ns = TP_LOST_GRACE_NS; /* a provider may lengthen it at open */
    dev->slab = slab;
    dev->slab_bytes = slab_bytes;
    int rc = is_ucsim(device)
                 ? tp_ucsim_open(dev, bind_ipv4, faults, err, errlen)
                 : tp_ibv_open(dev, device && device[0] ? device : NULL, gid_index, err, errlen);
    if (rc < 0) {
        free(dev);
        return NULL;
    }
    tp_mr *mr = &dev->mrs[0];
    mr->lo = (uintptr_t)slab;
    mr->hi = mr->lo + slab_bytes;
    if (dev->prov->reg(dev, mr, err, errlen) < 0) {
        dev->prov->close(dev);
        free(dev);
        return NULL;
    }
    mr->used = 1;
    return dev;
}

/* Forget everything the hot paths knew about the previous queue pair. */
static void reset_qp_state(tp_dev *dev) {
    dev->qp_built = dev->connected = 0;
    dev->rq_outstanding = 0;
    dev->mode = TP_MODE_IDLE;
    dev->armed = 0;
    dev->armed_bytes = dev->armed_chunks = 0;
    dev->gate_count = dev->recv_done = dev->last_seq = dev->cur_seq = 0;
    dev->send_outstanding = 0;
    dev->drain_recvs = 0;
    dev->bulk_recvs[0] = dev->bulk_recvs[1] = 0;
    dev->wedged_code = 0;
    dev->wedged[0] = '\0';
    dev->stats.direction_dead = 0;
    dev->stats.recv_done = 0;
    dev->stats.window_armed = 0;
}

int tp_build_qp(tp_dev *dev, int qp_type, int setup_attempt, int cq_depth, int send_wr,
                int recv_wr, char *err, size_t errlen) {
    if (!dev) return TP_EINVAL;
    if (qp_type != TP_QPT_RC && qp_type != TP_QPT_UC && qp_type != TP_QPT_UD) {
        tp_errf(err, errlen, "tp_build_qp: unknown queue pair type %d (TP_QPT_RC 2, UC 3, UD 4)",
                qp_type);
        return TP_EINVAL;
    }
    if (setup_attempt < 0 || setup_attempt > 0xfff) {
        tp_errf(err, errlen, "tp_build_qp: setup_attempt %d out of range 0..4095", setup_attempt);
        return TP_EINVAL;
    }
    int cq = cq_depth > 0 ? cq_depth : TP_DEFAULT_CQ;
    int swr = send_wr > 0 ? send_wr : TP_DEFAULT_WR;
    int rwr = recv_wr > 0 ? recv_wr : TP_DEFAULT_WR;
    reset_qp_state(dev);
    int rc = dev->prov->build_qp(dev, qp_type, setup_attempt, &cq, &swr, &rwr, err, errlen);
    if (rc < 0) return rc;
    dev->qp_built = 1;
    dev->qp_type = qp_type;
    dev->setup_attempt = setup_attempt;
    dev->cq_depth = cq;
    dev->send_wr = swr;
    dev->recv_wr = rwr;
    return TP_OK;
}

void tp_depths(const tp_dev *dev, int *cq_depth, int *send_wr, int *recv_wr) {
    if (cq_depth) *cq_depth = dev ? dev->cq_depth : 0;
    if (send_wr) *send_wr = dev ? dev->send_wr : 0;
    if (recv_wr) *recv_wr = dev ? dev->recv_wr : 0;
}

int tp_local_info(const tp_dev *dev, tp_info *out) {
    if (!dev || !out || !dev->qp_built) return TP_EINVAL;
    *out = dev->local;
    return TP_OK;
}

int tp_connect(tp_dev *dev, const tp_info *peer, char *err, size_t errlen) {
    if (!dev || !peer) return TP_EINVAL;
    if (!dev->qp_built) {
        tp_errf(err, errlen, "tp_connect: no queue pair (call tp_build_qp first)");
        return TP_EINVAL;
    }
    int rc = dev->prov->connect(dev, peer, err, errlen);
    if (rc < 0) return rc;
    dev->connected = 1;
    return TP_OK;
}

const char *tp_device_name(const tp_dev *dev) { return dev ? dev->name : ""; }

void tp_close(tp_dev *dev) {
    if (!dev) return;
    for (int i = TP_MAX_MRS - 1; i >= 0; i--) {
        if (dev->mrs[i].used) dev->prov->dereg(dev, &dev->mrs[i]);
        dev->mrs[i].used = 0;
    }
    dev->prov->close(dev);
    free(dev);
}

void tp_set_fds(tp_dev *dev, int control_fd, int barrier_fd) {
    if (!dev) return;
    dev->control_fd = control_fd;
    dev->barrier_fd = barrier_fd;
    dev->next_peer_check_ns = 0;
    dev->moved_seen_ns = 0;
}

/* ------------------------------------------------------------------------
 * Memory registrations.
 * --------------------------------------------------------------------- */

/* The region holding all of [addr, addr + len), or NULL. */
static const tp_mr *find_mr(const tp_dev *dev, const void *addr, uint64_t len) {
    const uintptr_t lo = (uintptr_t)addr;
    if (lo + len < lo) return NULL;
    for (int i = 0; i < TP_MAX_MRS; i++) {
        const tp_mr *mr = &dev->mrs[i];
        if (mr->used && lo >= mr->lo && lo <= mr->hi && len <= mr->hi - lo) return mr;
    }
    return NULL;
}

static int count_mrs(const tp_dev *dev) {
    int n = 0;
    for (int i = 0; i < TP_MAX_MRS; i++) n += dev->mrs[i].used;
    return n;
}

int tp_reg(tp_dev *dev, void *addr, uint64_t len, char *err, size_t errlen) {
    if (!dev) return TP_EINVAL;
    if (!addr || len == 0 || (uintptr_t)addr + len < (uintptr_t)addr) {
        tp_errf(err, errlen, "tp_reg: bad region %p + %llu bytes", addr, (unsigned long long)len);
        return TP_EINVAL;
    }
    int slot = -1;
    for (int i = 1; i < TP_MAX_MRS && slot < 0; i++)
        if (!dev->mrs[i].used) slot = i;
    if (slot < 0) {
        /* Why a cap: the Apple stack allows ~100 regions in all and fails
         * the next registration with a bare error. */
        tp_errf(err, errlen, "tp_reg: %d memory regions registered already (the Apple "
                "Thunderbolt RDMA stack allows ~100 in all); tp_dereg unused ones first",
                TP_MAX_MRS);
        return TP_ENOMEM;
    }
    tp_mr *mr = &dev->mrs[slot];
    memset(mr, 0, sizeof(*mr));
    mr->lo = (uintptr_t)addr;
    mr->hi = mr->lo + len;
    int rc = dev->prov->reg(dev, mr, err, errlen);
    if (rc < 0) return rc;
    mr->used = 1;
    return slot;
}

int tp_dereg(tp_dev *dev, int handle) {
    if (!dev || handle <= 0 || handle >= TP_MAX_MRS || !dev->mrs[handle].used)
        return TP_EINVAL; /* handle 0 is the slab: it lives until tp_close */
    dev->prov->dereg(dev, &dev->mrs[handle]);
    dev->mrs[handle].used = 0;
    return TP_OK;
}

/* ------------------------------------------------------------------------
 * Raw work requests and completion reaping.
 * --------------------------------------------------------------------- */

static int post_recv_mr(tp_dev *dev, const tp_mr *mr, const void *addr, uint32_t len,
                        uint64_t wr_id, char *err, size_t errlen) {
    int rc = dev->prov->post_recv(dev, (uintptr_t)addr, len, mr->lkey, wr_id, err, errlen);
    if (rc == 0) dev->rq_outstanding++;
    return rc;
}

static int post_send_mr(tp_dev *dev, const tp_mr *mr, const void *addr, uint32_t len,
                        uint64_t wr_id, int opcode, uint32_t imm, int signaled, char *err,
                        size_t errlen) {
    int rc = dev->prov->post_send(dev, (uintptr_t)addr, len, mr->lkey, wr_id, opcode, imm,
                                  signaled, err, errlen);
    if (rc == 0) {
        dev->stats.sends++;
        dev->stats.send_bytes += len;
    }
    return rc;
}

static int unregistered(const tp_dev *dev, const char *what, const void *addr, uint32_t len,
                        char *err, size_t errlen) {
    tp_errf(err, errlen, "tp rdma: %s buffer %p + %u bytes lies in no registered memory region "
            "(slab %p + %llu bytes, %d regions in all); register it with tp_reg",
            what, addr, len, (void *)dev->slab, (unsigned long long)dev->slab_bytes,
            count_mrs(dev));
    return TP_EINVAL;
}

int tp_post_recv(tp_dev *dev, void *addr, uint32_t len, uint64_t wr_id, char *err,
                 size_t errlen) {
    if (!dev) return TP_EINVAL;
    if (!dev->qp_built) {
        tp_errf(err, errlen, "tp_post_recv: no queue pair (call tp_build_qp first)");
        return TP_EINVAL;
    }
    const tp_mr *mr = find_mr(dev, addr, len);
    if (!mr) return unregistered(dev, "receive", addr, len, err, errlen);
    return post_recv_mr(dev, mr, addr, len, wr_id, err, errlen);
}

int tp_post_send(tp_dev *dev, const void *addr, uint32_t len, uint64_t wr_id, int opcode,
                 int signaled, char *err, size_t errlen) {
    if (!dev) return TP_EINVAL;
    if (opcode != TP_OP_SEND && opcode != TP_OP_WRITE) {
        tp_errf(err, errlen, "tp_post_send: unknown opcode %d (TP_OP_SEND 0, TP_OP_WRITE 1)",
                opcode);
        return TP_EINVAL;
    }
    if (!dev->connected) {
        tp_errf(err, errlen, "tp_post_send: queue pair not connected (tp_build_qp, tp_connect)");
        return TP_EINVAL;
    }
    const tp_mr *mr = find_mr(dev, addr, len);
    if (!mr) return unregistered(dev, "send", addr, len, err, errlen);
    /* Raw sends (warm-up, tests) stay plain SEND: tags are a hot-path matter. */
    return post_send_mr(dev, mr, addr, len, wr_id, opcode, 0, signaled, err, errlen);
}

/* One non-blocking pass over the completion queue, with the bookkeeping
 * every caller needs (receive queue occupancy, counters). */
static int poll_once(tp_dev *dev, tp_wc *wc, int max, char *err, size_t errlen) {
    int n = dev->prov->poll(dev, wc, max, err, errlen);
    for (int i = 0; i < n; i++) {
        if (wc[i].opcode != TP_WC_RECV) continue;
        if (dev->rq_outstanding) dev->rq_outstanding--;
        if (wc[i].status == TP_WC_SUCCESS) {
            dev->stats.recvs++;
            dev->stats.recv_bytes += wc[i].byte_len;
        }
    }
    return n;
}

/* 1 when the data socket holds unread bytes (peeked, never consumed). EOF
 * or an error is 0: a closed socket is the control socket's to report. */
static int data_pending(int fd) {
    char byte;
    return recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
}

/* Reap at least one completion or give up at deadline_ns. Returns the
 * count, 0 at the deadline, TP_EPEER when the control socket closed (no
 * message: the caller knows what it was waiting for), TP_EMOVED (see
 * watch_data), or another negative code with err set. UC queue pairs never
 * report a dead peer, the control socket does: it is sampled every
 * millisecond while nothing arrives.
 * watch_data: a hot path is waiting for a receive of the peer's; sample the
 * data socket on the same millisecond tick, and when it has held unread
 * bytes for lost_grace_ns with that receive still missing, return
 * TP_EMOVED: the peer has moved past the message (why that proves a loss:
 * "Loss with nothing behind it" above hp_pump). */
static int reap(tp_dev *dev, tp_wc *wc, int max, uint64_t deadline_ns, int watch_data,
                char *err, size_t errlen) {
    uint64_t start = 0;
    for (;;) {
        int n = poll_once(dev, wc, max, err, errlen);
        if (n != 0) return n;
        const uint64_t now = tp_mono_ns();
        if (!start) start = now;
        if (now >= deadline_ns) return 0;
        int rc = TP_OK;
        if (now >= dev->next_peer_check_ns) {
            if (dev->control_fd >= 0 && tp_fd_closed(dev->control_fd)) rc = TP_EPEER;
            /* A peer that said goodbye (an unread STOP or ERROR frame keeps
             * the control socket readable, hiding its EOF) has closed the
             * data socket too: its EOF is the same news. */
            if (rc == TP_OK && dev->barrier_fd >= 0 && tp_fd_closed(dev->barrier_fd)) rc = TP_EPEER;
            if (rc == TP_OK && watch_data && dev->barrier_fd >= 0) {
                if (!data_pending(dev->barrier_fd)) dev->moved_seen_ns = 0;
                else if (!dev->moved_seen_ns) dev->moved_seen_ns = now;
                else if (now - dev->moved_seen_ns >= dev->lost_grace_ns) return TP_EMOVED;
            }
            dev->next_peer_check_ns = now + 1000000u;
        }
        if (rc == TP_OK) rc = dev->prov->idle(dev, deadline_ns, now - start);
        if (rc == TP_EPEER) {
            /* A peer that finishes its last gate and exits closes the
             * control socket right after its final send: that message has
             * landed already, so reap it before calling the peer dead, or
             * a clean end of run looks like a failure. */
            n = poll_once(dev, wc, max, err, errlen);
            return n != 0 ? n : TP_EPEER;
        }
        if (rc < 0) return rc;
    }
}

static uint64_t deadline_after(double timeout_s) {
    if (!(timeout_s > 0)) return tp_mono_ns();
    if (timeout_s > 1e6) timeout_s = 1e6;
    return tp_mono_ns() + (uint64_t)(timeout_s * 1e9);
}

int tp_poll(tp_dev *dev, tp_wc *wc, int max, double timeout_s, char *err, size_t errlen) {
    if (!dev || !wc || max <= 0) return TP_EINVAL;
    if (!dev->qp_built) {
        tp_errf(err, errlen, "tp_poll: no queue pair (call tp_build_qp first)");
        return TP_EINVAL;
    }
    int n = reap(dev, wc, max, deadline_after(timeout_s), 0, err, errlen);
    if (n == TP_EPEER)
        tp_errf(err, errlen, "tp rdma: peer closed the control channel while polling");
    return n;
}

/* ------------------------------------------------------------------------
 * Hot paths: shared machinery.
 * --------------------------------------------------------------------- */

/* A failed hot path leaves work requests in flight that the next call
 * cannot account for, so the queue pair is marked unusable until rebuilt. */
static int hp_fail(tp_dev *dev, int code, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int hp_fail(tp_dev *dev, int code, char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dev->wedged, sizeof(dev->wedged), fmt, ap);
    va_end(ap);
    dev->wedged_code = code;
    dev->mode = TP_MODE_IDLE;
    tp_errf(err, errlen, "%s", dev->wedged);
    return code;
}

/* Mark unusable with a message a lower layer already wrote into err. */
static int hp_wedge(tp_dev *dev, int code, char *err, size_t errlen) {
    return hp_fail(dev, code, err, errlen, "%s", err && errlen ? err : "tp rdma: failure");
}

static int hp_enter(tp_dev *dev, double timeout_s, const char *what, char *err, size_t errlen) {
    if (!dev) return TP_EINVAL;
    if (dev->wedged_code) {
        tp_errf(err, errlen, "tp rdma: queue pair unusable after an earlier failure (%s); "
                "rebuild it (tp_build_qp) or fall back to TCP", dev->wedged);
        return dev->wedged_code;
    }
    if (!dev->connected) {
        tp_errf(err, errlen, "%s: queue pair not connected (tp_build_qp, tp_connect first)", what);
        return TP_EINVAL;
    }
    if (dev->slab_bytes < TP_OFF_END) {
        tp_errf(err, errlen, "%s: slab of %llu bytes is smaller than the %llu bytes the hot "
                "paths own (tp_slab_bytes())", what, (unsigned long long)dev->slab_bytes,
                (unsigned long long)TP_OFF_END);
        return TP_EINVAL;
    }
    if (!(timeout_s > 0)) {
        tp_errf(err, errlen, "%s: timeout_s must be > 0 (got %g)", what, timeout_s);
        return TP_EINVAL;
    }
    dev->moved_seen_ns = 0;
    return TP_OK;
}

static uint32_t chunks_of(uint64_t bytes) {
    return (uint32_t)((bytes + TP_MAX_MSG - 1) / TP_MAX_MSG);
}

static uint8_t *ring_slot(const tp_dev *dev, uint64_t gate) {
    return dev->slab + TP_OFF_RING + (gate % TP_RECV_WINDOW) * TP_GATE_SLOT_BYTES;
}

static uint32_t bulk_chunk_len(uint64_t bytes, uint64_t round, uint32_t slot) {
    const uint64_t off = round * TP_BULK_ROUND_BYTES + (uint64_t)slot * TP_MAX_MSG;
    if (off >= bytes) return 0;
    return (uint32_t)(bytes - off > TP_MAX_MSG ? TP_MAX_MSG : bytes - off);
}

/* A drain marker must fit the receive it lands in: the peer's window has
 * the same shape as ours (the arm barrier checked the byte count), and a
 * window of tiny gates has receives smaller than TP_DRAIN_MSG_BYTES. */
static uint32_t drain_marker_len(const tp_dev *dev, int final_chunk) {
    const uint32_t len = final_chunk ? dev->armed_bytes - (dev->armed_chunks - 1) * TP_MAX_MSG
                                     : TP_MAX_MSG;
    return len < TP_DRAIN_MSG_BYTES ? len : TP_DRAIN_MSG_BYTES;
}

/* ---- sequence tags (why: see "Sequence tags" in _verbs.h) ---- */

static uint32_t gate_imm(uint64_t gate, uint32_t chunk) {
    return TP_IMM_GATE | chunk << 24 | (uint32_t)(gate & 0xffffff);
}

static uint32_t bulk_imm(uint64_t round, uint32_t slot) {
    return TP_IMM_BULK | (uint32_t)(round & 0x3fffff) << 6 | (slot & 0x3f);
}

/* The full number a tag's low `bits` bits stand for, taken nearest to near. */
static uint64_t unwrap(uint64_t near, uint32_t low, int bits) {
    const uint64_t span = UINT64_C(1) << bits;
    uint64_t d = (low - near) & (span - 1);
    return d & (span >> 1) ? near - (span - d) : near + d;
}

/* The tag the message landing in this hot-path receive must carry, or 0
 * when wr_id is no hot-path receive of the current mode. */
static uint32_t expected_imm(const tp_dev *dev, uint64_t wr_id) {
    const uint64_t tag = wr_id & TP_TAG_MASK, low = wr_id & ~TP_TAG_MASK;
    if ((dev->mode == TP_MODE_GATE || dev->mode == TP_MODE_DRAIN) &&
        (tag == 0 || tag == TP_TAG_GATE_CHUNK)) {
        const uint32_t chunk = tag == 0 ? dev->armed_chunks - 1 : 0;
        if (dev->mode == TP_MODE_GATE) return gate_imm(low, chunk);
        /* The peer's i-th marker lands in our i-th outstanding receive: the
         * window holds gates gate_count + 1 .. gate_count + TP_RECV_WINDOW. */
        return TP_IMM_DRAIN | (uint32_t)((low - dev->gate_count - 1) * dev->armed_chunks + chunk);
    }
    if (dev->mode == TP_MODE_BULK && tag == TP_TAG_BULK_RECV)
        return bulk_imm(low >> 8, (uint32_t)(low & 0xff));
    return 0;
}

/* Which receive, in the caller's terms: the gate seq label, or the round. */
static void describe_recv(char *buf, size_t n, const tp_dev *dev, uint64_t wr_id) {
    const uint64_t tag = wr_id & TP_TAG_MASK, low = wr_id & ~TP_TAG_MASK;
    char chunk[40] = "";
    if (dev->mode == TP_MODE_BULK) {
        snprintf(buf, n, "bulk round %llu slot %llu of a %llu-byte exchange",
                 (unsigned long long)(low >> 8), (unsigned long long)(low & 0xff),
                 (unsigned long long)dev->bulk_bytes);
        return;
    }
    if (dev->armed_chunks > 1)
        snprintf(chunk, sizeof(chunk), ", chunk %u of %u",
                 tag == 0 ? dev->armed_chunks : 1u, dev->armed_chunks);
    if (dev->mode == TP_MODE_DRAIN)
        snprintf(buf, n, "the window drain after gate seq %llu (receive for gate #%llu%s)",
                 (unsigned long long)dev->last_seq, (unsigned long long)low, chunk);
    else if (low == dev->gate_count + 1)
        snprintf(buf, n, "gate seq %llu (gate #%llu%s)", (unsigned long long)dev->cur_seq,
                 (unsigned long long)low, chunk);
    else /* the peer runs at most one gate ahead: its next gate's receive */
        snprintf(buf, n, "the gate after seq %llu (gate #%llu%s)",
                 (unsigned long long)dev->cur_seq, (unsigned long long)low, chunk);
}

/* What a tag says arrived, relative to what was expected. */
static void describe_imm(char *buf, size_t n, const tp_dev *dev, uint32_t imm, uint32_t want) {
    const uint32_t kind = imm & TP_IMM_KIND_MASK;
    if (kind == TP_IMM_GATE && (want & TP_IMM_KIND_MASK) == TP_IMM_GATE) {
        const uint64_t exp = unwrap(dev->gate_count + 1, want & 0xffffff, 24);
        const uint64_t got = unwrap(exp, imm & 0xffffff, 24);
        const unsigned c = (imm >> 24) & 0xf;
        char chunk[40] = "";
        if (dev->armed_chunks > 1)
            snprintf(chunk, sizeof(chunk), " chunk %u of %u", c + 1, dev->armed_chunks);
        if (got > exp)
            snprintf(buf, n, "the peer's gate #%llu%s (%llu gate%s later)",
                     (unsigned long long)got, chunk, (unsigned long long)(got - exp),
                     got - exp == 1 ? "" : "s");
        else if (got == exp)
            snprintf(buf, n, "the peer's gate #%llu%s (a later chunk of the same gate)",
                     (unsigned long long)got, chunk);
        else
            snprintf(buf, n, "the peer's gate #%llu%s (an earlier gate)",
                     (unsigned long long)got, chunk);
    } else if (kind == TP_IMM_GATE) {
        snprintf(buf, n, "a gate message (gate #%u mod 2^24, chunk %u)", imm & 0xffffff,
                 ((imm >> 24) & 0xf) + 1);
    } else if (kind == TP_IMM_DRAIN) {
        snprintf(buf, n, "the peer's drain marker %u", imm & 0xfffffff);
    } else if (kind == TP_IMM_BULK) {
        const uint64_t r = unwrap((want >> 6) & 0x3fffff, (imm >> 6) & 0x3fffff, 22);
        snprintf(buf, n, "the peer's bulk round %llu slot %u", (unsigned long long)r, imm & 0x3f);
    } else {
        snprintf(buf, n, "a message tagged 0x%08x (no hot-path tag)", imm);
    }
}

static void describe_wr(char *buf, size_t n, uint64_t wr_id) {
    const uint64_t low = wr_id & ~TP_TAG_MASK;
    switch (wr_id & TP_TAG_MASK) {
    case 0: snprintf(buf, n, "gate #%llu, final chunk", (unsigned long long)low); break;
    case TP_TAG_GATE_CHUNK: snprintf(buf, n, "gate #%llu, first chunk", (unsigned long long)low); break;
    case TP_TAG_GATE_SEND: snprintf(buf, n, "gate #%llu send", (unsigned long long)low); break;
    case TP_TAG_DRAIN: snprintf(buf, n, "drain marker %llu", (unsigned long long)low); break;
    case TP_TAG_BULK_RECV:
    case TP_TAG_BULK_SEND:
        snprintf(buf, n, "bulk round %llu slot %llu %s", (unsigned long long)(low >> 8),
                 (unsigned long long)(low & 0xff),
                 (wr_id & TP_TAG_MASK) == TP_TAG_BULK_RECV ? "receive" : "send");
        break;
    default: snprintf(buf, n, "not a hot-path work request"); break;
    }
}

/* What the hot path was doing, for error messages. */
static const char *hp_context(const tp_dev *dev, char *buf, size_t n) {
    if (dev->mode == TP_MODE_BULK)
        snprintf(buf, n, "a bulk exchange of %llu bytes", (unsigned long long)dev->bulk_bytes);
    else if (dev->mode == TP_MODE_DRAIN)
        snprintf(buf, n, "the window drain after gate seq %llu", (unsigned long long)dev->last_seq);
    else
        snprintf(buf, n, "gate seq %llu", (unsigned long long)dev->cur_seq);
    return buf;
}

/* Account one completion. Every status is checked: UC reports few errors,
 * but the ones it reports (a short receive buffer, a flushed queue) mean
 * the data is not where the caller will read it. */
static int hp_on_wc(tp_dev *dev, const tp_wc *wc, char *err, size_t errlen) {
    const uint64_t tag = wc->wr_id & TP_TAG_MASK;
    const uint64_t low = wc->wr_id & ~TP_TAG_MASK;
    char what[96], ctx[96];
    if (wc->status != TP_WC_SUCCESS) {
        if (wc->opcode == TP_WC_RECV && wc->status == TP_WC_LOC_LEN_ERR &&
            dev->mode != TP_MODE_DRAIN && expected_imm(dev, wc->wr_id)) {
            /* The ranks armed the same sizes (the barrier checked), so a
             * message too long for its receive is the peer's next one, the
             * receive's own having been lost (the 16 KiB first chunk of the
             * next gate landing in a smaller final-chunk receive). Error
             * completions carry no immediate data to say more. */
            describe_recv(what, sizeof(what), dev, wc->wr_id);
            return hp_fail(dev, TP_ELOST, err, errlen,
                           "tp rdma: lost message detected at %s: a longer message landed in "
                           "its receive (LOC_LEN_ERR), i.e. the peer's next one (UC dropped a "
                           "message without an error; the queue pair must be rebuilt)", what);
        }
        describe_wr(what, sizeof(what), wc->wr_id);
        return hp_fail(dev, TP_ECOMPLETION, err, errlen,
                       "tp rdma: completion error %s (status %d) on %s wr_id 0x%llx (%s) during "
                       "%s", tp_wc_status_name(wc->status), wc->status,
                       wc->opcode == TP_WC_RECV ? "receive" : "send",
                       (unsigned long long)wc->wr_id, what, hp_context(dev, ctx, sizeof(ctx)));
    }
    if (wc->opcode != TP_WC_RECV) {
        if ((tag == TP_TAG_GATE_SEND || tag == TP_TAG_DRAIN || tag == TP_TAG_BULK_SEND) &&
            dev->send_outstanding)
            dev->send_outstanding--;
        return TP_OK;
    }
    /* The tag check: the message must be the one this receive was posted
     * for. UC would otherwise hand us the peer's next message silently. */
    const uint32_t want_imm = expected_imm(dev, wc->wr_id);
    if (want_imm && wc->has_imm && wc->imm != want_imm &&
        !(dev->mode == TP_MODE_DRAIN && (wc->imm & TP_IMM_KIND_MASK) != TP_IMM_DRAIN)) {
        char got[96];
        describe_recv(what, sizeof(what), dev, wc->wr_id);
        describe_imm(got, sizeof(got), dev, wc->imm, want_imm);
        return hp_fail(dev, TP_ELOST, err, errlen,
                       "tp rdma: lost message detected at %s: received %s instead (UC dropped "
                       "a message without an error; the queue pair must be rebuilt)", what, got);
    }
    if (want_imm && !wc->has_imm && !dev->untagged_logged) {
        /* The peer's driver refused SEND_WITH_IMM (see _verbs.h): go on
         * without the check rather than fail, and say so once. */
        dev->untagged_logged = 1;
        fprintf(stderr, TP_LOG "rdma: the peer's hot-path messages carry no sequence tag (its "
                "device refused SEND_WITH_IMM?): a message lost on the UC link cannot be detected "
                "at the gate; run with --debug-hash N to catch a divergence\n");
    }
    uint32_t want = 0;
    if (dev->mode == TP_MODE_DRAIN && (tag == 0 || tag == TP_TAG_GATE_CHUNK)) {
        /* The peer's drain markers consume our window; anything else here
         * means the ranks ran different gate sequences. */
        const uint8_t *at = ring_slot(dev, low) +
                            (tag == 0 ? (uint64_t)(dev->armed_chunks - 1) * TP_MAX_MSG : 0);
        want = drain_marker_len(dev, tag == 0);
        if (wc->byte_len != want || memcmp(at, "DS4DRAIN", want) != 0)
            return hp_fail(dev, TP_ECOMPLETION, err, errlen,
                           "tp rdma: desync: a %u-byte message arrived while draining the "
                           "receive window (expected a %u-byte drain marker): the ranks ran "
                           "different gate sequences", wc->byte_len, want);
        dev->drain_recvs++;
        return TP_OK;
    }
    if (tag == 0 && dev->mode == TP_MODE_GATE) {
        want = dev->armed_bytes - (dev->armed_chunks - 1) * TP_MAX_MSG;
        if (wc->byte_len == want) {
            if (low > dev->recv_done) dev->recv_done = low;
            return TP_OK;
        }
    } else if (tag == TP_TAG_GATE_CHUNK && dev->mode == TP_MODE_GATE) {
        want = TP_MAX_MSG;
        if (wc->byte_len == want) return TP_OK;
    } else if (tag == TP_TAG_BULK_RECV && dev->mode == TP_MODE_BULK) {
        want = bulk_chunk_len(dev->bulk_bytes, low >> 8, (uint32_t)(low & 0xff));
        if (wc->byte_len == want) {
            dev->bulk_recvs[(low >> 8) & 1]++;
            return TP_OK;
        }
    } else {
        describe_wr(what, sizeof(what), wc->wr_id);
        return hp_fail(dev, TP_ECOMPLETION, err, errlen,
                       "tp rdma: unexpected receive completion wr_id 0x%llx (%s) during %s; "
                       "was a raw receive left posted?", (unsigned long long)wc->wr_id, what,
                       hp_context(dev, ctx, sizeof(ctx)));
    }
    describe_wr(what, sizeof(what), wc->wr_id);
    return hp_fail(dev, TP_ECOMPLETION, err, errlen,
                   "tp rdma: desync: %s received %u bytes, expected %u during %s (do both "
                   "ranks run the same gate sizes?)", what, wc->byte_len, want,
                   hp_context(dev, ctx, sizeof(ctx)));
}

/* Loss with nothing behind it. A lost message is caught by its tag when a
 * later message lands in its receive; the last message before the peer
 * leaves the queue pair (the last gate before a drain, a bulk exchange or a
 * gate-signature exchange; a bulk's last chunk) has no later message. What
 * follows it instead is the peer's next word on the TCP data socket, and
 * that word proves the loss:
 *   - The peer writes the data socket only between hot paths (Python: the
 *     gate-signature descriptor, the bulk header) or at a receives-posted
 *     barrier at the start of one (hp_barrier: gate window arm, drain, bulk
 *     round 0), never while one of its hot-path waits is in progress.
 *   - The peer leaves the gate, drain or bulk exchange we are waiting in
 *     only once all of our messages of it reached it, and it posts all of
 *     its own before it waits (gate chunks, every drain marker; bulk round
 *     r + 1 only after our round r arrived, so when it has finished, every
 *     round of its own is sent). So when it writes that word, every message
 *     of its we are waiting for was already sent, and UC has no retries.
 *   - Nothing is pending for us on the data socket while we wait for
 *     completions: every data-socket exchange is write-then-read of a fixed
 *     size on both sides, so the words of our own barriers (and the
 *     Python exchanges before this call) were read in full before we
 *     posted our sends; the peer's next word comes only after it left the
 *     exchange we are in (above), and the word of our own next barrier is
 *     read by that barrier, outside these waits. Unread bytes therefore
 *     mean "the peer is past this".
 * So hp_pump watches the data socket (peeked, every ms, reap) while a
 * receive of ours is still missing, and once bytes have sat there for
 * lost_grace_ns (TP_LOST_GRACE_NS: a message still on the wire) with the
 * receive still missing, the message is lost: TP_ELOST naming what, well
 * before the timeout. Not during the barrier's own read (hp_barrier does
 * not reap) nor while only our send completions are outstanding. If the
 * ranks ran different gate sequences the same picture can arise; the pair
 * stops either way. A data socket at EOF is not a move past: a peer that
 * exits closes the control socket too (TP_EPEER). */

/* Reap whatever is ready (waiting up to the deadline for the first) and
 * account it. >0 progress, 0 deadline passed, TP_EPEER, TP_EMOVED (only
 * with watch_data: a receive of ours is missing, see above), or an error
 * with the queue pair marked unusable. */
static int hp_pump(tp_dev *dev, uint64_t deadline_ns, int watch_data, char *err,
                   size_t errlen) {
    tp_wc wc[32];
    int n = reap(dev, wc, 32, deadline_ns, watch_data, err, errlen);
    if (n < 0 && n != TP_EPEER && n != TP_EMOVED) return hp_wedge(dev, n, err, errlen);
    for (int i = 0; i < n; i++) {
        int rc = hp_on_wc(dev, &wc[i], err, errlen);
        if (rc < 0) return rc;
    }
    return n;
}

/* The wait ended without progress: name what was being waited for.
 * missing: what of the peer's has not arrived ("gate message", ...), or
 * NULL when only our own send completions were outstanding. */
static int hp_stalled(tp_dev *dev, int rc, double timeout_s, const char *what,
                      const char *missing, char *err, size_t errlen) {
    if (rc == TP_EMOVED)
        return hp_fail(dev, TP_ELOST, err, errlen,
                       "tp rdma: lost message detected at %s: the peer has moved past it (its "
                       "next data-socket word arrived %.0f ms ago) but its %s never landed (UC "
                       "dropped a message without an error; the queue pair must be rebuilt)",
                       what, (double)(tp_mono_ns() - dev->moved_seen_ns) / 1e6,
                       missing ? missing : "message");
    if (rc == TP_EPEER) {
        if (!missing)
            return hp_fail(dev, TP_EPEER, err, errlen,
                           "tp rdma: peer closed the control channel during %s", what);
        return hp_fail(dev, TP_EPEER, err, errlen,
                       "tp rdma: peer closed the control channel during %s, and the peer's %s "
                       "for it never arrived (lost on the link, or the peer died)", what, missing);
    }
    return hp_fail(dev, TP_ETIMEOUT, err, errlen, "tp rdma: timeout after %.1f s waiting for %s",
                   timeout_s, what);
}

/* Receives-posted barrier: an 8-byte word each way over the TCP data
 * socket, written only after this side's receives are posted, and sends
 * start only after the peer's word arrived. Why: a UC send that reaches a
 * queue pair with no receive posted kills that direction for good. The
 * word carries what was armed, so ranks that disagree fail loudly here. */
#define TP_BARRIER_GATE UINT32_C(0x47415445) /* "GATE" */
#define TP_BARRIER_BULK UINT32_C(0x42554c4b) /* "BULK" */
#define TP_BARRIER_DRAIN UINT32_C(0x4452414e) /* "DRAN" */

static void barrier_desc(char *buf, size_t n, uint32_t magic, uint32_t value) {
    if (magic == TP_BARRIER_GATE) snprintf(buf, n, "a gate window of %u-byte vectors", value);
    else if (magic == TP_BARRIER_BULK) snprintf(buf, n, "a bulk exchange (size tag %u)", value);
    else if (magic == TP_BARRIER_DRAIN) snprintf(buf, n, "a window drain after %u gates", value);
    else snprintf(buf, n, "nothing we know (word 0x%08x%08x)", value, magic);
}

static int hp_barrier(tp_dev *dev, uint32_t magic, uint32_t value, uint64_t deadline_ns,
                      double timeout_s, const char *what, char *err, size_t errlen) {
    const int fd = dev->barrier_fd;
    if (fd < 0)
        return hp_fail(dev, TP_EINVAL, err, errlen,
                       "tp rdma: no barrier socket for the receives-posted barrier before %s; "
                       "call tp_set_fds(dev, control_fd, data_fd) first", what);
    uint8_t out[8], in[8];
    for (int i = 0; i < 4; i++) {
        out[i] = (uint8_t)(magic >> (8 * i));
        out[4 + i] = (uint8_t)(value >> (8 * i));
    }
#ifdef MSG_NOSIGNAL
    const int wflags = MSG_DONTWAIT | MSG_NOSIGNAL;
#else
    const int wflags = MSG_DONTWAIT;
#endif
    size_t sent = 0, got = 0;
    int watch_ctl = dev->control_fd >= 0;
    while (got < 8) {
        if (sent < 8) {
            ssize_t w = send(fd, out + sent, 8 - sent, wflags);
            if (w > 0) {
                sent += (size_t)w;
                continue;
            }
            if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                return hp_fail(dev, TP_EPEER, err, errlen,
                               "tp rdma: peer closed the data socket (send: %s) during the "
                               "receives-posted barrier before %s", strerror(errno), what);
        } else {
            ssize_t r = recv(fd, in + got, 8 - got, MSG_DONTWAIT);
            if (r > 0) {
                got += (size_t)r;
                continue;
            }
            if (r == 0)
                return hp_fail(dev, TP_EPEER, err, errlen,
                               "tp rdma: peer closed the data socket during the "
                               "receives-posted barrier before %s", what);
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                return hp_fail(dev, TP_EPEER, err, errlen,
                               "tp rdma: peer closed the data socket (recv: %s) during the "
                               "receives-posted barrier before %s", strerror(errno), what);
        }
        const uint64_t now = tp_mono_ns();
        if (now >= deadline_ns)
            return hp_fail(dev, TP_ETIMEOUT, err, errlen,
                           "tp rdma: timeout after %.1f s waiting for the peer's "
                           "receives-posted word before %s", timeout_s, what);
        if (tp_fd_closed(dev->control_fd))
            return hp_fail(dev, TP_EPEER, err, errlen,
                           "tp rdma: peer closed the control channel during the "
                           "receives-posted barrier before %s", what);
        struct pollfd p[2] = {{fd, sent < 8 ? POLLOUT : POLLIN, 0}, {dev->control_fd, POLLIN, 0}};
        uint64_t slice = deadline_ns - now;
        if (slice > 10000000u) slice = 10000000u;
        /* Unread control frames keep that fd readable: after the first
         * wake-up rely on the per-slice check above instead of spinning. */
        if (tp_poll_fds(p, watch_ctl ? 2 : 1, slice) > 0 && watch_ctl && p[1].revents)
            watch_ctl = 0;
    }
    /* Bytes seen during an earlier wait of this call were this word. */
    dev->moved_seen_ns = 0;
    uint32_t pm = 0, pv = 0;
    for (int i = 0; i < 4; i++) {
        pm |= (uint32_t)in[i] << (8 * i);
        pv |= (uint32_t)in[4 + i] << (8 * i);
    }
    if (pm != magic || pv != value) {
        char ours[64], theirs[64];
        barrier_desc(ours, sizeof(ours), magic, value);
        barrier_desc(theirs, sizeof(theirs), pm, pv);
        return hp_fail(dev, TP_EINVAL, err, errlen,
                       "tp rdma: desync at the receives-posted barrier before %s: we armed %s, "
                       "the peer armed %s; both ranks must run the same gate sequence",
                       what, ours, theirs);
    }
    return TP_OK;
}

static int hp_need_depth(tp_dev *dev, const char *what, uint32_t recvs, uint32_t sends,
                         char *err, size_t errlen) {
    if ((uint64_t)dev->recv_wr >= recvs && (uint64_t)dev->send_wr >= sends &&
        (uint64_t)dev->cq_depth >= (uint64_t)recvs + sends)
        return TP_OK;
    tp_errf(err, errlen, "tp rdma: %s needs %u receives, %u sends and %u completion entries "
            "outstanding; the queue pair was granted recv %d, send %d, cq %d", what, recvs,
            sends, recvs + sends, dev->recv_wr, dev->send_wr, dev->cq_depth);
    return TP_ENOMEM;
}

/* ------------------------------------------------------------------------
 * Decode gates: a window of receives posted by sequence number.
 * --------------------------------------------------------------------- */

/* Post the receives of gate seq into its ring slot. Vectors above the
 * driver's 16 KiB message cap ride as two messages landing contiguously;
 * UC delivery is in order, so the k-th chunk the peer sends matches the
 * k-th receive, and only the final chunk carries the bare gate number:
 * its completion means the whole vector is in. */
static int gate_post(tp_dev *dev, uint64_t gate, char *err, size_t errlen) {
    uint8_t *base = ring_slot(dev, gate);
    for (uint32_t c = 0; c < dev->armed_chunks; c++) {
        const int last = c + 1 == dev->armed_chunks;
        const uint32_t len = last ? dev->armed_bytes - c * TP_MAX_MSG : TP_MAX_MSG;
        int rc = post_recv_mr(dev, &dev->mrs[0], base + (uint64_t)c * TP_MAX_MSG, len,
                              last ? gate : (TP_TAG_GATE_CHUNK | gate), err, errlen);
        if (rc < 0) return hp_wedge(dev, rc, err, errlen);
    }
    return TP_OK;
}

static int gate_arm(tp_dev *dev, uint32_t bytes, uint64_t gate, uint64_t seq,
                    uint64_t deadline_ns, double timeout_s, char *err, size_t errlen) {
    if (dev->rq_outstanding) {
        tp_errf(err, errlen, "tp rdma: cannot arm the gate window at seq %llu: %llu receives "
                "are still posted on the queue pair (warm-up leftovers?); the window needs an "
                "empty receive queue", (unsigned long long)seq,
                (unsigned long long)dev->rq_outstanding);
        return TP_EINVAL;
    }
    const uint32_t chunks = chunks_of(bytes);
    int rc = hp_need_depth(dev, "the gate window", TP_RECV_WINDOW * chunks,
                           TP_RECV_WINDOW * chunks, err, errlen);
    if (rc < 0) return rc;
    dev->armed_bytes = bytes;
    dev->armed_chunks = chunks;
    dev->armed = 1;
    dev->stats.window_armed = 1;
    dev->recv_done = gate - 1;
    for (uint64_t g = gate; g < gate + TP_RECV_WINDOW; g++) {
        rc = gate_post(dev, g, err, errlen);
        if (rc < 0) return rc;
    }
    char what[48];
    snprintf(what, sizeof(what), "gate seq %llu", (unsigned long long)seq);
    return hp_barrier(dev, TP_BARRIER_GATE, bytes, deadline_ns, timeout_s, what, err, errlen);
}

/* Consume the peer's posted window with drain markers while the peer's
 * markers consume ours; when both sides are done the queue pair is empty.
 * A barrier comes first: the peer may still be inside its last gate, with
 * the receive for its last gate + window not yet re-posted, and a marker that
 * reached that missing receive would kill the direction. */
static int hp_drain(tp_dev *dev, uint64_t deadline_ns, double timeout_s, char *err,
                    size_t errlen) {
    if (!dev->armed) return TP_OK;
    const uint32_t n = TP_RECV_WINDOW * dev->armed_chunks;
    uint8_t *marker = dev->slab + TP_OFF_CTRL;
    memcpy(marker, "DS4DRAIN", TP_DRAIN_MSG_BYTES);
    dev->mode = TP_MODE_DRAIN;
    dev->drain_recvs = 0;
    char what[96];
    snprintf(what, sizeof(what), "the window drain after gate seq %llu",
             (unsigned long long)dev->last_seq);
    int brc = hp_barrier(dev, TP_BARRIER_DRAIN, (uint32_t)dev->gate_count, deadline_ns, timeout_s,
                         what, err, errlen);
    if (brc < 0) return brc;
    for (uint32_t i = 0; i < n; i++) {
        const int final_chunk = (i + 1) % dev->armed_chunks == 0;
        int rc = post_send_mr(dev, &dev->mrs[0], marker, drain_marker_len(dev, final_chunk),
                              TP_TAG_DRAIN | i, TP_OP_SEND_IMM, TP_IMM_DRAIN | i, 1, err,
                              errlen);
        if (rc < 0) return hp_wedge(dev, rc, err, errlen);
        dev->send_outstanding++;
    }
    while (dev->drain_recvs < n || dev->send_outstanding) {
        const int missing = dev->drain_recvs < n;
        int rc = hp_pump(dev, deadline_ns, missing, err, errlen);
        if (rc > 0) continue;
        if (rc < 0 && rc != TP_EPEER && rc != TP_EMOVED) return rc;
        snprintf(what, sizeof(what), "the window drain after gate seq %llu (%u/%u markers in)",
                 (unsigned long long)dev->last_seq, dev->drain_recvs, n);
        return hp_stalled(dev, rc, timeout_s, what, missing ? "drain marker" : NULL, err,
                          errlen);
    }
    dev->armed = 0;
    dev->stats.window_armed = 0;
    dev->recv_done = dev->gate_count;
    dev->mode = TP_MODE_IDLE;
    return TP_OK;
}

int tp_gate(tp_dev *dev, const void *src, void *dst, uint32_t bytes, uint64_t seq,
            double timeout_s, char *err, size_t errlen) {
    int rc = hp_enter(dev, timeout_s, "tp_gate", err, errlen);
    if (rc < 0) return rc;
    if (!src || !dst || bytes == 0 || bytes > TP_GATE_SLOT_BYTES) {
        tp_errf(err, errlen, "tp_gate: a gate moves 1..%llu bytes (%d messages of at most %d) "
                "between non-NULL buffers; got %u bytes, src %p, dst %p",
                (unsigned long long)TP_GATE_SLOT_BYTES, TP_GATE_MAX_CHUNKS, TP_MAX_MSG, bytes,
                src, dst);
        return TP_EINVAL;
    }
    /* seq is the caller's label (errors name it); the window advances by
     * our own gate count, which both ranks share since they run the same
     * gates, so callers may skip labels (a bulk exchange takes one). */
    const uint64_t gate = dev->gate_count + 1;
    dev->cur_seq = seq;
    const uint64_t deadline = deadline_after(timeout_s);
    if (dev->armed && bytes != dev->armed_bytes) {
        /* Both ranks change size at the same seq, so both drain together. */
        rc = hp_drain(dev, deadline, timeout_s, err, errlen);
        if (rc < 0) return rc;
    }
    if (!dev->armed) {
        rc = gate_arm(dev, bytes, gate, seq, deadline, timeout_s, err, errlen);
        if (rc < 0) return rc;
    }
    dev->mode = TP_MODE_GATE;

    /* Send straight from the caller's buffer when the NIC can read it,
     * else through the slab's send slot (free: the previous gate returned
     * only after its sends completed). */
    const tp_mr *mr = find_mr(dev, src, bytes);
    const uint8_t *from = src;
    if (!mr) {
        memcpy(dev->slab + TP_OFF_SEND, src, bytes);
        from = dev->slab + TP_OFF_SEND;
        mr = &dev->mrs[0];
    }
    for (uint32_t c = 0; c < dev->armed_chunks; c++) {
        const uint32_t len = c + 1 == dev->armed_chunks ? bytes - c * TP_MAX_MSG : TP_MAX_MSG;
        rc = post_send_mr(dev, mr, from + (uint64_t)c * TP_MAX_MSG, len, TP_TAG_GATE_SEND | gate,
                          TP_OP_SEND_IMM, gate_imm(gate, c), 1, err, errlen);
        if (rc < 0) return hp_wedge(dev, rc, err, errlen);
        dev->send_outstanding++;
    }

    /* Spin until the peer's seq landed and our own sends are done (so the
     * caller may reuse src as soon as we return). */
    while (dev->recv_done < gate || dev->send_outstanding) {
        const int missing = dev->recv_done < gate;
        rc = hp_pump(dev, deadline, missing, err, errlen);
        if (rc > 0) continue;
        if (rc < 0 && rc != TP_EPEER && rc != TP_EMOVED) return rc;
        char what[80];
        snprintf(what, sizeof(what), "gate seq %llu (recv_done %llu)", (unsigned long long)seq,
                 (unsigned long long)(missing ? dev->last_seq : seq));
        return hp_stalled(dev, rc, timeout_s, what, missing ? "gate message" : NULL, err,
                          errlen);
    }
    memcpy(dst, ring_slot(dev, gate), bytes);
    /* Re-arm gate + window now, before the caller can send gate + 1: the
     * peer sends gate + window only after our gate + window - 1 reached it,
     * so it can never hit an unposted receive (that would kill the
     * direction). */
    rc = gate_post(dev, gate + TP_RECV_WINDOW, err, errlen);
    if (rc < 0) return rc;
    dev->gate_count = gate;
    dev->last_seq = seq;
    dev->stats.recv_done = seq;
    return TP_OK;
}

int tp_drain(tp_dev *dev, double timeout_s, char *err, size_t errlen) {
    if (dev && !dev->armed && !dev->wedged_code) return TP_OK;
    int rc = hp_enter(dev, timeout_s, "tp_drain", err, errlen);
    if (rc < 0) return rc;
    return hp_drain(dev, deadline_after(timeout_s), timeout_s, err, errlen);
}

/* ------------------------------------------------------------------------
 * Bulk exchange: rounds of TP_BULK_SLOTS x TP_MAX_MSG.
 * --------------------------------------------------------------------- */

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    uint64_t bytes;
    const tp_mr *send_mr, *recv_mr; /* NULL: go through slab staging */
} bulk_job;

static uint64_t round_bytes(uint64_t bytes, uint64_t r) {
    const uint64_t off = r * TP_BULK_ROUND_BYTES;
    return bytes - off > TP_BULK_ROUND_BYTES ? TP_BULK_ROUND_BYTES : bytes - off;
}

/* Receives of round r land straight in dst when it is registered, else in
 * staging half (r & 1): round r + 1 is posted while round r is unread. */
static int bulk_post_round(tp_dev *dev, const bulk_job *j, uint64_t r, char *err,
                           size_t errlen) {
    const uint64_t rb = round_bytes(j->bytes, r);
    const uint32_t n = chunks_of(rb);
    uint8_t *base = j->recv_mr ? j->dst + r * TP_BULK_ROUND_BYTES
                               : dev->slab + TP_OFF_BULK_RECV + (r & 1) * TP_BULK_ROUND_BYTES;
    const tp_mr *mr = j->recv_mr ? j->recv_mr : &dev->mrs[0];
    for (uint32_t i = 0; i < n; i++) {
        int rc = post_recv_mr(dev, mr, base + (uint64_t)i * TP_MAX_MSG,
                              bulk_chunk_len(j->bytes, r, i), TP_TAG_BULK_RECV | (r << 8) | i,
                              err, errlen);
        if (rc < 0) return hp_wedge(dev, rc, err, errlen);
    }
    return TP_OK;
}

int tp_bulk(tp_dev *dev, const void *src, void *dst, uint64_t bytes, double timeout_s,
            char *err, size_t errlen) {
    int rc = hp_enter(dev, timeout_s, "tp_bulk", err, errlen);
    if (rc < 0) return rc;
    if (bytes && (!src || !dst)) {
        tp_errf(err, errlen, "tp_bulk: NULL buffer (src %p, dst %p, %llu bytes)", src, dst,
                (unsigned long long)bytes);
        return TP_EINVAL;
    }
    const uint64_t rounds = (bytes + TP_BULK_ROUND_BYTES - 1) / TP_BULK_ROUND_BYTES;
    if (rounds >> 40) {
        tp_errf(err, errlen, "tp_bulk: %llu bytes is too large", (unsigned long long)bytes);
        return TP_EINVAL;
    }
    const uint64_t deadline = deadline_after(timeout_s);
    /* The decode window's receives would swallow bulk messages: drain. */
    rc = hp_drain(dev, deadline, timeout_s, err, errlen);
    if (rc < 0 || bytes == 0) return rc;
    if (dev->rq_outstanding) {
        tp_errf(err, errlen, "tp_bulk: %llu receives are still posted on the queue pair "
                "(warm-up leftovers?); bulk rounds need an empty receive queue",
                (unsigned long long)dev->rq_outstanding);
        return TP_EINVAL;
    }
    rc = hp_need_depth(dev, "a bulk exchange", 2 * TP_BULK_SLOTS, TP_BULK_SLOTS, err, errlen);
    if (rc < 0) return rc;

    bulk_job j = {src, dst, bytes, find_mr(dev, src, bytes), find_mr(dev, dst, bytes)};
    dev->mode = TP_MODE_BULK;
    dev->bulk_bytes = bytes;
    dev->bulk_recvs[0] = dev->bulk_recvs[1] = 0;
    for (uint64_t r = 0; r < 2 && r < rounds; r++) {
        rc = bulk_post_round(dev, &j, r, err, errlen);
        if (rc < 0) return rc;
    }
    char what[96];
    snprintf(what, sizeof(what), "bulk round 0 of %llu (%llu bytes)",
             (unsigned long long)rounds, (unsigned long long)bytes);
    rc = hp_barrier(dev, TP_BARRIER_BULK, (uint32_t)(bytes ^ (bytes >> 32)), deadline, timeout_s,
                    what, err, errlen);
    if (rc < 0) return rc;

    for (uint64_t r = 0; r < rounds; r++) {
        const uint64_t off = r * TP_BULK_ROUND_BYTES;
        const uint64_t rb = round_bytes(bytes, r);
        const uint32_t n = chunks_of(rb);
        const uint8_t *from = j.src + off;
        const tp_mr *smr = j.send_mr;
        if (!smr) {
            /* Staging is free: the previous round waited for its sends. */
            memcpy(dev->slab + TP_OFF_BULK_SEND, from, rb);
            from = dev->slab + TP_OFF_BULK_SEND;
            smr = &dev->mrs[0];
        }
        /* Round r + 1's receives are already posted, and the peer sends
         * r + 1 only after all of our round r reached it. */
        for (uint32_t i = 0; i < n; i++) {
            rc = post_send_mr(dev, smr, from + (uint64_t)i * TP_MAX_MSG,
                              bulk_chunk_len(bytes, r, i), TP_TAG_BULK_SEND | (r << 8) | i,
                              TP_OP_SEND_IMM, bulk_imm(r, i), 1, err, errlen);
            if (rc < 0) return hp_wedge(dev, rc, err, errlen);
            dev->send_outstanding++;
        }
        while (dev->bulk_recvs[r & 1] < n || dev->send_outstanding) {
            const int missing = dev->bulk_recvs[r & 1] < n;
            rc = hp_pump(dev, deadline, missing, err, errlen);
            if (rc > 0) continue;
            if (rc < 0 && rc != TP_EPEER && rc != TP_EMOVED) return rc;
            snprintf(what, sizeof(what), "bulk round %llu of %llu (%u/%u receives in, %u sends "
                     "pending)", (unsigned long long)r, (unsigned long long)rounds,
                     dev->bulk_recvs[r & 1], n, dev->send_outstanding);
            return hp_stalled(dev, rc, timeout_s, what, missing ? "bulk message" : NULL, err,
                              errlen);
        }
        if (!j.recv_mr)
            memcpy(j.dst + off, dev->slab + TP_OFF_BULK_RECV + (r & 1) * TP_BULK_ROUND_BYTES, rb);
        dev->bulk_recvs[r & 1] = 0;
        /* Post round r + 2 into the half just read, before sending r + 1. */
        if (r + 2 < rounds) {
            rc = bulk_post_round(dev, &j, r + 2, err, errlen);
            if (rc < 0) return rc;
        }
    }
    dev->mode = TP_MODE_IDLE;
    return TP_OK;
}

/* ------------------------------------------------------------------------
 * Slab size and counters.
 * --------------------------------------------------------------------- */

uint64_t tp_slab_bytes(void) { return TP_OFF_END; }

void tp_get_stats(const tp_dev *dev, tp_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof(*out));
    if (!dev) return;
    *out = dev->stats;
    out->recv_done = dev->last_seq;
    out->window_armed = dev->armed;
}
