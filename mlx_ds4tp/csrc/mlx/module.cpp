// mlx_ds4tp._pairgroup: the Python face of the backend. Built with nanobind in
// MLX's domain (NB_DOMAIN=mlx) and nanobind's internals ABI of MLX's own
// bindings, so our Group is an mlx.core.distributed.Group to MLX: MLX's
// collectives, mlx.nn's sharded layers and mlx-lm's shard() take it as is.

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/version.h"
#include "group.h"

namespace nb = nanobind;
using namespace mlx_ds4tp;

#define DS4TP_STR2(x) #x
#define DS4TP_STR(x) DS4TP_STR2(x)
#define DS4TP_BUILT_MLX \
  DS4TP_STR(MLX_VERSION_MAJOR) "." DS4TP_STR(MLX_VERSION_MINOR) "." DS4TP_STR(MLX_VERSION_PATCH)

// Read from the file by Python before it loads this module (collectives/backend.py):
// an extension built against another MLX may not even load, so the version it
// was built against must be readable without loading it.
extern "C" __attribute__((used, visibility("default"))) const char ds4tp_built_against_mlx[] =
    "ds4tp-built-against-mlx=" DS4TP_BUILT_MLX ";";

NB_MODULE(_pairgroup, m) {
  m.doc() = "mlx_ds4tp's MLX distributed backend (see mlx_ds4tp/collectives/backend.py)";
  // Group's type must be registered before ours names it as a base.
  nb::module_::import_("mlx.core");

  nb::class_<LinkedGroup, mx::distributed::Group>(
      m, "Group",
      "An mlx.core.distributed.Group of 2 to 8 ranks over an mlx_ds4tp mesh (one link per pair "
      "of ranks; a pair is a mesh of two), or over a ring's links alone (ring=[ranks in cycle "
      "order]); split(color, key) makes subgroups over the same links.")
      .def(
          "__init__",
          [](LinkedGroup* self, int rank, int size, uintptr_t mesh, uintptr_t exchange,
             uintptr_t sum2, uintptr_t close, std::vector<int> ring) {
            if (size < 2 || size > TP_MESH_MAX || rank < 0 || rank >= size) {
              throw std::invalid_argument("Group: rank " + std::to_string(rank) + " of size " +
                                          std::to_string(size) + ": give 2 <= size <= " +
                                          std::to_string(TP_MESH_MAX) + " and 0 <= rank < size");
            }
            if (!mesh || !exchange || !sum2 || !close) {
              throw std::invalid_argument("Group: a null mesh or entry point");
            }
            if (!ring.empty()) {
              // A ring: every rank once, three or more (a pair's one link is its own ring).
              std::vector<int> seen(size, 0);
              bool every = static_cast<int>(ring.size()) == size && size >= 3;
              for (int r : ring) every = every && r >= 0 && r < size && !seen[r]++;
              if (!every) {
                throw std::invalid_argument("Group: ring= must name each of the " + std::to_string(size) +
                                            " ranks once, in cycle order, for 3 ranks or more; "
                                            "give [] for the full mesh");
              }
            }
            auto core = std::make_shared<MeshCore>();
            core->ring = std::move(ring);
            core->mesh = reinterpret_cast<tp_mesh*>(mesh);
            core->exchange = reinterpret_cast<MeshExchangeFn>(exchange);
            core->sum2 = reinterpret_cast<Sum2Fn>(sum2);
            core->close = reinterpret_cast<MeshCloseFn>(close);
            std::vector<int> members(size);
            for (int r = 0; r < size; r++) members[r] = r;
            new (self) LinkedGroup(std::make_shared<LinkedGroupImpl>(core, std::move(members), rank));
          },
          nb::arg("rank"), nb::arg("size"), nb::arg("mesh"), nb::arg("exchange"), nb::arg("sum2"),
          nb::arg("close"), nb::arg("ring") = std::vector<int>{})
      .def(
          "_close_backend",
          [](LinkedGroup& self) {
            nb::gil_scoped_release released;  // may wait for an exchange in flight
            self.impl_->close();
          },
          "Stop the collectives of the group and its subgroups: wake an exchange in flight, wait "
          "for it, refuse the rest.")
      .def(
          "_attach_backend",
          [](LinkedGroup& self, uintptr_t mesh) {
            if (!mesh) throw std::invalid_argument("Group: a null mesh");
            self.impl_->attach(reinterpret_cast<tp_mesh*>(mesh));
          },
          nb::arg("mesh"), "Run the collectives of this closed group over a new mesh of the same ranks.")
      .def(
          "split",
          [](LinkedGroup& self, int color, int key) {
            // The ranks swap (color, key) over the links before the subgroup exists: the
            // interpreter is released meanwhile, so ranks in threads of one process (the
            // tests) reach their own split.
            std::shared_ptr<mx::distributed::detail::GroupImpl> impl;
            {
              nb::gil_scoped_release released;
              impl = self.impl_->split(color, key);
            }
            return mx::distributed::Group(impl);
          },
          nb::arg("color"), nb::arg("key") = -1,
          "The ranks of this color, ordered by key (default: their rank), as a group over the "
          "same links.");

  // MLX's own group (ring, JACCL) under a type Python can extend, so the group
  // init(transport="mlx") returns carries the same extras as ours.
  nb::class_<SharedGroup, mx::distributed::Group>(
      m, "SharedGroup", "An mlx.core.distributed.Group sharing another group's implementation.")
      .def(
          "__init__",
          [](SharedGroup* self, const mx::distributed::Group& group) { new (self) SharedGroup(group); },
          nb::arg("group"));

  nb::class_<LocalGroup, mx::distributed::Group>(
      m, "LocalGroup",
      "An mlx.core.distributed.Group of ranks with no link between them: cut only (every "
      "collective fails at evaluation) or gateless (collectives hand the input back).")
      .def(
          "__init__",
          [](LocalGroup* self, int rank, int size, bool gateless) {
            if (size < 1 || rank < 0 || rank >= size) {
              throw std::invalid_argument("LocalGroup: rank " + std::to_string(rank) +
                                          " of size " + std::to_string(size) +
                                          ": give 0 <= rank < size");
            }
            new (self) LocalGroup(rank, size, gateless);
          },
          nb::arg("rank"), nb::arg("size"), nb::arg("gateless"));

  m.def(
      "dtype_codes",
      [] {
        nb::list codes;
        for (const auto& [dtype, code] : dtype_codes()) codes.append(nb::make_tuple(dtype, code));
        return codes;
      },
      "[(mlx.core.Dtype, code)]: every dtype the collectives take, with its code in the "
      "exchange header (TP_DTYPE_*), in code order.");

  m.attr("BUILT_AGAINST_MLX") = DS4TP_BUILT_MLX;
}
