// Copying at the boundary: walk() and stat_file() (the listing, copy/walk.hpp), and
// CopyJob (copy/copier.hpp).
#include "bindings/common.hpp"
#include "copy/copier.hpp"
#include "copy/walk.hpp"

#include <pybind11/stl.h>

namespace fastload::bindings {

void register_copy(py::module_& m) {
  py::class_<copy::Tree>(m, "Tree", "A listed source tree, sorted by path.")
      .def("__len__", [](const copy::Tree& t) { return t.entries.size(); })
      .def_property_readonly("files", [](const copy::Tree& t) { return t.files; })
      .def_property_readonly("total_bytes", [](const copy::Tree& t) { return t.total_bytes; })
      .def_property_readonly("skipped",
                             [](const copy::Tree& t) {
                               py::list out;
                               for (const auto& s : t.skipped) out.append(fs_str(s));
                               return out;
                             })
      .def(
          "entries",
          [](const copy::Tree& t) {
            py::list out(t.entries.size());
            for (size_t i = 0; i < t.entries.size(); ++i) {
              const auto& e = t.entries[i];
              out[i] = py::make_tuple(fs_str(e.path), int(e.type), e.size, e.blocks, e.mode,
                                      e.mtime_ns, fs_str(e.target));
            }
            return out;
          },
          "(path, type, size, blocks, mode, mtime_ns, link_target) per entry; type 0 file, "
          "1 directory, 2 symlink.");

  m.def(
      "walk",
      [](const py::object& root, const py::iterable& include, const py::iterable& exclude,
         bool skip_special, unsigned threads) {
        std::string r = fs_bytes(root);
        copy::WalkOptions opt{fs_list(include), fs_list(exclude), skip_special, threads};
        py::gil_scoped_release nogil;
        return copy::walk(r, opt);
      },
      py::arg("root"), py::arg("include"), py::arg("exclude"), py::arg("skip_special"),
      py::arg("threads"), "Lists a directory tree in parallel.");

  m.def(
      "stat_file",
      [](const py::object& root, const py::object& rel) {
        std::string r = fs_bytes(root), p = fs_bytes(rel);
        py::gil_scoped_release nogil;
        return copy::stat_file(r, p);
      },
      py::arg("root"), py::arg("name"), "A Tree of the one regular file root/name.");

  m.def("temp_name", [](const py::object& rel) { return fs_str(copy::temp_name(fs_bytes(rel))); },
        py::arg("path"));

  py::class_<copy::CopyJob>(m, "CopyJob", "A copy (or, with dst=None, a digest-only read).")
      .def(py::init([](const py::object& src_root, const py::object& dst_root,
                       const py::list& src, const py::object& dst, const std::vector<uint64_t>& size,
                       const std::vector<uint64_t>& blocks, const std::vector<uint32_t>& mode,
                       const std::vector<int64_t>& mtime_ns, const std::string& engine,
                       unsigned depth, unsigned threads, unsigned files_in_flight,
                       uint64_t stripe_size, unsigned big_buffers) {
             size_t n = src.size();
             if (size.size() != n || blocks.size() != n || mode.size() != n || mtime_ns.size() != n)
               throw py::value_error("CopyJob: per-file lists differ in length");
             std::vector<std::string> dsts;
             bool write = !dst.is_none();
             if (write) {
               dsts = fs_list(dst);
               if (dsts.size() != n) throw py::value_error("CopyJob: dst list length differs");
             }
             std::vector<copy::FileTask> tasks(n);
             for (size_t i = 0; i < n; ++i) {
               tasks[i].src = fs_bytes(src[i]);
               if (write) tasks[i].dst = std::move(dsts[i]);
               tasks[i].size = size[i];
               tasks[i].blocks = blocks[i];
               tasks[i].mode = mode[i];
               tasks[i].mtime_ns = mtime_ns[i];
             }
             copy::CopyOptions opt;
             if (!io::parse_kind(engine, &opt.engine.kind))
               throw py::value_error("unknown engine '" + engine +
                                     "' (expected 'auto', 'uring' or 'pread')");
             opt.engine.depth = depth;
             opt.engine.threads = threads;
             opt.files_in_flight = files_in_flight;
             opt.stripe_size = stripe_size;
             opt.small_size = std::min<uint64_t>(opt.small_size, stripe_size);
             opt.big_buffers = big_buffers;
             opt.write = write;
             return new copy::CopyJob(fs_bytes(src_root), write ? fs_bytes(dst_root) : "",
                                      std::move(tasks), opt);
           }),
           py::arg("src_root"), py::arg("dst_root"), py::arg("src"), py::arg("dst"),
           py::arg("size"), py::arg("blocks"), py::arg("mode"), py::arg("mtime_ns"),
           py::arg("engine"), py::arg("depth"), py::arg("threads"), py::arg("files_in_flight"),
           py::arg("stripe_size"), py::arg("big_buffers"))
      .def("start", &copy::CopyJob::start, py::call_guard<py::gil_scoped_release>())
      .def("wait", &copy::CopyJob::wait, py::arg("timeout_ms"),
           py::call_guard<py::gil_scoped_release>())
      .def("cancel", &copy::CopyJob::cancel)
      .def("rethrow", &copy::CopyJob::rethrow)
      .def("take_done",
           [](copy::CopyJob& j) {
             auto done = j.take_done();
             py::list out(done.size());
             for (size_t i = 0; i < done.size(); ++i) {
               const auto& d = done[i];
               out[i] = py::make_tuple(
                   d.index, py::bytes(reinterpret_cast<const char*>(d.digests.data()),
                                      d.digests.size() * sizeof(uint64_t)));
             }
             return out;
           })
      .def_property_readonly("bytes_done", &copy::CopyJob::bytes_done)
      .def_property_readonly("files_done", &copy::CopyJob::files_done)
      .def_property_readonly("bytes_total", &copy::CopyJob::bytes_total)
      .def_property_readonly("files_total", &copy::CopyJob::files_total)
      .def_property_readonly("engine", &copy::CopyJob::engine_name);
}

}  // namespace fastload::bindings
