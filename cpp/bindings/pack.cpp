// Packing at the boundary: ShardFile (what fastload.ShardWriter writes through), the
// member-size arithmetic the planner needs, list_archive() and pack_run(), both run on a
// background thread waited on in 100 ms slices so Ctrl-C cancels them.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <functional>

#include "bindings/common.hpp"
#include "common/error.hpp"
#include "pack/pack.hpp"
#include "tar/writer.hpp"

namespace fastload::bindings {
namespace {

template <class T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <class T>
std::span<const T> span_of(const Array<T>& a) {
  return {a.data(), size_t(a.size())};
}

std::string_view view_of(const py::bytes& b) {
  return {PyBytes_AS_STRING(b.ptr()), size_t(PyBytes_GET_SIZE(b.ptr()))};
}

// A contiguous read-only view of any buffer-protocol object, released on destruction.
class View {
 public:
  explicit View(const py::handle& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  }
  ~View() { PyBuffer_Release(&view_); }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  const char* data() const { return static_cast<const char*>(view_.buf); }
  uint64_t size() const { return uint64_t(view_.len); }

 private:
  Py_buffer view_{};
};

py::tuple list_archive(const py::object& path, bool nested, unsigned threads) {
  const std::string p = fs_bytes(path);
  CancelToken cancel;
  pack::Listing listing;
  run_cancellable([&] { listing = pack::list_archive(p, nested, threads, &cancel); }, cancel, {});
  const size_t n = listing.members.size();
  py::list names(n);
  Array<uint64_t> offsets{py::ssize_t(n)}, sizes{py::ssize_t(n)};
  uint64_t* o = offsets.mutable_data();
  uint64_t* s = sizes.mutable_data();
  for (size_t i = 0; i < n; ++i) {
    const pack::Listed& m = listing.members[i];
    names[i] = fs_str(m.path);
    o[i] = m.offset;
    s[i] = m.size;
  }
  py::list examples;
  for (const auto& e : listing.skipped_examples) examples.append(fs_str(e));
  py::dict info;
  info["inner_tars"] = listing.inner_tars;
  info["skipped"] = listing.skipped;
  info["skipped_examples"] = examples;
  return py::make_tuple(names, offsets, sizes, info);
}

// A pack plan as Python hands it over (fastload.packing.folder): the arrays and bytes
// are kept here, so the pack::Plan views into them stay valid while the plan lives.
struct PackPlan {
  std::string root;  // "" when the sources are paths of their own (an archive)
  py::bytes sources, names, inline_data;
  Array<uint64_t> src_offsets, m_off, m_size, m_name, shard_first;
  Array<int64_t> m_src;
  Array<uint32_t> m_name_len;
  Array<uint8_t> m_first;
  bool whole_files = false;
  std::vector<std::string> final_paths, tmp_paths;

