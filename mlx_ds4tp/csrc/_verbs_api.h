/* mlx_ds4tp._verbs public API: what Python (transport.py, warmup.py) calls.
 *
 * This file is two things at once, so every declaration is written once:
 *   - C: _verbs.h includes it, and every .c file of the module sees it;
 *   - the cffi cdef: _verbs_build.py reads it whole. So it holds only what
 *     cffi's parser takes: integer #defines, typedefs, prototypes and
 *     comments; no #include, no #if, no attributes. cffi checks at import
 *     that every constant and struct layout here equals what the compiler
 *     made of it, so Python reads sizes from lib.TP_* and cannot drift.
 *
 * Every function that can fail returns a negative TP_E* code (or NULL) and
 * writes a one-line message into err[errlen] that names the values involved
 * and, where there is one, the fix. */

/* The Apple driver never delivers a message above 16 KiB. */
#define TP_MAX_MSG 16384
/* Decode gates posted ahead, by sequence number, at most (fewer where the
 * device takes fewer receives: tp_stats.window). */
#define TP_RECV_WINDOW 16
/* A gate vector rides as at most this many <= TP_MAX_MSG chunks. */
#define TP_GATE_MAX_CHUNKS 2
/* One bulk round: at most 64 x 16 KiB (fewer where the device takes fewer
 * work requests: tp_stats.bulk_slots). */
#define TP_BULK_SLOTS 64
/* Depths tp_build_qp asks for when given 0 (the device may grant less, and
 * take less still at post time). */
#define TP_DEFAULT_CQ 512
#define TP_DEFAULT_SEND_WR 1024
#define TP_DEFAULT_RECV_WR 1024
/* Memory registrations per device, the slab's included: the Apple stack
 * allows about 100 in all and fails the next with a bare error. */
#define TP_MAX_MRS 96
/* A waiter's yield that took longer than this (ns) gave the core to another
 * task: it blocks from then on (tp_yield_lost below). */
#define TP_YIELD_LOST_NS 20000

/* Return codes. */
#define TP_OK 0
#define TP_EINVAL -1       /* bad argument */
#define TP_EUNAVAIL -2     /* provider or device not available */
#define TP_ESYS -3         /* a system or verbs call failed (errno in message) */
#define TP_ETIMEOUT -4     /* a wait ran out */
#define TP_EPEER -5        /* the peer closed the control socket */
#define TP_ECOMPLETION -6  /* a work completion carried an error status */
#define TP_ENOTSUP -7      /* refused by the device (e.g. RC/UD queue pair on UC-only hardware) */
#define TP_ENOMEM -8       /* queue full / too many outstanding work requests / too many MRs */
#define TP_EDESYNC -9      /* the TCP gate header from the peer differs from ours */
#define TP_ELOST -10       /* UC lost a message: a hot-path receive got the peer's NEXT message */
#define TP_ECLOSED -11     /* the pair was closed: a sum gate refuses to touch its freed socket or device */

/* Queue pair types (ucsim accepts only TP_QPT_UC, like the Apple driver). */
#define TP_QPT_RC 2
#define TP_QPT_UC 3
#define TP_QPT_UD 4

/* Work request opcodes. */
#define TP_OP_SEND 0
#define TP_OP_WRITE 1      /* RDMA WRITE: the Apple driver accepts it and never executes it */

/* Work completion opcodes reported by tp_poll. */
#define TP_WC_SEND 0
#define TP_WC_RECV 1

/* Work completion statuses (numbered as ibv_wc_status). */
#define TP_WC_SUCCESS 0
#define TP_WC_LOC_LEN_ERR 1

/* What one side tells the other through the RDMA_INFO control frame. For
 * ucsim, gid is ::ffff:<bound IPv4> and lid carries the datagram port.
 * mtu is in bytes (1024: the only path MTU the Apple driver accepts). */
typedef struct {
    uint32_t qpn;
    uint32_t psn;
    uint32_t mtu;
    uint16_t lid;
    uint8_t link_layer;
    uint8_t gid[16];
} tp_info;

