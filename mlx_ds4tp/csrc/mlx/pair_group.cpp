// The two-rank GroupImpl: each collective is dispatched on the group's CPU
// stream, exchanges the partials through the C module (csrc/exchange.c) and
// combines them in rank order, so both ranks compute the same expression and
// hold the same bits.

#include "pair_group.h"

#include <cmath>
#include <complex>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <type_traits>

#include "mlx/backend/cpu/encoder.h"

namespace mlx_ds4tp {

namespace {

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

// ---- Combining the two partials (first = rank 0's) -------------------------

template <typename T>
T add(T a, T b) {
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

void combine(int op, int code, Sum2Fn sum2, const void* first, const void* second, void* out,
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
void poison(int code, void* out, size_t bytes) {
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

const char* op_label(int op) {
  switch (op) {
    case TP_XOP_SUM: return "all_sum";
    case TP_XOP_GATHER: return "all_gather";
    case TP_XOP_MAX: return "all_max";
    case TP_XOP_MIN: return "all_min";
    case TP_XOP_SCATTER: return "sum_scatter";
    default: return "send/recv";
  }
}

// What both ranks must agree on for an exchange of `a` (its bytes may be a part of it).
tp_xsig signature(int op, int code, const mx::array& a, uint64_t bytes) {
  tp_xsig sig{};
  sig.op = op;
  sig.dtype = code;
  sig.bytes = bytes;
  sig.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < sig.ndim && i < TP_XSIG_DIMS; i++) sig.shape[i] = a.shape(i);
  return sig;
}

int checked_code(int op, const mx::array& a) {
  const int code = dtype_code(a.dtype());
  if (code == 0) {
    std::ostringstream msg;
    msg << "mlx_ds4tp " << op_label(op) << ": dtype " << a.dtype()
        << " is not supported by the pair's collectives; use one of";
    each_dtype([&](const auto& entry) {
      msg << (entry.code == TP_DTYPE_FIRST ? " " : ", ") << entry.dtype;
      return false;
    });
    throw std::invalid_argument(msg.str());
  }
  return code;
}

}  // namespace

int dtype_code(mx::Dtype dtype) {
  int code = 0;
  each_dtype([&](const auto& entry) {
    if (entry.dtype.val() == dtype.val()) code = entry.code;
    return code != 0;
  });
  return code;
}

std::vector<std::pair<mx::Dtype, int>> dtype_codes() {
  std::vector<std::pair<mx::Dtype, int>> codes;
  each_dtype([&](const auto& entry) {
    codes.emplace_back(entry.dtype, entry.code);
    return false;
  });
  return codes;
}

// ---- The group --------------------------------------------------------------

PairGroupImpl::PairGroupImpl(int rank, tp_link* link, ExchangeFn exchange, Sum2Fn sum2,
                             CloseFn close)
    : rank_(rank),
      link_(link),
      exchange_(exchange),
      sum2_(sum2),
      close_(close) {}

mx::Stream cpu_communication_stream(mx::StreamOrDevice s) {
  // As MLX's own backends: the exchange runs on a CPU stream (the calling
  // thread's default one unless a CPU stream is named); on a Mac the model's
  // GPU work meets it through MLX's events. Streams are per thread in MLX, so
  // two ranks in one process (the tests) never queue behind each other.
  if (auto stream = std::get_if<mx::Stream>(&s); stream && stream->device == mx::Device::cpu) {
    return *stream;
  }
  return mx::default_stream(mx::Device::cpu);
}

mx::Stream PairGroupImpl::communication_stream(mx::StreamOrDevice s) {
  return cpu_communication_stream(s);
}

std::shared_ptr<mx::distributed::detail::GroupImpl> PairGroupImpl::split(int, int) {
  throw std::runtime_error(
      "mlx_ds4tp: a two-rank pair group cannot be split; use it whole (size 2)");
}

char* PairGroupImpl::scratch(size_t bytes) {
  if (scratch_.size() < bytes) scratch_.resize(bytes);
  return scratch_.data();
}

void PairGroupImpl::exchange(const tp_xsig& sig, const void* src, void* dst) {
  if (link_ == nullptr) {
    throw std::runtime_error(std::string("mlx_ds4tp ") + op_label(sig.op) +
                             ": this group is closed; create a new one with mlx_ds4tp.init(...)");
  }
  char err[512] = {0};
  const int rc = exchange_(link_, &sig, src, dst, err, sizeof(err));
  if (rc != 0) throw std::runtime_error(std::string("mlx_ds4tp: ") + err);
}

void PairGroupImpl::close() {
  // Wakes an exchange blocked on the peer, then waits for it to leave, so the
  // pair's sockets and device can be freed once this returns.
  if (link_ != nullptr) close_(link_);
  std::lock_guard<std::mutex> lock(mu_);
  link_ = nullptr;
}

void PairGroupImpl::attach(tp_link* link) {
  std::lock_guard<std::mutex> lock(mu_);
  if (link_ != nullptr) {
    throw std::runtime_error("mlx_ds4tp: the group is still open; close it before attaching a new link");
  }
  link_ = link;
}

void PairGroupImpl::reduce(int op, const mx::array& input, mx::array& output, mx::Stream stream) {
  const int code = checked_code(op, input);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  encoder.set_output_array(output);
  const char* in = input.data<char>();
  char* out = output.data<char>();
  const size_t n = input.size();
  const size_t bytes = input.nbytes();
  const tp_xsig sig = signature(op, code, input, bytes);
  encoder.dispatch([self = shared_from_this(), op, code, sig, in, out, n, bytes]() {
    std::lock_guard<std::mutex> lock(self->mu_);
    char* peer = self->scratch(bytes);
    try {
      self->exchange(sig, in, peer);
    } catch (...) {
      poison(code, out, bytes);
      throw;
    }
    const bool first = self->rank_ == 0;
    combine(op, code, self->sum2_, first ? in : peer, first ? peer : in, out, n);
  });
}

void PairGroupImpl::all_sum(const mx::array& input, mx::array& output, mx::Stream stream) {
  reduce(TP_XOP_SUM, input, output, stream);
}

void PairGroupImpl::all_max(const mx::array& input, mx::array& output, mx::Stream stream) {
  reduce(TP_XOP_MAX, input, output, stream);
}

void PairGroupImpl::all_min(const mx::array& input, mx::array& output, mx::Stream stream) {
  reduce(TP_XOP_MIN, input, output, stream);
}

void PairGroupImpl::all_gather(const mx::array& input, mx::array& output, mx::Stream stream) {
  const int code = checked_code(TP_XOP_GATHER, input);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  encoder.set_output_array(output);
  const char* in = input.data<char>();
  char* out = output.data<char>();
  const size_t bytes = input.nbytes();
  const tp_xsig sig = signature(TP_XOP_GATHER, code, input, bytes);
  encoder.dispatch([self = shared_from_this(), sig, in, out, bytes]() {
    std::lock_guard<std::mutex> lock(self->mu_);
    // The peer's rows land straight in their place in the output.
    try {
      self->exchange(sig, in, out + (1 - self->rank_) * bytes);
    } catch (...) {
      poison(sig.dtype, out, 2 * bytes);
      throw;
    }
    std::memcpy(out + self->rank_ * bytes, in, bytes);
  });
}

void PairGroupImpl::sum_scatter(const mx::array& input, mx::array& output, mx::Stream stream) {
  const int code = checked_code(TP_XOP_SCATTER, input);
  if (input.ndim() == 0 || input.shape(0) % 2 != 0) {
    throw std::invalid_argument(
        "mlx_ds4tp sum_scatter: the input's first dimension must be divisible by the group "
        "size 2");
  }
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  encoder.set_output_array(output);
  const char* in = input.data<char>();
  char* out = output.data<char>();
  const size_t half = input.nbytes() / 2;
  const size_t n = input.size() / 2;
  const tp_xsig sig = signature(TP_XOP_SCATTER, code, input, half);
  encoder.dispatch([self = shared_from_this(), code, sig, in, out, half, n]() {
    std::lock_guard<std::mutex> lock(self->mu_);
    // Half the bytes of an all_sum move: the rows the peer keeps go out, the
    // peer's partial of the rows this rank keeps comes back.
    const int r = self->rank_;
    const char* mine = in + r * half;
    char* peer = self->scratch(half);
    try {
      self->exchange(sig, in + (1 - r) * half, peer);
    } catch (...) {
      poison(code, out, half);
      throw;
    }
    combine(TP_XOP_SCATTER, code, self->sum2_, r == 0 ? mine : peer, r == 0 ? peer : mine, out, n);
  });
}

// send/recv: the transports move bytes both ways at once (an exchange), so the
// receiver sends filler of the same size and the sender drops what it gets.
void PairGroupImpl::send(const mx::array& input, int dst, mx::Stream stream) {
  if (dst != 1 - rank_) {
    throw std::invalid_argument("mlx_ds4tp send: dst=" + std::to_string(dst) + " but this rank (" +
                                std::to_string(rank_) + ") can only send to rank " +
                                std::to_string(1 - rank_));
  }
  const int code = checked_code(TP_XOP_P2P_FROM, input);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  const char* in = input.data<char>();
  const size_t bytes = input.nbytes();
  const tp_xsig sig = signature(TP_XOP_P2P_FROM + rank_, code, input, bytes);
  encoder.dispatch([self = shared_from_this(), sig, in, bytes]() {
    std::lock_guard<std::mutex> lock(self->mu_);
    self->exchange(sig, in, self->scratch(bytes));
  });
}

void PairGroupImpl::recv(mx::array& out, int src, mx::Stream stream) {
  if (src != 1 - rank_) {
    throw std::invalid_argument("mlx_ds4tp recv: src=" + std::to_string(src) + " but this rank (" +
                                std::to_string(rank_) + ") can only receive from rank " +
                                std::to_string(1 - rank_));
  }
  const int code = checked_code(TP_XOP_P2P_FROM, out);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_output_array(out);
  char* dst = out.data<char>();
  const size_t bytes = out.nbytes();
  const tp_xsig sig = signature(TP_XOP_P2P_FROM + src, code, out, bytes);
  encoder.dispatch([self = shared_from_this(), sig, dst, bytes]() {
    std::lock_guard<std::mutex> lock(self->mu_);
    char* filler = self->scratch(bytes);
    std::memset(filler, 0, bytes);
    try {
      self->exchange(sig, filler, dst);
    } catch (...) {
      poison(sig.dtype, dst, bytes);
      throw;
    }
  });
}

}  // namespace mlx_ds4tp

namespace mlx_ds4tp {

mx::Stream LocalGroupImpl::communication_stream(mx::StreamOrDevice s) {
  return cpu_communication_stream(s);
}

void LocalGroupImpl::refuse(const char* op) {
  if (gateless_) {
    throw std::runtime_error(std::string("mlx_ds4tp: ") + op +
                             " is not offered by a gateless group (it has all_sum, all_max, "
                             "all_min and all_gather only)");
  }
  throw std::runtime_error(std::string("mlx_ds4tp: ") + op + " on a group that only says who rank " +
                           std::to_string(rank_) + " of " + std::to_string(size_) +
                           " is (it can cut weights, not run them); pass the group from "
                           "mlx_ds4tp.init(...) or mx.distributed.init()");
}

void LocalGroupImpl::copy(const char* op, const mx::array& input, mx::array& output,
                          mx::Stream stream, int times) {
  if (!gateless_) refuse(op);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  encoder.set_output_array(output);
  const char* in = input.data<char>();
  char* out = output.data<char>();
  const size_t bytes = input.nbytes();
  encoder.dispatch([in, out, bytes, times]() {
    for (int i = 0; i < times; ++i) std::memcpy(out + i * bytes, in, bytes);
  });
}

}  // namespace mlx_ds4tp
