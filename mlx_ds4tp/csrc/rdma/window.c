/* mlx_ds4tp._verbs hot paths, decode gates: a window of receives posted
 * ahead by gate number, the gate itself, and the drain that empties the
 * window before a bulk exchange or a change of gate size.
 *
 * Both ranks run the same gate sequence, so all matching is by order: the
 * k-th message the peer sends lands in the k-th receive we posted. */

#include "_verbs_hot.h"

#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * Decode gates: a window of receives posted by sequence number.
 * --------------------------------------------------------------------- */

/* The window is a stream of receives in gate order: gate g's chunks, then
 * gate g + 1's, each landing in its gate's ring slot. Vectors above the
 * driver's 16 KiB message cap ride as two messages landing contiguously;
 * UC delivery is in order, so the k-th chunk the peer sends matches the
 * k-th receive, and only the final chunk carries the bare gate number: its
 * completion means the whole vector is in. (post_gate, post_chunk) is the
 * next receive of the stream; a device that refuses a post part-way
 * through a gate leaves the cursor there and the rest follows later.
 *
 * Why two gates are enough: the peer sends gate g + 1 only after our gate
 * g reached it, and we send gate g + 1 only after the refill at the end of
 * our gate g. So when the peer may send g + 1 our receives for it must be
 * posted, and before we send g + 1 those for g + 2 must be: a window of 2
 * gates past the one completed. More lets the peer run ahead of a slow
 * copy-out without waiting; TP_RECV_WINDOW caps it (the ring's slots). */

static uint32_t chunk_len(const tp_dev *dev, uint32_t chunk) {
    return chunk + 1 == dev->armed_chunks ? dev->armed_bytes - chunk * TP_MAX_MSG : TP_MAX_MSG;
}

/* Post the next receive of the stream. TP_ENOMEM: the device has no room
 * (nothing posted); with wait set, wait for the peer's next message to make
 * room instead (only where the peer may send). */
static int window_post_next(tp_dev *dev, int wait, uint64_t deadline_ns, double timeout_s,
                            char *err, size_t errlen) {
    const uint64_t gate = dev->post_gate;
    const uint32_t c = dev->post_chunk;
    const int last = c + 1 == dev->armed_chunks;
    uint8_t *at = ring_slot(dev, gate) + (uint64_t)c * TP_MAX_MSG;
    const uint64_t wr_id = last ? gate : (TP_TAG_GATE_CHUNK | gate);
    int rc;
    if (wait) {
        char what[80];
        snprintf(what, sizeof(what), "room for the receive of the gate after seq %llu",
                 (unsigned long long)dev->cur_seq);
        rc = hp_post_recv_waiting(dev, &dev->mrs[0], at, chunk_len(dev, c), wr_id, deadline_ns,
                                  timeout_s, what, err, errlen);
    } else {
        rc = hp_post_recv(dev, &dev->mrs[0], at, chunk_len(dev, c), wr_id, err, errlen);
    }
    if (rc < 0) return rc;
    if (last) {
        dev->post_chunk = 0;
        dev->post_gate++;
    } else {
        dev->post_chunk++;
    }
    return TP_OK;
}

/* After gate `done` completed: post the stream through gate done + window.
 * Receives for done + 1 and done + 2 are a must (see above): for those a
 * refusal waits for room; beyond them it shrinks the window. */
