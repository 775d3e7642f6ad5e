/* mlx_ds4tp._verbs, private: what the hot-path files share (csrc/rdma/loss.c,
 * csrc/rdma/flow.c, csrc/rdma/window.c, csrc/rdma/bulk.c) and what they need of the
 * device layer (csrc/rdma/dev.c).
 *
 * The hot loops exist to respect two facts of Apple's Thunderbolt RDMA (UC
 * queue pairs, as ucsim models them in csrc/rdma/ucsim.c):
 *   1. a message that reaches a queue pair with no receive posted does not
 *      just vanish, that direction stops delivering for good, so every send
 *      must be preceded by a receive the peer provably posted (the
 *      receives-posted barrier, csrc/rdma/flow.c);
 *   2. UC never reports loss: no error completion anywhere, the receive
 *      meant for the lost message stays posted and the peer's next message
 *      lands in it. Every hot-path message therefore carries a sequence tag
 *      (immediate data, "Sequence tags" in _verbs_api.h) that the receiver
 *      checks against what the receive was posted for (TP_ELOST on a
 *      mismatch, csrc/rdma/loss.c); a loss with nothing behind it on the queue
 *      pair is revealed by the peer's next word on the TCP data socket
 *      ("Loss with nothing behind it", csrc/rdma/loss.c); every wait is bounded
 *      and names what it waited for.
 * Both ranks run the same gate sequence, so all matching is by order: the
 * k-th message the peer sends lands in the k-th receive we posted. */
#ifndef MLX_DS4TP_VERBS_HOT_H
#define MLX_DS4TP_VERBS_HOT_H

#include "_verbs_priv.h"

/* ---- device layer (csrc/rdma/dev.c) ---- */

/* The registered region holding all of [addr, addr + len), or NULL. */
const tp_mr *tp_find_mr(const tp_dev *dev, const void *addr, uint64_t len);
/* Post through a known registration, with the core's bookkeeping. */
int tp_post_recv_mr(tp_dev *dev, const tp_mr *mr, const void *addr, uint32_t len,
                    uint64_t wr_id, char *err, size_t errlen);
int tp_post_send_mr(tp_dev *dev, const tp_mr *mr, const void *addr, uint32_t len,
                    uint64_t wr_id, int opcode, uint32_t imm, int signaled, char *err,
                    size_t errlen);
/* Reap at least one completion or give up at deadline_ns (see csrc/rdma/dev.c). */
int tp_reap(tp_dev *dev, tp_wc *wc, int max, uint64_t deadline_ns, int watch_data, char *err,
            size_t errlen);
uint64_t tp_deadline_after(double timeout_s);

/* ---- entering, failing and waiting (csrc/rdma/loss.c) ---- */

int hp_fail(tp_dev *dev, int code, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
int hp_wedge(tp_dev *dev, int code, char *err, size_t errlen);
int hp_enter(tp_dev *dev, double timeout_s, const char *what, char *err, size_t errlen);
int hp_pump(tp_dev *dev, uint64_t deadline_ns, int watch_data, char *err, size_t errlen);
int hp_stalled(tp_dev *dev, int rc, double timeout_s, const char *what, const char *missing,
               char *err, size_t errlen);

/* ---- flow control (csrc/rdma/flow.c) ---- */

/* Receives-posted barrier words: magic, then what was armed. */
#define TP_BARRIER_GATE UINT32_C(0x47415445)  /* "GATE" */
#define TP_BARRIER_BULK UINT32_C(0x42554c4b)  /* "BULK" */
#define TP_BARRIER_DRAIN UINT32_C(0x4452414e) /* "DRAN" */

/* Bulk and drain words carry a count in the top byte that the ranks need
 * not share; the rest must match. */
#define TP_BARRIER_MATCH UINT32_C(0x00ffffff)

/* Write our word, read the peer's (into *peer_value, if not NULL); a word
 * that does not match ours is a desync (TP_EINVAL, queue pair wedged). */
int hp_barrier(tp_dev *dev, uint32_t magic, uint32_t value, uint32_t *peer_value,
               uint64_t deadline_ns, double timeout_s, const char *what, char *err,
               size_t errlen);

/* Receives / sends a hot path may keep outstanding: the granted depth, or
 * less once the device refused a post. */
int hp_usable_recv(const tp_dev *dev);
int hp_usable_send(const tp_dev *dev);
/* Post one hot-path receive. TP_ENOMEM: the device refused it for want of
 * room (its real depth is learned, nothing was posted, the queue pair is
 * still fine); another negative code wedges the queue pair. */
int hp_post_recv(tp_dev *dev, const tp_mr *mr, void *addr, uint32_t len, uint64_t wr_id,
                 char *err, size_t errlen);
/* The same, but on a refusal wait for one of the peer's messages to consume
 * a posted receive, then post again (only where the peer may send). */
int hp_post_recv_waiting(tp_dev *dev, const tp_mr *mr, void *addr, uint32_t len,
                         uint64_t wr_id, uint64_t deadline_ns, double timeout_s, const char *what,
                         char *err, size_t errlen);
/* Post one tagged, signaled hot-path send (imm: its sequence tag), reaping
 * send completions first when the device has no room for it. */
int hp_post_send(tp_dev *dev, const tp_mr *mr, const void *addr, uint32_t len, uint64_t wr_id,
                 uint32_t imm, uint64_t deadline_ns, double timeout_s, const char *what,
                 char *err, size_t errlen);

/* ---- decode window (csrc/rdma/window.c) ---- */

/* Consume the decode window on both sides; no-op when not armed. */
int hp_drain(tp_dev *dev, uint64_t deadline_ns, double timeout_s, char *err, size_t errlen);

/* ---- slab layout and sequence tags ---- */

static inline uint32_t chunks_of(uint64_t bytes) {
    return (uint32_t)((bytes + TP_MAX_MSG - 1) / TP_MAX_MSG);
}

static inline uint8_t *ring_slot(const tp_dev *dev, uint64_t gate) {
    return dev->slab + TP_OFF_RING + (gate % TP_RECV_WINDOW) * TP_GATE_SLOT_BYTES;
}

/* Bytes of chunk i (counted from 0) of a bulk exchange. */
static inline uint32_t bulk_chunk_len(uint64_t bytes, uint64_t chunk) {
    const uint64_t off = chunk * TP_MAX_MSG;
    if (off >= bytes) return 0;
    return (uint32_t)(bytes - off > TP_MAX_MSG ? TP_MAX_MSG : bytes - off);
}

/* A drain marker must fit the receive it lands in: the peer's window has
 * the same shape as ours (the arm barrier checked the byte count), and a
 * window of tiny gates has receives smaller than TP_DRAIN_MSG_BYTES. */
static inline uint32_t drain_marker_len(const tp_dev *dev, int final_chunk) {
    const uint32_t len = final_chunk ? dev->armed_bytes - (dev->armed_chunks - 1) * TP_MAX_MSG
                                     : TP_MAX_MSG;
    return len < TP_DRAIN_MSG_BYTES ? len : TP_DRAIN_MSG_BYTES;
}

static inline uint32_t gate_imm(uint64_t gate, uint32_t chunk) {
    return TP_IMM_GATE | chunk << 24 | (uint32_t)(gate & 0xffffff);
}

static inline uint32_t bulk_imm(uint64_t chunk) {
    return TP_IMM_BULK | (uint32_t)(chunk & 0xfffffff);
}

#endif
