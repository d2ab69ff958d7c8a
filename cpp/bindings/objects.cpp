// Whole objects to files, a batch per call (copy/objects.*): the bodies are read through
// the buffer protocol, no copy, and written with the GIL released.
#include <pybind11/stl.h>

#include "bindings/common.hpp"
#include "common/error.hpp"
#include "copy/objects.hpp"

namespace fastload::bindings {

void register_objects(py::module_& m) {
  m.def(
      "write_objects",
      [](const py::object& root, const py::sequence& items, uint32_t mode, uint64_t stripe) {
        const std::string root_path = fs_bytes(root);
        std::vector<py::buffer_info> held;  // released after the writes, the GIL held
        std::vector<copy::ObjectBody> bodies;
        held.reserve(items.size());
        bodies.reserve(items.size());
        for (const py::handle item : items) {
          const auto t = item.cast<py::tuple>();
          if (t.size() != 3 && t.size() != 4) {
            throw py::value_error("write_objects: items are (name, body, mtime_ns[, mark])");
          }
          held.push_back(t[1].cast<py::buffer>().request());
          const std::span<const char> b = contiguous_bytes(held.back(), "write_objects");
          bodies.push_back({fs_bytes(t[0]), b.data(), b.size(), t[2].cast<int64_t>(),
                            t.size() == 4 ? std::string(t[3].cast<py::bytes>()) : std::string()});
        }
        std::vector<std::vector<uint64_t>> digests;
        std::vector<std::exception_ptr> errors;
        {
          py::gil_scoped_release nogil;
          copy::ObjectWriter writer(root_path, mode, stripe);
          writer.write_all(bodies, digests, errors);
        }
        py::object factory;
        py::list out(bodies.size());
        for (size_t i = 0; i < bodies.size(); ++i) {
          if (errors[i]) {
            try {
              std::rethrow_exception(errors[i]);
            } catch (const Error& e) {
              if (!factory) factory = py::module_::import("fastload.errors").attr("from_native");
              out[i] = factory("os", e.err(), e.op(), fs_str(e.path()), fs_str(e.what()));
            }
            continue;
          }
          std::string raw(digests[i].size() * 8, '\0');
          for (size_t k = 0; k < digests[i].size(); ++k) {
            for (int j = 0; j < 8; ++j) raw[k * 8 + j] = char(digests[i][k] >> (8 * j));
          }
          out[i] = py::bytes(raw);
        }
        return out;
      },
      py::arg("root"), py::arg("items"), py::arg("mode"), py::arg("stripe"),
      "Writes each (name, body, mtime_ns[, mark]) of items whole to root/name (name "
      "relative, its folder there), with the GIL released: through a temporary (O_TMPFILE "
      "where the file system has them), mode (less the umask), mtime_ns as both times, the "
      "mark (bytes) as the xattr user.fastload.object where the file system keeps one, "
      "then into place. "
      "Returns per item its chunk digests (fl64 of each stripe bytes, 8 little-endian "
      "bytes each), or the OSError naming the file (no temporary left behind); the "
      "others are written all the same.");
}

}  // namespace fastload::bindings
