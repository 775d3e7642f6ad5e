// The N-rank GroupImpl over a mesh of links (mesh_group.h). Each collective is
// dispatched on the group's CPU stream; under the mesh's lock it moves blocks
// between the ranks through the C module's tp_mesh_exchange and combines the
// partials in rank order, ((r0 + r1) + r2) + r3, so every rank computes the same
// expression and holds the same bits, whatever the message size:
//  - up to TP_MESH_SMALL_BYTES every rank sends its whole buffer to every peer
//    and reduces all N itself (one round trip: a decode gate's case);
//  - larger, a reduce-scatter (rank k reduces the k-th of N chunks) then an
//    all-gather of the reduced chunks: each rank moves 2 (N-1)/N of the bytes
//    instead of N-1 times them.

#include "mesh_group.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "mlx/backend/cpu/encoder.h"
#include "pair_group.h"

namespace mlx_ds4tp {

using namespace dtypes;

namespace {

// out = ((p[0] op p[1]) op p[2]) ...: the N partials (each `bytes`, n items) in rank
// order; intermediate sums ping-pong between acc and acc + bytes (the C sum
// takes no overlapping buffers), the last lands in out.
void combine_all(int op, int code, Sum2Fn sum2, const char* parts, int count, size_t bytes,
                 size_t n, char* acc, char* out) {
  if (count == 1) {
    if (out != parts) std::memcpy(out, parts, bytes);
    return;
  }
  const char* left = parts;
  for (int k = 1; k < count; k++) {
    char* dest = k == count - 1 ? out : acc + (k % 2) * bytes;
    combine(op, code, sum2, left, parts + k * bytes, dest, n);
    left = dest;
  }
}

}  // namespace

MeshGroupImpl::MeshGroupImpl(std::shared_ptr<MeshCore> core, std::vector<int> members, int me)
    : core_(std::move(core)), members_(std::move(members)), me_(me) {}

mx::Stream MeshGroupImpl::communication_stream(mx::StreamOrDevice s) {
  return cpu_communication_stream(s);
}

void MeshGroupImpl::exchange(const std::vector<int>& members, int me, const tp_xsig& sig,
                             std::vector<const void*>& srcs, std::vector<void*>& dsts) {
  if (core_->mesh == nullptr) {
    throw std::runtime_error(std::string("mlx_ds4tp ") + op_label(sig.op) +
                             ": this group is closed; create a new one with mlx_ds4tp.init(...)");
  }
  if (members.size() < 2) return;
  char err[512] = {0};
  const int rc = core_->exchange(core_->mesh, members.data(), static_cast<int>(members.size()), me,
                                 &sig, srcs.data(), dsts.data(), err, sizeof(err));
  if (rc != 0) throw std::runtime_error(std::string("mlx_ds4tp: ") + err);
}

void MeshGroupImpl::close() {
  // Wakes an exchange blocked on a peer, then waits for it to leave, so the
  // links' sockets and devices can be freed once this returns.
  if (core_->mesh != nullptr) core_->close(core_->mesh);
  std::lock_guard<std::mutex> lock(core_->mu);
  core_->mesh = nullptr;
}

void MeshGroupImpl::attach(tp_mesh* mesh) {
  std::lock_guard<std::mutex> lock(core_->mu);
  if (core_->mesh != nullptr) throw std::runtime_error("mlx_ds4tp: this mesh is still open; close it first");
  if (mesh == nullptr || mesh->rank != members_[me_] || mesh->size < size()) {
    throw std::invalid_argument("mlx_ds4tp: the new mesh must keep this rank and the ranks");
  }
  core_->mesh = mesh;
}

std::shared_ptr<mx::distributed::detail::GroupImpl> MeshGroupImpl::split(int color, int key) {
  // Every rank learns every rank's (color, key): a blocking all-gather now, as
  // MLX's split is called outside any graph.
  const int n = size();
  std::vector<int32_t> all(2 * static_cast<size_t>(n));
  const int32_t mine[2] = {color, key < 0 ? me_ : key};
  tp_xsig sig{};
  sig.op = TP_XOP_GATHER;
  sig.dtype = TP_DTYPE_INT32;
  sig.bytes = sizeof(mine);
  sig.ndim = 1;
  sig.shape[0] = 2;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    std::vector<const void*> srcs(n, mine);
    std::vector<void*> dsts(n);
    for (int k = 0; k < n; k++) dsts[k] = all.data() + 2 * k;
    exchange(members_, me_, sig, srcs, dsts);
    std::memcpy(all.data() + 2 * me_, mine, sizeof(mine));
  }
  // The new group: the ranks of this color, ordered by key, then by rank.
  std::vector<std::pair<int32_t, int>> order;
  for (int k = 0; k < n; k++)
    if (all[2 * k] == color) order.emplace_back(all[2 * k + 1], k);
  std::sort(order.begin(), order.end());
  std::vector<int> members;
  int me = -1;
  for (const auto& [k_key, k] : order) {
    if (k == me_) me = static_cast<int>(members.size());
    members.push_back(members_[k]);
  }
  return std::make_shared<MeshGroupImpl>(core_, std::move(members), me);
}

