/* What the exchange header carries, in one place for C, C++ and Python:
 *   - C: _verbs.h includes this before _verbs_api.h (csrc/exchange.c packs
 *     and names these codes);
 *   - C++: csrc/mlx/pair_group.h includes it (the backend's one dtype table
 *     maps MLX's dtypes onto these codes);
 *   - Python: _verbs_build.py puts this file into the cffi cdef ahead of
 *     _verbs_api.h, so the values are lib.TP_* and cffi checks at import
 *     that they equal what the compiler made of them.
 * So, as _verbs_api.h, it holds only what cffi's parser takes: integer
 * #defines and comments, no #include, no #if, no include guard. */

/* "DS4X" little-endian: the first word of every exchange header. */
#define TP_EXCHANGE_MAGIC 0x58345344
/* magic u32, op u16, dtype u16, seq u64, bytes u64, ndim u32, 0 u32, dims
 * TP_XSIG_DIMS x u64. Shapes of more than TP_XSIG_DIMS dimensions are
 * compared on their first TP_XSIG_DIMS and their byte count. */
#define TP_EXCHANGE_HEADER 96
#define TP_XSIG_DIMS 8

/* An exchange up to this size is a decode gate (RDMA: two TP_MAX_MSG chunks
 * in the receive window); larger ones are bulk exchanges. */
#define TP_GATE_BYTES 32768

/* The collectives; send/recv name the sending rank, TP_XOP_P2P_FROM + src,
 * so two senders or two receivers disagree. */
#define TP_XOP_SUM 1
#define TP_XOP_GATHER 2
#define TP_XOP_MAX 3
#define TP_XOP_MIN 4
#define TP_XOP_SCATTER 5
#define TP_XOP_P2P_FROM 6

/* The dtypes the collectives take, TP_DTYPE_FIRST .. TP_DTYPE_LAST (0 is
 * none). The first three are also the ones tp_sum2 adds (csrc/sum.c). */
#define TP_DTYPE_FLOAT32 1
#define TP_DTYPE_FLOAT16 2
#define TP_DTYPE_BFLOAT16 3
#define TP_DTYPE_BOOL 4
#define TP_DTYPE_INT8 5
#define TP_DTYPE_INT16 6
#define TP_DTYPE_INT32 7
#define TP_DTYPE_INT64 8
#define TP_DTYPE_UINT8 9
#define TP_DTYPE_UINT16 10
#define TP_DTYPE_UINT32 11
#define TP_DTYPE_UINT64 12
#define TP_DTYPE_FLOAT64 13
#define TP_DTYPE_COMPLEX64 14
#define TP_DTYPE_FIRST 1
#define TP_DTYPE_LAST 14
