#include "bindings/common.hpp"
#include "hash/digest.hpp"

namespace fastload::bindings {

void register_hash(py::module_& m) {
  m.def(
      "fl64",
      [](const py::buffer& data, uint64_t seed) {
        py::buffer_info info = data.request();
        if (!PyBuffer_IsContiguous(info.view(), 'C'))
          throw py::value_error("fl64 needs a contiguous buffer");
        const void* p = info.ptr;
        size_t n = size_t(info.size * info.itemsize);
        py::gil_scoped_release nogil;
        return hash::fl64(p, n, seed);
      },
      py::arg("data"), py::arg("seed") = 0,
      "The 64-bit chunk digest fastload stores in its manifests.");
}

}  // namespace fastload::bindings
