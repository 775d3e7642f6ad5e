/* mlx_ds4tp._verbs hot paths, bulk exchange for prefill: the bytes move as
 * a stream of <= TP_MAX_MSG chunks in rounds of at most TP_BULK_SLOTS, the
 * next round's receives posted before this round's sends.
 *
 * Flow: receives for rounds 0 and 1 are posted before the receives-posted
 * barrier; then for each round r we send our round r, wait for the peer's,
 * and post the receives of round r + 2 before sending round r + 1. The peer
 * sends its round r + 1 only after our round r reached it, i.e. after we
 * posted round r + 1's receives (at the end of round r - 1): no message
 * ever finds no receive posted.
 *
 * Round size: a round's receives twice over must fit the receive depth the
 * device really takes, one round of sends its send depth, and all of it the
 * completion queue. Apple's driver refuses the post past 63 outstanding
 * whatever it granted, so the first exchange may learn a smaller depth as
 * it posts rounds 0 and 1 (nothing is sent before the barrier, so a refusal
 * there just means smaller rounds). Each side then says in its barrier word
 * how large a round it can take and both use the smaller: receives are
 * posted per chunk, independent of the round size, so those already posted
 * stay valid. */

#include "_verbs_hot.h"

#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * Chunks and where they land.
 * --------------------------------------------------------------------- */

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    uint64_t bytes, chunks;
    const tp_mr *send_mr, *recv_mr; /* NULL: go through slab staging */
    uint64_t deadline_ns;
    double timeout_s;
} bulk_job;

/* Chunk i lands straight in dst when it is registered, else in staging slot
 * i % TP_BULK_STAGE_SLOTS. A slot is reused only once its chunk was copied
 * out: at most two rounds (<= TP_BULK_STAGE_SLOTS chunks) are posted past
 * the last round read. */
static uint8_t *chunk_home(const tp_dev *dev, const bulk_job *j, uint64_t i) {
    if (j->recv_mr) return j->dst + i * TP_MAX_MSG;
    return dev->slab + TP_OFF_BULK_RECV + (i % TP_BULK_STAGE_SLOTS) * TP_MAX_MSG;
}

/* Post receives up to chunk `end` (exclusive). Before the barrier (wait 0)
 * a refusal returns TP_ENOMEM; after it, it waits for the peer's next
 * message to make room. */
static int bulk_post_through(tp_dev *dev, const bulk_job *j, uint64_t end, int wait,
                             char *err, size_t errlen) {
    const tp_mr *mr = j->recv_mr ? j->recv_mr : &dev->mrs[0];
    if (end > j->chunks) end = j->chunks;
    while (dev->bulk_posted < end) {
        const uint64_t i = dev->bulk_posted;
        int rc;
        if (wait) {
            char what[96];
            snprintf(what, sizeof(what), "room for bulk chunk %llu of a %llu-byte exchange",
                     (unsigned long long)i, (unsigned long long)j->bytes);
            rc = hp_post_recv_waiting(dev, mr, chunk_home(dev, j, i), bulk_chunk_len(j->bytes, i),
                                      TP_TAG_BULK_RECV | i, j->deadline_ns, j->timeout_s, what,
                                      err, errlen);
        } else {
            rc = hp_post_recv(dev, mr, chunk_home(dev, j, i), bulk_chunk_len(j->bytes, i),
                              TP_TAG_BULK_RECV | i, err, errlen);
        }
        if (rc < 0) return rc;
        dev->bulk_posted++;
    }
    return TP_OK;
}

/* Messages per round this side can take (see the top of this file). */
static uint32_t own_slots(const tp_dev *dev) {
    int s = TP_BULK_SLOTS;
    if (hp_usable_recv(dev) / 2 < s) s = hp_usable_recv(dev) / 2;
    if (hp_usable_send(dev) < s) s = hp_usable_send(dev);
    if (dev->cq_depth / 3 < s) s = dev->cq_depth / 3;
    return s > 0 ? (uint32_t)s : 0;
}

/* ------------------------------------------------------------------------
 * The exchange.
 * --------------------------------------------------------------------- */

/* Arm: post rounds 0 and 1, agree on the round size at the barrier. */
static int bulk_arm(tp_dev *dev, bulk_job *j, char *err, size_t errlen) {
    uint32_t slots = own_slots(dev);
    if (!slots) {
        tp_errf(err, errlen, "tp_bulk: no room for a bulk round: the device takes %d receives, "
                "%d sends, and the completion queue holds %d", hp_usable_recv(dev),
                hp_usable_send(dev), dev->cq_depth);
        return TP_ENOMEM;
    }
    dev->mode = TP_MODE_BULK;
    dev->bulk_bytes = j->bytes;
    dev->bulk_posted = dev->bulk_recvd = 0;
    dev->bulk_slots = slots;
    int rc = bulk_post_through(dev, j, 2 * (uint64_t)slots, 0, err, errlen);
    if (rc == TP_ENOMEM && !dev->wedged_code) {
        /* The device took fewer than it granted (and learned so): rounds
         * of half what it took. */
        slots = (uint32_t)(dev->bulk_posted / 2);
        if (!slots)
            return hp_fail(dev, TP_ENOMEM, err, errlen, "tp rdma: the device took %llu receives "
                           "for a bulk exchange of %llu bytes; rounds need 2",
                           (unsigned long long)dev->bulk_posted, (unsigned long long)j->bytes);
    } else if (rc < 0) {
        return rc;
    }
    char what[96];
    snprintf(what, sizeof(what), "bulk round 0 (%llu bytes)", (unsigned long long)j->bytes);
    const uint32_t size_tag = (uint32_t)(j->bytes ^ (j->bytes >> 24) ^ (j->bytes >> 48));
    uint32_t peer_word = 0;
    rc = hp_barrier(dev, TP_BARRIER_BULK, (size_tag & TP_BARRIER_MATCH) | slots << 24, &peer_word,
                    j->deadline_ns, j->timeout_s, what, err, errlen);
    if (rc < 0) return rc;
    const uint32_t peer_slots = peer_word >> 24;
    if (!peer_slots || peer_slots > TP_BULK_SLOTS)
        return hp_fail(dev, TP_EINVAL, err, errlen, "tp rdma: desync at the receives-posted "
                       "barrier before %s: the peer offers rounds of %u messages (1..%d)", what,
                       peer_slots, TP_BULK_SLOTS);
    dev->bulk_slots = peer_slots < slots ? peer_slots : slots;
    return TP_OK;
}

