/* The collectives' names in error messages, one table for the C exchange
 * (exchange.c) and the C++ backend (mlx/dtypes.h), so a mismatch reads the
 * same from either side. Not in the cffi cdef (exchange_codes.h is: it holds
 * only what cffi's parser takes), so a function may live here. Needs
 * exchange_codes.h and _verbs_api.h (TP_MESH_MAX) included first. */
#ifndef TP_EXCHANGE_NAMES_H
#define TP_EXCHANGE_NAMES_H

static inline const char *tp_op_name(int op) {
    /* send/recv name the sending rank (TP_XOP_P2P_FROM + src), so two senders
     * or two receivers read as such. */
    static const char *const p2p[TP_MESH_MAX] = {
        "send/recv from rank 0", "send/recv from rank 1", "send/recv from rank 2",
        "send/recv from rank 3", "send/recv from rank 4", "send/recv from rank 5",
        "send/recv from rank 6", "send/recv from rank 7"};
    switch (op) {
    case TP_XOP_SUM: return "all_sum";
    case TP_XOP_GATHER: return "all_gather";
    case TP_XOP_MAX: return "all_max";
    case TP_XOP_MIN: return "all_min";
    case TP_XOP_SCATTER: return "sum_scatter";
    default: break;
    }
    if (op >= TP_XOP_P2P_FROM && op < TP_XOP_P2P_FROM + TP_MESH_MAX) return p2p[op - TP_XOP_P2P_FROM];
    return "collective";
}

#endif
