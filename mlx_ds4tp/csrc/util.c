/* mlx_ds4tp._verbs: small helpers shared by the device layer, the hot paths
 * and both providers (clocks, randomness, socket checks, messages). The fake
 * libibverbs of the tests (tests/fake_ibverbs/) links this file and
 * csrc/rdma/ucsim.c, so keep it free of anything else of the module. */

#include "_verbs_priv.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#if defined(__linux__) || defined(__APPLE__)
#include <sys/random.h> /* getentropy */
#endif

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

/* A waiter's spin yields so that a peer rank on the same core runs at once.
 * But a yield that hands the core to another task leaves the waiter runnable,
 * not asleep: when its message arrives the scheduler does not wake it, and it
 * waits out the other task's slice (1.5-4 ms on Linux's EEVDF, against a gate
 * of about 20 us). On a core shared with a busy process that cost most of a
 * token's time at an even-paced split (5:3 decoded at 4.7 tok/s against 6.0
 * without spinning). A yield that took this long ran another task: the caller
 * blocks instead, and a sleeper is woken, promptly, when its data comes. */
static uint64_t yields_lost;

int tp_yield_lost(void) {
    const uint64_t before = tp_mono_ns();
    sched_yield();
    if (tp_mono_ns() - before <= TP_YIELD_LOST_NS) return 0;
    __atomic_fetch_add(&yields_lost, 1, __ATOMIC_RELAXED);
    return 1;
}

uint64_t tp_yields_lost(void) {
    return __atomic_load_n(&yields_lost, __ATOMIC_RELAXED);
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
