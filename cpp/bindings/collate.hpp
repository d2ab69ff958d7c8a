// What pack() (collate.cpp) and Index.fetch_packed (index.cpp) share: the buffers a
// Python `alloc(sizes)` callback hands out. See collate.cpp for the contract; the
// layout is common/columns.hpp's.
#pragma once

#include <cstdint>
#include <vector>

#include "bindings/common.hpp"

namespace fastload::bindings {

// Writable views of the buffers alloc(sizes) returned, held (so their memory stays put)
// until destroyed, which must happen with the GIL held.
class OutBuffers {
 public:
  // Calls alloc(list of sizes) and takes a writable contiguous view of each buffer it
  // returns; ValueError when it returns the wrong count or a buffer that is too short.
  static OutBuffers allocate(const py::handle& alloc, const std::vector<uint64_t>& sizes);
  ~OutBuffers();
  OutBuffers(OutBuffers&& other) noexcept : views_(std::move(other.views_)) {
    other.views_.clear();
  }
  OutBuffers(const OutBuffers&) = delete;
  OutBuffers& operator=(const OutBuffers&) = delete;
  OutBuffers& operator=(OutBuffers&&) = delete;

  char* data(size_t i) const { return static_cast<char*>(views_[i].buf); }

 private:
  OutBuffers() = default;
  std::vector<Py_buffer> views_;
};

}  // namespace fastload::bindings
