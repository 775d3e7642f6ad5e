/* mlx_ds4tp._verbs, private: the device object shared by the device layer
 * (csrc/rdma/dev.c), the hot paths (_verbs_hot.h) and the two providers
 * (csrc/rdma/ibv.c: real verbs, csrc/rdma/ucsim.c: emulated Thunderbolt UC).
 * Include this first in every .c file of the module. */
#ifndef MLX_DS4TP_VERBS_PRIV_H
#define MLX_DS4TP_VERBS_PRIV_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* ppoll, SO_RCVBUFFORCE, MSG_NOSIGNAL */
#endif

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "_verbs.h"

#define TP_LOG "ds4-tp: "


/* Hot-path work request ids. A gate's final chunk receive carries the bare
 * gate number (gates since the build; top byte 0) so its completion is the
 * arrival watermark; every other hot-loop work request is tagged in the top
 * byte. */
#define TP_TAG_MASK (UINT64_C(0xff) << 56)
#define TP_TAG_GATE_CHUNK (UINT64_C(0xd1) << 56) /* | seq: non-final chunk recv */
#define TP_TAG_GATE_SEND (UINT64_C(0xd2) << 56)  /* | seq */
#define TP_TAG_DRAIN (UINT64_C(0xd3) << 56)      /* | index */
#define TP_TAG_BULK_RECV (UINT64_C(0xd4) << 56)  /* | chunk index in the exchange */
#define TP_TAG_BULK_SEND (UINT64_C(0xd5) << 56)  /* | chunk index in the exchange */

/* Hot-path sequence tags, the immediate data of every hot-path message (see
 * "Sequence tags" in _verbs.h): the kind in the top nibble (never 0, so a tag
 * cannot be confused with an untagged message), then what the message is.
 * Gate numbers wrap at 2^24 and bulk chunks at 2^28: a lost message shifts
 * the stream by one message, far less than either. */
#define TP_IMM_KIND_MASK UINT32_C(0xf0000000)
#define TP_IMM_GATE UINT32_C(0x10000000)  /* | chunk << 24 | (gate & 0xffffff) */
#define TP_IMM_DRAIN UINT32_C(0x20000000) /* | marker index (the receive it must land in) */
#define TP_IMM_BULK UINT32_C(0x30000000)  /* | (chunk index & 0xfffffff) */

/* Provider opcode beyond the public TP_OP_*: SEND_WITH_IMM, hot paths only. */
#define TP_OP_SEND_IMM 2

/* Slab layout owned by the hot paths (tp_slab_bytes()). 4 KiB aligned. */
#define TP_GATE_SLOT_BYTES ((uint64_t)TP_GATE_MAX_CHUNKS * TP_MAX_MSG)
#define TP_BULK_ROUND_BYTES ((uint64_t)TP_BULK_SLOTS * TP_MAX_MSG)
#define TP_OFF_SEND 0u
#define TP_OFF_CTRL (TP_OFF_SEND + TP_GATE_SLOT_BYTES) /* 4 KiB: drain markers */
#define TP_OFF_RING (TP_OFF_CTRL + 4096u)
#define TP_OFF_BULK_SEND (TP_OFF_RING + (uint64_t)TP_RECV_WINDOW * TP_GATE_SLOT_BYTES)
#define TP_OFF_BULK_RECV (TP_OFF_BULK_SEND + TP_BULK_ROUND_BYTES)
/* Bulk receive staging: a ring of two rounds' messages; chunk i lands in
 * slot i % TP_BULK_STAGE_SLOTS (rounds may be smaller than TP_BULK_SLOTS). */
#define TP_BULK_STAGE_SLOTS (2u * TP_BULK_SLOTS)
#define TP_OFF_END (TP_OFF_BULK_RECV + (uint64_t)TP_BULK_STAGE_SLOTS * TP_MAX_MSG)

/* Drain markers: small, so they fit any posted receive, and recognisable,
 * so a real gate arriving during a drain is reported as a desync. */
#define TP_DRAIN_MSG_BYTES 8u

/* Loss with nothing behind it ("Sequence tags" in _verbs.h): how long an
 * awaited receive may stay missing after the peer's next data-socket word
 * is seen. Why a grace at all: the peer writes that word only after its own
 * message to us was posted, but on hardware the message may still be on the
 * wire (or in our CQ, unreaped) when the TCP bytes arrive. Why 100 ms: a
 * Thunderbolt message is in flight for microseconds and even a loaded
 * scheduler's hiccups are a few milliseconds, so 100 ms is far past any
 * late arrival, yet short enough that a lost last message stops the pair
 * in well under a second instead of after DS4_TP_TIMEOUT_SEC. A provider
 * whose delivery is slower adds its delay (ucsim: delay_us). */
#define TP_LOST_GRACE_NS UINT64_C(100000000)

/* reap()/hp_pump() only, never returned by the API: the peer moved past the
 * receive being waited for (its next data-socket word arrived and the grace
 * ran out); the hot path turns it into TP_ELOST naming what was missing. */
#define TP_EMOVED -100


typedef struct {
    uintptr_t lo, hi;  /* [lo, hi) */
    uint32_t lkey;
    int used;
    void *handle;      /* provider's registration (struct ibv_mr *) */
} tp_mr;

/* What a provider implements. Every function gets the device; errors are
 * negative TP_E* codes with a message in err. */
