#include "bindings/common.hpp"
#include "hash/digest.hpp"

namespace fastload::bindings {

void register_hash(py::module_& m) {
  m.def(
      "fl64",
      [](const py::buffer& data, uint64_t seed) {
        py::buffer_info info = data.request();
        std::span<const char> b = contiguous_bytes(info, "fl64");
        py::gil_scoped_release nogil;
        return hash::fl64(b.data(), b.size(), seed);
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
            std::span<const char> b = contiguous_bytes(info, "Fl64Stream.update");
            py::gil_scoped_release nogil;
            h.update(b.data(), b.size());
          },
          py::arg("data"))
      .def("digest", &hash::Fl64Stream::digest,
           "fl64 of everything fed so far (the stream goes on).");
}

}  // namespace fastload::bindings
