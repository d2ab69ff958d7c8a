// Chunk digests: a fast 64-bit non-cryptographic checksum ("fl64"), computed on each
// chunk while it is copied, stored in the manifest and recomputed by verify().
// It detects corruption and truncation; it is not a defence against an adversary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastload::hash {

// One-shot digest of [data, data+len).
uint64_t fl64(const void* data, size_t len, uint64_t seed = 0) noexcept;

// Streaming form: feeding the same bytes in any split gives the same value as fl64().
class Fl64Stream {
 public:
  explicit Fl64Stream(uint64_t seed = 0) noexcept;
  void update(const void* data, size_t len) noexcept;
  uint64_t digest() const noexcept;  // may be called more than once; does not reset

 private:
  uint64_t acc_[8];              // the eight lanes
  uint64_t total_ = 0;           // bytes fed so far, buffered ones included
  uint64_t seed_;
  unsigned char buf_[64];        // a partial stripe, waiting for more bytes
  size_t buffered_ = 0;
  unsigned pos_ = 0;             // position of the next stripe inside its 1 KiB block
};

// Digest of len zero bytes (holes of sparse files), without touching memory.
uint64_t fl64_zeros(uint64_t len, uint64_t seed = 0) noexcept;

}  // namespace fastload::hash
