/* mlx_ds4tp._verbs hot paths, shared machinery and loss detection: entering
 * and failing a hot path, the sequence tags every hot-path message carries
 * (why: "Sequence tags" in _verbs_api.h), the check of every completion
 * against what its receive was posted for, and the waits that name what
 * they waited for. */

#include "_verbs_hot.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * Hot paths: shared machinery.
 * --------------------------------------------------------------------- */

/* A failed hot path leaves work requests in flight that the next call
 * cannot account for, so the queue pair is marked unusable until rebuilt. */
int hp_fail(tp_dev *dev, int code, char *err, size_t errlen, const char *fmt, ...) {
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
int hp_wedge(tp_dev *dev, int code, char *err, size_t errlen) {
    return hp_fail(dev, code, err, errlen, "%s", err && errlen ? err : "tp rdma: failure");
}

int hp_enter(tp_dev *dev, double timeout_s, const char *what, char *err, size_t errlen) {
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

/* ---- sequence tags (why: see "Sequence tags" in _verbs.h) ---- */

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
         * window holds gates gate_count + 1 .. gate_count + window. */
        return TP_IMM_DRAIN | (uint32_t)((low - dev->gate_count - 1) * dev->armed_chunks + chunk);
    }
    if (dev->mode == TP_MODE_BULK && tag == TP_TAG_BULK_RECV)
        return bulk_imm(low);
    return 0;
}

/* Which receive, in the caller's terms: the gate seq label, or the round. */
static void describe_recv(char *buf, size_t n, const tp_dev *dev, uint64_t wr_id) {
    const uint64_t tag = wr_id & TP_TAG_MASK, low = wr_id & ~TP_TAG_MASK;
    char chunk[40] = "";
    if (dev->mode == TP_MODE_BULK) {
        const uint64_t slots = dev->bulk_slots ? dev->bulk_slots : 1;
        snprintf(buf, n, "bulk round %llu slot %llu of a %llu-byte exchange",
                 (unsigned long long)(low / slots), (unsigned long long)(low % slots),
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
        const uint64_t slots = dev->bulk_slots ? dev->bulk_slots : 1;
        const uint64_t c = unwrap(want & 0xfffffff, imm & 0xfffffff, 28);
        snprintf(buf, n, "the peer's bulk round %llu slot %llu", (unsigned long long)(c / slots),
                 (unsigned long long)(c % slots));
    } else {
        snprintf(buf, n, "a message tagged 0x%08x (no hot-path tag)", imm);
    }
}

static void describe_wr(char *buf, size_t n, const tp_dev *dev, uint64_t wr_id) {
    const uint64_t low = wr_id & ~TP_TAG_MASK;
    const uint64_t slots = dev->bulk_slots ? dev->bulk_slots : 1;
    switch (wr_id & TP_TAG_MASK) {
    case 0: snprintf(buf, n, "gate #%llu, final chunk", (unsigned long long)low); break;
    case TP_TAG_GATE_CHUNK: snprintf(buf, n, "gate #%llu, first chunk", (unsigned long long)low); break;
    case TP_TAG_GATE_SEND: snprintf(buf, n, "gate #%llu send", (unsigned long long)low); break;
    case TP_TAG_DRAIN: snprintf(buf, n, "drain marker %llu", (unsigned long long)low); break;
    case TP_TAG_BULK_RECV:
    case TP_TAG_BULK_SEND:
        snprintf(buf, n, "bulk round %llu slot %llu %s", (unsigned long long)(low / slots),
                 (unsigned long long)(low % slots),
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
        describe_wr(what, sizeof(what), dev, wc->wr_id);
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
        want = bulk_chunk_len(dev->bulk_bytes, low);
        if (wc->byte_len == want) {
            dev->bulk_recvd++;
            return TP_OK;
        }
    } else {
        describe_wr(what, sizeof(what), dev, wc->wr_id);
        return hp_fail(dev, TP_ECOMPLETION, err, errlen,
                       "tp rdma: unexpected receive completion wr_id 0x%llx (%s) during %s; "
                       "was a raw receive left posted?", (unsigned long long)wc->wr_id, what,
                       hp_context(dev, ctx, sizeof(ctx)));
    }
    describe_wr(what, sizeof(what), dev, wc->wr_id);
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
 *     round of its own is sent; where the device has no room for a send it
 *     waits for a send completion, still inside the exchange). So when it
 *     writes that word, every message
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
int hp_pump(tp_dev *dev, uint64_t deadline_ns, int watch_data, char *err,
                   size_t errlen) {
    tp_wc wc[32];
    int n = tp_reap(dev, wc, 32, deadline_ns, watch_data, err, errlen);
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
int hp_stalled(tp_dev *dev, int rc, double timeout_s, const char *what,
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
