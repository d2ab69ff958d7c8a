// Writing tar files: deterministic member headers and a shard written front to back.
//
//   write_header()  deterministic member headers: POSIX ustar, uid/gid 0, empty user and
//                   group names, mode 0644, one fixed mtime; a pax 'x' header before it
//                   when the name is longer than 100 bytes or the size needs more than
//                   11 octal digits. Same name and size, same bytes.
//   ShardFile       one shard written sequentially under a temporary name, renamed into
//                   place by commit() (fastload.ShardWriter writes through it; pack's
//                   per-shard mode too).
//   read_source()   a member's bytes read from its source file, refusing a file that
//                   changed size since it was planned (pack's scatter mode reads through it).
//
// The archives are what tar/reader.hpp parses back: ustar, and pax for long names and
// sizes. Errors are fastload::Error (kOs naming the file, kSourceChanged).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.hpp"

namespace fastload::tar {

inline constexpr uint64_t kBlock = 512;
inline constexpr int64_t kMtime = 946684800;  // 2000-01-01T00:00:00Z, on every member
inline constexpr uint64_t kEndBytes = 2 * kBlock;  // the end-of-archive marker
inline constexpr size_t kUstarName = 100;
inline constexpr uint64_t kOctalSizeMax = 077777777777ull;  // 11 octal digits

constexpr uint64_t padded(uint64_t n) { return (n + kBlock - 1) & ~(kBlock - 1); }

// Bytes of the header blocks of a member (512, or more with a pax header).
uint64_t header_bytes(size_t name_len, uint64_t size);
// Bytes a member takes in a shard: headers, data, padding.
inline uint64_t member_bytes(size_t name_len, uint64_t size) {
  return header_bytes(name_len, size) + padded(size);
}
// Writes the header blocks of a member to out (header_bytes() bytes) and returns their
// count. name: the member's path, not empty, without NUL bytes (checked by callers).
size_t write_header(std::string_view name, uint64_t size, char* out);

// A shard written front to back through a buffer: created (truncated) at tmp_path,
// renamed to final_path by commit(). Destroyed without commit(), it removes tmp_path.
// Not thread-safe; one writer per shard.
class ShardFile {
 public:
  ShardFile(std::string final_path, std::string tmp_path, size_t buffer_bytes = 4u << 20);
  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  // One member from memory.
  void add(std::string_view name, const char* data, uint64_t size);
  // One member whose `size` bytes are read from fd at offset (pread); `what` names the
  // source in errors. whole_file: the member is the whole file, so a file that is now
  // longer or shorter than `size` is a kSourceChanged error.
  void add_from(std::string_view name, uint64_t size, int fd, uint64_t offset, bool whole_file,
                const std::string& what);
  // Bytes of members so far (the end-of-archive marker is added by commit()).
  uint64_t bytes() const { return bytes_; }
  uint64_t members() const { return members_; }
  // Writes the end-of-archive marker, (sync) fdatasync, renames into place. Throws
  // Error(kOs); on failure the temporary file is removed.
  void commit(bool sync);
  // Closes and removes the temporary file (no-op after commit()).
  void abort() noexcept;
  const std::string& path() const { return final_path_; }

 private:
  void flush();
  void write_all(const char* p, size_t n);
  char* room(size_t n);  // n <= capacity: contiguous space at the end of the buffer

  std::string final_path_, tmp_path_;
  UniqueFd fd_;
  std::vector<char> buf_;
  size_t fill_ = 0;
  uint64_t bytes_ = 0, members_ = 0;
  bool done_ = false;
};

// Reads exactly n bytes at off of fd into dst; `what` names the source in errors.
// check_eof: the bytes are a whole file, which must end right after them, and dst has
// room for n + 1 bytes (a regular file's read returns less than asked only at its end,
// so the check costs no extra call). A file that is shorter, or (check_eof) longer, is
// Error(kSourceChanged); a failed read Error(kOs).
void read_source(int fd, char* dst, uint64_t n, uint64_t off, bool check_eof,
                 const std::string& what);

}  // namespace fastload::tar
