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

  // One stream per writer: update() runs without the GIL, so a stream must not be fed
  // from two threads at once.
  py::class_<hash::Fl64Stream>(
      m, "Fl64Stream",
      "fl64 of bytes fed in pieces as they arrive: any split gives fl64 of the whole. "
      "Not for use from two threads at once.")
      .def(py::init<uint64_t>(), py::arg("seed") = 0)
      .def(
          "update",
          [](hash::Fl64Stream& h, const py::buffer& data) {
            py::buffer_info info = data.request();
            if (!PyBuffer_IsContiguous(info.view(), 'C'))
              throw py::value_error("Fl64Stream.update needs a contiguous buffer");
            const void* p = info.ptr;
            size_t n = size_t(info.size * info.itemsize);
            py::gil_scoped_release nogil;
            h.update(p, n);
          },
          py::arg("data"))
      .def("digest", &hash::Fl64Stream::digest,
           "fl64 of everything fed so far (the stream goes on).");
}

}  // namespace fastload::bindings
