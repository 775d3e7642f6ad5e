/* TCP gate hot loop: the fallback transport's decode gate, in C so the round
 * trip pays no interpreter time and runs with the GIL released.
 *
 * The data socket is blocking with SO_RCVTIMEO/SO_SNDTIMEO set by Python, so
 * the kernel enforces the deadline: a read that waits past it returns EAGAIN
 * and no poll() is spent on the fast path.
 *
 * Before blocking, a read polls the socket for up to spin_ns. A rank that
 * reaches a gate first usually waits well under a millisecond for the other
 * (the two halves of a layer finish at slightly different times); asleep in
 * the kernel it pays a wake-up on top of that, and its core may drop into an
 * idle state the wake-up must climb out of. The RDMA path spins on its
 * completion queue for the same reason. Each poll yields the core: when
 * other threads are runnable (both ranks and more on too few cores) they run
 * instead of the poll, which otherwise slowed such a machine 5x; and a yield
 * that gave the core away ends the spin (tp_yield_lost, csrc/util.c). */

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_verbs.h"
#include "_verbs_priv.h"

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0 /* macOS: SO_NOSIGPIPE is set on the socket instead */
#endif

static void tcp_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static int tcp_errno_code(int e) {
    if (e == EAGAIN || e == EWOULDBLOCK) return TP_ETIMEOUT;
    if (e == ECONNRESET || e == EPIPE || e == ENOTCONN) return TP_EPEER;
    return TP_ESYS;
}

/* One wording for every failed send or receive: a timeout says the peer is
 * stuck, a reset says it closed, anything else names the system error. */
static int tcp_fail(int e, const char *op, const char *what, uint64_t seq, char *err,
                    size_t errlen) {
    const int code = tcp_errno_code(e);
    if (code == TP_ETIMEOUT)
        tcp_err(err, errlen, "tcp %s seq %llu: no data from the peer within the gate timeout; "
                "is the peer stopped or stuck?", what, (unsigned long long)seq);
    else if (code == TP_EPEER)
        tcp_err(err, errlen, "peer closed the gate connection (%s) during tcp %s seq %llu",
                strerror(e), what, (unsigned long long)seq);
    else
        tcp_err(err, errlen, "tcp %s seq %llu: %s failed: %s", what, (unsigned long long)seq, op,
                strerror(e));
    return code;
}

static int tcp_eof(const char *what, uint64_t seq, size_t got, size_t len, char *err,
                   size_t errlen) {
    tcp_err(err, errlen, "peer closed the gate connection (EOF) during tcp %s seq %llu "
            "(%zu/%zu bytes)", what, (unsigned long long)seq, got, len);
    return TP_EPEER;
}

/* Write every byte of iov[0..n) (header then payload), resuming partial writes. */
static int tcp_write_all(int fd, struct iovec *iov, int n, const char *what, uint64_t seq,
                         char *err, size_t errlen) {
    while (n > 0) {
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)n;
        ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return tcp_fail(errno, "send", what, seq, err, errlen);
        }
        size_t left = (size_t)w;
        while (n > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return TP_OK;
}

/* recvmsg that polls until the monotonic clock passes spin_until (0: never
 * polls), then blocks in the kernel until SO_RCVTIMEO. */
static ssize_t recv_spin_then_block(int fd, struct msghdr *msg, uint64_t spin_until) {
    if (spin_until) {
        do {
            ssize_t r = recvmsg(fd, msg, MSG_DONTWAIT);
            if (r >= 0) return r;
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return r;
            if (tp_yield_lost()) break;
        } while (tp_mono_ns() < spin_until);
    }
    ssize_t r;
    do {
        r = recvmsg(fd, msg, 0);
    } while (r < 0 && errno == EINTR);
    return r;
}

/* Read exactly len bytes into buf. */
static int tcp_read_all(int fd, void *buf, size_t len, uint64_t spin_until, const char *what,
                        uint64_t seq, char *err, size_t errlen) {
    char *p = buf;
    size_t got = 0;
    while (got < len) {
        struct iovec iov = {p + got, len - got};
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        ssize_t r = recv_spin_then_block(fd, &msg, spin_until);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0) return tcp_eof(what, seq, got, len, err, errlen);
        return tcp_fail(errno, "receive", what, seq, err, errlen);
    }
    return TP_OK;
}

