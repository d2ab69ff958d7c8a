// The I/O layer's queries at the boundary: io_uring availability, the file system under
// a path (io/fs.hpp) and its table of known kinds, page-cache residency, syncfs; and the
// positional writer of the Python side (common/write.hpp).
#include <cstdlib>

#include "bindings/common.hpp"
#include "common/error.hpp"
#include "common/write.hpp"
#include "io/engine.hpp"
#include "io/fs.hpp"
#include "io/residency.hpp"

namespace fastload::bindings {

void register_io(py::module_& m) {
  m.def("uring_available", &io::uring_available,
        "True when io_uring can be set up here (not refused by the kernel or seccomp).");
  m.def(
      "resolve_engine",
      [](const std::string& engine, const py::object& where) {
        io::Kind requested = engine_kind(engine), kind;
        std::string w = where.is_none() ? std::string() : fs_bytes(where);
        int r;
        {
          py::gil_scoped_release nogil;
          r = io::resolve_kind(requested, w, true, &kind);
        }
        if (r != 0) {
          const char* e = std::getenv("FASTLOAD_ENGINE");
          throw py::value_error(std::string("FASTLOAD_ENGINE='") + (e ? e : "") +
                                "' is not 'auto', 'uring' or 'pread'");
        }
        return std::string(io::kind_name(kind));
      },
      py::arg("engine"), py::arg("where") = py::none(),
      "The backend a job asked for `engine` runs here: 'uring' or 'pread' (the one rule, "
      "io::resolve_kind: FASTLOAD_ENGINE, where's file system, io_uring's availability).");
  m.def(
      "fs_type",
      [](const py::object& path) {
        std::string p = fs_bytes(path);
        uint32_t magic = 0;
        int err;
        {
          py::gil_scoped_release nogil;
          err = io::fs_magic(p, &magic);
        }
        if (err != 0) throw Error::os(-err, "statfs", p);
        return magic;
      },
      py::arg("path"), "The file system's magic number (statfs(2) f_type).");
  m.def(
      "file_systems",
      [] {
        py::dict out;
        for (const io::FsKind& k : io::file_systems())
          out[py::int_(k.magic)] = py::make_tuple(k.name, k.network);
        return out;
      },
      "The file systems known by name: {magic: (name, network)}; network marks network "
      "and FUSE file systems.");
  m.def(
      "cached_bytes",
      [](int fd, uint64_t offset, uint64_t length) {
        int err;
        uint64_t n;
        {
          py::gil_scoped_release nogil;
          n = io::cached_bytes(fd, offset, length, &err);
        }
        if (err != 0) throw Error::os(-err, "check the page cache of file descriptor",
                                      std::to_string(fd));
        return n;
      },
      py::arg("fd"), py::arg("offset"), py::arg("length"),
      "How many bytes of the range of fd are in the page cache (mincore(2); reads "
      "nothing).");
  m.def(
      "syncfs",
      [](const py::object& path) {
        std::string p = fs_bytes(path);
        int err;
        {
          py::gil_scoped_release nogil;
          err = io::sync_fs(p);
        }
        if (err != 0) throw Error::os(-err, "sync file system of", p);
      },
      py::arg("path"), "Flushes the file system holding path to stable storage (syncfs(2)).");
  m.def(
      "pwrite_all",
      [](int fd, const py::buffer& data, int64_t offset, const py::object& path) {
        const py::buffer_info info = data.request();
        const std::span<const char> bytes = contiguous_bytes(info, "data");
        const std::string what = fs_bytes(path);
        py::gil_scoped_release nogil;
        write_all_at(fd, bytes.data(), bytes.size(), offset, what);
      },
      py::arg("fd"), py::arg("data"), py::arg("offset"), py::arg("path"),
      "Writes all of the buffer data at offset of fd, the GIL released (short writes and "
      "EINTR retried); an error names path.");
}

}  // namespace fastload::bindings
