// The shard index at the boundary: build_index() (a background thread, waited on in
// 100 ms slices so Ctrl-C cancels it), Index (an opened index and its shards) with the
// batched fetch (planned and read by index/batch.hpp, here only converted), and Payload,
// the zero-copy read-only buffer over a member's bytes.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <functional>
#include <memory>
#include <optional>

#include "bindings/collate.hpp"
#include "bindings/common.hpp"
#include "common/columns.hpp"
#include "common/error.hpp"
#include "index/batch.hpp"
#include "index/builder.hpp"
#include "index/reader.hpp"

#include <pybind11/stl.h>

namespace fastload::bindings {
namespace {

using index::Access;
using index::FieldSelection;
using index::IndexFile;
using index::Piece;
using index::Shards;

// A member's bytes, owned by whatever keeps them alive: a shard's mapping or a batch's
// read buffer. Exposes a read-only 1-D buffer of unsigned bytes; numpy arrays and
// memoryviews made from it hold a reference to it, so the memory outlives them all.
//
// A plain CPython type, not a pybind11 class: a fetch makes one per field of every
// sample, and a pybind11 instance costs about ten times the allocation this does
// (it was most of the time of ds[i] on small samples).
struct PayloadObject {
  PyObject_HEAD
  std::shared_ptr<const void> owner;  // constructed in place by make_payload
  const char* data;
  Py_ssize_t size;
};

PyTypeObject* payload_type = nullptr;

py::object make_payload(std::shared_ptr<const void> owner, const char* data, size_t size) {
  PayloadObject* o = PyObject_New(PayloadObject, payload_type);
  if (!o) throw py::error_already_set();
  new (&o->owner) std::shared_ptr<const void>(std::move(owner));
  o->data = data;
  o->size = Py_ssize_t(size);
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(o));
}

void payload_dealloc(PyObject* self) {
  auto* o = reinterpret_cast<PayloadObject*>(self);
  PyTypeObject* type = Py_TYPE(self);
  o->owner.~shared_ptr();
  PyObject_Free(self);
  Py_DECREF(type);  // instances of a heap type hold a reference to it
}

int payload_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  auto* o = reinterpret_cast<PayloadObject*>(self);
  return PyBuffer_FillInfo(view, self, const_cast<char*>(o->data), o->size, /*readonly=*/1,
                           flags);
}

Py_ssize_t payload_len(PyObject* self) { return reinterpret_cast<PayloadObject*>(self)->size; }

PyObject* payload_tobytes(PyObject* self, PyObject*) {
  auto* o = reinterpret_cast<PayloadObject*>(self);
  return PyBytes_FromStringAndSize(o->data, o->size);
}

PyObject* payload_reduce(PyObject* self, PyObject*) {  // pickles as bytes
  PyObject* b = payload_tobytes(self, nullptr);
  if (!b) return nullptr;
  return Py_BuildValue("(O(N))", reinterpret_cast<PyObject*>(&PyBytes_Type), b);
}

PyObject* payload_repr(PyObject* self) {
  return PyUnicode_FromFormat("<fastload.Payload of %zd bytes>",
                              reinterpret_cast<PayloadObject*>(self)->size);
}