typedef struct {
    uint64_t wr_id;
    int32_t status;
    int32_t opcode;
    uint32_t byte_len;
    uint32_t imm;      /* receives: the sender's immediate data (host order), if has_imm */
    int32_t has_imm;   /* 1: sent as SEND_WITH_IMM (a hot-path sequence tag), 0: plain SEND */
} tp_wc;

typedef struct tp_dev tp_dev;

/* 1 when this build has the ibverbs provider (it was compiled against
 * infiniband/verbs.h), 0 when only ucsim exists (MLX_DS4TP_NO_IBVERBS=1 or
 * no header): tp_probe/tp_open then say how to get the header. */
int tp_built_with_ibverbs(void);

/* sched_yield, then 1 when another task held the core meanwhile (the yield took
 * longer than TP_YIELD_LOST_NS): a waiter should stop spinning and block. */
int tp_yield_lost(void);
/* How many yields in this process gave the core away (so how many waits gave
 * up polling for it): what tells a poll cut short from one never made. */
uint64_t tp_yields_lost(void);

/* The verbs library the ibverbs provider loads for every later tp_probe and
 * tp_open: a path (Python passes DS4_TP_VERBS_LIBRARY), or NULL/"" for the
 * system one (/usr/lib/librdma.dylib on macOS, libibverbs.so.1 on Linux).
 * Process-wide; devices already open keep the library they were opened
 * with. A library that cannot be loaded is reported by the next
 * tp_probe/tp_open, naming the path. TP_EINVAL if the path is too long. */
int tp_set_verbs_library(const char *path, char *err, size_t errlen);

/* Is the provider usable here?  device NULL/"" = ibverbs (any device),
 * "ucsim" = the emulated device, any other name = that ibverbs device.
 * Returns 1 yes, 0 no (reason in err). Never fails loudly. */
int tp_probe(const char *device, char *err, size_t errlen);

/* Open a device, allocate the protection domain and register the slab (the
 * one registration the transport needs; the Apple stack allows ~100 regions
 * in all). role 0 = leader, 1 = worker. bind_ipv4 is the local address the
 * control channel uses (ucsim binds its datagram socket there; ibverbs
 * ignores it). gid_index < 0 = find the IPv4-mapped GID. faults: the
 * DS4_TP_UCSIM_FAULTS string (ucsim only; NULL or "" = defaults), items
 * drop=l2w|w2l:K, drop_nth=l2w|w2l:N (on every build, the sender's N-th
 * hot-path message over 64 bytes is lost, counted from 1: gate and bulk
 * chunks, never the warm-up's plain sends), kill_unposted=0|1, loss=P,
 * seed=S, max_msg=N, max_recv=N, post_cap=N, delay_us=N (docs/design.md's table). */
tp_dev *tp_open(const char *device, int gid_index, const char *bind_ipv4, int role,
                const char *faults, void *slab, uint64_t slab_bytes,
                char *err, size_t errlen);

/* (Re)build the completion queue and queue pair: destroys any previous ones,
 * keeps the PD and memory registrations. setup_attempt 0 is the first build;
 * the packet sequence number is offset by setup_attempt * 0x1000 and the
 * queue pair gets a new number. Depths requested may be reduced by the device;
 * the granted ones are readable with tp_depths. qp_type is TP_QPT_*. */
int tp_build_qp(tp_dev *dev, int qp_type, int setup_attempt, int cq_depth,
                int send_wr, int recv_wr, char *err, size_t errlen);
void tp_depths(const tp_dev *dev, int *cq_depth, int *send_wr, int *recv_wr);
int tp_local_info(const tp_dev *dev, tp_info *out);
/* INIT -> RTR -> RTS with the recipe the Apple driver accepts (UC, MTU 1024,
 * GRH with the IPv4-mapped GID, hop limit 1). */
int tp_connect(tp_dev *dev, const tp_info *peer, char *err, size_t errlen);
const char *tp_device_name(const tp_dev *dev);
void tp_close(tp_dev *dev);

