// Packing at the boundary: pack() copies the payloads of a batch, column by column
// (one column per field), into buffers the caller allocates (fastload.collate allocates
// them in shared memory when it runs in a DataLoader worker), each payload copied once,
// with the GIL released.
//
// The caller-allocates contract (the `alloc` callback) is shared with Index.fetch_packed
// (index.cpp): alloc(sizes) is called once, with the GIL held, in the calling thread,
// with 2 sizes per column: the column's payload bytes, then 8 * (rows + 1) for its
// offsets; it returns one writable contiguous buffer per size, at least that long.
// Offsets are native-endian int64: row r of column c is data[off[r], off[r + 1]).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "bindings/collate.hpp"
#include "bindings/common.hpp"
#include "common/columns.hpp"

namespace fastload::bindings {

OutBuffers::~OutBuffers() {
  for (Py_buffer& v : views_) PyBuffer_Release(&v);
}

OutBuffers OutBuffers::allocate(const py::handle& alloc, const std::vector<uint64_t>& sizes) {
  py::list request(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) request[i] = py::int_(sizes[i]);
  py::object got = alloc(request);
  if (!PySequence_Check(got.ptr()) || size_t(PySequence_Size(got.ptr())) != sizes.size())
    throw py::value_error("alloc must return one buffer per requested size (" +
                          std::to_string(sizes.size()) + ")");
  OutBuffers out;
  out.views_.reserve(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    py::object item = py::reinterpret_steal<py::object>(PySequence_GetItem(got.ptr(), Py_ssize_t(i)));
    if (!item) throw py::error_already_set();
    Py_buffer v{};
    if (PyObject_GetBuffer(item.ptr(), &v, PyBUF_SIMPLE | PyBUF_WRITABLE) != 0)
      throw py::error_already_set();
    out.views_.push_back(v);  // released by ~OutBuffers from here on
    if (uint64_t(v.len) < sizes[i])
      throw py::value_error("alloc returned a buffer of " + std::to_string(v.len) +
                            " bytes where " + std::to_string(sizes[i]) + " were asked for");
  }
  return out;
}

namespace {

// Read-only views of every payload of a batch, released (with the GIL held) when the
// pack() call that took them returns.
class InViews {
 public:
  explicit InViews(size_t n) : views_(n), held_(n, false) {}
  ~InViews() {
    for (size_t i = 0; i < views_.size(); ++i)
      if (held_[i]) PyBuffer_Release(&views_[i]);
  }
  InViews(const InViews&) = delete;
  InViews& operator=(const InViews&) = delete;
  bool take(size_t i, PyObject* obj) {
    if (PyObject_GetBuffer(obj, &views_[i], PyBUF_SIMPLE) != 0) return false;
    held_[i] = true;
    return true;
  }
  const Py_buffer& operator[](size_t i) const { return views_[i]; }

 private:
  std::vector<Py_buffer> views_;
  std::vector<bool> held_;
};

std::string name_at(const py::sequence& names, size_t i) {
  return i < py::len(names) ? py::str(names[i]).cast<std::string>() : std::to_string(i);
}

py::list pack(const py::sequence& columns, const py::function& alloc, const py::sequence& names,
              const py::sequence& keys, bool allow_missing) {
  const size_t ncol = py::len(columns);
  std::vector<py::object> cols;  // PySequence_Fast: lists and tuples read without copies
  size_t rows = 0;
  for (size_t c = 0; c < ncol; ++c) {
    PyObject* fast = PySequence_Fast(py::object(columns[c]).ptr(), "a column must be a sequence");
    if (!fast) throw py::error_already_set();
    cols.push_back(py::reinterpret_steal<py::object>(fast));
    const size_t n = size_t(PySequence_Fast_GET_SIZE(fast));
    if (c && n != rows)
      throw py::value_error("every column must have as many rows as the first (" +
                            std::to_string(rows) + "), column " + name_at(names, c) + " has " +
                            std::to_string(n));
    rows = n;
  }

  InViews in(ncol * rows);
  std::vector<uint64_t> size(ncol * rows, 0);
  std::vector<uint64_t> request(2 * ncol, 0);
  py::list missing(ncol);
  for (size_t c = 0; c < ncol; ++c) {
    PyObject** items = PySequence_Fast_ITEMS(cols[c].ptr());
    py::list absent;
    for (size_t r = 0; r < rows; ++r) {
      const size_t i = c * rows + r;
      if (items[r] == Py_None) {
        if (!allow_missing)
          throw py::key_error("sample '" + name_at(keys, r) + "' has no field '" +
                              name_at(names, c) + "' (collate(..., allow_missing=True) gives None)");
        absent.append(r);
        continue;
      }
      if (!in.take(i, items[r])) {
        PyErr_Clear();
        throw py::type_error("field '" + name_at(names, c) + "' of sample '" + name_at(keys, r) +
                             "' is a " + std::string(Py_TYPE(items[r])->tp_name) +
                             ", not a bytes-like object (collate packs payloads: bytes, "
                             "buffers, fastload Payloads; or ints)");
      }
      size[i] = uint64_t(in[i].len);
      request[2 * c] += size[i];
    }
    request[2 * c + 1] = offsets_bytes(rows);
    missing[c] = py::len(absent) ? py::object(absent) : py::none();
  }

  OutBuffers out = OutBuffers::allocate(alloc, request);
  {
    py::gil_scoped_release nogil;
    for (size_t c = 0; c < ncol; ++c) {
      char* dst = out.data(2 * c);
      write_offsets(out.data(2 * c + 1), size.data() + c * rows, rows);
      for (size_t r = 0; r < rows; ++r) {
        const size_t i = c * rows + r;
        if (size[i]) std::memcpy(dst, in[i].buf, size[i]);
        dst += size[i];
      }
    }
  }
  return missing;
}

}  // namespace

void register_collate(py::module_& m) {
  m.def("pack_payloads", &pack, py::arg("columns"), py::arg("alloc"), py::arg("names") = py::tuple(),
        py::arg("keys") = py::tuple(), py::arg("allow_missing") = false,
        "Copies columns of payloads (bytes-like or None) back to back into buffers from "
        "alloc(sizes), with the GIL released. Returns, per column, the rows that were None "
        "(or None where every row had a payload).");
}

}  // namespace fastload::bindings
