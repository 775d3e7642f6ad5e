// mlx_ds4tp's MLX distributed backend: one GroupImpl for 2 to 8 ranks over a
// mesh of links, one per pair of ranks (csrc/exchange.c's tp_mesh; a pair is a
// mesh of two), so mx.distributed's collectives, mlx.nn's sharded layers and
// mlx-lm's shard() run over two Macs or eight alike, as primitives in MLX's
// graph run at evaluation on the group's CPU stream with no interpreter on the
// path. split(color, key) makes subgroups over the same links. Every reduction
// combines the ranks' partials in rank order, so every rank holds the same bits.
// A mesh whose links form a ring (ring.cpp) runs every collective over the
// ring's links alone, to the same bits as the full mesh.
#pragma once

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "dtypes.h"
#include "mlx/distributed/distributed.h"
#include "mlx/distributed/distributed_impl.h"
#include "mlx/stream.h"

namespace mlx_ds4tp {

// The C module's entry points, handed over as addresses: _verbs is another
// shared object, loaded by Python with its symbols local to it.
using MeshExchangeFn = int (*)(tp_mesh*, const int*, int, int, const tp_xsig*, const void**,
                               void**, char*, size_t);
using MeshCloseFn = void (*)(tp_mesh*);

// What a group and its subgroups share: the C mesh, its entry points, and the
// lock that runs one collective at a time over its links.
struct MeshCore {
  tp_mesh* mesh;
  MeshExchangeFn exchange;
  Sum2Fn sum2;
  MeshCloseFn close;
  // The ring the collectives run over (mesh ranks in cycle order, each cabled to the
  // next and the last to the first); empty: every pair of ranks has its link.
  std::vector<int> ring;
  std::mutex mu;
  std::vector<char> scratch;
  // At least `bytes` of scratch, reused by every collective (they run one at a time, under mu).
  char* scratch_of(size_t bytes) {
    if (scratch.size() < bytes) scratch.resize(bytes);
    return scratch.data();
  }
  // The ring's bundles in flight (ring.cpp), apart: a collective's own scratch holds its
  // partials meanwhile.
  std::vector<char> bundles;
  char* bundles_of(size_t bytes) {
    if (bundles.size() < bytes) bundles.resize(bytes);
    return bundles.data();
  }
};

class LinkedGroupImpl : public mx::distributed::detail::GroupImpl,
                        public std::enable_shared_from_this<LinkedGroupImpl> {
 public:
  // members: the mesh ranks of this group in its rank order; me: this rank's place.
  // Over a ring, a group of 3 or more must hold the whole ring, a group of two a cable
  // of it (anything else has no way between its members): refused here.
  LinkedGroupImpl(std::shared_ptr<MeshCore> core, std::vector<int> members, int me);

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

  // Every collective of this group (subgroups included) fails from now on.
  void close();
  // Run this closed group's collectives (subgroups included) over a new mesh of the same
  // ranks (`ds4tp serve` taking a restarted rank back); refused while it is open.
  void attach(tp_mesh* mesh);

 private:
  // The arrays registered with the stream's encoder, then body(*this) dispatched on it,
  // run under the mesh's lock.
  template <typename Body>
  void dispatch(mx::Stream stream, const mx::array* input, mx::array* output, Body body);
  void reduce(int op, const mx::array& input, mx::array& output, mx::Stream stream);
  // The reduction itself, under the lock: two members swap partials straight into scratch;
  // more, small blocks go all to all, large ones reduce-scatter then all-gather.
  void reduce_now(int op, int code, const tp_xsig& sig, const char* in, char* out, size_t n);
  // reduce_now's two steps, over the full mesh or the ring's links alone (both leave every
  // partial to combine in rank order, so the two give the same bits): every member's block of
  // `block` bytes into base + k block (this member's already there); and the member k's chunk
  // of every member into got + k cb, from src's chunks.
  void gather_blocks(const tp_xsig& sig, char* base, size_t block);
  void scatter_chunks(const tp_xsig& part, const char* src, size_t cb, char* got);
  // One exchange among `members` (this rank at `me`): srcs[k] to member k, its block into dsts[k].
  void exchange(const int* members, int count, int me, const tp_xsig& sig, const void** srcs,
                void** dsts);
  // The two-member case: src to the other member, its block into dst.
  void swap_with_other(const tp_xsig& sig, const void* src, void* dst);
  // send/recv's exchange with one member: the two of them, in rank order.
  void exchange_with(int peer, const tp_xsig& sig, const void* src, void* dst);
  void check_peer(const char* op, const char* what, int peer) const;

  // ---- Over a ring (ring.cpp): only the links to the two neighbours carry bytes ----
  // The ring's order as this group's ranks (empty: the full mesh, or a group of two).
  static std::vector<int> ring_of(const MeshCore& core, const std::vector<int>& members, int me);
  bool on_ring() const { return !ring_.empty(); }
  int ring_member(int step) const;  // the member `step` places on from this one (negative: back)
  // One step: to_next to the next member and to_prev to the previous, both `sig.bytes`;
  // the previous one's into from_prev, the next one's into from_next.
  void ring_step(const tp_xsig& sig, const void* to_next, void* from_prev, const void* to_prev,
                 void* from_next);
  // Every member's block of b bytes into blocks + k b (this member's already there): each
  // block half-way round the ring each way.
  void ring_all_gather(const tp_xsig& sig, char* blocks, size_t b);
  // The member k's block of every member into got + k cb, from src's blocks (block k of
  // src for member k; this member's own block copied): each block the short way round.
  void ring_scatter(const tp_xsig& sig, const char* src, size_t cb, char* got);
  // Refuses send/recv with a member that is no neighbour on the ring.
  void check_neighbour(const char* op, const char* what, int peer) const;

  std::shared_ptr<MeshCore> core_;
  const std::vector<int> members_;
  const int me_;
  const std::vector<int> ring_;  // members' places in cycle order (indices into members_)
  int pos_ = 0;                  // this member's place in ring_
};

// What Python holds: an mlx.core.distributed.Group whose implementation is ours.
struct LinkedGroup : public mx::distributed::Group {
  explicit LinkedGroup(std::shared_ptr<LinkedGroupImpl> impl)
      : mx::distributed::Group(impl), impl_(std::move(impl)) {}
  std::shared_ptr<LinkedGroupImpl> impl_;
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
//   runs exactly its part of every matmul and meets no one.
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

// Every dtype the collectives take, with its code, in code order.
std::vector<std::pair<mx::Dtype, int>> dtype_codes();

// out = ((p[0] op p[1]) op p[2]) ...: the `count` partials (each `bytes`, n items) in rank
// order, intermediate sums in acc (2 bytes); group.cpp's.
void combine_all(int op, int code, Sum2Fn sum2, const char* parts, int count, size_t bytes,
                 size_t n, char* acc, char* out);

}  // namespace mlx_ds4tp
