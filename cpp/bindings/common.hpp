// Helpers shared by the binding files. Only cpp/bindings/ includes pybind11.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/cancel.hpp"
#include "io/engine.hpp"

namespace fastload::bindings {

namespace py = pybind11;

// File names cross the boundary as the OS gives them: bytes on the C++ side, str with
// surrogateescape on the Python side (what os.fsdecode/os.fsencode do).
py::str fs_str(const std::string& s);
std::string fs_bytes(const py::handle& obj);  // accepts str, bytes or os.PathLike
std::vector<std::string> fs_list(const py::iterable& items);  // fs_bytes of each

// The bytes of a requested buffer; a strided one raises ValueError("<what> needs a
// contiguous buffer"). `info` holds the view: keep it for as long as the bytes are used.
std::span<const char> contiguous_bytes(const py::buffer_info& info, const char* what);

// Runs work() on a thread while this (Python) thread waits in 100 ms slices: Ctrl-C
// cancels the work and raises KeyboardInterrupt once it has stopped; tick() (progress,
// may be empty) runs between slices with the GIL held, and what it throws cancels too.
// What work() throws is rethrown here.
void run_cancellable(const std::function<void()>& work, CancelToken& cancel,
                     const std::function<void()>& tick);

// An engine name ("auto", "uring", "io_uring", "pread") as a kind; anything else raises
// ValueError naming it.
io::Kind engine_kind(const std::string& name);

void register_errors(py::module_& m);
void register_io(py::module_& m);
void register_copy(py::module_& m);
void register_hash(py::module_& m);
void register_index(py::module_& m);
void register_extract(py::module_& m);
void register_pack(py::module_& m);
void register_collate(py::module_& m);
void register_shm(py::module_& m);
void register_order(py::module_& m);
void register_objects(py::module_& m);

}  // namespace fastload::bindings
