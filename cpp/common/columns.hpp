// The packed column layout that fastload.collate (pack_payloads) and Index.fetch_packed
// both produce: per column, its rows' payloads back to back in one buffer, and rows + 1
// native-endian int64 offsets in another (row r is data[off[r], off[r + 1]); off[0] is
// 0, off[rows] the column's bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fastload {

// Bytes of a column's offsets.
constexpr uint64_t offsets_bytes(size_t rows) { return 8 * (uint64_t(rows) + 1); }

// Writes the rows + 1 offsets of rows of sizes[0 .. rows) to dst (offsets_bytes(rows)
// bytes, any alignment).
inline void write_offsets(char* dst, const uint64_t* sizes, size_t rows) noexcept {
  int64_t at = 0;
  for (size_t r = 0; r < rows; ++r) {
    std::memcpy(dst + 8 * r, &at, 8);  // memcpy: dst need not be 8-aligned
    at += int64_t(sizes[r]);
  }
  std::memcpy(dst + 8 * rows, &at, 8);
}

}  // namespace fastload
