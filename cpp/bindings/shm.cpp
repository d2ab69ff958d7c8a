// The shared-memory batch blocks at the boundary (the protocol is in shm/block.hpp):
// ShmBlock (a worker's block), ShmView (the main process's mapping of one) and ShmLease,
// a writable buffer over a block's payload (what torch.frombuffer wraps; the tensor's
// storage keeps the lease alive, and with it the count on the block).
#include "bindings/common.hpp"
#include "shm/block.hpp"

namespace fastload::bindings {

void register_shm(py::module_& m) {
  py::class_<shm::Lease>(m, "ShmLease", py::buffer_protocol(),
                         "A writable buffer over a shared-memory batch block; the block is "
                         "free for reuse once every lease on it is gone.")
      .def_buffer([](const shm::Lease& l) {
        return py::buffer_info(l.data(), 1, "B", 1, {py::ssize_t(l.capacity())}, {1},
                               /*readonly=*/false);
      })
      .def_property_readonly("capacity", &shm::Lease::capacity);

  py::class_<shm::View>(m, "ShmView", "A block received from another process, mapped here.")
      .def(py::init<int, size_t>(), py::arg("fd"), py::arg("length"),
           "Maps the block behind fd (closed here); OSError if it is not a block of that "
           "length.")
      .def("adopt", &shm::View::adopt,
           "A lease taking over the count the sending process retained for it.")
      .def_property_readonly("length", &shm::View::length)
      .def_property_readonly("users", &shm::View::users)
      .def_property_readonly("owner", &shm::View::owner,
                             "The pid writing batches into the block (0: free to claim).")
      .def("disown", &shm::View::disown,
           "Frees the block for ShmBlock.claim (its owner has exited or let it go).")
      .def_property("held", &shm::View::held, &shm::View::hold,
                    "Leases on a held mapping retire their counts when destroyed "
                    "(shm_take_retired) instead of giving them back.");

  py::class_<shm::Retired>(m, "ShmRetired",
                           "Counts retired by leases on held mappings; release() (or "
                           "dropping it) gives them back, in the process that retired them.")
      .def("__len__", &shm::Retired::size)
      .def("release", &shm::Retired::release);
  m.def("shm_take_retired", &shm::Retired::take,
        "Every count retired by leases on held mappings in this process since the last call.");

  py::class_<shm::Block>(m, "ShmBlock",
                         "A reusable shared-memory (memfd) block for packed batches.")
      .def(py::init<size_t>(), py::arg("capacity"))
      .def_static("claim", &shm::Block::claim, py::arg("fd"),
                  "The free block behind fd (an inherited descriptor, kept by the caller), "
                  "owned by this process from now on; None if another process owns it.")
      .def_property_readonly("users", &shm::Block::users)
      .def_property_readonly("fd", &shm::Block::fd)
      .def_property_readonly("inode", &shm::Block::inode)
      .def_property_readonly("length", &shm::Block::length)
      .def_property_readonly("capacity", &shm::Block::capacity)
      .def_property_readonly("address", &shm::Block::address)
      .def("lease", &shm::Block::lease)
      .def("retain", &shm::Block::retain);
}

}  // namespace fastload::bindings
