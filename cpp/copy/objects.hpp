// Whole objects fetched into memory (small objects of an object-store prefix), written
// to their files under a destination root: a batch per call, so the Python side makes
// one call for many objects instead of an open, a write, a digest, a utime and a rename
// each. The core's half only: the caller holds the bodies alive for the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "common/unique_fd.hpp"

namespace fastload::copy {

struct ObjectBody {
  std::string name;  // relative to the root; its folder exists
  const char* data = nullptr;
  size_t size = 0;
  int64_t mtime_ns = 0;
  // Recorded with the file, before it is linked into place, as the extended attribute
  // kObjectMark (empty: none): what the object was (its identity), so a file found whole
  // at its name after a kill is known for that object. Where the file system keeps no
  // user attributes the file is written without it (and is not trusted that way).
  std::string mark;
};

inline constexpr const char* kObjectMark = "user.fastload.object";

// Writes one object at a time, whole, to a temporary that becomes its final name only
// when written, digested and timed: an O_TMPFILE linked into place where the file system
// has them (nothing is left behind by a failure or a crash), else a named temporary
// (temp_name: ".NAME.fl-tmp", created new: one a killed run left is removed first)
// renamed over the name, removed on a failure. A file already at the name is replaced
// whole. Not for use from two threads at once (it
// learns, once, what the file system refuses).
class ObjectWriter {
 public:
  // `root` names the destination folder (opened here; errors name it); `mode` is the
  // files' mode (the umask applies, as to open(2)); `stripe` the bytes per chunk digest.
  ObjectWriter(const std::string& root, uint32_t mode, uint64_t stripe);

  // Writes `body`; returns its chunk digests (fl64 of each stripe; one of the empty
  // bytes for an empty body). Throws Error naming the file (its final path under the
  // root) on a failure, after removing any temporary.
  std::vector<uint64_t> write(const ObjectBody& body);

  // write() of each body in order; a failure is kept in `errors[i]` (empty where the
  // body was written) and the others still go on.
  void write_all(const std::vector<ObjectBody>& bodies, std::vector<std::vector<uint64_t>>& digests,
                 std::vector<std::exception_ptr>& errors);

 private:
  UniqueFd open_temp(const ObjectBody& b, std::string& named);
  int link_into_place(int fd, const std::string& rel);

  std::string root_path_;
  UniqueFd root_;
  uint32_t mode_;
  uint64_t stripe_;
  bool tmpfile_ = true;          // O_TMPFILE works here (till it is refused)
  bool empty_path_link_ = true;  // linkat(AT_EMPTY_PATH) is allowed (till refused)
};

}  // namespace fastload::copy