/* Sockets the hot loops watch: control_fd for peer death (EOF/reset is
 * TP_EPEER within ~1 ms of spinning), barrier_fd (the TCP data socket) for
 * the receives-posted barrier inside tp_gate / tp_bulk. -1 = none. */
void tp_set_fds(tp_dev *dev, int control_fd, int barrier_fd);

/* no_imm 1: hot-path messages go out untagged (plain SEND, no sequence tag;
 * see "Sequence tags" below), for a driver that mangles immediate data.
 * Python sets it from LinkSettings (DS4_TP_RDMA_NO_IMM). Logged once. */
void tp_set_no_imm(tp_dev *dev, int no_imm);

/* Extra memory registrations: tp_gate / tp_bulk send straight out of (and
 * receive straight into) a registered region instead of the slab. Returns a
 * handle >= 0 or a negative code. At most 96 in all. The exchange passes MLX's
 * buffers, never registered (a registration per new buffer would cost more
 * than the 16 KiB copy), so only the C tests register. */
int tp_reg(tp_dev *dev, void *addr, uint64_t len, char *err, size_t errlen);
int tp_dereg(tp_dev *dev, int handle);

/* Raw work requests (used by warm-up and tests). addr must lie inside a
 * registered region. */
int tp_post_recv(tp_dev *dev, void *addr, uint32_t len, uint64_t wr_id, char *err, size_t errlen);
int tp_post_send(tp_dev *dev, const void *addr, uint32_t len, uint64_t wr_id, int opcode,
                 int signaled, char *err, size_t errlen);
/* Reap up to max completions, waiting at most timeout_s for the first one.
 * Returns the count (0 on timeout), or TP_EPEER / negative on failure. Does
 * NOT treat error statuses as failures: the caller reads wc[i].status. */
int tp_poll(tp_dev *dev, tp_wc *wc, int max, double timeout_s, char *err, size_t errlen);

/* ---- hot paths (call with the GIL released) ---- */

/* Sequence tags: why every hot-path message carries one.
 * UC never reports a lost message: the sender's completion says SUCCESS, the
 * receive meant for it simply stays posted, and since receives are consumed
 * in order the peer's NEXT message lands in it. Without a check, the gate
 * would return the peer's partial for seq s + 1 as if it were seq s, and
 * every later gate would be shifted by one: a silently wrong model output.
 * So every hot-path message goes out as SEND_WITH_IMM whose 32-bit immediate
 * names what it is (gate number and chunk, bulk round and slot, drain marker
 * index); every receive completion's tag is checked against what that posted
 * receive expects, and a mismatch is TP_ELOST with a message naming the gate
 * seq (or bulk round): "tp rdma: lost message detected at gate seq S ...".
 * The queue pair is then unusable until rebuilt, like after any hot-path
 * failure. A lost message that nothing follows on the queue pair (the last
 * gate before a drain, a bulk exchange or a gate-signature exchange; a
 * bulk's last chunk) is revealed by the TCP data socket instead: the peer
 * writes its next word there only after it has left the exchange, i.e.
 * after sending every message of it, so unread bytes there while a receive
 * is still missing 100 ms later (TP_LOST_GRACE_NS, a message still on the
 * wire) are TP_ELOST too: "tp rdma: lost message detected at gate seq S:
 * the peer has moved past it ...". At the end of a run (the peer closed
 * the control socket instead) it is TP_EPEER saying the peer's message
 * never arrived. The argument is in csrc/rdma/loss.c, above hp_pump.
 * Raw work requests (tp_post_send: warm-up, tests) stay plain SEND.
 * Real hardware: whether AppleThunderboltRDMA supports SEND_WITH_IMM on UC is
 * unverified. If the driver refuses the first tagged post (EINVAL/ENOTSUP),
 * the ibverbs provider logs once ("ds4-tp: ...") and sends untagged from then
 * on (tp_set_no_imm forces that); a receiver that gets untagged
 * hot-path messages logs once and skips the check, and loss detection then
 * rests on the hidden-state hash check (ds4tp run --debug-hash N). */

