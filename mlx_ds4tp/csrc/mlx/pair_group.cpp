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

using namespace dtypes;


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
