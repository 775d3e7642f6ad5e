/* One exchange of the pair, for the MLX backend (csrc/mlx/): this rank's bytes
 * to the peer, the peer's bytes back, whatever the collective, over the TCP
 * data socket or the RDMA queue pair.
 *
 * The backend's GroupImpl runs inside MLX's evaluation, on the group's CPU
 * stream thread, with no interpreter anywhere: it hands this file the input
 * array's buffer and a destination, and combines the two partials itself.
 *
 * ==== What travels with every exchange ====
 * Both ranks must run the same collectives in the same order. A pair that
 * does not (a peer at another collective, dtype or size, a skipped gate) must
 * fail loudly, never sum the wrong partials, so each exchange carries its
 * signature: collective, dtype, byte count and sequence number.
 *   - TCP: the exchange header (exchange_codes.h: collective, dtype, sequence,
 *     bytes, and the shape, so a mismatch names both ranks' arrays) rides
 *     ahead of the payload in the same write; the peer compares it with its
 *     own before it waits for any payload (tp_tcp_gate / tp_tcp_duplex).
 *   - RDMA: the payload rides the queue pair, whose immediates carry only the
 *     sequence; the header goes over the data socket when the signature
 *     changes (a decode step's gates share one) and before every bulk
 *     exchange, which needs the byte count agreed anyway.
 *
 * ==== After a failure ====
 * A failed exchange leaves the pair's streams in an unknown place (half a
 * payload read, a receive window out of step), so the link is dead from then
 * on: every later exchange fails at once naming the first failure, and the
 * data socket is shut down so the peer, possibly waiting inside its own
 * exchange, fails at once too instead of at its timeout. */

#include "_verbs_priv.h"
#include "exchange_names.h"

#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

static const char *dtype_name(int code) {
    static const char *names[TP_DTYPE_LAST + 1] = {
        [TP_DTYPE_FLOAT32] = "float32", [TP_DTYPE_FLOAT16] = "float16",
        [TP_DTYPE_BFLOAT16] = "bfloat16", [TP_DTYPE_BOOL] = "bool",
        [TP_DTYPE_INT8] = "int8", [TP_DTYPE_INT16] = "int16",
        [TP_DTYPE_INT32] = "int32", [TP_DTYPE_INT64] = "int64",
        [TP_DTYPE_UINT8] = "uint8", [TP_DTYPE_UINT16] = "uint16",
        [TP_DTYPE_UINT32] = "uint32", [TP_DTYPE_UINT64] = "uint64",
        [TP_DTYPE_FLOAT64] = "float64", [TP_DTYPE_COMPLEX64] = "complex64"};
    return code >= TP_DTYPE_FIRST && code <= TP_DTYPE_LAST ? names[code] : "dtype?";
}