static uint64_t spin_deadline(uint64_t spin_ns) {
    return spin_ns ? tp_mono_ns() + spin_ns : 0;
}

/* Header and payload leave in one sendmsg so TCP_NODELAY never splits them
 * into two segments. 16 KiB fits any socket buffer, so both sides writing
 * first cannot deadlock. */
static inline int tcp_post(int fd, const void *hdr_out, uint32_t hdr_len, const void *src,
                           uint64_t bytes, uint64_t seq, char *err, size_t errlen) {
    struct iovec out[2] = {{(void *)hdr_out, hdr_len}, {(void *)src, (size_t)bytes}};
    return tcp_write_all(fd, out, 2, "gate", seq, err, errlen);
}

/* The peer's header and payload: one scatter read usually brings both. */
static inline int tcp_collect(int fd, const void *hdr_out, void *hdr_in, uint32_t hdr_len,
                              void *dst, uint64_t bytes, uint64_t seq, uint64_t spin_ns,
                              char *err, size_t errlen) {
    struct iovec in[2] = {{hdr_in, hdr_len}, {dst, (size_t)bytes}};
    struct msghdr msg;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = in;
    msg.msg_iovlen = 2;
    const uint64_t spin_until = spin_deadline(spin_ns);
    ssize_t r = recv_spin_then_block(fd, &msg, spin_until);
    if (r < 0) return tcp_fail(errno, "receive", "gate", seq, err, errlen);
    if (r == 0) return tcp_eof("gate", seq, 0, hdr_len + (size_t)bytes, err, errlen);
    size_t got = (size_t)r;
    if (got < hdr_len) {
        int rc = tcp_read_all(fd, (char *)hdr_in + got, hdr_len - got, spin_until, "gate header",
                              seq, err, errlen);
        if (rc != TP_OK) return rc;
        got = hdr_len;
    }
    /* The header is checked before any more payload is awaited: a peer at
     * another gate or with another size fails fast instead of hanging. The
     * two ranks send identical headers when they are in step. */
    if (memcmp(hdr_in, hdr_out, hdr_len) != 0) {
        tcp_err(err, errlen, "gate desync at seq %llu", (unsigned long long)seq);
        return TP_EDESYNC;
    }
    size_t payload_got = got - hdr_len;
    if (payload_got < bytes)
        return tcp_read_all(fd, (char *)dst + payload_got, (size_t)bytes - payload_got,
                            spin_until, "gate", seq, err, errlen);
    return TP_OK;
}

int tp_tcp_gate(int fd, const void *hdr_out, void *hdr_in, uint32_t hdr_len,
                const void *src, void *dst, uint64_t bytes, uint64_t seq, uint64_t spin_ns,
                char *err, size_t errlen) {
    int rc = tcp_post(fd, hdr_out, hdr_len, src, bytes, seq, err, errlen);
    if (rc != TP_OK) return rc;
    return tcp_collect(fd, hdr_out, hdr_in, hdr_len, dst, bytes, seq, spin_ns, err, errlen);
}

/* tp_tcp_gate in two halves, for a rank with several peers (csrc/exchange.c's mesh): post
 * to every peer first, then collect from each, so the round trips overlap
 * instead of adding up. The bytes on the wire are tp_tcp_gate's. */
int tp_tcp_post(int fd, const void *hdr_out, uint32_t hdr_len, const void *src, uint64_t bytes,
                uint64_t seq, char *err, size_t errlen) {
    return tcp_post(fd, hdr_out, hdr_len, src, bytes, seq, err, errlen);
}

int tp_tcp_collect(int fd, const void *hdr_out, void *hdr_in, uint32_t hdr_len, void *dst,
                   uint64_t bytes, uint64_t seq, uint64_t spin_ns, char *err, size_t errlen) {
    return tcp_collect(fd, hdr_out, hdr_in, hdr_len, dst, bytes, seq, spin_ns, err, errlen);
}

int tp_tcp_raw(int fd, const void *src, void *dst, uint64_t bytes, uint64_t spin_ns, char *err,
               size_t errlen) {
    struct iovec out[1] = {{(void *)src, (size_t)bytes}};
    int rc = tcp_write_all(fd, out, 1, "raw exchange", 0, err, errlen);
    if (rc != TP_OK) return rc;
    return tcp_read_all(fd, dst, (size_t)bytes, spin_deadline(spin_ns), "raw exchange", 0, err,
                        errlen);
}

