// The group's collectives over a ring (group.h): when the links form one cycle
// (Mac minis have three Thunderbolt ports, so five to eight of them can only
// be cabled so), each member exchanges with its two neighbours only, and the
// links between the others carry nothing.
//
// The sums are the full mesh's to the bit: the partials of every item still
// meet in one place and combine in rank order, ((r0 + r1) + r2) + r3, only
// they get there over the cables. (A ring reduce-scatter that adds as it goes
// would start each chunk's sum at another rank, so the ranks' bits would
// agree with each other but not with the mesh, nor with a pair.)
//  - up to TP_MESH_SMALL_BYTES (a decode gate): every partial goes half-way
//    round each way (N/2 steps, every one the same size), then each member
//    combines all N;
//  - larger: each member's chunk k goes the short way round to member k
//    (forwarded, not added, on the way), which combines the N of them; then
//    the reduced chunks go half-way round each way as above.
// Every step is one exchange with each neighbour, both directions of each
// cable busy; the cables are met in an order (a colouring of the cycle: even
// cables, odd ones, the closing one of an odd ring last) that every member
// follows, so two neighbours always find each other.

#include <cstring>
#include <stdexcept>
#include <string>

#include "group.h"

namespace mlx_ds4tp {

namespace {

// "0-1-2-3": a ring of ranks as the errors name it.
std::string ring_text(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : "-") + std::to_string(r);
  return text;
}

int place_of(const std::vector<int>& ring, int rank) {
  for (size_t k = 0; k < ring.size(); k++)
    if (ring[k] == rank) return static_cast<int>(k);
  return -1;
}

}  // namespace

std::vector<int> LinkedGroupImpl::ring_of(const MeshCore& core, const std::vector<int>& members,
                                          int me) {
  const std::vector<int>& ring = core.ring;
  const int count = static_cast<int>(members.size());
  if (ring.empty() || count < 2) return {};
  const int places = static_cast<int>(ring.size());
  std::vector<int> order;
  if (count == 2) {
    const int a = place_of(ring, members[0]), b = place_of(ring, members[1]);
    const int apart = ((a - b) % places + places) % places;
    if (a >= 0 && b >= 0 && (apart == 1 || apart == places - 1)) return {};
  } else if (count == places) {
    for (int rank : ring) {
      for (int k = 0; k < count; k++)
        if (members[k] == rank) order.push_back(k);
    }
    if (static_cast<int>(order.size()) == count) return order;
  }
  std::string ranks;
  for (int r : members) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  throw std::invalid_argument(
      "mlx_ds4tp split: over the ring " + ring_text(ring) + " a group of mesh ranks " + ranks +
      " (this one rank " + std::to_string(members[me]) + ") has no way between its members "
      "but through ranks outside it; a subgroup over a ring holds every rank, or two "
      "neighbours");
}

int LinkedGroupImpl::ring_member(int step) const {
  const int n = static_cast<int>(ring_.size());
  return ring_[((pos_ + step) % n + n) % n];
}

void LinkedGroupImpl::ring_step(const tp_xsig& sig, const void* to_next, void* from_prev,
                                const void* to_prev, void* from_next) {
  const int n = size();
  // Cable q joins places q and q + 1: even cables first, then odd ones, the one closing
  // an odd ring last. A member's two cables always differ in colour, so every member
  // meets its neighbours in an order that never waits in a circle.
  auto colour = [n](int cable) { return n % 2 == 1 && cable == n - 1 ? 2 : cable % 2; };
  const bool next_first = colour(pos_) < colour((pos_ + n - 1) % n);
  // tp_mesh_exchange's tournament among three, this member at 0, meets member 2 and then 1.
  const int first = ring_member(next_first ? 1 : -1), second = ring_member(next_first ? -1 : 1);
  const int trio[3] = {members_[me_], members_[second], members_[first]};
  const void* srcs[3] = {nullptr, next_first ? to_prev : to_next, next_first ? to_next : to_prev};
  void* dsts[3] = {nullptr, next_first ? from_prev : from_next, next_first ? from_next : from_prev};
  exchange(trio, 3, 0, sig, srcs, dsts);
}