/* One decode gate, seq = 1, 2, 3, ... strictly increasing by one. Arms the
 * receive window (up to TP_RECV_WINDOW gates, as many as the device's depth
 * takes, at least 2) on first use after bring-up or a
 * drain, with a receives-posted barrier over barrier_fd; sends bytes from src
 * (straight from a registered region, else through the slab's send slot) in
 * ceil(bytes / TP_MAX_MSG) <= TP_GATE_MAX_CHUNKS chunks; spins until the
 * peer's gate seq has landed; copies it into dst; re-arms seq + window.
 * A gate whose byte count differs from the armed window's drains and re-arms
 * first (both ranks run the same gate sequence, so both do it together).
 * Details (all hot paths): timeout_s must be > 0; the receive queue must be
 * empty when a window or bulk exchange is armed (raw receives left posted
 * are TP_EINVAL); the barrier word carries what each side armed, so ranks
 * that disagree get a "desync" error; after any failure the queue pair is
 * marked unusable and every hot path fails fast until tp_build_qp. seq is
 * the caller's label (errors and stats.recv_done name it): the window is
 * keyed by the count of gates since the build, which both ranks share, so
 * labels may skip (a bulk exchange taking a seq) or jump. */
int tp_gate(tp_dev *dev, const void *src, void *dst, uint32_t bytes, uint64_t seq,
            double timeout_s, char *err, size_t errlen);

/* tp_gate in two halves, for a rank with several peers (the mesh): post
 * this gate's sends, then (after posting to the other peers) wait for the
 * peer's, copy it to dst and refill the window. Only on a window armed for
 * `bytes` already (a gate's steady state, no barrier due): otherwise
 * tp_gate_post is TP_ENOTSUP with nothing done, and the caller runs tp_gate. */
int tp_gate_post(tp_dev *dev, const void *src, uint32_t bytes, uint64_t seq, double timeout_s,
                 char *err, size_t errlen);
int tp_gate_wait(tp_dev *dev, void *dst, uint32_t bytes, uint64_t seq, double timeout_s,
                 char *err, size_t errlen);

/* Consume the decode window on both sides (dummy sends matching the peer's
 * posted receives) so the queue pair is empty. No-op when not armed. Starts
 * with a barrier over barrier_fd: the peer may still be inside its last gate
 * with the receive for that seq + window not yet re-posted. */
int tp_drain(tp_dev *dev, double timeout_s, char *err, size_t errlen);

/* Bulk exchange for prefill: drains the decode window, then moves bytes in
 * rounds of up to TP_BULK_SLOTS x TP_MAX_MSG (both ranks use the smaller of
 * what their devices take) through the slab's bulk staging, with the next
 * round's receives posted before this round's sends and a receives-posted
 * barrier before the first round.
 * Queue depth (all hot paths): Apple's driver grants large depths and then
 * refuses the post past 63 outstanding with ENOMEM; the first refusal is
 * learned (logged once, tp_stats.recv_cap / send_cap) and every later
 * window and round stays within it, nothing lost or sent twice. */
int tp_bulk(tp_dev *dev, const void *src, void *dst, uint64_t bytes, double timeout_s,
            char *err, size_t errlen);

/* Slab bytes the hot paths own, at the start of the slab: the gate send slot
 * (TP_GATE_MAX_CHUNKS x TP_MAX_MSG), the receive window ring (TP_RECV_WINDOW
 * slots of that size) and bulk staging (1 round send + 2 rounds receive).
 * Anything after this offset belongs to the caller (warm-up buffers). */
uint64_t tp_slab_bytes(void);

/* Counters for tests and the bench. */
typedef struct {
    uint64_t sends, recvs, send_bytes, recv_bytes;
    uint64_t dropped_oversize, dropped_fault, dropped_unposted, dropped_stale;
    int direction_dead;          /* ucsim: our receive direction was killed */
    uint64_t recv_done;          /* highest gate seq whose receive completed */
    int window_armed;
    int recv_cap, send_cap;      /* depths the device really accepts, learned when it refused
                                    a post (0: none refused yet) */
    uint32_t window;             /* gates the decode window posts ahead (<= TP_RECV_WINDOW) */
    uint32_t bulk_slots;         /* messages per round of the last bulk exchange
                                    (<= TP_BULK_SLOTS) */
} tp_stats;
void tp_get_stats(const tp_dev *dev, tp_stats *out);

