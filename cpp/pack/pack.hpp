// Packing webdataset-style tar shards (the other side of the shard index); the tar
// writing itself (headers, ShardFile) is tar/writer.hpp's.
//
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

namespace fastload::pack {

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