void register_payload(py::module_& m) {
  static PyMethodDef methods[] = {
      {"tobytes", payload_tobytes, METH_NOARGS, "A copy of the bytes."},
      {"__bytes__", payload_tobytes, METH_NOARGS, "A copy of the bytes."},
      {"__reduce__", payload_reduce, METH_NOARGS, "Pickles as bytes."},
      {nullptr, nullptr, 0, nullptr}};
  static PyType_Slot slots[] = {
      {Py_tp_doc, const_cast<char*>("A read-only view of one member's bytes (zero-copy). "
                                    "Supports the buffer protocol; pickles as bytes.")},
      {Py_tp_dealloc, reinterpret_cast<void*>(payload_dealloc)},
      {Py_tp_repr, reinterpret_cast<void*>(payload_repr)},
      {Py_tp_methods, methods},
      {Py_sq_length, reinterpret_cast<void*>(payload_len)},
      {Py_bf_getbuffer, reinterpret_cast<void*>(payload_getbuffer)},
      {0, nullptr}};
  static PyType_Spec spec = {"fastload._core.Payload", sizeof(PayloadObject), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (!type) throw py::error_already_set();
  payload_type = reinterpret_cast<PyTypeObject*>(type);  // the module keeps it alive
  m.add_object("Payload", py::reinterpret_steal<py::object>(type));
}

struct PyIndex {
  std::shared_ptr<const IndexFile> file;
  std::unique_ptr<Shards> shards;
  std::vector<py::object> field_names;  // py::str per field id, reused in every dict
};

std::shared_ptr<PyIndex> open_index(const py::object& path, bool check_shards) {
  std::string p = fs_bytes(path);
  auto out = std::make_shared<PyIndex>();
  {
    py::gil_scoped_release nogil;
    out->file = IndexFile::open(p);
    if (check_shards) out->file->check_shards();
    out->shards = std::make_unique<Shards>(out->file);
  }
  for (uint64_t f = 0; f < out->file->field_count(); ++f)
    out->field_names.push_back(fs_str(std::string(out->file->field_name(f))));
  return out;
}

// The arguments fetch() and fetch_packed() share, converted once.
struct Request {
  Access access = Access::kMmap;
  std::vector<uint64_t> samples;  // sample positions (negative indices resolved)
  std::optional<std::vector<uint32_t>> fields;  // the field ids named (nullopt: fields=None)
  FieldSelection selection;
};

Request parse_request(const PyIndex& ix, const py::handle& indices, const py::object& fields,
                      const std::string& access) {
  Request r;
  if (access == "read") r.access = Access::kRead;
  else if (access != "mmap")
    throw py::value_error("access must be 'mmap' or 'read', not '" + access + "'");
  const int64_t n = int64_t(ix.file->sample_count());
  if (PyList_Check(indices.ptr()) || PyTuple_Check(indices.ptr()))
    r.samples.reserve(size_t(py::len(indices)));
  for (py::handle h : indices) {
    Py_ssize_t i = PyNumber_AsSsize_t(h.ptr(), PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (i < 0) i += n;
    if (i < 0 || i >= n)
      throw py::index_error("sample index " + std::to_string(py::cast<int64_t>(h)) +
                            " out of range for " + std::to_string(n) + " samples");
    r.samples.push_back(uint64_t(i));
  }
  if (!fields.is_none()) {
    r.fields.emplace();
    for (py::handle h : fields) {
      const std::string name = fs_bytes(h);
      const std::optional<uint32_t> f = ix.file->field_id(name);
      if (!f) {
        std::string have;
        for (uint64_t k = 0; k < ix.file->field_count(); ++k)
          have += (k ? ", " : "") + std::string(ix.file->field_name(k));
        throw py::value_error("no field '" + name + "' in index '" + ix.file->path() +
                              "' (its fields: " + have + ")");
      }
      r.fields->push_back(*f);
    }
  }
  r.selection = index::select_fields(ix.file->field_count(), r.fields);
  return r;
}

const std::vector<bool>* mask_of(const Request& r) {
  return r.selection.want ? &*r.selection.want : nullptr;
}

// One call, one batch: plan and bring the bytes in (index/batch.hpp, GIL released),
// then build the dicts. copy=false hands out Payloads over the located bytes;
// copy=true fills bytes objects (made with the GIL, filled without it: nothing else
// can see them yet).
py::list fetch(PyIndex& ix, const py::handle& indices, const py::object& fields, bool copy,
               const std::string& access) {
  const Request req = parse_request(ix, indices, fields, access);
  const std::vector<uint64_t>& samples = req.samples;
  std::vector<Piece> pieces;
  index::Located located;
  {
    py::gil_scoped_release nogil;
    pieces.reserve(samples.size() * 4);
    ix.shards->plan(samples, mask_of(req), pieces);
    if (!copy) located = index::locate(*ix.shards, pieces, req.access, /*prefault=*/true);
  }

  std::vector<py::object> values(pieces.size());
  if (copy) {
    std::vector<char*> dst(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      PyObject* b = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(pieces[i].size));
      if (!b) throw py::error_already_set();
      values[i] = py::reinterpret_steal<py::object>(b);
      dst[i] = PyBytes_AS_STRING(b);
    }
    py::gil_scoped_release nogil;
    index::copy_pieces(*ix.shards, pieces, dst, req.access);
  } else {
    for (size_t i = 0; i < pieces.size(); ++i)
      values[i] = make_payload(std::move(located.owner[i]), located.data[i], size_t(pieces[i].size));
  }

  py::list out(samples.size());
  size_t pi = 0;
  const py::str key_name("__key__");
  for (size_t k = 0; k < samples.size(); ++k) {
    py::dict d;
    d[key_name] = fs_str(std::string(ix.file->key(samples[k])));
    size_t got = 0;
    for (; pi < pieces.size() && pieces[pi].slot == k; ++pi, ++got)
      d[ix.field_names[pieces[pi].field]] = std::move(values[pi]);
    if (req.fields && got != req.selection.wanted) {
      for (uint32_t f : *req.fields)
        if (!d.contains(ix.field_names[f]))
          throw py::key_error("sample '" + std::string(ix.file->key(samples[k])) +
                              "' has no field '" + std::string(ix.file->field_name(f)) + "'");
    }
    out[k] = std::move(d);
  }
  return out;
}

// The batch packed (fastload.collate's fast path): one column per field (index::Columns),
// each payload copied once, from the mapping (or by the I/O engine's reads), straight
// into buffers alloc(sizes) hands out (the contract is in collate.cpp). Columns: `fields`
// in order, or every field the batch's samples have, in order of first appearance. A
// sample without a column's field is a KeyError, or with allow_missing a row listed as
// missing. Returns (keys, column names, per column the missing rows or None).
py::tuple fetch_packed(PyIndex& ix, const py::handle& indices, const py::object& fields,
                       const py::function& alloc, const std::string& access,
                       bool allow_missing) {
  const Request req = parse_request(ix, indices, fields, access);
  const std::vector<uint64_t>& samples = req.samples;
  const size_t rows = samples.size();
  std::vector<Piece> pieces;
  index::Columns cols;
  {
    py::gil_scoped_release nogil;
    pieces.reserve(rows * 4);
    ix.shards->plan(samples, mask_of(req), pieces);
    cols = index::layout_columns(pieces, rows, ix.file->field_count(), req.fields);
  }
  const size_t ncol = cols.count();
  py::list missing(ncol);
  std::vector<uint64_t> request(2 * ncol, 0);
  for (size_t c = 0; c < ncol; ++c) {
    py::list absent;
    for (uint32_t r : cols.missing(c)) {
      if (!allow_missing)
        throw py::key_error("sample '" + std::string(ix.file->key(samples[r])) +
                            "' has no field '" + std::string(ix.file->field_name(cols.field[c])) +
                            "' (allow_missing=True gives None)");
      absent.append(r);
    }
    request[2 * c] = cols.data_bytes(c);
    request[2 * c + 1] = offsets_bytes(rows);
    missing[c] = py::len(absent) ? py::object(absent) : py::none();
  }

  OutBuffers out = OutBuffers::allocate(alloc, request);
  {
    py::gil_scoped_release nogil;
    std::vector<char*> data(ncol), offsets(ncol);
    for (size_t c = 0; c < ncol; ++c) {
      data[c] = out.data(2 * c);
      offsets[c] = out.data(2 * c + 1);
    }
    index::fill_columns(*ix.shards, cols, pieces, data, offsets, req.access);
  }

  py::list keys(rows);
  for (size_t r = 0; r < rows; ++r) keys[r] = fs_str(std::string(ix.file->key(samples[r])));
  py::list names(ncol);
  for (size_t c = 0; c < ncol; ++c) names[c] = ix.field_names[cols.field[c]];
  return py::make_tuple(keys, names, missing);
}

py::dict run_build(const py::sequence& open_paths, const py::sequence& stored_paths,
                   const py::object& index_path, const std::string& on_duplicate,
                   unsigned threads, const py::object& progress) {
  if (py::len(open_paths) != py::len(stored_paths))
    throw py::value_error("build_index: open_paths and stored_paths differ in length");
  std::vector<std::string> open = fs_list(open_paths), stored = fs_list(stored_paths);
  std::vector<index::ShardInput> shards(open.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    shards[i].open_path = std::move(open[i]);
    shards[i].stored_path = std::move(stored[i]);
  }
  index::BuildOptions opt;
  if (on_duplicate == "error") opt.on_duplicate = index::OnDuplicate::kError;
  else if (on_duplicate == "first") opt.on_duplicate = index::OnDuplicate::kFirst;
  else throw py::value_error("on_duplicate must be 'error' or 'first', not '" + on_duplicate + "'");
  opt.threads = threads;
  std::string out = fs_bytes(index_path);
  CancelToken cancel;
  std::atomic<uint64_t> done{0};
  opt.cancel = &cancel;
  opt.shards_done = &done;

  index::BuildResult result;
  std::function<void()> tick;
  if (!progress.is_none())
    tick = [&] { progress(done.load(std::memory_order_relaxed), shards.size()); };
  run_cancellable([&] { result = index::build(shards, out, opt); }, cancel, tick);
  py::dict d;
  d["shards"] = result.shards;
  d["samples"] = result.samples;
  d["members"] = result.members;
  d["fields"] = result.fields;
  d["shard_bytes"] = result.shard_bytes;
  d["duplicates_skipped"] = result.duplicates_skipped;
  d["index_bytes"] = result.index_bytes;
  return d;
}

// A shard's scan (scan_shard) and an index's bytes built from scans, held natively.
struct PyShardScan {
  std::shared_ptr<const index::ShardScan> scan;
};
struct PyIndexImage {
  std::string bytes;
};

PyShardScan run_scan(const py::object& path) {
  std::string p = fs_bytes(path);
  PyShardScan out;
  py::gil_scoped_release nogil;
  out.scan = index::scan_one(p, index::BuildOptions{});
  return out;
}

PyIndexImage run_build_scanned(const py::sequence& scans, const py::sequence& names,
                               const py::sequence& stored_paths, const std::string& on_duplicate) {
  if (py::len(scans) != py::len(names) || py::len(names) != py::len(stored_paths))
    throw py::value_error("build_index_scanned: scans, names and stored_paths differ in length");
  std::vector<std::string> open = fs_list(names), stored = fs_list(stored_paths);
  std::vector<index::ShardInput> shards(open.size());
  std::vector<std::shared_ptr<const index::ShardScan>> keep;
  std::vector<const index::ShardScan*> each;
  for (size_t i = 0; i < shards.size(); ++i) {
    shards[i] = {std::move(open[i]), std::move(stored[i])};
    keep.push_back(scans[i].cast<const PyShardScan&>().scan);
    each.push_back(keep.back().get());
  }
  index::BuildOptions opt;
  if (on_duplicate == "first") opt.on_duplicate = index::OnDuplicate::kFirst;
  else if (on_duplicate != "error")
    throw py::value_error("on_duplicate must be 'error' or 'first', not '" + on_duplicate + "'");
  PyIndexImage out;
  py::gil_scoped_release nogil;
  out.bytes = index::build_bytes(shards, each, opt, nullptr);
  return out;
}

void write_image(const PyIndexImage& image, int fd, const py::object& path) {
  std::string p = fs_bytes(path);
  py::gil_scoped_release nogil;
  size_t done = 0;
  while (done < image.bytes.size()) {
    ssize_t n = ::pwrite(fd, image.bytes.data() + done,
                         std::min<size_t>(image.bytes.size() - done, size_t(1) << 30), off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error::os(n < 0 ? errno : EIO, "write index", p);
    done += size_t(n);
  }
}

}  // namespace

void register_index(py::module_& m) {
  py::class_<PyShardScan>(m, "ShardScan", "A tar shard's headers, scanned (scan_shard).");
  py::class_<PyIndexImage>(m, "IndexImage", "An index's bytes, built from shard scans.")
      .def("__len__", [](const PyIndexImage& im) { return im.bytes.size(); })
      .def("write", &write_image, py::arg("fd"), py::arg("path"),
           "Writes the bytes at offset 0 of fd (path names it in errors).");
  m.def("scan_shard", &run_scan, py::arg("path"),
        "Scans one tar shard's headers (what build_index_scanned needs of it).");
  m.def("build_index_scanned", &run_build_scanned, py::arg("scans"), py::arg("names"),
        py::arg("stored_paths"), py::arg("on_duplicate") = "error",
        "The index of shards scanned beforehand (names: for errors; stored_paths: recorded).");

  register_payload(m);

  py::class_<PyIndex, std::shared_ptr<PyIndex>>(m, "Index", "An opened shard index.")
      .def(py::init(&open_index), py::arg("path"), py::arg("check_shards") = true)
      .def("__len__", [](const PyIndex& ix) { return ix.file->sample_count(); })
      .def_property_readonly("path", [](const PyIndex& ix) { return fs_str(ix.file->path()); })
      .def_property_readonly("shard_count", [](const PyIndex& ix) { return ix.file->shard_count(); })
      .def_property_readonly("member_count",
                             [](const PyIndex& ix) { return ix.file->member_count(); })
      .def_property_readonly("fields", [](const PyIndex& ix) {
        py::list out;
        for (const auto& f : ix.field_names) out.append(f);
        return out;
      })
      .def("check_shards",
           [](const PyIndex& ix) {
             py::gil_scoped_release nogil;
             ix.file->check_shards();
           })
      .def(
          "shard",
          [](const PyIndex& ix, uint64_t i) {
            if (i >= ix.file->shard_count()) throw py::index_error("shard index out of range");
            index::ShardRecord r = ix.file->shard(i);
            return py::make_tuple(fs_str(std::string(ix.file->shard_path(i))),
                                  fs_str(ix.file->shard_open_path(i)), r.size, r.mtime_ns,
                                  r.first_sample, r.sample_count);
          },
          py::arg("i"),
          "(stored path, path to open, size, mtime_ns, first sample, sample count)")
      .def(
          "sample",
          [](const PyIndex& ix, uint64_t i) {
            if (i >= ix.file->sample_count()) throw py::index_error("sample index out of range");
            index::SampleRecord s = ix.file->sample(i);
            py::list members;
            for (uint32_t k = 0; k < s.member_count; ++k) {
              index::MemberRecord r = ix.file->member(s.first_member + k);
              members.append(py::make_tuple(ix.field_names[r.field], r.offset, r.size));
            }
            return py::make_tuple(fs_str(std::string(ix.file->key(i))), s.shard, members);
          },
          py::arg("i"), "(key, shard, [(field, offset, size), ...])")
      .def(
          "find",
          [](const PyIndex& ix, const py::object& key) -> py::object {
            std::string k = fs_bytes(key);
            auto r = ix.file->find(k);
            if (!r) return py::none();
            return py::int_(*r);
          },
          py::arg("key"), "The position of the sample with this key, or None.")
      .def("keys",
           [](const PyIndex& ix) {
             py::list out(ix.file->sample_count());
             for (uint64_t i = 0; i < ix.file->sample_count(); ++i)
               out[i] = fs_str(std::string(ix.file->key(i)));
             return out;
           })
      .def("info",
           [](const PyIndex& ix) {
             const index::Header& h = ix.file->header();
             py::dict d;
             d["version"] = h.version;
             d["flags"] = h.flags;
             d["on_duplicate"] = (h.flags & index::kFlagFirstOnDuplicate) ? "first" : "error";
             d["file_size"] = h.file_size;
             d["shards"] = h.shard_count;
             d["samples"] = h.sample_count;
             d["members"] = h.member_count;
             d["fields"] = h.field_count;
             d["hash_slots"] = h.hash_slots;
             d["string_size"] = h.string_size;
             return d;
           })
      .def_property_readonly("engine",
                             [](const PyIndex& ix) { return ix.shards->engine_name(); })
      .def(
          "forget_shard",
          [](PyIndex& ix, uint64_t i) {
            if (i >= ix.file->shard_count()) throw py::index_error("shard index out of range");
            py::gil_scoped_release nogil;
            ix.shards->forget(uint32_t(i));
          },
          py::arg("i"),
          "Drops the index's mapping and descriptor of shard i (reopened by path on next use).")
      .def("fetch", &fetch, py::arg("indices"), py::arg("fields") = py::none(),
           py::arg("copy") = false, py::arg("access") = "mmap",
           "Samples as dicts {'__key__': key, field: Payload | bytes}, one native call.")
      .def("fetch_packed", &fetch_packed, py::arg("indices"), py::arg("fields"),
           py::arg("alloc"), py::arg("access") = "mmap", py::arg("allow_missing") = false,
           "The samples packed, one column per field, into buffers from alloc(sizes) "
           "(see fastload._core.pack_payloads); returns (keys, column names, missing rows).");

  m.def("index_tables_checksummed", &IndexFile::tables_checksummed,
        "How many index opens in this process checksummed their tables.");
  m.def("build_index", &run_build, py::arg("open_paths"), py::arg("stored_paths"),
        py::arg("index_path"), py::arg("on_duplicate") = "error", py::arg("threads") = 0,
        py::arg("progress") = py::none(),
        "Scans tar shards (headers only, in parallel) and writes an index atomically.");
}

}  // namespace fastload::bindings
