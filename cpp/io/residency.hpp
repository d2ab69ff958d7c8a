// How much of a file's byte range is in the page cache, asked without reading it.
//
// The archive reader uses it to choose, block by block, between a buffered read (the
// bytes are cached: a copy out of memory) and an O_DIRECT read (they are not: the disk
// DMAs straight into the read block, with no copy and without filling the page cache
// with an archive nobody reads twice). mmap + mincore(2) works on every kernel; the
// mapping is never touched, so asking starts no I/O (a probing read with RWF_NOWAIT
// would: it still starts readahead before it returns EAGAIN).
#pragma once

#include <cstdint>

namespace fastload::io {

// The bytes of [offset, offset + length) of fd whose pages are resident (length when
// all are; 0 for an empty range). On failure returns 0 and sets *err to -errno; else
// *err is 0.
uint64_t cached_bytes(int fd, uint64_t offset, uint64_t length, int* err) noexcept;

}  // namespace fastload::io