typedef struct {
    const char *kind; /* "ibverbs" | "ucsim" */
    int (*build_qp)(tp_dev *dev, int qp_type, int attempt, int *cq_depth, int *send_wr,
                    int *recv_wr, char *err, size_t errlen);
    int (*connect)(tp_dev *dev, const tp_info *peer, char *err, size_t errlen);
    int (*reg)(tp_dev *dev, tp_mr *mr, char *err, size_t errlen);
    void (*dereg)(tp_dev *dev, tp_mr *mr);
    int (*post_recv)(tp_dev *dev, uintptr_t addr, uint32_t len, uint32_t lkey, uint64_t wr_id,
                     char *err, size_t errlen);
    /* opcode TP_OP_SEND_IMM sends imm as immediate data (ignored otherwise). */
    int (*post_send)(tp_dev *dev, uintptr_t addr, uint32_t len, uint32_t lkey, uint64_t wr_id,
                     int opcode, uint32_t imm, int signaled, char *err, size_t errlen);
    /* Non-blocking: reap up to max completions (>= 0) or fail. */
    int (*poll)(tp_dev *dev, tp_wc *wc, int max, char *err, size_t errlen);
    /* Nothing was ready: wait a little (spin, or block in the kernel), at
     * most until deadline_ns (CLOCK_MONOTONIC). waited_ns: how long this
     * wait has lasted so far. 0, or TP_EPEER when the control socket closed. */
    int (*idle)(tp_dev *dev, uint64_t deadline_ns, uint64_t waited_ns);
    void (*close)(tp_dev *dev);
} tp_provider;

enum { TP_MODE_IDLE = 0, TP_MODE_GATE, TP_MODE_DRAIN, TP_MODE_BULK };

struct tp_dev {
    const tp_provider *prov;
    void *impl; /* provider state */
    char name[64];
    int role;

    uint8_t *slab;
    uint64_t slab_bytes;
    tp_mr mrs[TP_MAX_MRS]; /* mrs[0] is the slab */

    int qp_built, connected, qp_type, setup_attempt;
    int cq_depth, send_wr, recv_wr; /* granted */
    tp_info local;
    int control_fd, barrier_fd;
    uint64_t next_peer_check_ns;
    uint64_t moved_seen_ns;  /* != 0: when the peer's next data-socket bytes were first
                                seen during a hot-path receive wait */
    uint64_t lost_grace_ns;  /* TP_LOST_GRACE_NS plus the provider's delivery delay */

    /* Work requests the core has seen posted and not yet completed. */
    uint64_t rq_outstanding;

    /* The device's real depths, learned when it refused a post (0: none
     * refused yet). Apple's driver grants large depths at creation, then
     * refuses the post past 63 outstanding (csrc/rdma/flow.c). Kept across
     * rebuilds: it is the device's, not the queue pair's. */
    int recv_cap, send_cap;

    /* Hot-path state. */
    int mode;
    int armed;
    uint32_t armed_bytes, armed_chunks;
    uint32_t window;             /* gates the window keeps posted ahead (2..TP_RECV_WINDOW) */
    uint64_t post_gate;          /* the window's next receive to post: gate number, */
    uint32_t post_chunk;         /* and chunk of it */
    uint64_t gate_count;         /* gates completed since the build (window key) */
    uint64_t recv_done;          /* highest gate number whose receive completed */
    uint64_t last_seq, cur_seq;  /* caller's labels: last completed, in progress */
    uint32_t send_outstanding;   /* hot-path signaled sends not yet reaped */
    uint32_t drain_recvs;        /* drain markers received */
    uint64_t bulk_bytes;         /* current bulk exchange (for length checks) */
    uint32_t bulk_slots;         /* messages per round of the current bulk exchange */
    uint64_t bulk_posted;        /* bulk chunks whose receive is posted, */
    uint64_t bulk_recvd;         /* and whose message arrived (in order) */
    int wedged_code;             /* != 0: a hot path failed; rebuild first */
    char wedged[320];
    int untagged_logged;         /* logged once: the peer's hot-path messages carry no tag */
    int no_imm;                  /* hot-path sends go untagged (tp_set_no_imm, or the
                                    ibverbs provider after the device refused a tag) */

    tp_stats stats;
};

/* ---- shared helpers (csrc/util.c) ---- */
void tp_errf(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
uint64_t tp_mono_ns(void);
uint64_t tp_real_ns(void);
uint64_t tp_random64(void);
/* 1 when the peer closed (EOF or reset) the socket, 0 otherwise. */
int tp_fd_closed(int fd);
/* Block in poll() on fds for at most ns nanoseconds. */
int tp_poll_fds(void *pfds, int nfds, uint64_t ns);
const char *tp_wc_status_name(int status);

/* ---- providers ---- */
extern const tp_provider tp_ucsim_provider;
int tp_ucsim_open(tp_dev *dev, const char *bind_ipv4, const char *faults, char *err,
                  size_t errlen);
/* The tests' fake libibverbs drives ucsim through these two as well. */
void tp_ucsim_set_send_psn(tp_dev *dev, uint32_t psn);
uint16_t tp_ucsim_port(const tp_dev *dev);

extern const tp_provider tp_ibv_provider;
int tp_ibv_probe(const char *device, char *err, size_t errlen);
int tp_ibv_open(tp_dev *dev, const char *device, int gid_index, char *err, size_t errlen);

#endif
