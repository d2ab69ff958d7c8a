// Native errors become Python exceptions here, once. The classes live in Python
// (fastload.errors); a factory there picks the subclass from the kind and errno.
#include "bindings/common.hpp"
#include "common/error.hpp"

namespace fastload::bindings {

static const char* kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::kOs: return "os";
    case ErrorKind::kNoSpace: return "no_space";
    case ErrorKind::kSourceChanged: return "source_changed";
    case ErrorKind::kUnsupported: return "unsupported";
    case ErrorKind::kFormat: return "format";
    case ErrorKind::kIndexFormat: return "index_format";
    case ErrorKind::kUnsafe: return "unsafe";
    case ErrorKind::kCancelled: return "cancelled";
  }
  return "os";
}

void register_errors(py::module_& m) {
  (void)m;
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kCancelled) {
        PyErr_SetNone(PyExc_KeyboardInterrupt);
        return;
      }
      // Builds the exception with fastload.errors.from_native(kind, errno, op, path, msg).
      try {
        py::object factory = py::module_::import("fastload.errors").attr("from_native");
        py::object exc = factory(kind_name(e.kind()), e.err(), e.op(), fs_str(e.path()),
                                 fs_str(e.what()));
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      } catch (py::error_already_set& inner) {
        inner.restore();
      }
    }
  });
}

}  // namespace fastload::bindings