  pack::Plan view() const {
    pack::Plan plan;
    plan.root = root;
    plan.sources = view_of(sources);
    plan.src_offsets = span_of(src_offsets);
    plan.m_src = span_of(m_src);
    plan.m_off = span_of(m_off);
    plan.m_size = span_of(m_size);
    plan.m_name = span_of(m_name);
    plan.m_name_len = span_of(m_name_len);
    plan.m_first = span_of(m_first);
    plan.names = view_of(names);
    plan.inline_data = view_of(inline_data);
    plan.whole_files = whole_files;
    plan.shard_first = span_of(shard_first);
    plan.final_paths = final_paths;
    plan.tmp_paths = tmp_paths;
    return plan;
  }
};

const char* mode_name(pack::Mode m) { return m == pack::Mode::kScatter ? "scatter" : "per_shard"; }

pack::Mode parse_mode(const std::string& mode) {
  if (mode == "per_shard") return pack::Mode::kPerShard;
  if (mode == "scatter") return pack::Mode::kScatter;
  throw py::value_error("mode must be 'per_shard' or 'scatter', not '" + mode + "'");
}

py::dict pack_run(const PackPlan& p, const pack::Options& options, const py::object& progress) {
  const pack::Plan plan = p.view();
  pack::Options opt = options;
  CancelToken cancel;
  std::atomic<uint64_t> samples{0}, bytes{0};
  opt.cancel = &cancel;
  opt.samples_done = &samples;
  opt.bytes_done = &bytes;
  pack::Result result;
  std::function<void()> tick;
  if (!progress.is_none())
    tick = [&] { progress(samples.load(std::memory_order_relaxed), bytes.load(std::memory_order_relaxed)); };
  try {
    run_cancellable([&] { result = pack::run(plan, opt); }, cancel, tick);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
  if (tick) tick();
  py::dict d;
  d["shards"] = result.shards;
  d["samples"] = result.samples;
  d["members"] = result.members;
  d["bytes"] = result.bytes;
  return d;
}

}  // namespace

void register_pack(py::module_& m) {
  m.def(
      "tar_member_bytes",
      [](const Array<uint64_t>& name_lens, const Array<uint64_t>& sizes) {
        if (name_lens.size() != sizes.size())
          throw py::value_error("tar_member_bytes: name_lens and sizes differ in length");
        Array<uint64_t> out(name_lens.size());
        const uint64_t* l = name_lens.data();
        const uint64_t* s = sizes.data();
        uint64_t* o = out.mutable_data();
        for (py::ssize_t i = 0; i < name_lens.size(); ++i) o[i] = tar::member_bytes(size_t(l[i]), s[i]);
        return out;
      },
      py::arg("name_lens"), py::arg("sizes"),
      "Bytes each member takes in a shard (headers, data, padding), from the byte length "
      "of its name and its size.");

  m.def(
      "tar_header",
      [](const py::object& name, uint64_t size) {
        const std::string n = fs_bytes(name);
        std::string out(size_t(tar::header_bytes(n.size(), size)), '\0');
        tar::write_header(n, size, out.data());
        return py::bytes(out);
      },
      py::arg("name"), py::arg("size"), "The header blocks fastload writes for a member.");

  py::class_<tar::ShardFile>(m, "ShardFile",
                              "A tar shard written front to back under a temporary name, "
                              "renamed into place by commit().")
      .def(py::init([](const py::object& final_path, const py::object& tmp_path) {
             std::string f = fs_bytes(final_path), t = fs_bytes(tmp_path);
             py::gil_scoped_release nogil;
             return new tar::ShardFile(f, t);
           }),
           py::arg("final_path"), py::arg("tmp_path"))
      .def(
          "add_sample",
          [](tar::ShardFile& f, const py::object& key, const py::sequence& fields) {
            const std::string k = fs_bytes(key);
            const size_t n = size_t(py::len(fields));
            std::vector<std::string> names(n);
            std::vector<std::unique_ptr<View>> views(n);
            for (size_t i = 0; i < n; ++i) {
              py::tuple t = fields[i].cast<py::tuple>();
              if (t.size() != 2) throw py::value_error("add_sample: fields are (name, data) pairs");
              names[i] = k + "." + fs_bytes(t[0]);
              views[i] = std::make_unique<View>(t[1]);
            }
            const uint64_t before = f.bytes();
            {
              py::gil_scoped_release nogil;
              for (size_t i = 0; i < n; ++i) f.add(names[i], views[i]->data(), views[i]->size());
            }
            return f.bytes() - before;
          },
          py::arg("key"), py::arg("fields"),
          "Appends one sample: a member KEY.FIELD per (field, bytes-like) pair, in the order "
          "given. Returns the bytes it took.")
      .def_property_readonly("bytes", &tar::ShardFile::bytes)
      .def_property_readonly("members", &tar::ShardFile::members)
      .def_property_readonly("path", [](const tar::ShardFile& f) { return fs_str(f.path()); })
      .def("commit", &tar::ShardFile::commit, py::arg("sync") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("abort", &tar::ShardFile::abort, py::call_guard<py::gil_scoped_release>());

  m.def("list_archive", &list_archive, py::arg("path"), py::arg("nested"), py::arg("threads") = 0,
        "(names, data offsets, sizes, info) of the regular members of a tar (nested: and of "
        "its member tars), from headers only.");

  py::class_<PackPlan>(m, "PackPlan",
                       "A pack plan (computed by fastload.packing): sources, members in "
                       "output order, shards. Every argument is keyword-only.")
      .def(py::init([](const py::object& root, const py::bytes& sources,
                       Array<uint64_t> src_offsets, Array<int64_t> m_src, Array<uint64_t> m_off,
                       Array<uint64_t> m_size, Array<uint64_t> m_name,
                       Array<uint32_t> m_name_len, Array<uint8_t> m_first,
                       const py::bytes& names, const py::bytes& inline_data, bool whole_files,
                       Array<uint64_t> shard_first, const py::sequence& final_paths,
                       const py::sequence& tmp_paths) {
             PackPlan p;
             p.root = root.is_none() ? std::string() : fs_bytes(root);
             p.sources = sources;
             p.src_offsets = std::move(src_offsets);
             p.m_src = std::move(m_src);
             p.m_off = std::move(m_off);
             p.m_size = std::move(m_size);
             p.m_name = std::move(m_name);
             p.m_name_len = std::move(m_name_len);
             p.m_first = std::move(m_first);
             p.names = names;
             p.inline_data = inline_data;
             p.whole_files = whole_files;
             p.shard_first = std::move(shard_first);
             p.final_paths = fs_list(final_paths);
             p.tmp_paths = fs_list(tmp_paths);
             return p;
           }),
           py::kw_only(), py::arg("root"), py::arg("sources"), py::arg("src_offsets"),
           py::arg("m_src"), py::arg("m_off"), py::arg("m_size"), py::arg("m_name"),
           py::arg("m_name_len"), py::arg("m_first"), py::arg("names"),
           py::arg("inline_data"), py::arg("whole_files"), py::arg("shard_first"),
           py::arg("final_paths"), py::arg("tmp_paths"))
      .def_property_readonly("shards", [](const PackPlan& p) { return p.final_paths.size(); })
      .def_property_readonly("members", [](const PackPlan& p) { return p.m_src.size(); });

  py::class_<pack::Options>(m, "PackOptions", "How pack_run writes a plan (pack::Options).")
      .def(py::init([](const std::string& mode, unsigned threads, bool sync, size_t max_open) {
             pack::Options o;
             o.mode = parse_mode(mode);
             o.threads = threads;
             o.sync = sync;
             o.max_open = max_open;
             return o;
           }),
           py::kw_only(), py::arg("mode") = "per_shard", py::arg("threads") = 0,
           py::arg("sync") = true, py::arg("max_open") = 256,
           "mode: 'per_shard' (each thread writes whole shards, reading every member: a "
           "tree) or 'scatter' (sources read in large ordered batches, every member written "
           "at its place: an archive); threads: 0 is one per CPU (at most 16); sync: "
           "fdatasync each shard before renaming it; max_open: scatter's shards open at once.")
      .def_property(
          "mode", [](const pack::Options& o) { return mode_name(o.mode); },
          [](pack::Options& o, const std::string& mode) { o.mode = parse_mode(mode); })
      .def_readwrite("threads", &pack::Options::threads)
      .def_readwrite("sync", &pack::Options::sync)
      .def_readwrite("max_open", &pack::Options::max_open)
      .def("__repr__", [](const pack::Options& o) {
        return std::string("PackOptions(mode='") + mode_name(o.mode) +
               "', threads=" + std::to_string(o.threads) + ", sync=" +
               (o.sync ? "True" : "False") + ", max_open=" + std::to_string(o.max_open) + ")";
      });

  m.def("pack_run", &pack_run, py::arg("plan"), py::arg("options"),
        py::arg("progress") = py::none(),
        "Executes a pack plan (computed by fastload.packing) as the options say; "
        "progress(samples, source bytes) is called while it runs. Returns the counts.");
}

}  // namespace fastload::bindings