/* Send round r, wait for the peer's, read it out. */
static int bulk_round(tp_dev *dev, const bulk_job *j, uint64_t r, uint64_t rounds, char *err,
                      size_t errlen) {
    const uint64_t first = r * dev->bulk_slots;
    const uint64_t n = j->chunks - first < dev->bulk_slots ? j->chunks - first : dev->bulk_slots;
    const uint64_t off = first * TP_MAX_MSG;
    const uint64_t rb = (j->bytes - off) < n * TP_MAX_MSG ? j->bytes - off : n * TP_MAX_MSG;
    const uint8_t *from = j->src + off;
    const tp_mr *smr = j->send_mr;
    if (!smr) {
        /* Staging is free: the previous round waited for its sends. */
        memcpy(dev->slab + TP_OFF_BULK_SEND, from, rb);
        from = dev->slab + TP_OFF_BULK_SEND;
        smr = &dev->mrs[0];
    }
    char what[128];
    snprintf(what, sizeof(what), "bulk round %llu of %llu", (unsigned long long)r,
             (unsigned long long)rounds);
    for (uint64_t i = 0; i < n; i++) {
        int rc = hp_post_send(dev, smr, from + i * TP_MAX_MSG, bulk_chunk_len(j->bytes, first + i),
                              TP_TAG_BULK_SEND | (first + i), bulk_imm(first + i), j->deadline_ns,
                              j->timeout_s, what, err, errlen);
        if (rc < 0) return rc;
    }
    while (dev->bulk_recvd < first + n || dev->send_outstanding) {
        const int missing = dev->bulk_recvd < first + n;
        int rc = hp_pump(dev, j->deadline_ns, missing, err, errlen);
        if (rc > 0) continue;
        if (rc < 0 && rc != TP_EPEER && rc != TP_EMOVED) return rc;
        snprintf(what, sizeof(what), "bulk round %llu of %llu (%llu/%llu receives in, %u sends "
                 "pending)", (unsigned long long)r, (unsigned long long)rounds,
                 (unsigned long long)(dev->bulk_recvd - first), (unsigned long long)n,
                 dev->send_outstanding);
        return hp_stalled(dev, rc, j->timeout_s, what, missing ? "bulk message" : NULL, err,
                          errlen);
    }
    if (!j->recv_mr)
        for (uint64_t i = first; i < first + n; i++)
            memcpy(j->dst + i * TP_MAX_MSG, chunk_home(dev, j, i), bulk_chunk_len(j->bytes, i));
    /* Post round r + 2 into the slots just read, before sending r + 1. */
    return bulk_post_through(dev, j, (r + 3) * dev->bulk_slots, 1, err, errlen);
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
    const uint64_t chunks = (bytes + TP_MAX_MSG - 1) / TP_MAX_MSG;
    if (chunks >> 40) {
        tp_errf(err, errlen, "tp_bulk: %llu bytes is too large", (unsigned long long)bytes);
        return TP_EINVAL;
    }
    const uint64_t deadline = tp_deadline_after(timeout_s);
    /* The decode window's receives would swallow bulk messages: drain. */
    rc = hp_drain(dev, deadline, timeout_s, err, errlen);
    if (rc < 0 || bytes == 0) return rc;
    if (dev->rq_outstanding) {
        tp_errf(err, errlen, "tp_bulk: %llu receives are still posted on the queue pair "
                "(warm-up leftovers?); bulk rounds need an empty receive queue",
                (unsigned long long)dev->rq_outstanding);
        return TP_EINVAL;
    }
    bulk_job j = {src, dst, bytes, chunks, tp_find_mr(dev, src, bytes), tp_find_mr(dev, dst, bytes),
                  deadline, timeout_s};
    rc = bulk_arm(dev, &j, err, errlen);
    if (rc < 0) return rc;
    const uint64_t rounds = (chunks + dev->bulk_slots - 1) / dev->bulk_slots;
    for (uint64_t r = 0; r < rounds; r++) {
        rc = bulk_round(dev, &j, r, rounds, err, errlen);
        if (rc < 0) return rc;
    }
    dev->mode = TP_MODE_IDLE;
    return TP_OK;
}