static void put_le(unsigned char *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void pack_header(unsigned char *h, const tp_xsig *sig, uint64_t seq) {
    memset(h, 0, TP_EXCHANGE_HEADER);
    put_le(h, TP_EXCHANGE_MAGIC, 4);
    put_le(h + 4, (uint64_t)sig->op, 2);
    put_le(h + 6, (uint64_t)sig->dtype, 2);
    put_le(h + 8, seq, 8);
    put_le(h + 16, sig->bytes, 8);
    put_le(h + 24, (uint64_t)sig->ndim, 4);
    const int kept = sig->ndim < TP_XSIG_DIMS ? sig->ndim : TP_XSIG_DIMS;
    for (int i = 0; i < kept; i++) put_le(h + 32 + 8 * i, (uint64_t)sig->shape[i], 8);
}

static void unpack_header(const unsigned char *h, tp_xsig *sig, uint64_t *seq) {
    memset(sig, 0, sizeof(*sig));
    sig->op = (int)get_le(h + 4, 2);
    sig->dtype = (int)get_le(h + 6, 2);
    *seq = get_le(h + 8, 8);
    sig->bytes = get_le(h + 16, 8);
    sig->ndim = (int)get_le(h + 24, 4);
    const int kept = sig->ndim < TP_XSIG_DIMS ? sig->ndim : TP_XSIG_DIMS;
    for (int i = 0; i < kept; i++) sig->shape[i] = (int64_t)get_le(h + 32 + 8 * i, 8);
}

/* "all_sum float32 (2, 4096)": an exchange as the errors name it (numpy's shape style). */
static void describe(const tp_xsig *sig, char *out, size_t len) {
    int n = snprintf(out, len, "%s %s (", tp_op_name(sig->op), dtype_name(sig->dtype));
    const int kept = sig->ndim < TP_XSIG_DIMS ? sig->ndim : TP_XSIG_DIMS;
    for (int i = 0; i < kept && n > 0 && (size_t)n < len; i++)
        n += snprintf(out + n, len - (size_t)n, i ? ", %lld" : "%lld", (long long)sig->shape[i]);
    if (n > 0 && (size_t)n < len)
        snprintf(out + n, len - (size_t)n, "%s%s)", sig->ndim > TP_XSIG_DIMS ? ", ..." : "",
                 sig->ndim == 1 ? "," : "");
}

/* "this rank has all_sum float32 (4096,), the peer has all_gather float32 (2048,)". */
static void name_desync(const unsigned char *theirs, const tp_xsig *mine, uint64_t seq, char *err,
                        size_t errlen) {
    char here[160], there[160];
    describe(mine, here, sizeof(here));
    const uint32_t magic = (uint32_t)get_le(theirs, 4);
    if (magic != TP_EXCHANGE_MAGIC) {
        tp_errf(err, errlen, "collective mismatch at seq %llu: this rank has %s, the peer sent no "
                "exchange header (magic 0x%08x); both ranks must run the same collectives in the "
                "same order", (unsigned long long)seq, here, magic);
        return;
    }
    tp_xsig peer;
    uint64_t peer_seq;
    unpack_header(theirs, &peer, &peer_seq);
    describe(&peer, there, sizeof(there));
    if (peer_seq != seq)
        tp_errf(err, errlen, "collective mismatch: this rank is at collective %llu (%s), the peer "
                "at %llu (%s); both ranks must run the same collectives in the same order",
                (unsigned long long)seq, here, (unsigned long long)peer_seq, there);
    else if (peer.bytes == mine->bytes && peer.op == mine->op && peer.dtype == mine->dtype &&
             peer.ndim == mine->ndim)
        tp_errf(err, errlen, "collective mismatch at seq %llu: this rank has %s, the peer has %s; "
                "both ranks must call the same collective with the same shape",
                (unsigned long long)seq, here, there);
    else
        tp_errf(err, errlen, "collective mismatch at seq %llu: this rank has %s, the peer has %s; "
                "both ranks must call the same collective with the same shape and dtype",
                (unsigned long long)seq, here, there);
}

static void record(tp_link *l, uint64_t bytes, uint64_t ns) {
    if (bytes <= TP_GATE_BYTES && l->latency_ns && l->latency_len) {
        l->latency_ns[l->latency_count[0] % l->latency_len] = (int64_t)ns;
        l->latency_count[0]++;
        l->latency_count[1] += ns;
    } else {
        l->other_ns += ns;
    }
}

/* The header alone, both ways, over the data socket (RDMA's signature check). */
static int swap_header(tp_link *l, const tp_xsig *sig, uint64_t seq, char *err, size_t errlen) {
    pack_header(l->hdr_out, sig, seq);
    int rc = tp_tcp_gate(l->fd, l->hdr_out, l->hdr_in, TP_EXCHANGE_HEADER, NULL, NULL, 0,
                         seq, l->spin_ns, err, errlen);
    if (rc == TP_EDESYNC) name_desync(l->hdr_in, sig, seq, err, errlen);
    return rc;
}

static int run_tcp(tp_link *l, const tp_xsig *sig, const void *src, void *dst, uint64_t seq,
                   char *err, size_t errlen) {
    const uint64_t bytes = sig->bytes;
    pack_header(l->hdr_out, sig, seq);
    int rc = bytes <= TP_GATE_BYTES
                 ? tp_tcp_gate(l->fd, l->hdr_out, l->hdr_in, TP_EXCHANGE_HEADER, src, dst,
                               bytes, seq, l->spin_ns, err, errlen)
                 : tp_tcp_duplex(l->fd, l->hdr_out, l->hdr_in, TP_EXCHANGE_HEADER, src,
                                 dst, bytes, seq, l->spin_ns, l->timeout_s, err, errlen);
    if (rc == TP_EDESYNC) name_desync(l->hdr_in, sig, seq, err, errlen);
    return rc;
}

static int same_sig(const tp_xsig *a, const tp_xsig *b) {
    if (a->op != b->op || a->dtype != b->dtype || a->bytes != b->bytes || a->ndim != b->ndim)
        return 0;
    const int kept = a->ndim < TP_XSIG_DIMS ? a->ndim : TP_XSIG_DIMS;
    for (int i = 0; i < kept; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

static int run_rdma(tp_link *l, const tp_xsig *sig, const void *src, void *dst, uint64_t seq,
                    char *err, size_t errlen) {
    const uint64_t bytes = sig->bytes;
    const int gate = bytes <= TP_GATE_BYTES;
    if (!gate || !l->sig_valid || !same_sig(&l->sig, sig)) {
        int rc = swap_header(l, sig, seq, err, errlen);
        if (rc != TP_OK) return rc;
        l->sig_valid = 1;
        l->sig = *sig;
    }
    if (gate) {
        int rc = tp_gate(l->dev, src, dst, (uint32_t)bytes, seq, l->timeout_s, err, errlen);
        return rc < 0 ? rc : TP_OK;
    }
    return tp_bulk(l->dev, src, dst, bytes, l->timeout_s, err, errlen);
}

int tp_link_exchange(tp_link *l, const tp_xsig *sig, const void *src, void *dst, char *err,
                     size_t errlen) {
    if (l->failed || l->pair->closed) {
        tp_errf(err, errlen, "%s %s: this group is closed%s%s; create a new one with "
                "mlx_ds4tp.init(...)", tp_op_name(sig->op), dtype_name(sig->dtype),
                l->failed ? " since an earlier collective failed: " : "",
                l->failed ? l->failure : "");
        return TP_ECLOSED;
    }
    const uint64_t seq = ++l->pair->seq;
    const uint64_t t0 = tp_mono_ns();
    int rc = l->dev ? run_rdma(l, sig, src, dst, seq, err, errlen)
                    : run_tcp(l, sig, src, dst, seq, err, errlen);
    if (rc == TP_OK) {
        record(l, sig->bytes, tp_mono_ns() - t0);
        return TP_OK;
    }
    l->failed = 1;
    snprintf(l->failure, sizeof(l->failure), "%s", err && errlen ? err : "unknown error");
    /* The peer may be waiting inside its own exchange: a shut-down socket is
     * an EOF it sees at once (the RDMA hot loop watches this socket too). */
    shutdown(l->fd, SHUT_RDWR);
    return rc;
}

/* ==== A mesh of N ranks ====
 * Every pair of ranks has its own link, built as a pair's (hello, secret,
 * model check, transport, RDMA bring-up: link/mesh.py), so each peer's block
 * travels exactly as a pair's exchange does, header, sequence and checks
 * included. What the mesh adds is the order: a rank posts its small blocks
 * to every TCP peer before it waits for any (a write that fits the socket
 * buffers never blocks, so no order of posts can deadlock), and meets its
 * RDMA peers, and every peer for large blocks, in the rounds of a
 * round-robin tournament (the circle method): in each round every member has
 * at most one partner, and every member walks the rounds in the same order,
 * so each pairwise exchange finds its partner there. */

static void mesh_fail(tp_mesh *m, const char *why) {
    if (!m->failed) {
        m->failed = 1;
        snprintf(m->failure, sizeof(m->failure), "%s", why && *why ? why : "unknown error");
    }
    /* Every link dies with the first: the peers waiting on this rank see an
     * EOF at once and fail theirs the same way, so no rank waits out its timeout. */
    for (int r = 0; r < m->size && r < TP_MESH_MAX; r++) {
        tp_link *l = m->links[r];
        if (!l) continue;
        if (!l->failed) {
            l->failed = 1;
            snprintf(l->failure, sizeof(l->failure), "another link of the mesh failed: %.470s", m->failure);
        }
        shutdown(l->fd, SHUT_RDWR);
    }
}

/* Member i's partner in round r of n members (n if i sits the round out). */
static int partner(int i, int r, int n) {
    const int m = n + (n & 1); /* odd n: a phantom member; its partner sits out */
    if (i == m - 1) return r % (m - 1);
    int p = ((2 * r - i) % (m - 1) + (m - 1)) % (m - 1);
    return p == i ? m - 1 : p;
}

static int link_usable(tp_mesh *m, tp_link *l, const tp_xsig *sig, char *err, size_t errlen) {
    if (!l->failed && !l->pair->closed && !m->closed) return TP_OK;
    const char *why = m->failed ? m->failure : l->failed ? l->failure : "";
    tp_errf(err, errlen, "%s %s: this group is closed%s%s; create a new one with "
            "mlx_ds4tp.init(...)", tp_op_name(sig->op), dtype_name(sig->dtype),
            *why ? " since an earlier collective failed: " : "", why);
    return TP_ECLOSED;
}

/* The peer's rank named in a failure, so the message says which link broke. */
static int mesh_error(tp_mesh *m, int rc, int peer, char *err, size_t errlen) {
    char text[512];
    snprintf(text, sizeof(text), "link rank %d <-> rank %d: %.470s", m->rank, peer, err ? err : "");
    if (err && errlen) snprintf(err, errlen, "%s", text);
    mesh_fail(m, text);
    return rc;
}

static int mesh_pairwise(tp_mesh *m, const int *members, int n, int me, const tp_xsig *sig,
                         const void **srcs, void **dsts, const int *skip, char *err, size_t errlen) {
    for (int r = 0; r < n + (n & 1) - 1; r++) {
        const int k = partner(me, r, n);
        if (k >= n || (skip && skip[k])) continue;
        tp_link *l = m->links[members[k]];
        int rc = tp_link_exchange(l, sig, srcs[k], dsts[k], err, errlen);
        if (rc != TP_OK) return mesh_error(m, rc, members[k], err, errlen);
    }
    return TP_OK;
}

/* A posted link that failed: dead from now on, as tp_link_exchange leaves one. */
static int link_lost(tp_mesh *m, tp_link *l, int rc, int peer, char *err, size_t errlen) {
    l->failed = 1;
    snprintf(l->failure, sizeof(l->failure), "%s", err && errlen ? err : "unknown error");
    return mesh_error(m, rc, peer, err, errlen);
}

enum { MESH_PAIRWISE = 0, MESH_POSTED_TCP, MESH_POSTED_GATE };

/* Post this rank's block to member k's link when it can go ahead of the wait:
 * always over TCP (it fits the socket buffers), over RDMA only as a gate on a
 * window armed for it with the signature already agreed (both ends of a link
 * see the same window and signature, so both decide alike). */
static int mesh_post(tp_mesh *m, tp_link *l, int peer, const tp_xsig *sig, const void *src,
                     uint64_t *seq, int *how, char *err, size_t errlen) {
    *how = MESH_PAIRWISE;
    if (!l->dev) {
        *seq = ++l->pair->seq;
        pack_header(l->hdr_out, sig, *seq);
        int rc = tp_tcp_post(l->fd, l->hdr_out, TP_EXCHANGE_HEADER, src, sig->bytes, *seq, err, errlen);
        if (rc != TP_OK) return link_lost(m, l, rc, peer, err, errlen);
        *how = MESH_POSTED_TCP;
        return TP_OK;
    }
    if (sig->bytes > TP_GATE_BYTES || !l->sig_valid || !same_sig(&l->sig, sig)) return TP_OK;
    const uint64_t next = l->pair->seq + 1;
    int rc = tp_gate_post(l->dev, src, (uint32_t)sig->bytes, next, l->timeout_s, err, errlen);
    if (rc == TP_ENOTSUP) return TP_OK;
    if (rc != TP_OK) return link_lost(m, l, rc, peer, err, errlen);
    *seq = l->pair->seq = next;
    *how = MESH_POSTED_GATE;
    return TP_OK;
}

static int mesh_collect(tp_mesh *m, tp_link *l, int peer, const tp_xsig *sig, void *dst,
                        uint64_t seq, int how, char *err, size_t errlen) {
    const uint64_t t0 = tp_mono_ns();
    int rc;
    if (how == MESH_POSTED_TCP) {
        rc = tp_tcp_collect(l->fd, l->hdr_out, l->hdr_in, TP_EXCHANGE_HEADER, dst, sig->bytes, seq,
                            l->spin_ns, err, errlen);
        if (rc == TP_EDESYNC) name_desync(l->hdr_in, sig, seq, err, errlen);
    } else {
        rc = tp_gate_wait(l->dev, dst, (uint32_t)sig->bytes, seq, l->timeout_s, err, errlen);
    }
    if (rc != TP_OK) return link_lost(m, l, rc, peer, err, errlen);
    record(l, sig->bytes, tp_mono_ns() - t0);
    return TP_OK;
}

int tp_mesh_exchange(tp_mesh *m, const int *members, int n, int me, const tp_xsig *sig,
                     const void **srcs, void **dsts, char *err, size_t errlen) {
    if (n < 2 || n > TP_MESH_MAX || me < 0 || me >= n) {
        tp_errf(err, errlen, "mesh exchange among %d members (this one at %d): give 2..%d",
                n, me, TP_MESH_MAX);
        return TP_EINVAL;
    }
    for (int k = 0; k < n; k++) {
        if (k == me) continue;
        tp_link *l = members[k] >= 0 && members[k] < TP_MESH_MAX ? m->links[members[k]] : NULL;
        if (!l) {
            tp_errf(err, errlen, "mesh exchange: no link to rank %d", members[k]);
            return TP_EINVAL;
        }
        int rc = link_usable(m, l, sig, err, errlen);
        if (rc != TP_OK) return rc;
    }
    if (n == 2 || sig->bytes > TP_MESH_SMALL_BYTES)
        return mesh_pairwise(m, members, n, me, sig, srcs, dsts, NULL, err, errlen);
    /* Small: post to every peer that can take it ahead (every TCP peer, an
     * RDMA peer in a gate's steady state), meet the others round by round,
     * then collect what was posted. No rank blocks before it has posted, so
     * the rounds of the ranks that meet pairwise always find their partner. */
    uint64_t seqs[TP_MESH_MAX];
    int how[TP_MESH_MAX] = {0};
    for (int k = 0; k < n; k++) {
        if (k == me) continue;
        int rc = mesh_post(m, m->links[members[k]], members[k], sig, srcs[k], &seqs[k], &how[k],
                           err, errlen);
        if (rc != TP_OK) return rc;
    }
    how[me] = MESH_POSTED_TCP; /* never met: not a peer */
    int rc = mesh_pairwise(m, members, n, me, sig, srcs, dsts, how, err, errlen);
    if (rc != TP_OK) return rc;
    for (int k = 0; k < n; k++) {
        if (k == me || how[k] == MESH_PAIRWISE) continue;
        rc = mesh_collect(m, m->links[members[k]], members[k], sig, dsts[k], seqs[k], how[k], err,
                          errlen);
        if (rc != TP_OK) return rc;
    }
    return TP_OK;
}

void tp_mesh_close(tp_mesh *m) {
    if (!m->failed && !m->closed) {
        for (int r = 0; r < m->size && r < TP_MESH_MAX; r++)
            if (m->links[r]) shutdown(m->links[r]->fd, SHUT_RDWR);
    }
    m->closed = 1;
    for (int r = 0; r < m->size && r < TP_MESH_MAX; r++)
        if (m->links[r]) m->links[r]->pair->closed = 1;
}

void *tp_mesh_exchange_address(void) { return (void *)&tp_mesh_exchange; }
void *tp_mesh_close_address(void) { return (void *)&tp_mesh_close; }
void *tp_sum2_address(void) { return (void *)&tp_sum2; }