static int window_refill(tp_dev *dev, uint64_t done, uint64_t deadline_ns, double timeout_s,
                         char *err, size_t errlen) {
    while (dev->post_gate <= done + dev->window) {
        const int must = dev->post_gate <= done + 2;
        int rc = window_post_next(dev, must, deadline_ns, timeout_s, err, errlen);
        if (rc == TP_ENOMEM && !must && !dev->wedged_code) {
            dev->window = (uint32_t)(dev->post_gate - 1 - done);
            return TP_OK;
        }
        if (rc < 0) return rc;
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
    /* Completions outstanding at most: the window's receives and one
     * gate's sends; the completion queue must hold them all. */
    int by_cq = dev->cq_depth / (int)chunks - 1;
    int want = hp_usable_recv(dev) / (int)chunks;
    if (by_cq < want) want = by_cq;
    if (want > TP_RECV_WINDOW) want = TP_RECV_WINDOW;
    if (want < 2) {
        tp_errf(err, errlen, "tp rdma: a gate window of %u-byte vectors needs 2 gates of %u "
                "receives posted ahead; the device takes %d receives and a completion queue of "
                "%d", bytes, chunks, hp_usable_recv(dev), dev->cq_depth);
        return TP_ENOMEM;
    }
    dev->armed_bytes = bytes;
    dev->armed_chunks = chunks;
    dev->armed = 1;
    dev->stats.window_armed = 1;
    dev->recv_done = gate - 1;
    dev->post_gate = gate;
    dev->post_chunk = 0;
    /* The peer sends nothing before the barrier below, so a refusal here
     * shrinks the window to what the device took. */
    while (dev->post_gate < gate + (uint64_t)want) {
        int rc = window_post_next(dev, 0, deadline_ns, timeout_s, err, errlen);
        if (rc == TP_ENOMEM && !dev->wedged_code) break;
        if (rc < 0) return rc;
    }
    const uint64_t covered = dev->post_gate - gate;
    if (covered < 2)
        return hp_fail(dev, TP_ENOMEM, err, errlen, "tp rdma: the device took only %llu "
                       "receives; a gate window of %u-byte vectors needs 2 gates of %u posted "
                       "ahead", (unsigned long long)dev->rq_outstanding, bytes, chunks);
    dev->window = (uint32_t)covered;
    char what[48];
    snprintf(what, sizeof(what), "gate seq %llu", (unsigned long long)seq);
    return hp_barrier(dev, TP_BARRIER_GATE, bytes, NULL, deadline_ns, timeout_s, what, err,
                      errlen);
}

/* Consume the peer's posted window with drain markers while the peer's
 * markers consume ours; when both sides are done the queue pair is empty.
 * A barrier comes first: the peer may still be inside its last gate, with
 * the receive for its last gate + window not yet re-posted, and a marker that
 * reached that missing receive would kill the direction. The barrier word
 * carries how many receives each side has posted (windows may differ: each
 * side's is what its device took), and the markers sent are exactly the
 * peer's count. */
int hp_drain(tp_dev *dev, uint64_t deadline_ns, double timeout_s, char *err,
             size_t errlen) {
    if (!dev->armed) return TP_OK;
    const uint32_t mine = (uint32_t)dev->rq_outstanding;
    uint8_t *marker = dev->slab + TP_OFF_CTRL;
    memcpy(marker, "DS4DRAIN", TP_DRAIN_MSG_BYTES);
    dev->mode = TP_MODE_DRAIN;
    dev->drain_recvs = 0;
    char what[96];
    snprintf(what, sizeof(what), "the window drain after gate seq %llu",
             (unsigned long long)dev->last_seq);
    uint32_t peer_word = 0;
    int rc = hp_barrier(dev, TP_BARRIER_DRAIN,
                        ((uint32_t)dev->gate_count & TP_BARRIER_MATCH) | mine << 24, &peer_word,
                        deadline_ns, timeout_s, what, err, errlen);
    if (rc < 0) return rc;
    const uint32_t n = peer_word >> 24;
    for (uint32_t i = 0; i < n; i++) {
        const int final_chunk = (i + 1) % dev->armed_chunks == 0;
        rc = hp_post_send(dev, &dev->mrs[0], marker, drain_marker_len(dev, final_chunk),
                          TP_TAG_DRAIN | i, TP_IMM_DRAIN | i, deadline_ns, timeout_s, what, err,
                          errlen);
        if (rc < 0) return rc;
    }
    while (dev->drain_recvs < mine || dev->send_outstanding) {
        const int missing = dev->drain_recvs < mine;
        rc = hp_pump(dev, deadline_ns, missing, err, errlen);
        if (rc > 0) continue;
        if (rc < 0 && rc != TP_EPEER && rc != TP_EMOVED) return rc;
        snprintf(what, sizeof(what), "the window drain after gate seq %llu (%u/%u markers in)",
                 (unsigned long long)dev->last_seq, dev->drain_recvs, mine);
        return hp_stalled(dev, rc, timeout_s, what, missing ? "drain marker" : NULL, err,
                          errlen);
    }
    dev->armed = 0;
    dev->stats.window_armed = 0;
    dev->recv_done = dev->gate_count;
    dev->mode = TP_MODE_IDLE;
    return TP_OK;
}

/* A gate's sends, shared by tp_gate and tp_gate_post: straight from the
 * caller's buffer when the NIC can read it, else through the slab's send slot
 * (free: the previous gate returned only after its sends completed). */
static inline int gate_send(tp_dev *dev, const void *src, uint32_t bytes, uint64_t gate,
                            uint64_t seq, uint64_t deadline, double timeout_s, char *err,
                            size_t errlen) {
    int rc;
    const tp_mr *mr = tp_find_mr(dev, src, bytes);
    const uint8_t *from = src;
    if (!mr) {
        memcpy(dev->slab + TP_OFF_SEND, src, bytes);
        from = dev->slab + TP_OFF_SEND;
        mr = &dev->mrs[0];
    }
    /* Named once a gate, not once a chunk: only an error reads it. */
    char what[48];
    snprintf(what, sizeof(what), "gate seq %llu", (unsigned long long)seq);
    for (uint32_t c = 0; c < dev->armed_chunks; c++) {
        rc = hp_post_send(dev, mr, from + (uint64_t)c * TP_MAX_MSG, chunk_len(dev, c),
                          TP_TAG_GATE_SEND | gate, gate_imm(gate, c), deadline, timeout_s, what,
                          err, errlen);
        if (rc < 0) return rc;
    }
    return TP_OK;
}

/* A gate's end, shared by tp_gate and tp_gate_wait: spin until the peer's
 * gate landed and our own sends are done (so the caller may reuse src as
 * soon as we return), copy it out, then refill through gate + window now,
 * before the caller can send gate + 1 (why that is in time: above
 * window_post_next), so the peer never hits an unposted receive (that would
 * kill the direction). */
static inline int gate_finish(tp_dev *dev, void *dst, uint32_t bytes, uint64_t gate,
                              uint64_t seq, uint64_t deadline, double timeout_s, char *err,
                              size_t errlen) {
    int rc;
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
    rc = window_refill(dev, gate, deadline, timeout_s, err, errlen);
    if (rc < 0) return rc;
    dev->gate_count = gate;
    dev->last_seq = seq;
    dev->stats.recv_done = seq;
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
    const uint64_t deadline = tp_deadline_after(timeout_s);
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

    rc = gate_send(dev, src, bytes, gate, seq, deadline, timeout_s, err, errlen);
    if (rc < 0) return rc;
    return gate_finish(dev, dst, bytes, gate, seq, deadline, timeout_s, err, errlen);
}

/* tp_gate in two halves for a rank with several peers (csrc/exchange.c's
 * mesh): only on a window already armed for this byte count (the steady
 * state of a decode step's gates), where a gate needs no barrier; anything
 * else is TP_ENOTSUP with nothing done, and the caller runs tp_gate. The
 * halves keep tp_gate's order on the link: post, wait, refill. */
int tp_gate_post(tp_dev *dev, const void *src, uint32_t bytes, uint64_t seq, double timeout_s,
                 char *err, size_t errlen) {
    int rc = hp_enter(dev, timeout_s, "tp_gate_post", err, errlen);
    if (rc < 0) return rc;
    if (!src || !dev->armed || bytes != dev->armed_bytes || dev->mode != TP_MODE_GATE)
        return TP_ENOTSUP;
    const uint64_t gate = dev->gate_count + 1;
    dev->cur_seq = seq;
    const uint64_t deadline = tp_deadline_after(timeout_s);
    return gate_send(dev, src, bytes, gate, seq, deadline, timeout_s, err, errlen);
}

int tp_gate_wait(tp_dev *dev, void *dst, uint32_t bytes, uint64_t seq, double timeout_s,
                 char *err, size_t errlen) {
    int rc = hp_enter(dev, timeout_s, "tp_gate_wait", err, errlen);
    if (rc < 0) return rc;
    const uint64_t gate = dev->gate_count + 1;
    const uint64_t deadline = tp_deadline_after(timeout_s);
    return gate_finish(dev, dst, bytes, gate, seq, deadline, timeout_s, err, errlen);
}

int tp_drain(tp_dev *dev, double timeout_s, char *err, size_t errlen) {
    if (dev && !dev->armed && !dev->wedged_code) return TP_OK;
    int rc = hp_enter(dev, timeout_s, "tp_drain", err, errlen);
    if (rc < 0) return rc;
    return hp_drain(dev, tp_deadline_after(timeout_s), timeout_s, err, errlen);
}
