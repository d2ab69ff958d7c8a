// Writing webdataset-style tar shards (the other side of the shard index).
//
//   write_header()  deterministic member headers: POSIX ustar, uid/gid 0, empty user and
//                   group names, mode 0644, one fixed mtime; a pax 'x' header before it
//                   when the name is longer than 100 bytes or the size needs more than
//                   11 octal digits. Same name and size, same bytes.
//   ShardFile       one shard written sequentially under a temporary name, renamed into
//                   place by commit() (fastload.ShardWriter writes through it).
//   list_archive()  the regular members of a tar, or of a tar of tars, from their headers
//                   only (data is seeked over): what a pack plan is computed from.
//   run()           executes a pack plan (computed in python/fastload/packing/): members
//                   in output order, cut into shards, read from source files or from one
//                   archive, written by several threads at once, each shard renamed into
//                   place once complete.
//
// Same plan, same bytes: nothing in a shard depends on timing, threads or the clock.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/cancel.hpp"
#include "common/unique_fd.hpp"

namespace fastload::pack {

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

// ---- listing archives ----------------------------------------------------------------

struct Listed {
  std::string path;  // normalised ("./a//b" -> "a/b"); in a tar of tars "inner/path",
                     // inner being the member tar's path without ".tar"
  uint64_t offset;   // of the data in the archive file
  uint64_t size;
};

struct Listing {
  std::vector<Listed> members;       // regular files, in archive order
  uint64_t inner_tars = 0;           // member tars listed (nested)
  uint64_t skipped = 0;              // links and other non-regular members (not directories)
  std::vector<std::string> skipped_examples;  // the first few of those
};

// Lists the regular members of the tar file at `path` by reading headers only (small
// members are read through in 64 KiB windows, large ones seeked over). nested: members
// named *.tar are listed as archives themselves (one level), several at a time on
// `threads` threads. Throws Error: kOs, kFormat (malformed archive, naming the member),
// kUnsafe (absolute paths or ".." in member names), kCancelled.
Listing list_archive(const std::string& path, bool nested, unsigned threads,
                     const CancelToken* cancel = nullptr);

// ---- executing a plan ----------------------------------------------------------------

enum class Mode : uint8_t {
  kPerShard,  // each thread writes whole shards front to back, reading every member
              // (a file per member: a directory tree)
  kScatter,   // threads read the sources in large ordered batches and write every member
              // at its precomputed place in its shard (one archive as the source)
};

struct Plan {
  // Source files: source i is root/sources[src_offsets[i], src_offsets[i+1]) (or that
  // path alone when root is empty).
  std::string root;
  std::string_view sources;
  std::span<const uint64_t> src_offsets;
  // Members, in output order: shard after shard, sample after sample.
  std::span<const int64_t> m_src;     // source file, or -1: the data is inline[m_off, +size)
  std::span<const uint64_t> m_off;    // offset of the data in the source (or in inline)
  std::span<const uint64_t> m_size;
  std::span<const uint64_t> m_name;   // name offsets into names (m_name[i]..+m_name_len[i])
  std::span<const uint32_t> m_name_len;
  std::span<const uint8_t> m_first;   // 1 where a sample starts (progress only)
  std::string_view names;
  std::string_view inline_data;
  bool whole_files = false;  // every member is a whole source file (a tree)
  // Shards: shard s holds members [shard_first[s], shard_first[s+1]).
  std::span<const uint64_t> shard_first;
  std::vector<std::string> final_paths, tmp_paths;
};

struct Options {
  Mode mode = Mode::kPerShard;
  unsigned threads = 0;        // 0: one per CPU (at most 16)
  bool sync = true;            // fdatasync each shard before renaming it
  size_t max_open = 256;       // kScatter: shards open at once (more: several passes)
  const CancelToken* cancel = nullptr;
  std::atomic<uint64_t>* samples_done = nullptr;
  std::atomic<uint64_t>* bytes_done = nullptr;  // source bytes copied
};

struct Result {
  uint64_t shards = 0, samples = 0, members = 0, bytes = 0;  // bytes: of the shards
};

// Checks the plan (sizes of spans, offsets in range), then writes every shard. Throws
// Error: kOs (naming the file), kSourceChanged (a source file of another size than
// planned), kCancelled; std::invalid_argument for an inconsistent plan. On failure no
// temporary file is left; shards already renamed into place stay.
Result run(const Plan& plan, const Options& options);

// Shard sizes a plan gives (end-of-archive marker included), without writing anything.
std::vector<uint64_t> shard_sizes(const Plan& plan);

}  // namespace fastload::pack