/* Advance an iovec array past `done` bytes; returns how many entries are left
 * and points *first at the first one with bytes to go. */
static int iov_skip(struct iovec *iov, int n, size_t done, struct iovec *cur) {
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (done >= iov[i].iov_len) {
            done -= iov[i].iov_len;
            continue;
        }
        cur[k].iov_base = (char *)iov[i].iov_base + done;
        cur[k].iov_len = iov[i].iov_len - done;
        done = 0;
        k++;
    }
    return k;
}

int tp_tcp_duplex(int fd, const void *hdr_out, void *hdr_in, uint32_t hdr_len, const void *src,
                  void *dst, uint64_t bytes, uint64_t seq, uint64_t spin_ns, double timeout_s,
                  char *err, size_t errlen) {
    /* Both sides write and read at once, never blocking in either: a side
     * that only wrote could fill both socket buffers while its peer also only
     * writes, so every write is non-blocking and reads drain the peer's bytes
     * in between. The header rides in the same byte stream, ahead of the
     * payload, so a bulk exchange costs no separate header round trip. */
    struct iovec out[2] = {{(void *)hdr_out, hdr_len}, {(void *)src, (size_t)bytes}};
    struct iovec in[2] = {{hdr_in, hdr_len}, {dst, (size_t)bytes}};
    const size_t total = (size_t)hdr_len + (size_t)bytes;
    size_t sent = 0, got = 0;
    int header_checked = 0;
    const uint64_t timeout_ns = (uint64_t)(timeout_s * 1e9);
    uint64_t now = tp_mono_ns();
    uint64_t spin_until = now + spin_ns;
    uint64_t last_progress = now;
    while (sent < total || got < total) {
        int progressed = 0;
        struct iovec cur[2];
        struct msghdr msg;
        if (sent < total) {
            memset(&msg, 0, sizeof(msg));
            msg.msg_iov = cur;
            msg.msg_iovlen = (size_t)iov_skip(out, 2, sent, cur);
            ssize_t w = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (w > 0) {
                sent += (size_t)w;
                progressed = 1;
            } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                return tcp_fail(errno, "send", "bulk exchange", seq, err, errlen);
            }
        }
        if (got < total) {
            memset(&msg, 0, sizeof(msg));
            msg.msg_iov = cur;
            msg.msg_iovlen = (size_t)iov_skip(in, 2, got, cur);
            ssize_t r = recvmsg(fd, &msg, MSG_DONTWAIT);
            if (r > 0) {
                got += (size_t)r;
                progressed = 1;
            } else if (r == 0) {
                return tcp_eof("bulk exchange", seq, got, total, err, errlen);
            } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                return tcp_fail(errno, "receive", "bulk exchange", seq, err, errlen);
            }
        }
        /* A peer at another exchange or with another size fails as soon as its
         * header is in, before more of its payload is awaited. */
        if (!header_checked && got >= hdr_len) {
            if (memcmp(hdr_in, hdr_out, hdr_len) != 0) {
                tcp_err(err, errlen, "bulk exchange desync at seq %llu", (unsigned long long)seq);
                return TP_EDESYNC;
            }
            header_checked = 1;
        }
        if (progressed) {
            last_progress = tp_mono_ns();
            continue;
        }
        now = tp_mono_ns();
        if (now - last_progress >= timeout_ns) {
            tcp_err(err, errlen, "bulk exchange seq %llu: no progress for %g s (sent %zu/%zu, "
                    "received %zu/%zu bytes); is the peer stopped or stuck?",
                    (unsigned long long)seq, timeout_s, sent, total, got, total);
            return TP_ETIMEOUT;
        }
        if (now < spin_until) {
            if (!tp_yield_lost()) continue;
            spin_until = 0; /* another task has the core: block from now on */
        }
        struct pollfd pfd = {fd, (short)((got < total ? POLLIN : 0) | (sent < total ? POLLOUT : 0)), 0};
        uint64_t left_ms = (timeout_ns - (now - last_progress)) / 1000000u + 1;
        poll(&pfd, 1, (int)(left_ms < 1000 ? left_ms : 1000));
    }
    return TP_OK;
}

