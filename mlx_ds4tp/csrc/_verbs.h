/* mlx_ds4tp._verbs: one small C API for a Thunderbolt UC queue pair, with two
 * providers behind it (the real ibverbs stack, dlopen'ed at run time, and
 * "ucsim", an emulated Apple Thunderbolt UC device over loopback datagrams).
 *
 * Python (transport.py, warmup.py) drives setup; the hot loops (decode gates,
 * bulk rounds, window drain) live here and run with the GIL released.
 *
 * The declarations are in exchange_codes.h and _verbs_api.h, which are also
 * the cffi cdef; this header adds what only the C compiler can decide. */
#ifndef MLX_DS4TP_VERBS_H
#define MLX_DS4TP_VERBS_H

#include <stddef.h>
#include <stdint.h>

/* 1 when this build was compiled against <infiniband/verbs.h> (the ibverbs
 * provider exists), 0 when only ucsim does (tp_probe/tp_open then say how to
 * get the header; tp_built_with_ibverbs() tells Python). The build defines
 * TP_FORCE_NO_IBVERBS when MLX_DS4TP_NO_IBVERBS=1, to build as a machine
 * without the header would. */
#if !defined(TP_FORCE_NO_IBVERBS) && defined(__has_include)
#if __has_include(<infiniband/verbs.h>)
#define TP_HAVE_IBVERBS_HEADER 1
#endif
#endif
#ifndef TP_HAVE_IBVERBS_HEADER
#define TP_HAVE_IBVERBS_HEADER 0
#endif

#include "exchange_codes.h"
#include "_verbs_api.h"

#endif
