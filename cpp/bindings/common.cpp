// The helpers every binding file uses (declared in common.hpp).
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "bindings/common.hpp"

namespace fastload::bindings {

py::str fs_str(const std::string& s) {
  PyObject* o = PyUnicode_DecodeFSDefaultAndSize(s.data(), Py_ssize_t(s.size()));
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

std::string fs_bytes(const py::handle& obj) {
  PyObject* b = nullptr;
  if (!PyUnicode_FSConverter(obj.ptr(), &b)) throw py::error_already_set();
  auto owned = py::reinterpret_steal<py::bytes>(b);
  return std::string(owned);
}

std::span<const char> contiguous_bytes(const py::buffer_info& info, const char* what) {
  if (!PyBuffer_IsContiguous(info.view(), 'C'))
    throw py::value_error(std::string(what) + " needs a contiguous buffer");
  return {static_cast<const char*>(info.ptr), size_t(info.size * info.itemsize)};
}

std::vector<std::string> fs_list(const py::iterable& items) {
  std::vector<std::string> out;
  for (auto item : items) out.push_back(fs_bytes(item));
  return out;
}

void run_cancellable(const std::function<void()>& work, CancelToken& cancel,
                     const std::function<void()>& tick) {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::exception_ptr error;
  std::thread worker([&] {
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lock(mu);
    finished = true;
    cv.notify_all();
  });
  auto stop = [&] {
    cancel.cancel();
    py::gil_scoped_release nogil;
    worker.join();
  };
  for (;;) {
    bool over;
    {
      py::gil_scoped_release nogil;
      std::unique_lock lock(mu);
      over = cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return finished; });
    }
    if (over) break;
    if (PyErr_CheckSignals() != 0) {
      stop();
      throw py::error_already_set();
    }
    if (tick) {
      try {
        tick();
      } catch (...) {
        stop();
        throw;
      }
    }
  }
  worker.join();
  if (error) std::rethrow_exception(error);
}

io::Kind engine_kind(const std::string& name) {
  io::Kind kind;
  if (!io::parse_kind(name, &kind))
    throw py::value_error("unknown engine '" + name + "' (expected 'auto', 'uring' or 'pread')");
  return kind;
}

}  // namespace fastload::bindings