void MeshGroupImpl::reduce_now(int op, int code, const tp_xsig& sig, const char* in, char* out,
                               size_t n) {
  const int count = size();
  const size_t bytes = sig.bytes;
  if (n == 0) return;
  const size_t item = bytes / n;
  std::vector<const void*> srcs(count);
  std::vector<void*> dsts(count);
  auto& scratch = core_->scratch;
  if (bytes <= TP_MESH_SMALL_BYTES || count <= 2) {
    // [the N partials][two accumulators]
    scratch.resize(std::max(scratch.size(), (count + 2) * bytes));
    char* parts = scratch.data();
    std::memcpy(parts + me_ * bytes, in, bytes);
    for (int k = 0; k < count; k++) {
      srcs[k] = in;
      dsts[k] = parts + k * bytes;
    }
    exchange(members_, me_, sig, srcs, dsts);
    combine_all(op, code, core_->sum2, parts, count, bytes, n, parts + count * bytes, out);
    return;
  }
  // Reduce-scatter then all-gather over N chunks of c items (the last padded).
  const size_t c = (n + count - 1) / count;
  const size_t cb = c * item;
  const bool padded = n % count != 0;
  // [padded input / gathered chunks: N cb][received chunks: N cb][reduced: cb][two accumulators]
  scratch.resize(std::max(scratch.size(), (2 * count + 3) * cb));
  char* whole = scratch.data();
  char* got = whole + count * cb;
  char* reduced = got + count * cb;
  char* acc = reduced + cb;
  const char* src = in;
  if (padded) {
    std::memcpy(whole, in, bytes);
    std::memset(whole + bytes, 0, count * cb - bytes);
    src = whole;
  }
  tp_xsig part = sig;
  part.bytes = cb;
  std::memcpy(got + me_ * cb, src + me_ * cb, cb);
  for (int k = 0; k < count; k++) {
    srcs[k] = src + k * cb;
    dsts[k] = got + k * cb;
  }
  exchange(members_, me_, part, srcs, dsts);
  combine_all(op, code, core_->sum2, got, count, cb, c, acc, reduced);
  // The input is no longer read: the gathered chunks may land in out (its
  // buffer may be the input's, donated) or, padded, in the staging copy.
  char* gathered = padded ? whole : out;
  std::memcpy(gathered + me_ * cb, reduced, cb);
  for (int k = 0; k < count; k++) {
    srcs[k] = reduced;
    dsts[k] = gathered + k * cb;
  }
  exchange(members_, me_, part, srcs, dsts);
  if (padded) std::memcpy(out, gathered, bytes);
}

void MeshGroupImpl::reduce(int op, const mx::array& input, mx::array& output, mx::Stream stream) {
  const int code = checked_code(op, input);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  encoder.set_output_array(output);
  const char* in = input.data<char>();
  char* out = output.data<char>();
  const size_t n = input.size();
  const tp_xsig sig = signature(op, code, input, input.nbytes());
  encoder.dispatch([self = shared_from_this(), op, code, sig, in, out, n]() {
    std::lock_guard<std::mutex> lock(self->core_->mu);
    try {
      self->reduce_now(op, code, sig, in, out, n);
    } catch (...) {
      poison(code, out, sig.bytes);
      throw;
    }
  });
}

void MeshGroupImpl::all_sum(const mx::array& input, mx::array& output, mx::Stream stream) {
  reduce(TP_XOP_SUM, input, output, stream);
}

void MeshGroupImpl::all_max(const mx::array& input, mx::array& output, mx::Stream stream) {
  reduce(TP_XOP_MAX, input, output, stream);
}

void MeshGroupImpl::all_min(const mx::array& input, mx::array& output, mx::Stream stream) {
  reduce(TP_XOP_MIN, input, output, stream);
}

void MeshGroupImpl::all_gather(const mx::array& input, mx::array& output, mx::Stream stream) {
  const int code = checked_code(TP_XOP_GATHER, input);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  encoder.set_output_array(output);
  const char* in = input.data<char>();
  char* out = output.data<char>();
  const size_t bytes = input.nbytes();
  const tp_xsig sig = signature(TP_XOP_GATHER, code, input, bytes);
  encoder.dispatch([self = shared_from_this(), sig, in, out, bytes]() {
    std::lock_guard<std::mutex> lock(self->core_->mu);
    const int count = self->size();
    // Every peer's rows land straight in their place in the output.
    std::vector<const void*> srcs(count, in);
    std::vector<void*> dsts(count);
    for (int k = 0; k < count; k++) dsts[k] = out + k * bytes;
    try {
      self->exchange(self->members_, self->me_, sig, srcs, dsts);
    } catch (...) {
      poison(sig.dtype, out, count * bytes);
      throw;
    }
    std::memcpy(out + self->me_ * bytes, in, bytes);
  });
}

