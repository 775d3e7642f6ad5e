// mlx_ds4tp's MLX distributed backend: a two-rank GroupImpl over the pair's
// exchange (csrc/exchange.c), so mx.distributed.all_sum(x, group=g) and every
// other collective are primitives in MLX's graph, run at evaluation on the
// group's CPU stream with no interpreter on the path.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/distributed/distributed.h"
#include "mlx/distributed/distributed_impl.h"
#include "mlx/stream.h"

#include "dtypes.h"

namespace mlx_ds4tp {

namespace mx = mlx::core;

// The C module's entry points, handed over as addresses: _verbs is another
// shared object, loaded by Python with its symbols local to it.
using ExchangeFn = int (*)(tp_link*, const tp_xsig*, const void*, void*, char*, size_t);
using CloseFn = void (*)(tp_link*);

class PairGroupImpl : public mx::distributed::detail::GroupImpl,
                      public std::enable_shared_from_this<PairGroupImpl> {
 public:
  PairGroupImpl(int rank, tp_link* link, ExchangeFn exchange, Sum2Fn sum2, CloseFn close);

  mx::Stream communication_stream(mx::StreamOrDevice s = {}) override;
  int rank() override { return rank_; }
  int size() override { return 2; }
  std::shared_ptr<GroupImpl> split(int color, int key = -1) override;

  void all_sum(const mx::array& input, mx::array& output, mx::Stream stream) override;
  void all_gather(const mx::array& input, mx::array& output, mx::Stream stream) override;
  void send(const mx::array& input, int dst, mx::Stream stream) override;
  void recv(mx::array& out, int src, mx::Stream stream) override;
  void all_max(const mx::array& input, mx::array& output, mx::Stream stream) override;
  void all_min(const mx::array& input, mx::array& output, mx::Stream stream) override;
  void sum_scatter(const mx::array& input, mx::array& output, mx::Stream stream) override;

  // After close() every collective fails at evaluation, saying the group is closed.
  void close();
  // A closed group over a new link (the same peer's rank come back): the model
  // code that holds this group, its sharded layers, works on unchanged.
  void attach(tp_link* link);

 private:
  void reduce(int op, const mx::array& input, mx::array& output, mx::Stream stream);
  // One exchange: this rank's bytes out, the peer's in; throws naming what failed.
  void exchange(const tp_xsig& sig, const void* src, void* dst);
  // The peer's partial lands here: one buffer reused by every collective (they
  // run one at a time, under mu_).
  char* scratch(size_t bytes);

  const int rank_;
  tp_link* link_;
  const ExchangeFn exchange_;
  const Sum2Fn sum2_;
  const CloseFn close_;
  std::mutex mu_;
  std::vector<char> scratch_;
};

// What Python holds: an mlx.core.distributed.Group whose implementation is ours.
struct PairGroup : public mx::distributed::Group {
  explicit PairGroup(std::shared_ptr<PairGroupImpl> impl)
      : mx::distributed::Group(impl), impl_(std::move(impl)) {}
  std::shared_ptr<PairGroupImpl> impl_;
};

// Another group's implementation (MLX's own backends) under a type of ours.
struct SharedGroup : public mx::distributed::Group {
  explicit SharedGroup(const mx::distributed::Group& group)
      : mx::distributed::Group(group.raw_group()) {}
};

// A group of `size` ranks with no link between them, for code that needs an
// mx.distributed.Group but no peer:
// - cut only (gateless=false): enough to cut a model's weights (mlx-lm's shard()
//   asks only rank() and size()), never to run one; every collective fails at
//   evaluation saying so, rather than summing nothing.
// - gateless (true): all_sum and all_max/all_min hand this rank's input back,
//   all_gather repeats it once per rank. The compute ceiling's group: each rank
//   runs exactly its half of every matmul and meets no one.
class LocalGroupImpl : public mx::distributed::detail::GroupImpl {
 public:
  LocalGroupImpl(int rank, int size, bool gateless)
      : rank_(rank), size_(size), gateless_(gateless) {}
  mx::Stream communication_stream(mx::StreamOrDevice s = {}) override;
  int rank() override { return rank_; }
  int size() override { return size_; }
  std::shared_ptr<GroupImpl> split(int, int = -1) override { refuse("split"); }
  void all_sum(const mx::array& in, mx::array& out, mx::Stream s) override { copy("all_sum", in, out, s, 1); }
  void all_gather(const mx::array& in, mx::array& out, mx::Stream s) override {
    copy("all_gather", in, out, s, size_);
  }
  void send(const mx::array&, int, mx::Stream) override { refuse("send"); }
  void recv(mx::array&, int, mx::Stream) override { refuse("recv"); }
  void all_max(const mx::array& in, mx::array& out, mx::Stream s) override { copy("all_max", in, out, s, 1); }
  void all_min(const mx::array& in, mx::array& out, mx::Stream s) override { copy("all_min", in, out, s, 1); }
  void sum_scatter(const mx::array&, mx::array&, mx::Stream) override { refuse("sum_scatter"); }

 private:
  [[noreturn]] void refuse(const char* op);
  // `times` copies of the input, one after the other, into the output.
  void copy(const char* op, const mx::array& in, mx::array& out, mx::Stream stream, int times);
  const int rank_, size_;
  const bool gateless_;
};

struct LocalGroup : public mx::distributed::Group {
  LocalGroup(int rank, int size, bool gateless)
      : mx::distributed::Group(std::make_shared<LocalGroupImpl>(rank, size, gateless)) {}
};

// The CPU stream a collective runs on: the one named, else the thread's default.
mx::Stream cpu_communication_stream(mx::StreamOrDevice s);

// Every dtype the collectives take, with its code, in code order.
std::vector<std::pair<mx::Dtype, int>> dtype_codes();

}  // namespace mlx_ds4tp
