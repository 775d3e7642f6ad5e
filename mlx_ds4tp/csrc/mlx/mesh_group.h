// mlx_ds4tp's MLX backend for N ranks: a GroupImpl over a mesh of links, one
// per pair of ranks (csrc/exchange.c's tp_mesh), so mx.distributed's
// collectives, mlx.nn's sharded layers and mlx-lm's shard() run over three or
// four Macs as over a pair. split(color, key) makes subgroups over the same
// links. Every reduction combines the ranks' partials in rank order, so every
// rank holds the same bits.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "dtypes.h"
#include "mlx/distributed/distributed.h"
#include "mlx/distributed/distributed_impl.h"
#include "mlx/stream.h"

namespace mlx_ds4tp {

using MeshExchangeFn = int (*)(tp_mesh*, const int*, int, int, const tp_xsig*, const void**,
                               void**, char*, size_t);
using MeshCloseFn = void (*)(tp_mesh*);

// What a mesh's group and its subgroups share: the C mesh, its entry points, and
// the lock that runs one collective at a time over its links.
struct MeshCore {
  tp_mesh* mesh;
  MeshExchangeFn exchange;
  Sum2Fn sum2;
  MeshCloseFn close;
  std::mutex mu;
  std::vector<char> scratch;
};

class MeshGroupImpl : public mx::distributed::detail::GroupImpl,
                      public std::enable_shared_from_this<MeshGroupImpl> {
 public:
  // members: the mesh ranks of this group in its rank order; me: this rank's place.
  MeshGroupImpl(std::shared_ptr<MeshCore> core, std::vector<int> members, int me);

  mx::Stream communication_stream(mx::StreamOrDevice s = {}) override;
  int rank() override { return me_; }
  int size() override { return static_cast<int>(members_.size()); }
  std::shared_ptr<GroupImpl> split(int color, int key = -1) override;

  void all_sum(const mx::array& input, mx::array& output, mx::Stream stream) override;
  void all_gather(const mx::array& input, mx::array& output, mx::Stream stream) override;
  void send(const mx::array& input, int dst, mx::Stream stream) override;
  void recv(mx::array& out, int src, mx::Stream stream) override;
  void all_max(const mx::array& input, mx::array& output, mx::Stream stream) override;
  void all_min(const mx::array& input, mx::array& output, mx::Stream stream) override;
  void sum_scatter(const mx::array& input, mx::array& output, mx::Stream stream) override;

  // Every collective of this mesh (subgroups included) fails from now on.
  void close();
  // Run this closed mesh's collectives (subgroups included) over a new mesh of the same
  // ranks (`ds4tp serve` taking a restarted rank back); refused while it is open.
  void attach(tp_mesh* mesh);

 private:
  void reduce(int op, const mx::array& input, mx::array& output, mx::Stream stream);
  // The reduction itself, under the lock: small blocks all to all, large ones
  // reduce-scatter then all-gather; both combine in rank order.
  void reduce_now(int op, int code, const tp_xsig& sig, const char* in, char* out, size_t n);
  // One exchange among `members` (this rank at `me`): srcs[k] to member k, its block into dsts[k].
  void exchange(const std::vector<int>& members, int me, const tp_xsig& sig,
                std::vector<const void*>& srcs, std::vector<void*>& dsts);
  void check_peer(const char* op, const char* what, int peer) const;

  std::shared_ptr<MeshCore> core_;
  const std::vector<int> members_;
  const int me_;
};

// What Python holds: an mlx.core.distributed.Group whose implementation is a mesh's.
struct MeshGroup : public mx::distributed::Group {
  explicit MeshGroup(std::shared_ptr<MeshGroupImpl> impl)
      : mx::distributed::Group(impl), impl_(std::move(impl)) {}
  std::shared_ptr<MeshGroupImpl> impl_;
};

}  // namespace mlx_ds4tp