void LinkedGroupImpl::ring_all_gather(const tp_xsig& sig, char* blocks, size_t b) {
  if (b == 0) return;
  const int n = size();
  tp_xsig step = sig;
  step.bytes = b;
  // Step s: on goes what came in the step before (this member's own at first), from
  // s - 1 places behind forwards and from s - 1 ahead backwards.
  for (int s = 1; s <= (n - 1) / 2; s++) {
    ring_step(step, blocks + ring_member(1 - s) * b, blocks + ring_member(-s) * b,
              blocks + ring_member(s - 1) * b, blocks + ring_member(s) * b);
  }
  if (n % 2 == 0) {
    // The member opposite is as far either way: the first half of its block comes from
    // behind, the last from ahead (an odd b: the middle byte both ways, the same). A gate's
    // block comes whole both ways instead: a gate of another size would cost an RDMA link
    // its armed window and a header swap, more than the bytes saved.
    const int s = n / 2;
    const size_t h = b <= TP_GATE_BYTES ? b : (b + 1) / 2;
    step.bytes = h;
    ring_step(step, blocks + ring_member(1 - s) * b, blocks + ring_member(-s) * b,
              blocks + ring_member(s - 1) * b + (b - h), blocks + ring_member(s) * b + (b - h));
  }
}

void LinkedGroupImpl::ring_scatter(const tp_xsig& sig, const char* src, size_t cb, char* got) {
  std::memcpy(got + me_ * cb, src + me_ * cb, cb);
  if (cb == 0) return;
  const int n = size();
  const int full = (n - 1) / 2;  // whole blocks each way; an even ring halves the opposite one's
  const bool halves = n % 2 == 0;
  const size_t h = (cb + 1) / 2;
  // A bundle: the blocks of one origin still on their way, nearest destination first.
  size_t bundle = full * cb + (halves ? h : 0);
  const int steps = full + (halves ? 1 : 0);
  // Three members: each bundle is one block, sent from src and received in place.
  const bool staged = bundle > cb;
  const char* fwd_stage = src + ring_member(1) * cb;
  const char* back_stage = src + ring_member(-1) * cb;
  char* fwd_in[2] = {nullptr, nullptr};
  char* back_in[2] = {nullptr, nullptr};
  if (staged) {
    // [forwards: staged, in (two)][backwards: staged, in (two)]
    char* buf = core_->bundles_of(6 * bundle);
    fwd_in[0] = buf + bundle;
    fwd_in[1] = buf + 2 * bundle;
    back_in[0] = buf + 4 * bundle;
    back_in[1] = buf + 5 * bundle;
    for (int d = 1; d <= full; d++) {
      std::memcpy(buf + (d - 1) * cb, src + ring_member(d) * cb, cb);
      std::memcpy(buf + 3 * bundle + (d - 1) * cb, src + ring_member(-d) * cb, cb);
    }
    if (halves) {
      const char* opposite = src + ring_member(n / 2) * cb;
      std::memcpy(buf + full * cb, opposite, h);
      std::memcpy(buf + 3 * bundle + full * cb, opposite + (cb - h), h);
    }
    fwd_stage = buf;
    back_stage = buf + 3 * bundle;
  }
  for (int s = 1; s <= steps; s++) {
    // The last bundle is this member's block alone (an even ring: its half): it lands in place.
    const bool last = s == steps;
    const size_t back_at = s > full ? cb - h : 0;
    tp_xsig step = sig;
    step.bytes = bundle;
    ring_step(step, s == 1 ? fwd_stage : fwd_in[(s - 1) % 2] + cb,
              last ? got + ring_member(-s) * cb : fwd_in[s % 2],
              s == 1 ? back_stage : back_in[(s - 1) % 2] + cb,
              last ? got + ring_member(s) * cb + back_at : back_in[s % 2]);
    if (last) break;
    // Each bundle's first block is this member's: from s places behind, and s ahead.
    std::memcpy(got + ring_member(-s) * cb, fwd_in[s % 2], cb);
    std::memcpy(got + ring_member(s) * cb, back_in[s % 2], cb);
    bundle -= cb;
  }
}

void LinkedGroupImpl::check_neighbour(const char* op, const char* what, int peer) const {
  if (!on_ring() || peer == ring_member(1) || peer == ring_member(-1)) return;
  std::vector<int> order;
  for (int k : ring_) order.push_back(k);
  throw std::invalid_argument(
      std::string("mlx_ds4tp ") + op + ": " + what + "=" + std::to_string(peer) +
      " is no neighbour of rank " + std::to_string(me_) + " on the ring " + ring_text(order) +
      " (only the ring's cables carry bytes, and a send/recv has one); give rank " +
      std::to_string(ring_member(-1)) + " or " + std::to_string(ring_member(1)) +
      ", or pass it on through the ranks between");
}

}  // namespace mlx_ds4tp