/* ---- TCP hot loops (the fallback transport, csrc/tcp/gate.c) ----
 * tp_link_exchange's TCP legs (and its RDMA signature swaps), with the header
 * it packs; tp_tcp_raw is the bench's floor. */

/* One decode gate on a blocking socket whose SO_RCVTIMEO/SO_SNDTIMEO set
 * the deadline: send hdr_out + src in one sendmsg, receive the peer's header
 * into hdr_in and its payload into dst. Both ranks send identical headers
 * when in step, so a differing header is TP_EDESYNC, detected before any more
 * payload is awaited (hdr_in then holds the peer's header). Each read polls
 * the socket for up to spin_ns in all before it blocks (0: block at once). */
int tp_tcp_gate(int fd, const void *hdr_out, void *hdr_in, uint32_t hdr_len,
                const void *src, void *dst, uint64_t bytes, uint64_t seq, uint64_t spin_ns,
                char *err, size_t errlen);
/* A bulk exchange (prefill rows, gathered logits) of any size: hdr_out then
 * src out, the peer's header into hdr_in and its payload into dst, writing
 * and reading at once without blocking in either, so both ranks writing
 * first cannot deadlock whatever the socket buffers. Polls for up to spin_ns
 * before sleeping in poll(). TP_EDESYNC when the peer's header differs (in
 * hdr_in); TP_ETIMEOUT after timeout_s without a byte moving either way. */
int tp_tcp_duplex(int fd, const void *hdr_out, void *hdr_in, uint32_t hdr_len, const void *src,
                  void *dst, uint64_t bytes, uint64_t seq, uint64_t spin_ns, double timeout_s,
                  char *err, size_t errlen);
/* The floor the TCP exchange is measured against: write bytes, read bytes. */
int tp_tcp_raw(int fd, const void *src, void *dst, uint64_t bytes, uint64_t spin_ns, char *err,
               size_t errlen);
/* tp_tcp_gate in two halves, the same bytes on the wire: post (header and
 * payload out) to every peer first, then collect (the peer's header checked,
 * then its payload) from each, so a rank with several peers overlaps their
 * round trips (csrc/exchange.c's mesh). The payload must fit the socket
 * buffers (the mesh posts at most TP_MESH_SMALL_BYTES). */
int tp_tcp_post(int fd, const void *hdr_out, uint32_t hdr_len, const void *src, uint64_t bytes,
                uint64_t seq, char *err, size_t errlen);
int tp_tcp_collect(int fd, const void *hdr_out, void *hdr_in, uint32_t hdr_len, void *dst,
                   uint64_t bytes, uint64_t seq, uint64_t spin_ns, char *err, size_t errlen);


/* ---- The gate's sum (csrc/sum.c) ---- */

/* out[i] = first[i] + second[i] for count items of dtype (TP_DTYPE_FLOAT32,
 * TP_DTYPE_FLOAT16 or TP_DTYPE_BFLOAT16, exchange_codes.h): float16
 * and bfloat16 added in float32 and rounded to nearest-even, as MLX adds
 * them. out must not overlap the inputs. TP_EINVAL for another dtype. */
int tp_sum2(int dtype, const void *first, const void *second, void *out, uint64_t count);


/* ---- The pair's shared gate state ---- */

/* What every exchange of a pair shares: the sequence number of the last one
 * (the exchange header carries it) and whether the pair is closed. The pair
 * owns it; tp_link_exchange bumps and checks it (tests set seq to put the
 * ranks out of step). */
typedef struct tp_pair_state {
    uint64_t seq;
    int closed;
} tp_pair_state;


/* ---- One exchange for the MLX backend (csrc/exchange.c) ---- */

