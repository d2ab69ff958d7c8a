#include <fcntl.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "bindings/common.hpp"
#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "io/engine.hpp"

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
