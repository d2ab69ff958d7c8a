// The file system under a path: what kind it is (statfs(2)'s magic number, and the one
// table of the kinds fastload knows by name, network file systems marked), and flushing
// it to stable storage (syncfs(2)).
//
// Staging reads a source on a network or FUSE file system through the thread pool
// rather than io_uring (there io_uring punts every open and uncached read to its kernel
// workers anyway); probe names the file systems in its report. Both read this table
// (Python through _core.file_systems()).
//
// Like the rest of the I/O layer, nothing here throws: failures return -errno.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace fastload::io {

struct FsKind {
  uint32_t magic;    // statfs(2) f_type, truncated to 32 bits as the kernel defines it
  const char* name;  // short and lower-case: "ext4", "nfs", "lustre", "fuse"
  bool network;      // a network or FUSE file system (its reads are round trips)
};

// Every kind known by name, each magic once.
std::span<const FsKind> file_systems() noexcept;

// The kind with this magic, or nullptr when it is not in the table.
const FsKind* find_fs(uint32_t magic) noexcept;

// The magic number of the file system holding path: 0 and *magic set, or -errno.
int fs_magic(const std::string& path, uint32_t* magic) noexcept;

// Flushes the file system holding path (a file or directory that can be opened
// read-only) to stable storage: 0 or -errno.
int sync_fs(const std::string& path) noexcept;

}  // namespace fastload::io
