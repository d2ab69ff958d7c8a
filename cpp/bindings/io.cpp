#include <fcntl.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "bindings/common.hpp"
#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "io/engine.hpp"
#include "io/residency.hpp"

namespace fastload::bindings {

void register_io(py::module_& m) {
  m.def("uring_available", &io::uring_available,
        "True when io_uring can be set up here (not refused by the kernel or seccomp).");
  m.def(
      "fs_type",
      [](const py::object& path) {
        std::string p = fs_bytes(path);
        struct statfs st;
        {
          py::gil_scoped_release nogil;
          if (::statfs(p.c_str(), &st) != 0) throw Error::os(errno, "statfs", p);
        }
        return static_cast<unsigned long>(st.f_type) & 0xffffffffUL;
      },
      py::arg("path"), "The file system's magic number (statfs(2) f_type).");
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
        py::gil_scoped_release nogil;
        UniqueFd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
        if (!fd || ::syncfs(fd.get()) != 0) throw Error::os(errno, "sync file system of", p);
      },
      py::arg("path"), "Flushes the file system holding path to stable storage (syncfs(2)).");
}

}  // namespace fastload::bindings
