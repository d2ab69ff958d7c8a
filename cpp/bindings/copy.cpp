// Copying at the boundary: walk(), walk_columns() and stat_file() (the listing,
// copy/walk.hpp), and CopyJob (copy/copier.hpp).
#include "bindings/common.hpp"
#include "copy/copier.hpp"
#include "copy/walk.hpp"

#include <pybind11/stl.h>

#include <algorithm>
#include <memory>

namespace fastload::bindings {

namespace {

// The files of a CopyJob, converted once from Python's per-file lists.
struct CopyFiles {
  std::vector<copy::FileTask> tasks;
  bool write = true;
};

}  // namespace

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
      "walk_columns",
      [](const py::object& root, const py::iterable& include, const py::iterable& exclude,
         bool skip_special, unsigned threads) {
        std::string r = fs_bytes(root);
        copy::WalkOptions opt{fs_list(include), fs_list(exclude), skip_special, threads};
        copy::FlatTree flat;
        {
          py::gil_scoped_release nogil;
          flat = copy::walk_flat(r, opt);
        }
        // The columns are bytes objects filled in place, without the GIL (nothing else
        // holds them yet): the listing is copied once, from the batches into them.
        const size_t n = flat.size();
        auto column = [](size_t bytes) {
          PyObject* o = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(bytes));
          if (!o) throw py::error_already_set();
          return py::reinterpret_steal<py::bytes>(o);
        };
        py::bytes paths = column(flat.path_bytes()), offsets = column(8 * (n + 1)),
                  kind = column(n), size = column(8 * n), blocks = column(8 * n),
                  mode = column(4 * n), mtime = column(8 * n);
        auto at = [](const py::bytes& b) { return PyBytes_AS_STRING(b.ptr()); };
        const copy::FlatTree::Columns cols{
            at(paths),
            reinterpret_cast<int64_t*>(at(offsets)),
            reinterpret_cast<uint8_t*>(at(kind)),
            reinterpret_cast<int64_t*>(at(size)),
            reinterpret_cast<int64_t*>(at(blocks)),
            reinterpret_cast<uint32_t*>(at(mode)),
            reinterpret_cast<int64_t*>(at(mtime))};
        {
          py::gil_scoped_release nogil;
          flat.fill_columns(cols);
        }
        py::dict targets;
        for (const auto& [i, t] : flat.targets()) targets[py::int_(i)] = fs_str(t);
        py::list skipped;
        for (const auto& s : flat.skipped()) skipped.append(fs_str(s));
        py::dict out;
        out["files"] = flat.files();
        out["total_bytes"] = flat.total_bytes();
        flat = copy::FlatTree();  // freed before the caller converts the columns
        out["paths"] = paths;
        out["offsets"] = offsets;
        out["kind"] = kind;
        out["size"] = size;
        out["blocks"] = blocks;
        out["mode"] = mode;
        out["mtime_ns"] = mtime;
        out["targets"] = targets;
        out["skipped"] = skipped;
        return out;
      },
      py::arg("root"), py::arg("include"), py::arg("exclude"), py::arg("skip_special"),
      py::arg("threads"),
      "Lists a directory tree in parallel, as columns in path order: paths (one bytes "
      "blob) and offsets (int64, one more than entries), kind (uint8: 0 file, 1 "
      "directory, 2 symlink), size, blocks, mtime_ns (int64), mode (uint32), each the "
      "native-endian bytes of its values; targets {index: link target}; files, "
      "total_bytes, skipped.");

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

  py::class_<CopyFiles>(m, "CopyFiles",
                        "The files of a CopyJob: per-file lists of equal length.")
      .def(py::init([](const py::list& src, const py::object& dst,
                       const std::vector<uint64_t>& size, const std::vector<uint64_t>& blocks,
                       const std::vector<uint32_t>& mode, const std::vector<int64_t>& mtime_ns,
                       bool stat_at_open) {
             size_t n = src.size();
             if (size.size() != n || blocks.size() != n || mode.size() != n || mtime_ns.size() != n)
               throw py::value_error("CopyFiles: per-file lists differ in length");
             auto out = std::make_unique<CopyFiles>();
             std::vector<std::string> dsts;
             out->write = !dst.is_none();
             if (out->write) {
               dsts = fs_list(dst);
               if (dsts.size() != n) throw py::value_error("CopyFiles: dst list length differs");
             }
             out->tasks.resize(n);
             for (size_t i = 0; i < n; ++i) {
               copy::FileTask& t = out->tasks[i];
               t.src = fs_bytes(src[i]);
               if (out->write) t.dst = std::move(dsts[i]);
               t.size = size[i];
               t.blocks = blocks[i];
               t.mode = mode[i];
               t.mtime_ns = mtime_ns[i];
               t.stat_at_open = stat_at_open;
             }
             return out;
           }),
           py::arg("src"), py::arg("dst"), py::arg("size"), py::arg("blocks"), py::arg("mode"),
           py::arg("mtime_ns"), py::kw_only(), py::arg("stat_at_open") = false,
           "src: paths under the source root; dst: paths under the destination root, or "
           "None to read and digest only (verify). stat_at_open: the files' size, blocks, "
           "mode and mtime are not given (a listing of names): each is learned from the "
           "opened source (CopyJob.task_meta).")
      .def("__len__", [](const CopyFiles& f) { return f.tasks.size(); });

  const copy::CopyOptions defaults;
  py::class_<copy::CopyOptions>(m, "CopyOptions", "How a CopyJob runs.")
      .def(py::init([](const std::string& engine, const py::object& engine_path, unsigned depth,
                       unsigned threads, unsigned files_in_flight, uint64_t stripe_size,
                       unsigned big_buffers, unsigned submitters, int src_network,
                       int src_fuse, bool lowest_priority) {
             copy::CopyOptions o;
             o.engine.kind = engine_kind(engine);
             if (!engine_path.is_none()) o.engine.where = fs_bytes(engine_path);
             o.engine.depth = depth;
             o.engine.threads = threads;
             o.files_in_flight = files_in_flight;
             o.stripe_size = stripe_size;
             o.big_buffers = big_buffers;
             o.submitters = submitters;
             o.src_network = src_network < 0 ? -1 : src_network > 0 ? 1 : 0;
             o.src_fuse = src_fuse < 0 ? -1 : src_fuse > 0 ? 1 : 0;
             o.lowest_priority = lowest_priority;
             return o;
           }),
           py::kw_only(), py::arg("engine") = "auto", py::arg("engine_path") = py::none(),
           py::arg("depth") = defaults.engine.depth, py::arg("threads") = defaults.engine.threads,
           py::arg("files_in_flight") = defaults.files_in_flight,
           py::arg("stripe_size") = defaults.stripe_size,
           py::arg("big_buffers") = defaults.big_buffers,
           py::arg("submitters") = defaults.submitters,
           py::arg("src_network") = defaults.src_network,
           py::arg("src_fuse") = defaults.src_fuse, py::arg("lowest_priority") = defaults.lowest_priority)
      .def_property(
          "engine", [](const copy::CopyOptions& o) { return io::kind_name(o.engine.kind); },
          [](copy::CopyOptions& o, const std::string& e) { o.engine.kind = engine_kind(e); })
      .def_property_readonly(
          "src_network", [](const copy::CopyOptions& o) { return o.src_network; },
          "1: the source is on a network or FUSE file system, 0: not, -1: the job looks.")
      .def_property_readonly(
          "src_fuse", [](const copy::CopyOptions& o) { return o.src_fuse; },
          "1: the source is on FUSE, 0: not, -1: the job looks.")
      .def_property_readonly("engine_path",
                             [](const copy::CopyOptions& o) -> py::object {
                               if (o.engine.where.empty()) return py::none();
                               return fs_str(o.engine.where);
                             })
      .def_property(
          "depth", [](const copy::CopyOptions& o) { return o.engine.depth; },
          [](copy::CopyOptions& o, unsigned v) { o.engine.depth = v; })
      .def_property(
          "threads", [](const copy::CopyOptions& o) { return o.engine.threads; },
          [](copy::CopyOptions& o, unsigned v) { o.engine.threads = v; })
      .def_readwrite("files_in_flight", &copy::CopyOptions::files_in_flight)
      .def_readwrite("stripe_size", &copy::CopyOptions::stripe_size)
      .def_readwrite("big_buffers", &copy::CopyOptions::big_buffers)
      .def_readwrite("submitters", &copy::CopyOptions::submitters)
      .def_readwrite("lowest_priority", &copy::CopyOptions::lowest_priority,
                     "The job's threads run at nice 19 (a stage in the background's own "
                     "order): those start() starts, not run()'s caller.");

  py::class_<copy::CopyJob>(m, "CopyJob", "A copy (or, with dst=None, a digest-only read).")
      .def(py::init([](const py::object& src_root, const py::object& dst_root,
                       const CopyFiles& files, const copy::CopyOptions& options) {
             copy::CopyOptions opt = options;
             opt.small_size = std::min<uint64_t>(opt.small_size, opt.stripe_size);
             opt.write = files.write;
             return new copy::CopyJob(fs_bytes(src_root), opt.write ? fs_bytes(dst_root) : "",
                                      files.tasks, opt);
           }),
           py::arg("src_root"), py::arg("dst_root"), py::arg("files"), py::arg("options"))
      .def("start", &copy::CopyJob::start, py::call_guard<py::gil_scoped_release>())
      .def("wait", &copy::CopyJob::wait, py::arg("timeout_ms"), py::arg("any_done") = false,
           py::call_guard<py::gil_scoped_release>(),
           "True once the job has finished; with any_done, returns (False) as soon as a "
           "finished file waits for take_done().")
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
      .def(
          "task_meta",
          [](const copy::CopyJob& j, size_t i) {
            const copy::FileTask& t = j.task(i);
            return py::make_tuple(t.size, t.blocks, t.mode, t.mtime_ns);
          },
          py::arg("index"),
          "(size, blocks, mode, mtime_ns) of task index: as given, or as found at its open "
          "(stat_at_open); read it once take_done() returned the task.")
      .def_property_readonly("bytes_done", &copy::CopyJob::bytes_done)
      .def_property_readonly("files_done", &copy::CopyJob::files_done)
      .def_property_readonly("bytes_total", &copy::CopyJob::bytes_total)
      .def_property_readonly("files_total", &copy::CopyJob::files_total)
      .def_property_readonly("engine", &copy::CopyJob::engine_name)
      .def_property_readonly("submitters", &copy::CopyJob::submitters)
      .def_property_readonly("read_seconds", [](const copy::CopyJob& j) { return j.busy_seconds(0); })
      .def_property_readonly("write_seconds",
                             [](const copy::CopyJob& j) { return j.busy_seconds(1); })
      .def_property_readonly("meta_seconds",
                             [](const copy::CopyJob& j) { return j.busy_seconds(2); });
}

}  // namespace fastload::bindings
