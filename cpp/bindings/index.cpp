// The shard index at the boundary: build_index() (a background thread, waited on in
// 100 ms slices so Ctrl-C cancels it), Index (an opened index and its shards) with the
// batched fetch, and Payload, the zero-copy read-only buffer over a member's bytes.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>

#include "bindings/collate.hpp"
#include "bindings/common.hpp"
#include "common/error.hpp"
#include "index/builder.hpp"
#include "index/reader.hpp"

#include <pybind11/stl.h>

namespace fastload::bindings {
namespace {

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

const char kEmpty[1] = {0};

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

// The arguments fetch() and fetch_packed() share, parsed once.
struct Request {
  bool read_mode = false;          // access="read" (else "mmap")
  std::vector<uint64_t> samples;   // sample positions (negative indices resolved)
  std::vector<uint32_t> fields;    // the field ids named, in order (empty: fields=None)
  std::optional<std::vector<bool>> want;  // a mask over field ids (nullopt: every field)
  size_t nwanted = 0;              // fields set in want
};

// The id of the field `name`; unknown names are a ValueError listing what the index has.
uint32_t field_id(const PyIndex& ix, const std::string& name) {
  for (uint64_t f = 0; f < ix.file->field_count(); ++f)
    if (ix.file->field_name(f) == name) return uint32_t(f);
  std::string have;
  for (uint64_t f = 0; f < ix.file->field_count(); ++f)
    have += (f ? ", " : "") + std::string(ix.file->field_name(f));
  throw py::value_error("no field '" + name + "' in index '" + ix.file->path() +
                        "' (its fields: " + have + ")");
}

Request parse_request(const PyIndex& ix, const py::handle& indices, const py::object& fields,
                      const std::string& access) {
  Request r;
  r.read_mode = access == "read";
  if (!r.read_mode && access != "mmap")
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
  if (fields.is_none()) return r;
  r.want.emplace(ix.file->field_count(), false);
  for (py::handle h : fields) {
    const uint32_t f = field_id(ix, fs_bytes(h));
    r.fields.push_back(f);
    if (!(*r.want)[f]) ++r.nwanted;
    (*r.want)[f] = true;
  }
  return r;
}

// One call, one batch: plan (GIL released), bring the bytes in (GIL released), then
// build the dicts. copy=false hands out Payloads; copy=true fills bytes objects (made
// with the GIL, filled without it: nothing else can see them yet).
py::list fetch(PyIndex& ix, const py::handle& indices, const py::object& fields, bool copy,
               const std::string& access) {
  const Request req = parse_request(ix, indices, fields, access);
  const bool read_mode = req.read_mode;
  const std::vector<uint64_t>& samples = req.samples;
  std::vector<Piece> pieces;
  std::vector<std::shared_ptr<const index::Mapping>> maps;  // per piece (mmap mode)
  std::shared_ptr<char[]> block;                            // read mode, copy=false
  std::vector<char*> dst;                                   // read mode: per piece
  {
    py::gil_scoped_release nogil;
    pieces.reserve(samples.size() * 4);
    ix.shards->plan(samples, req.want ? &*req.want : nullptr, pieces);
    if (!read_mode) {
      maps.resize(pieces.size());
      for (size_t i = 0; i < pieces.size(); ++i)
        maps[i] = (i && pieces[i].shard == pieces[i - 1].shard)
                      ? maps[i - 1]
                      : ix.shards->mapping(pieces[i].shard);
      if (!copy) ix.shards->prefault(pieces);
    } else if (!copy) {
      uint64_t total = 0;
      for (const Piece& p : pieces) total += p.size;
      block = std::shared_ptr<char[]>(new char[std::max<uint64_t>(total, 1)]);
      dst.resize(pieces.size());
      uint64_t at = 0;
      for (size_t i = 0; i < pieces.size(); ++i) {
        dst[i] = block.get() + at;
        at += pieces[i].size;
      }
      ix.shards->read(pieces, dst);
    }
  }

  std::vector<py::object> values(pieces.size());
  if (copy) {
    dst.resize(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      PyObject* b = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(pieces[i].size));
      if (!b) throw py::error_already_set();
      values[i] = py::reinterpret_steal<py::object>(b);
      dst[i] = PyBytes_AS_STRING(b);
    }
    py::gil_scoped_release nogil;
    if (read_mode) {
      ix.shards->read(pieces, dst);
    } else {
      for (size_t i = 0; i < pieces.size(); ++i)
        if (pieces[i].size) std::memcpy(dst[i], maps[i]->data() + pieces[i].offset, pieces[i].size);
    }
  } else {
    for (size_t i = 0; i < pieces.size(); ++i) {
      const size_t size = size_t(pieces[i].size);
      if (read_mode)
        values[i] = make_payload(block, size ? dst[i] : kEmpty, size);
      else
        values[i] = make_payload(maps[i], size ? maps[i]->data() + pieces[i].offset : kEmpty, size);
    }
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
    if (req.want && got != req.nwanted) {
      for (uint32_t f : req.fields)
        if (!d.contains(ix.field_names[f]))
          throw py::key_error("sample '" + std::string(ix.file->key(samples[k])) +
                              "' has no field '" + std::string(ix.file->field_name(f)) + "'");
    }
    out[k] = std::move(d);
  }
  return out;
}

// The batch packed (fastload.collate's fast path): one column per field, each payload
// copied once, from the mapping (or by the I/O engine's reads), straight into buffers
// alloc(sizes) hands out (the contract is in collate.cpp). Columns: `fields` in order,
// or every field the batch's samples have, in order of first appearance. A sample
// without a column's field is a KeyError, or with allow_missing a row listed as missing.
// Returns (keys, column names, per column the missing rows or None).
py::tuple fetch_packed(PyIndex& ix, const py::handle& indices, const py::object& fields,
                       const py::function& alloc, const std::string& access,
                       bool allow_missing) {
  const Request req = parse_request(ix, indices, fields, access);
  const bool read_mode = req.read_mode;
  const std::vector<uint64_t>& samples = req.samples;
  const size_t rows = samples.size();
  constexpr uint32_t kNone = UINT32_MAX;
  std::vector<uint32_t> column_of(ix.file->field_count(), kNone);
  std::vector<uint32_t> column_field;  // field id per column
  for (uint32_t f : req.fields)
    if (column_of[f] == kNone) {
      column_of[f] = uint32_t(column_field.size());
      column_field.push_back(f);
    }
  std::vector<Piece> pieces;
  std::vector<size_t> piece_at;  // per (column, row): index in pieces + 1, 0 if none
  std::vector<uint64_t> size;    // per (column, row)
  {
    py::gil_scoped_release nogil;
    pieces.reserve(rows * 4);
    ix.shards->plan(samples, req.want ? &*req.want : nullptr, pieces);
    if (!req.want)
      for (const Piece& p : pieces)
        if (column_of[p.field] == kNone) {
          column_of[p.field] = uint32_t(column_field.size());
          column_field.push_back(p.field);
        }
    piece_at.assign(column_field.size() * rows, 0);
    size.assign(column_field.size() * rows, 0);
    for (size_t i = 0; i < pieces.size(); ++i) {
      const size_t at = column_of[pieces[i].field] * rows + pieces[i].slot;
      piece_at[at] = i + 1;  // a field twice in one sample: the last wins, as in fetch()
      size[at] = pieces[i].size;
    }
  }
  const size_t ncol = column_field.size();
  py::list missing(ncol);
  std::vector<uint64_t> request(2 * ncol, 0);
  for (size_t c = 0; c < ncol; ++c) {
    py::list absent;
    for (size_t r = 0; r < rows; ++r) {
      if (piece_at[c * rows + r]) {
        request[2 * c] += size[c * rows + r];
        continue;
      }
      if (!allow_missing)
        throw py::key_error("sample '" + std::string(ix.file->key(samples[r])) +
                            "' has no field '" + std::string(ix.file->field_name(column_field[c])) +
                            "' (allow_missing=True gives None)");
      absent.append(r);
    }
    request[2 * c + 1] = 8 * (rows + 1);
    missing[c] = py::len(absent) ? py::object(absent) : py::none();
  }

  OutBuffers out = OutBuffers::allocate(alloc, request);
  {
    py::gil_scoped_release nogil;
    std::vector<Piece> todo;  // the pieces to bring in, and where each goes
    std::vector<char*> dst;
    todo.reserve(pieces.size());
    dst.reserve(pieces.size());
    for (size_t c = 0; c < ncol; ++c) {
      write_offsets(out.data(2 * c + 1), size.data() + c * rows, rows);
      char* at = out.data(2 * c);
      for (size_t r = 0; r < rows; ++r) {
        const size_t k = piece_at[c * rows + r];
        if (k && pieces[k - 1].size) {
          todo.push_back(pieces[k - 1]);
          dst.push_back(at);
        }
        at += size[c * rows + r];
      }
    }
    if (read_mode) {
      if (!todo.empty()) ix.shards->read(todo, dst);
    } else {
      std::shared_ptr<const index::Mapping> map;
      uint32_t shard = UINT32_MAX;
      for (size_t i = 0; i < todo.size(); ++i) {
        if (todo[i].shard != shard) {
          shard = todo[i].shard;
          map = ix.shards->mapping(shard);
        }
        std::memcpy(dst[i], map->data() + todo[i].offset, todo[i].size);
      }
    }
  }

  py::list keys(rows);
  for (size_t r = 0; r < rows; ++r) keys[r] = fs_str(std::string(ix.file->key(samples[r])));
  py::list names(ncol);
  for (size_t c = 0; c < ncol; ++c) names[c] = ix.field_names[column_field[c]];
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

}  // namespace

void register_index(py::module_& m) {
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
      .def("fetch", &fetch, py::arg("indices"), py::arg("fields") = py::none(),
           py::arg("copy") = false, py::arg("access") = "mmap",
           "Samples as dicts {'__key__': key, field: Payload | bytes}, one native call.")
      .def("fetch_packed", &fetch_packed, py::arg("indices"), py::arg("fields"),
           py::arg("alloc"), py::arg("access") = "mmap", py::arg("allow_missing") = false,
           "The samples packed, one column per field, into buffers from alloc(sizes) "
           "(see fastload._core.pack_payloads); returns (keys, column names, missing rows).");

  m.def("build_index", &run_build, py::arg("open_paths"), py::arg("stored_paths"),
        py::arg("index_path"), py::arg("on_duplicate") = "error", py::arg("threads") = 0,
        py::arg("progress") = py::none(),
        "Scans tar shards (headers only, in parallel) and writes an index atomically.");
}

}  // namespace fastload::bindings
