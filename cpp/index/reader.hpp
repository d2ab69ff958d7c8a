// Reading a shard index and the samples it describes.
//
//   IndexFile  the index, mmapped read-only. open() checks magic, version, header
//              checksum, table bounds and the tables' checksum; records are then read
//              in place (bounds-checked on access), so opening costs O(file size) of
//              checksumming and nothing per sample beyond that.
//   Shards     the shards of one index, each opened and mmapped lazily on first use
//              (so the first sample of a 1,000-shard set costs one open), and the
//              batched fetch: plan the members of many samples, then either map them
//              (page faults, local disk) or read them all at once through the I/O
//              engine (network storage, where each fault is a round trip).
//
// Errors: Error(kIndexFormat) for a corrupt, foreign-version or stale index (naming the
// index or the shard and what is wrong), Error(kOs) for I/O failures.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.hpp"
#include "index/format.hpp"

namespace fastload::io {
class Engine;
}

namespace fastload::index {

// A read-only mapping of a whole file, unmapped when the last owner lets go.
class Mapping {
 public:
  // Maps [0, size) of fd. size 0 gives an empty mapping (no mmap call).
  Mapping(int fd, uint64_t size, const std::string& path);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const char* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }

 private:
  const char* data_ = nullptr;
  uint64_t size_ = 0;
};

class IndexFile {
 public:
  // Opens, maps and validates the index. Throws Error(kIndexFormat) naming `path` and
  // what is wrong, Error(kOs) when it cannot be opened.
  static std::shared_ptr<const IndexFile> open(const std::string& path);

  const std::string& path() const noexcept { return path_; }
  // The folder shard paths are relative to ("." for an index in the working folder).
  const std::string& folder() const noexcept { return folder_; }
  const Header& header() const noexcept { return header_; }
  uint64_t shard_count() const noexcept { return header_.shard_count; }
  uint64_t sample_count() const noexcept { return header_.sample_count; }
  uint64_t member_count() const noexcept { return header_.member_count; }
  uint64_t field_count() const noexcept { return header_.field_count; }

  // Records, bounds-checked: an index out of range is a caller bug (std::out_of_range);
  // a record whose references point outside the file is Error(kIndexFormat).
  ShardRecord shard(uint64_t i) const;
  SampleRecord sample(uint64_t i) const;
  MemberRecord member(uint64_t i) const;
  std::string_view shard_path(uint64_t i) const;  // as stored (relative)
  std::string shard_open_path(uint64_t i) const;  // resolved against folder()
  std::string_view key(uint64_t sample) const;
  std::string_view field_name(uint64_t field) const;
  // The sample with this key, if any.
  std::optional<uint64_t> find(std::string_view key) const;
  // The id of the field with this name, if any.
  std::optional<uint32_t> field_id(std::string_view name) const;

  // Checks that every shard still has the size and mtime it had when indexed. Throws
  // Error(kIndexFormat) naming the first shard that is missing or changed.
  void check_shards() const;

  // How many times open() has checksummed an index's tables in this process (each open
  // reads the whole table region once): for tests and benchmarks of reopening.
  static uint64_t tables_checksummed() noexcept;

 private:
  IndexFile() = default;
  [[noreturn]] void corrupt(const std::string& what) const;
  std::string_view str(uint64_t offset, uint64_t length, const char* what) const;

  std::string path_, folder_;
  std::unique_ptr<Mapping> map_;
  Header header_{};
};

// One member of one sample of a batch, as planned by Shards::plan().
struct Piece {
  uint32_t slot;    // position of the sample in the batch
  uint32_t field;   // field id
  uint32_t shard;
  uint64_t offset;  // in the shard
  uint64_t size;
};

class Shards {
 public:
  explicit Shards(std::shared_ptr<const IndexFile> index);
  ~Shards();
  Shards(const Shards&) = delete;
  Shards& operator=(const Shards&) = delete;

  const IndexFile& index() const noexcept { return *index_; }

  // Appends the members of samples[k] to out (slot k), in tar order; with `want` (one
  // entry per field id: true = wanted) only those fields. Checks each member lies
  // inside its shard's recorded size. Thread-safe.
  void plan(std::span<const uint64_t> samples, const std::vector<bool>* want,
            std::vector<Piece>& out) const;

  // The mapping of shard i, opened on first use (and checked to still have its
  // recorded size). Thread-safe; the mapping lives as long as any holder.
  std::shared_ptr<const Mapping> mapping(uint32_t shard);

  // Drops this object's mapping and descriptor of shard i (the next use opens the file
  // again, by its path): for a shard file that may be removed or replaced once its
  // reader lets go of it, so that no mapping here keeps the old file's blocks. Payloads
  // still holding the mapping keep it until they go. Thread-safe (waits for a read()).
  void forget(uint32_t shard);

  // Touches every page of the pieces (in their mappings) so the page faults happen
  // here, in the caller's thread, rather than later under the GIL.
  void prefault(std::span<const Piece> pieces);

  // Reads every piece into dst[i] (dst[i] holds pieces[i].size bytes), all at once
  // through the I/O engine (created on first use; FASTLOAD_ENGINE picks the backend).
  // Thread-safe (one batch at a time).
  void read(std::span<const Piece> pieces, std::span<char* const> dst);

  // The engine's name once read() has run ("uring", "pread"), else "".
  std::string engine_name() const;

 private:
  int shard_fd(uint32_t shard, std::span<const Piece> keep);

  std::shared_ptr<const IndexFile> index_;
  mutable std::mutex map_mu_;
  std::vector<std::shared_ptr<const Mapping>> maps_;
  std::vector<uint64_t> shard_size_;  // recorded sizes, for bounds checks

  // read(): the engine and the open shard descriptors, used one batch at a time.
  mutable std::mutex read_mu_;
  std::unique_ptr<io::Engine> engine_;
  pid_t engine_pid_ = 0;  // a forked child must not use (nor join) its parent's engine
  std::vector<UniqueFd> fds_;
  size_t open_fds_ = 0;
};

}  // namespace fastload::index
