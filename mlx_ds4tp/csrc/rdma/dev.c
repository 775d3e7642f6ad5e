/* mlx_ds4tp._verbs device layer: the public API of _verbs_api.h that is not
 * a hot path. Which provider serves a device (ibverbs, csrc/rdma/ibv.c, or the
 * emulated ucsim, csrc/rdma/ucsim.c), queue-pair life cycle, the
 * memory-registration table, raw work requests, and completion reaping with
 * the peer-death and loss watch every wait shares. */

#include "_verbs_hot.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------
 * Open, build, connect, close.
 * --------------------------------------------------------------------- */

int tp_built_with_ibverbs(void) { return TP_HAVE_IBVERBS_HEADER; }

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
    dev->window = 0;
    dev->post_gate = 0;
    dev->post_chunk = 0;
    dev->bulk_posted = dev->bulk_recvd = 0;
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
    int swr = send_wr > 0 ? send_wr : TP_DEFAULT_SEND_WR;
    int rwr = recv_wr > 0 ? recv_wr : TP_DEFAULT_RECV_WR;
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

void tp_set_no_imm(tp_dev *dev, int no_imm) {
    if (!dev) return;
    if (no_imm && !dev->no_imm)
        fprintf(stderr, TP_LOG "rdma device %s: hot-path messages go untagged (no_imm set): a "
                "message lost on the UC link cannot be detected at the gate; run with "
                "--debug-hash N to catch a divergence\n", dev->name);
    dev->no_imm = no_imm != 0;
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
const tp_mr *tp_find_mr(const tp_dev *dev, const void *addr, uint64_t len) {
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

int tp_post_recv_mr(tp_dev *dev, const tp_mr *mr, const void *addr, uint32_t len,
                        uint64_t wr_id, char *err, size_t errlen) {
    int rc = dev->prov->post_recv(dev, (uintptr_t)addr, len, mr->lkey, wr_id, err, errlen);
    if (rc == 0) dev->rq_outstanding++;
    return rc;
}

int tp_post_send_mr(tp_dev *dev, const tp_mr *mr, const void *addr, uint32_t len,
                        uint64_t wr_id, int opcode, uint32_t imm, int signaled, char *err,
                        size_t errlen) {
    /* Untagged on request (tp_set_no_imm) or after the device refused a
     * tag: the receiver then skips the check (see csrc/rdma/loss.c). */
    if (opcode == TP_OP_SEND_IMM && dev->no_imm) opcode = TP_OP_SEND;
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
    const tp_mr *mr = tp_find_mr(dev, addr, len);
    if (!mr) return unregistered(dev, "receive", addr, len, err, errlen);
    return tp_post_recv_mr(dev, mr, addr, len, wr_id, err, errlen);
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
    const tp_mr *mr = tp_find_mr(dev, addr, len);
    if (!mr) return unregistered(dev, "send", addr, len, err, errlen);
    /* Raw sends (warm-up, tests) stay plain SEND: tags are a hot-path matter. */
    return tp_post_send_mr(dev, mr, addr, len, wr_id, opcode, 0, signaled, err, errlen);
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
int tp_reap(tp_dev *dev, tp_wc *wc, int max, uint64_t deadline_ns, int watch_data,
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

uint64_t tp_deadline_after(double timeout_s) {
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
    int n = tp_reap(dev, wc, max, tp_deadline_after(timeout_s), 0, err, errlen);
    if (n == TP_EPEER)
        tp_errf(err, errlen, "tp rdma: peer closed the control channel while polling");
    return n;
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
    out->recv_cap = dev->recv_cap;
    out->send_cap = dev->send_cap;
    out->window = dev->window;
    out->bulk_slots = dev->bulk_slots;
}
