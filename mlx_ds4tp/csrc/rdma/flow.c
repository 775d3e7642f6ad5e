/* mlx_ds4tp._verbs hot paths, flow control: the receives-posted barrier
 * (a UC send must never reach a queue pair with no receive posted) and the
 * queue depth a hot path may really use (the device may refuse a post well
 * below the depth it granted at creation). */

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
 * The receives-posted barrier.
 * --------------------------------------------------------------------- */

/* Receives-posted barrier: an 8-byte word each way over the TCP data
 * socket, written only after this side's receives are posted, and sends
 * start only after the peer's word arrived. Why: a UC send that reaches a
 * queue pair with no receive posted kills that direction for good. The
 * word carries what was armed, so ranks that disagree fail loudly here. */

static void barrier_desc(char *buf, size_t n, uint32_t magic, uint32_t value) {
    /* The top byte of bulk and drain words is a count the ranks need not
     * share (csrc/rdma/bulk.c, csrc/rdma/window.c); only the rest must agree. */
    if (magic != TP_BARRIER_GATE) value &= TP_BARRIER_MATCH;
    if (magic == TP_BARRIER_GATE) snprintf(buf, n, "a gate window of %u-byte vectors", value);
    else if (magic == TP_BARRIER_BULK) snprintf(buf, n, "a bulk exchange (size tag %u)", value);
    else if (magic == TP_BARRIER_DRAIN) snprintf(buf, n, "a window drain after %u gates", value);
    else snprintf(buf, n, "nothing we know (word 0x%08x%08x)", value, magic);
}

int hp_barrier(tp_dev *dev, uint32_t magic, uint32_t value, uint32_t *peer_value,
               uint64_t deadline_ns, double timeout_s, const char *what, char *err,
               size_t errlen) {
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
    const uint32_t match = magic == TP_BARRIER_GATE ? UINT32_MAX : TP_BARRIER_MATCH;
    if (pm != magic || (pv & match) != (value & match)) {
        char ours[64], theirs[64];
        barrier_desc(ours, sizeof(ours), magic, value);
        barrier_desc(theirs, sizeof(theirs), pm, pv);
        return hp_fail(dev, TP_EINVAL, err, errlen,
                       "tp rdma: desync at the receives-posted barrier before %s: we armed %s, "
                       "the peer armed %s; both ranks must run the same gate sequence",
                       what, ours, theirs);
    }
    if (peer_value) *peer_value = pv;
    return TP_OK;
}

/* ------------------------------------------------------------------------
 * The depth a hot path may really use.
 *
 * Apple's driver takes ibv_create_qp with large work-request caps and then
 * refuses ibv_post_recv with ENOMEM at the 64th outstanding receive, and
 * ibv_post_send at the 64th send in flight (MLX's JACCL caps its queues at
 * 32 for this reason). So the granted depth is an upper bound only: a hot
 * path sizes its window or round from it, and when a post is refused it
 * learns the real depth (logged once per device and direction) and carries
 * on within it. A refused post queued nothing, so nothing is lost or sent
 * twice: a refused send is simply posted again once a send completion has
 * freed room; a refused receive either shrinks what is being armed (before
 * the receives-posted barrier, when the peer sends nothing yet) or waits
 * for one of the peer's messages, which the peer is free to send, to
 * consume a posted receive.
 * --------------------------------------------------------------------- */

static int min_cap(int granted, int learned) {
    return learned > 0 && learned < granted ? learned : granted;
}

int hp_usable_recv(const tp_dev *dev) { return min_cap(dev->recv_wr, dev->recv_cap); }
int hp_usable_send(const tp_dev *dev) { return min_cap(dev->send_wr, dev->send_cap); }

