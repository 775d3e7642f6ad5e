// The two-rank GroupImpl: each collective is dispatched on the group's CPU
// stream, exchanges the partials through the C module (csrc/exchange.c) and
// combines them in rank order, so both ranks compute the same expression and
// hold the same bits.

#include "pair_group.h"

#include <cmath>
#include <complex>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include "mlx/backend/cpu/encoder.h"

namespace mlx_ds4tp {

namespace {

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
  if ((op == TP_XOP_SUM || op == TP_XOP_SCATTER) && code >= TP_SUM_F32 && code <= TP_SUM_BF16) {
    sum2(code, first, second, out, n);
    return;
  }
  switch (code) {
    case 1: return combine_as<float>(op, first, second, out, n);
    case 2: return combine_as<mx::float16_t>(op, first, second, out, n);
    case 3: return combine_as<mx::bfloat16_t>(op, first, second, out, n);
    case 4: return combine_as<bool>(op, first, second, out, n);
    case 5: return combine_as<int8_t>(op, first, second, out, n);
    case 6: return combine_as<int16_t>(op, first, second, out, n);
    case 7: return combine_as<int32_t>(op, first, second, out, n);
    case 8: return combine_as<int64_t>(op, first, second, out, n);
    case 9: return combine_as<uint8_t>(op, first, second, out, n);
    case 10: return combine_as<uint16_t>(op, first, second, out, n);
    case 11: return combine_as<uint32_t>(op, first, second, out, n);
    case 12: return combine_as<uint64_t>(op, first, second, out, n);
    case 13: return combine_as<double>(op, first, second, out, n);
    case 14: return combine_as<mx::complex64_t>(op, first, second, out, n);
    default: throw std::invalid_argument("mlx_ds4tp: no combine for dtype code " + std::to_string(code));
  }
}

// A failed collective's output is filled with NaN where its dtype has one, so that even a
// reader that never sees the error (numpy's np.array() swallows the first evaluation error
// of an MLX array and reads it through another protocol, and MLX reports an evaluation's
// error once) gets no plausible sum.
void poison(int code, void* out, size_t bytes) {
  switch (code) {
    case 1: case 14: {  // float32, complex64 (two float32 each)
      const uint32_t nan = 0x7FC00000u;
      for (size_t i = 0; i + 4 <= bytes; i += 4) std::memcpy(static_cast<char*>(out) + i, &nan, 4);
      return;
    }
    case 2: case 3: {  // float16, bfloat16
      const uint16_t nan = code == 2 ? 0x7E00u : 0x7FC0u;
      for (size_t i = 0; i + 2 <= bytes; i += 2) std::memcpy(static_cast<char*>(out) + i, &nan, 2);
      return;
    }
    case 13: {
      const uint64_t nan = 0x7FF8000000000000ull;
      for (size_t i = 0; i + 8 <= bytes; i += 8) std::memcpy(static_cast<char*>(out) + i, &nan, 8);
      return;
    }
    default:
      return;  // integers and bools have no NaN: the error is all there is
  }
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
        << " is not supported by the pair's collectives; use float32, float16, bfloat16, "
           "bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float64 or "
           "complex64";
    throw std::invalid_argument(msg.str());
  }
  return code;
}

}  // namespace

int dtype_code(mx::Dtype dtype) {
  switch (dtype.val()) {
    case mx::Dtype::Val::float32: return 1;
    case mx::Dtype::Val::float16: return 2;
    case mx::Dtype::Val::bfloat16: return 3;
    case mx::Dtype::Val::bool_: return 4;
    case mx::Dtype::Val::int8: return 5;
    case mx::Dtype::Val::int16: return 6;
    case mx::Dtype::Val::int32: return 7;
    case mx::Dtype::Val::int64: return 8;
    case mx::Dtype::Val::uint8: return 9;
    case mx::Dtype::Val::uint16: return 10;
    case mx::Dtype::Val::uint32: return 11;
    case mx::Dtype::Val::uint64: return 12;
    case mx::Dtype::Val::float64: return 13;
    case mx::Dtype::Val::complex64: return 14;
    default: return 0;
  }
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
