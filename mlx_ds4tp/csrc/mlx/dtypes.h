// The dtypes the collectives take and how partials combine, for the group
// (group.cpp): one table maps MLX's dtypes onto the exchange's codes
// (exchange_codes.h), and every combine runs in rank order, so every rank
// computes the same expression and holds the same bits.
#pragma once

#include <cmath>
#include <complex>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include <cstddef>
#include <cstdint>

#include "mlx/array.h"
#include "mlx/utils.h"

// The C module's headers have no include guard (they are also its cffi cdef):
// this is the one place the C++ side includes them.
extern "C" {
#include "exchange_codes.h"
#include "_verbs_api.h"
#include "exchange_names.h"
}

namespace mlx_ds4tp {

namespace mx = mlx::core;

// The C module's float sum (tp_sum2, csrc/sum.c), handed over as an address.
using Sum2Fn = int (*)(int, const void*, const void*, void*, uint64_t);

// The exchange's code of an MLX dtype (TP_DTYPE_*, exchange_codes.h); 0 if none.
int dtype_code(mx::Dtype dtype);

namespace dtypes {

// ---- The dtypes: one table ---------------------------------------------------

// A dtype the collectives take: MLX's, its code in the exchange header
// (exchange_codes.h), and the C++ type its items are combined as.
template <typename T>
struct DtypeEntry {
  using type = T;
  mx::Dtype dtype;
  int code;
};

// The one place a dtype meets its code: dtype_code, the combine and the
// poisoning of a failed output all read it.
constexpr std::tuple kDtypes{
    DtypeEntry<float>{mx::float32, TP_DTYPE_FLOAT32},
    DtypeEntry<mx::float16_t>{mx::float16, TP_DTYPE_FLOAT16},
    DtypeEntry<mx::bfloat16_t>{mx::bfloat16, TP_DTYPE_BFLOAT16},
    DtypeEntry<bool>{mx::bool_, TP_DTYPE_BOOL},
    DtypeEntry<int8_t>{mx::int8, TP_DTYPE_INT8},
    DtypeEntry<int16_t>{mx::int16, TP_DTYPE_INT16},
    DtypeEntry<int32_t>{mx::int32, TP_DTYPE_INT32},
    DtypeEntry<int64_t>{mx::int64, TP_DTYPE_INT64},
    DtypeEntry<uint8_t>{mx::uint8, TP_DTYPE_UINT8},
    DtypeEntry<uint16_t>{mx::uint16, TP_DTYPE_UINT16},
    DtypeEntry<uint32_t>{mx::uint32, TP_DTYPE_UINT32},
    DtypeEntry<uint64_t>{mx::uint64, TP_DTYPE_UINT64},
    DtypeEntry<double>{mx::float64, TP_DTYPE_FLOAT64},
    DtypeEntry<mx::complex64_t>{mx::complex64, TP_DTYPE_COMPLEX64},
};

// fn(entry) for every entry; stops at the first for which it returns true.
template <typename Fn>
void each_dtype(Fn&& fn) {
  std::apply([&](const auto&... entry) { (fn(entry) || ...); }, kDtypes);
}

// fn(std::type_identity<T>{}) with T the C++ type of `code`; throws for a code the table lacks.
template <typename Fn>
void with_type(int code, Fn&& fn) {
  bool found = false;
  each_dtype([&](const auto& entry) {
    if (entry.code != code) return false;
    fn(std::type_identity<typename std::decay_t<decltype(entry)>::type>{});
    return found = true;
  });
  if (!found) throw std::invalid_argument("mlx_ds4tp: no dtype has code " + std::to_string(code));
}

// ---- Combining two partials (first = the lower rank's) ----------------------

template <typename T>
inline T add(T a, T b) {
  if constexpr (std::is_same_v<T, bool>) {
    return a || b;  // MLX's sum of bools is a logical or
  } else if constexpr (std::is_integral_v<T>) {
    // Integers wrap as MLX's do; unsigned arithmetic keeps that defined in C++.
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename T>
bool is_nan(T v) {
  if constexpr (std::is_same_v<T, mx::complex64_t>) {
    return std::isnan(v.real()) || std::isnan(v.imag());
  } else if constexpr (std::is_floating_point_v<T>) {
    return std::isnan(v);
  } else if constexpr (std::is_same_v<T, mx::float16_t> || std::is_same_v<T, mx::bfloat16_t>) {
    return std::isnan(static_cast<float>(v));
  } else {
    return false;
  }
}

// a >= b as numpy and MLX order values: complex numbers real part first; the
// 16-bit floats as the values they stand for (their bits' order is wrong for
// negatives).
template <typename T>
bool at_least(T a, T b) {
  if constexpr (std::is_same_v<T, mx::complex64_t>) {
    return a.real() > b.real() || (a.real() == b.real() && a.imag() >= b.imag());
  } else if constexpr (std::is_same_v<T, mx::float16_t> || std::is_same_v<T, mx::bfloat16_t>) {
    return static_cast<float>(a) >= static_cast<float>(b);
  } else {
    return a >= b;
  }
}

// NaN propagates (the first NaN wins); a tie keeps rank 0's value.
template <typename T>
T pick_max(T a, T b) {
  if (is_nan(a)) return a;
  if (is_nan(b)) return b;
  return at_least(a, b) ? a : b;
}

template <typename T>
T pick_min(T a, T b) {
  if (is_nan(a)) return a;
  if (is_nan(b)) return b;
  return at_least(b, a) ? a : b;
}

template <typename T>
void combine_as(int op, const void* first, const void* second, void* out, size_t n) {
  const T* a = static_cast<const T*>(first);
  const T* b = static_cast<const T*>(second);
  T* o = static_cast<T*>(out);
  // out may be first or second itself (MLX donates the input's buffer to the
  // output): each item is read before it is written.
  if (op == TP_XOP_MAX) {
    for (size_t i = 0; i < n; i++) o[i] = pick_max(a[i], b[i]);
  } else if (op == TP_XOP_MIN) {
    for (size_t i = 0; i < n; i++) o[i] = pick_min(a[i], b[i]);
  } else {
    for (size_t i = 0; i < n; i++) o[i] = add(a[i], b[i]);
  }
}

inline void combine(int op, int code, Sum2Fn sum2, const void* first, const void* second, void* out,
             size_t n) {
  // The float sums run in C, vectorised where the CPU allows, float16 and
  // bfloat16 added in float32 and rounded to nearest-even as MLX adds them.
  const bool float_sum = code == TP_DTYPE_FLOAT32 || code == TP_DTYPE_FLOAT16 ||
                         code == TP_DTYPE_BFLOAT16;
  if ((op == TP_XOP_SUM || op == TP_XOP_SCATTER) && float_sum) {
    sum2(code, first, second, out, n);
    return;
  }
  with_type(code, [&](auto type) {
    combine_as<typename decltype(type)::type>(op, first, second, out, n);
  });
}

// A failed collective's output is filled with NaN where its dtype has one, so that even a
// reader that never sees the error (numpy's np.array() swallows the first evaluation error
// of an MLX array and reads it through another protocol, and MLX reports an evaluation's
// error once) gets no plausible sum.
inline void poison(int code, void* out, size_t bytes) {
  with_type(code, [&](auto type) {
    using T = typename decltype(type)::type;
    // Integers and bools have no NaN: for them the error is all there is.
    if constexpr (!std::is_integral_v<T>) {
      const float q = std::numeric_limits<float>::quiet_NaN();
      T nan;
      if constexpr (std::is_same_v<T, mx::complex64_t>) {
        nan = T(q, q);
      } else {
        nan = T(q);
      }
      for (size_t i = 0; i + sizeof(T) <= bytes; i += sizeof(T)) {
        std::memcpy(static_cast<char*>(out) + i, &nan, sizeof(T));
      }
    }
  });
}

// What both ranks must agree on for an exchange of `a` (its bytes may be a part of it).
inline tp_xsig signature(int op, int code, const mx::array& a, uint64_t bytes) {
  tp_xsig sig{};
  sig.op = op;
  sig.dtype = code;
  sig.bytes = bytes;
  sig.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < sig.ndim && i < TP_XSIG_DIMS; i++) sig.shape[i] = a.shape(i);
  return sig;
}

inline int checked_code(int op, const mx::array& a) {
  const int code = dtype_code(a.dtype());
  if (code == 0) {
    std::ostringstream msg;
    msg << "mlx_ds4tp " << tp_op_name(op) << ": dtype " << a.dtype()
        << " is not supported by mlx_ds4tp's collectives; use one of";
    each_dtype([&](const auto& entry) {
      msg << (entry.code == TP_DTYPE_FIRST ? " " : ", ") << entry.dtype;
      return false;
    });
    throw std::invalid_argument(msg.str());
  }
  return code;
}


}  // namespace dtypes

}  // namespace mlx_ds4tp
