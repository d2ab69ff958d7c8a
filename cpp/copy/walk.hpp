// Parallel listing of a source tree.
//
// On a network file system every readdir and every stat is a round trip, so the walk
// keeps many of them in flight: a pool of threads takes two kinds of task, "list this
// directory" and "stat this batch of names", so one huge flat directory is stat'ed in
// parallel too. The result is sorted by path, so it does not depend on thread timing.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
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

// The entries of a walk in compact batches (the path bytes of a batch in one string, a
// fixed-size record per entry), with their order by path: what columns are made from
// without an object, or a heap string, per entry.
class FlatTree {
 public:
  struct Rec {
    uint64_t size = 0, blocks = 0;
    int64_t mtime_ns = 0;
    uint32_t off = 0, len = 0;  // the path in its batch's blob
    uint32_t mode = 0;
    EntryType type = EntryType::kFile;
  };
  struct Batch {
    std::string blob;
    std::vector<Rec> recs;
    std::vector<std::pair<uint32_t, std::string>> targets;  // a link's rec -> its target
  };

  // Where fill_columns() writes entry i (in path order): paths[offsets[i], offsets[i+1]),
  // the rest at index i. offsets has size()+1 elements, paths path_bytes() bytes.
  struct Columns {
    char* paths;
    int64_t* offsets;
    uint8_t* kind;
    int64_t* size;
    int64_t* blocks;
    uint32_t* mode;
    int64_t* mtime_ns;
  };

  FlatTree() = default;
  FlatTree(std::vector<Batch> batches, std::vector<std::string> skipped);

  size_t size() const { return order_.size(); }
  uint64_t path_bytes() const { return path_bytes_; }
  uint64_t files() const { return files_; }
  uint64_t total_bytes() const { return total_bytes_; }
  const std::vector<std::string>& skipped() const { return skipped_; }

  void fill_columns(const Columns& out) const;
  // Each link's index (in path order) and target, by index.
  std::vector<std::pair<uint64_t, std::string>> targets() const;
  // The same entries as a Tree (one Entry each).
  Tree to_tree() const;

 private:
  const Rec& rec(uint64_t ref) const { return batches_[ref >> 32].recs[uint32_t(ref)]; }

  std::vector<Batch> batches_;
  std::vector<uint64_t> order_;  // (batch << 32 | rec), sorted by path
  std::vector<std::string> skipped_;
  uint64_t path_bytes_ = 0, files_ = 0, total_bytes_ = 0;
};

// Lists root (a directory). Throws fastload::Error naming the first path that failed, or
// (kUnsupported) the first special file or escaping symlink when !skip_special.
FlatTree walk_flat(const std::string& root, const WalkOptions& options);

// walk_flat(), one Entry per entry (holds ~3x the memory of a FlatTree on big trees).
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