void MeshGroupImpl::sum_scatter(const mx::array& input, mx::array& output, mx::Stream stream) {
  const int code = checked_code(TP_XOP_SCATTER, input);
  const int count = size();
  if (input.ndim() == 0 || input.shape(0) % count != 0) {
    throw std::invalid_argument(
        "mlx_ds4tp sum_scatter: the input's first dimension must be divisible by the group "
        "size " + std::to_string(count));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  encoder.set_output_array(output);
  const char* in = input.data<char>();
  char* out = output.data<char>();
  const size_t chunk = input.nbytes() / count;
  const size_t n = input.size() / count;
  const tp_xsig sig = signature(TP_XOP_SCATTER, code, input, chunk);
  encoder.dispatch([self = shared_from_this(), code, sig, in, out, chunk, n, count]() {
    std::lock_guard<std::mutex> lock(self->core_->mu);
    // Rank k keeps rows k: the rows each peer keeps go out, each peer's partial
    // of this rank's rows comes back, and the N are combined in rank order.
    auto& scratch = self->core_->scratch;
    scratch.resize(std::max(scratch.size(), (count + 2) * chunk));
    char* parts = scratch.data();
    const int me = self->me_;
    std::memcpy(parts + me * chunk, in + me * chunk, chunk);
    std::vector<const void*> srcs(count);
    std::vector<void*> dsts(count);
    for (int k = 0; k < count; k++) {
      srcs[k] = in + k * chunk;
      dsts[k] = parts + k * chunk;
    }
    try {
      self->exchange(self->members_, me, sig, srcs, dsts);
    } catch (...) {
      poison(code, out, chunk);
      throw;
    }
    combine_all(TP_XOP_SCATTER, code, self->core_->sum2, parts, count, chunk, n,
                parts + count * chunk, out);
  });
}

void MeshGroupImpl::check_peer(const char* op, const char* what, int peer) const {
  const int count = static_cast<int>(members_.size());
  if (peer < 0 || peer >= count || peer == me_) {
    throw std::invalid_argument(std::string("mlx_ds4tp ") + op + ": " + what + "=" +
                                std::to_string(peer) + " but this is rank " + std::to_string(me_) +
                                " of a group of " + std::to_string(count) +
                                "; give another rank, 0 .. " + std::to_string(count - 1));
  }
}

// send/recv: the links move bytes both ways at once (an exchange), so the
// receiver sends filler of the same size and the sender drops what it gets.
void MeshGroupImpl::send(const mx::array& input, int dst, mx::Stream stream) {
  check_peer("send", "dst", dst);
  const int code = checked_code(TP_XOP_P2P_FROM, input);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(input);
  const char* in = input.data<char>();
  const size_t bytes = input.nbytes();
  const tp_xsig sig = signature(TP_XOP_P2P_FROM + me_, code, input, bytes);
  encoder.dispatch([self = shared_from_this(), sig, in, bytes, dst]() {
    std::lock_guard<std::mutex> lock(self->core_->mu);
    const int me = self->me_;
    const std::vector<int> two = {self->members_[std::min(me, dst)], self->members_[std::max(me, dst)]};
    const int at = me < dst ? 0 : 1;
    self->core_->scratch.resize(std::max(self->core_->scratch.size(), bytes));
    std::vector<const void*> srcs(2, in);
    std::vector<void*> dsts(2, self->core_->scratch.data());
    self->exchange(two, at, sig, srcs, dsts);
  });
}

void MeshGroupImpl::recv(mx::array& out, int src, mx::Stream stream) {
  check_peer("recv", "src", src);
  const int code = checked_code(TP_XOP_P2P_FROM, out);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_output_array(out);
  char* dst = out.data<char>();
  const size_t bytes = out.nbytes();
  const tp_xsig sig = signature(TP_XOP_P2P_FROM + src, code, out, bytes);
  encoder.dispatch([self = shared_from_this(), sig, dst, bytes, src]() {
    std::lock_guard<std::mutex> lock(self->core_->mu);
    const int me = self->me_;
    const std::vector<int> two = {self->members_[std::min(me, src)], self->members_[std::max(me, src)]};
    const int at = me < src ? 0 : 1;
    auto& scratch = self->core_->scratch;
    scratch.resize(std::max(scratch.size(), bytes));
    std::memset(scratch.data(), 0, bytes);
    std::vector<const void*> srcs(2, scratch.data());
    std::vector<void*> dsts(2, dst);
    try {
      self->exchange(two, at, sig, srcs, dsts);
    } catch (...) {
      poison(sig.dtype, dst, bytes);
      throw;
    }
  });
}

}  // namespace mlx_ds4tp
