// Builds a shard index (format.hpp) by scanning tar headers only.
//
// Shards are scanned in parallel, each by one thread, with tar::scan_file: only the
// header blocks are read (pread), member data is seeked over. Samples follow webdataset:
// the key of a member is its path up to the first dot of its base name, the field the
// rest ("a/b/x.seg.png" -> key "a/b/x", field "seg.png"); consecutive members with the
// same key form one sample. Directories and other non-regular members are ignored, as
// are top-level "__name__" metadata members (webdataset's convention); a leading "./"
// is dropped from every path.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/cancel.hpp"

namespace fastload::index {

struct ShardInput {
  std::string open_path;    // where to open the shard now
  std::string stored_path;  // what the index records (relative to the index's folder)
};

enum class OnDuplicate : uint8_t {
  kError,  // a key seen twice (in two shards, or twice apart in one) is an Error(kFormat)
  kFirst,  // the first sample with a key wins; later ones are left out of the index
};

struct BuildOptions {
  OnDuplicate on_duplicate = OnDuplicate::kError;
  unsigned threads = 0;  // 0: one per online CPU (at most 16), never more than shards
  const CancelToken* cancel = nullptr;          // checked between headers
  std::atomic<uint64_t>* shards_done = nullptr;  // progress, for the caller to poll
};

struct BuildResult {
  uint64_t shards = 0;
  uint64_t samples = 0;
  uint64_t members = 0;
  uint64_t fields = 0;
  uint64_t shard_bytes = 0;         // total size of the shards
  uint64_t duplicates_skipped = 0;  // samples left out by OnDuplicate::kFirst
  uint64_t index_bytes = 0;
};

// One shard's members as scan_one() found them (its headers only), to build an index
// from later (build_bytes() with scans), when the shard itself may be gone by then.
struct ShardScan;

// Scans the tar shard at `path` (headers only: its size and mtime recorded as they are
// now). Throws as build_bytes() does for one shard.
std::shared_ptr<const ShardScan> scan_one(const std::string& path, const BuildOptions& options);

// build_bytes() from shards scanned beforehand: scans[i] is shards[i]'s (its open_path
// only names it in errors). std::invalid_argument unless there is one scan per shard.
std::string build_bytes(const std::vector<ShardInput>& shards,
                        const std::vector<const ShardScan*>& scans, const BuildOptions& options,
                        BuildResult* result);

// Scans the shards and returns the index file's bytes. Throws Error: kOs (with the
// shard's path) on I/O errors, kFormat on a malformed or compressed shard, a member
// without a key, a field twice in one sample, or (kError) a duplicated key; kCancelled.
std::string build_bytes(const std::vector<ShardInput>& shards, const BuildOptions& options,
                        BuildResult* result);

// build_bytes(), then writes the index to `index_path` atomically: a temporary file in
// the same folder, fsync, rename over index_path, fsync of the folder.
BuildResult build(const std::vector<ShardInput>& shards, const std::string& index_path,
                  const BuildOptions& options);

// Writes bytes to path atomically (as build() does). Throws Error(kOs).
void write_file_atomic(const std::string& path, const std::string& bytes);

// Splits a member path by webdataset's rule. Returns false when the base name has no
// key (no dot, or a dot first) or no field (ends with the dot).
bool split_key(std::string_view path, std::string_view* key, std::string_view* field);

}  // namespace fastload::index
