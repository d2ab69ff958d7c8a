// Parallel listing of a source tree.
//
// On a network file system every readdir and every stat is a round trip, so the walk
// keeps many of them in flight: a pool of threads takes two kinds of task, "list this
// directory" and "stat this batch of names", so one huge flat directory is stat'ed in
// parallel too. The result is sorted by path, so it does not depend on thread timing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastload::copy {

enum class EntryType : uint8_t { kFile, kDir, kSymlink };

struct Entry {
  std::string path;    // relative to the root, '/'-separated, no leading "./"; "" is the root
  EntryType type;
  uint64_t size = 0;   // files: bytes
  uint64_t blocks = 0; // files: 512-byte blocks allocated (a sparse file has fewer than size/512)
  uint32_t mode = 0;   // permission bits (07777)
  int64_t mtime_ns = 0;
  std::string target;  // symlinks: the target to create (rewritten relative if it was absolute)
};

struct WalkOptions {
  std::vector<std::string> include;  // glob patterns; empty: everything
  std::vector<std::string> exclude;
  bool skip_special = false;  // skip (instead of refusing) devices, FIFOs, sockets, escaping links
  unsigned threads = 16;
};

struct Tree {
  std::vector<Entry> entries;  // sorted by path; the root itself is not included
  uint64_t total_bytes = 0;    // sum of file sizes
  uint64_t files = 0;
  std::vector<std::string> skipped;  // special files and escaping links left out (skip_special)
};

// Lists root (a directory). Throws fastload::Error naming the first path that failed, or
// (kUnsupported) the first special file or escaping symlink when !skip_special.
Tree walk(const std::string& root, const WalkOptions& options);

// A Tree of the one regular file root/rel (rel alone when root is empty), its entry's
// path `rel`, described as walk() would (not followed if it is a symlink). Throws
// Error(kOs) when it cannot be stat'ed, Error(kUnsupported) when it is not a regular file.
Tree stat_file(const std::string& root, const std::string& rel);

// fnmatch-based selection used by walk(): `*` matches '/', a pattern with no '/' also
// matches the base name.
bool glob_match(const std::string& pattern, const std::string& path);

// Resolves a symlink target lexically against the link's directory (both relative to the
// root). Returns false if it leaves the tree; otherwise stores the relative target to use
// in *out (absolute targets inside the tree become relative). root_abs is the absolute,
// symlink-free path of the root.
bool link_stays_inside(const std::string& root_abs, const std::string& link_path,
                       const std::string& target, std::string* out);

}  // namespace fastload::copy