/* A post was refused for want of room with `outstanding` already posted. */
static void learn_cap(tp_dev *dev, int is_recv, uint64_t outstanding) {
    int *cap = is_recv ? &dev->recv_cap : &dev->send_cap;
    const int granted = is_recv ? dev->recv_wr : dev->send_wr;
    const int was = *cap;
    if (outstanding < 1) outstanding = 1;
    if (was && (uint64_t)was <= outstanding) return;
    *cap = (int)outstanding;
    if (!was)
        fprintf(stderr, TP_LOG "rdma device %s refused a %s with %d outstanding (ENOMEM) though "
                "it granted a depth of %d: hot paths now keep at most %d %s posted\n", dev->name,
                is_recv ? "receive" : "send", *cap, granted, *cap,
                is_recv ? "receives" : "sends");
}

int hp_post_recv(tp_dev *dev, const tp_mr *mr, void *addr, uint32_t len, uint64_t wr_id,
                 char *err, size_t errlen) {
    if ((uint64_t)hp_usable_recv(dev) <= dev->rq_outstanding) {
        tp_errf(err, errlen, "tp rdma: %llu receives outstanding, the device takes %d",
                (unsigned long long)dev->rq_outstanding, hp_usable_recv(dev));
        return TP_ENOMEM;
    }
    int rc = tp_post_recv_mr(dev, mr, addr, len, wr_id, err, errlen);
    if (rc == TP_ENOMEM) {
        learn_cap(dev, 1, dev->rq_outstanding);
        return TP_ENOMEM;
    }
    return rc < 0 ? hp_wedge(dev, rc, err, errlen) : TP_OK;
}

/* After the device refused a post for want of room (the slow path): pump
 * until a completion lowers the outstanding receives (recv) or sends below
 * their count now, TP_OK; refused at once when none is outstanding, since
 * nothing could ever free room; else the pump's error or hp_stalled's. */
static int wait_for_room(tp_dev *dev, int recv, uint64_t deadline_ns, double timeout_s,
                         const char *what, char *err, size_t errlen) {
    const uint64_t before = recv ? dev->rq_outstanding : dev->send_outstanding;
    if (!before)
        return hp_fail(dev, TP_ENOMEM, err, errlen, "tp rdma: the device refused a %s with none "
                       "%s during %s", recv ? "receive" : "send", recv ? "outstanding" : "in flight",
                       what);
    while ((recv ? dev->rq_outstanding : dev->send_outstanding) >= before) {
        int rc = hp_pump(dev, deadline_ns, recv, err, errlen);
        if (rc > 0) continue;
        if (rc < 0 && rc != TP_EPEER && rc != TP_EMOVED) return rc;
        return hp_stalled(dev, rc, timeout_s, what, recv ? "message" : NULL, err, errlen);
    }
    return TP_OK;
}

int hp_post_recv_waiting(tp_dev *dev, const tp_mr *mr, void *addr, uint32_t len,
                         uint64_t wr_id, uint64_t deadline_ns, double timeout_s, const char *what,
                         char *err, size_t errlen) {
    for (;;) {
        int rc = hp_post_recv(dev, mr, addr, len, wr_id, err, errlen);
        if (rc != TP_ENOMEM) return rc;
        /* Room comes when one of the peer's messages consumes a receive. */
        rc = wait_for_room(dev, 1, deadline_ns, timeout_s, what, err, errlen);
        if (rc < 0) return rc;
    }
}

int hp_post_send(tp_dev *dev, const tp_mr *mr, const void *addr, uint32_t len, uint64_t wr_id,
                 uint32_t imm, uint64_t deadline_ns, double timeout_s, const char *what,
                 char *err, size_t errlen) {
    for (;;) {
        int rc = TP_ENOMEM;
        if ((uint64_t)hp_usable_send(dev) > dev->send_outstanding) {
            rc = tp_post_send_mr(dev, mr, addr, len, wr_id, TP_OP_SEND_IMM, imm, 1, err, errlen);
            if (rc == TP_OK) {
                dev->send_outstanding++;
                return TP_OK;
            }
            if (rc != TP_ENOMEM) return hp_wedge(dev, rc, err, errlen);
            learn_cap(dev, 0, dev->send_outstanding);
        }
        /* A send completion frees room; receives reaped meanwhile are
         * accounted as usual. */
        rc = wait_for_room(dev, 0, deadline_ns, timeout_s, what, err, errlen);
        if (rc < 0) return rc;
    }
}