/* An exchange's signature: what both ranks must agree on, the codes and
 * sizes exchange_codes.h's. The TCP header carries it whole. */
typedef struct tp_xsig {
    int op;                   /* TP_XOP_* */
    int dtype;                /* TP_DTYPE_* */
    uint64_t bytes;
    int ndim;
    int64_t shape[TP_XSIG_DIMS];
} tp_xsig;

/* What the MLX backend's GroupImpl holds of the pair: filled by Python once
 * the pair is complete, read and written only by tp_link_exchange after. */
typedef struct tp_link {
    tp_pair_state *pair;      /* seq (shared with every gate of the pair), closed */
    tp_dev *dev;              /* RDMA gates; NULL: TCP on fd */
    int fd;                   /* the gate data socket (RDMA: headers and barriers) */
    int rank;
    uint64_t spin_ns;         /* TCP: poll this long before blocking */
    double timeout_s;         /* every wait's deadline */
    int64_t *latency_ns;      /* ring of decode gates' round trips (NULL: not kept) */
    uint64_t latency_len;
    uint64_t *latency_count;  /* [0]: gates recorded, [1]: their total ns */
    uint64_t other_ns;        /* total ns of bulk exchanges and signature swaps */
    int sig_valid;            /* RDMA: the signature last agreed with the peer */
    tp_xsig sig;
    int failed;               /* an exchange failed: the link is dead (failure says why) */
    unsigned char hdr_out[TP_EXCHANGE_HEADER];
    unsigned char hdr_in[TP_EXCHANGE_HEADER];
    char failure[512];
} tp_link;

/* Send sig->bytes from src, receive the peer's into dst (src and dst must
 * not overlap): a peer at another collective, dtype, shape or sequence is
 * TP_EDESYNC, with both sides named in err. After any failure the link is dead: every
 * later call is TP_ECLOSED naming the first failure, and the data socket is
 * shut down so the peer fails at once too. */
int tp_link_exchange(tp_link *l, const tp_xsig *sig, const void *src, void *dst, char *err,
                     size_t errlen);
/* The float sum's address, for the C++ backend (it is another shared object). */
void *tp_sum2_address(void);


/* ---- A mesh of N ranks (csrc/exchange.c): one link per pair of ranks ---- */

/* The most ranks a mesh holds. */
#define TP_MESH_MAX 8
/* An exchange up to this size posts to every TCP peer before it collects;
 * larger ones (and every RDMA link) go pairwise, round by round. */
#define TP_MESH_SMALL_BYTES 65536

/* The mesh as the MLX backend holds it: filled by Python once every link is
 * complete (link/mesh.py), read and written only by tp_mesh_exchange after.
 * The first failure on any link fails them all: every link's data socket is
 * shut down, so each peer, possibly waiting on this rank, fails at once too
 * and does the same to its own links. */
typedef struct tp_mesh {
    int rank;                    /* this rank in the mesh */
    int size;
    tp_link *links[8];           /* links[r]: the link to rank r (TP_MESH_MAX); NULL for this rank */
    int failed;
    int closed;
    char failure[512];
} tp_mesh;

/* One step of any collective among members[0..n) (mesh ranks in the group's
 * rank order; this rank is members[me]): srcs[k] (sig->bytes) goes to member
 * k, member k's block lands in dsts[k] (k != me; entries at me unused). The
 * peers' exchanges run on their own links, each with its header and
 * sequence as a pair's: small ones posted to every TCP peer then collected,
 * the rest as a round-robin tournament of pairwise exchanges that every
 * member walks in the same order. */
int tp_mesh_exchange(tp_mesh *m, const int *members, int n, int me, const tp_xsig *sig,
                     const void **srcs, void **dsts, char *err, size_t errlen);
/* Mark the mesh closed and wake an exchange blocked on any of its links. */
void tp_mesh_close(tp_mesh *m);
/* The addresses the C++ backend calls (it is another shared object). */
void *tp_mesh_exchange_address(void);
void *tp_mesh_close_address(void);
