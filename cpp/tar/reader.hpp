// Streaming tar parsing, shared by extraction (stage() of archives) and the shard index
// builder. Two ways in, one decoder:
//
//   StreamParser  push model: feed() any split of the archive bytes (a file read in big
//                 sequential chunks, a gzip/zstd decoder's output, stdin, the data of a
//                 member that is itself a tar). Members and their data come out through
//                 a Sink.
//   scan_file()   pull model for seekable files: reads only the header blocks with pread
//                 and seeks over member data (index building, and skipped members).
//
// What GNU tar extracts is read the same way (header.hpp has the rules): v7 and pre-POSIX
// headers, ustar (with the 155-byte prefix), GNU (long names 'L' and long link names 'K',
// base-256 numeric fields, dump directories 'D', sparse members 'S'), pax extended
// ('x', Solaris 'X') and global ('g') headers with path, linkpath, size, mtime
// (fractional), uid, gid and GNU.sparse.* (sparse formats 0.0, 0.1 and 1.0); unknown
// types as regular files. Where GNU tar warns and goes on, the Sink gets on_warning().
// GNU multi-volume continuations ('M'), and whatever GNU tar fails on, are an Error of
// kind kFormat naming the member (or the offset) and what is wrong; nothing is ever read
// past a member's end.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace fastload::tar {

enum class MemberType : uint8_t {
  kFile,      // '0', '\0', '7' (contiguous), 'S' (sparse), and unknown types
  kHardlink,  // '1': link is the (archive) path of an earlier member
  kSymlink,   // '2'
  kCharDev,   // '3'
  kBlockDev,  // '4'
  kDir,       // '5', 'D' (GNU dump directory), or a regular file named "x/"
  kFifo,      // '6'
};

// A run of data in a sparse file: `size` bytes at `offset`; the rest of the file is holes.
struct SparseExtent {
  uint64_t offset = 0;
  uint64_t size = 0;
};

struct Member {
  std::string path;       // as stored (after pax/GNU long names and the ustar prefix)
  std::string link;       // hard or symbolic link target, as stored
  MemberType type = MemberType::kFile;
  uint64_t size = 0;      // the file's size (0 for non-files; holes included if sparse)
  // Bytes of data the Sink receives through on_data(): size, or for a sparse member the
  // sum of its extents' sizes.
  uint64_t data_size = 0;
  // A sparse member (GNU 'S' or pax GNU.sparse.*): its data is the extents', in this
  // order (ascending, not overlapping, within size); the rest of the file is holes.
  bool sparse = false;
  std::vector<SparseExtent> extents;
  uint32_t mode = 0;      // permission bits (07777)
  int64_t mtime_ns = 0;
  uint32_t uid = 0, gid = 0;
  uint64_t header_offset = 0;  // offset of the first header block of this member
                               // (including its pax/GNU extension headers)
  uint64_t data_offset = 0;    // offset of the member's data in the archive (of its
                               // first extent if sparse: later extents follow it, each
                               // padded to a block)
};

// What a Sink wants done with a member's data.
enum class Action : uint8_t { kRead, kSkip };

class Sink {
 public:
  virtual ~Sink() = default;
  // A member's header was decoded. kRead: its data comes through on_data(); kSkip: it is
  // discarded without being delivered.
  virtual Action on_member(const Member& m) = 0;
  // The next piece of the current member's data (only after kRead).
  virtual void on_data(const char* data, size_t n) = 0;
  // The current member's data is complete (called for every member, read or skipped).
  virtual void on_member_end() = 0;
  // What GNU tar would warn about and go on (an unknown type extracted as a regular file,
  // a lone zero block ending the archive, ...): one line naming the archive and member.
  virtual void on_warning(const std::string& message) { (void)message; }
};

class StreamParser {
 public:
  // name: how errors name the archive (its path, or "outer.tar:inner.tar").
  explicit StreamParser(std::string name);
  ~StreamParser();
  StreamParser(const StreamParser&) = delete;
  StreamParser& operator=(const StreamParser&) = delete;

  // Consumes all n bytes, calling the sink as members complete. Throws Error(kFormat).
  void feed(const char* data, size_t n, Sink& sink);
  // The input ended. Throws Error(kFormat) if it ended inside a member's data; a
  // missing end-of-archive marker (two zero blocks) is accepted, and so is a partial
  // block where a header would start (ignored with a warning), as GNU tar does.
  void finish(Sink& sink);
  // True once the end-of-archive marker was seen (or finish() accepted the end of input);
  // later bytes are ignored.
  bool at_end() const;
  // When the source is seekable, the caller may jump over a skipped member's data
  // instead of feeding it: after on_member() returned kSkip, skippable() is the number
  // of bytes (data plus padding) the parser expects to discard next; the caller seeks
  // that far and calls skipped(n) with how many it jumped (<= skippable()).
  uint64_t skippable() const;
  void skipped(uint64_t n, Sink& sink);
  // Bytes consumed so far (offset in the archive stream).
  uint64_t offset() const;

 private:
  struct Impl;
  Impl* impl_;
};

// Reads the headers of the tar file `fd` (size bytes) with pread, seeking over data,
// and calls fn for each member in order. Stops early if fn returns false. Throws
// Error(kOs) on I/O errors and Error(kFormat) on malformed input (e.g. a member whose
// data runs past the end of the file), naming `name`. Warnings go to `warn` if set.
void scan_file(int fd, uint64_t size, const std::string& name,
               const std::function<bool(const Member&)>& fn,
               const std::function<void(const std::string&)>& warn = {});

// Path safety (PEP 706's data filter is the reference; at least as strict):
// normalises a member path ("./a//b/" -> "a/b") and refuses absolute paths, ".."
// components, empty names and NUL bytes. Returns false and sets *why when unsafe.
// A name for the root itself ("." or "./", as `tar -C dir .` writes) is safe and
// normalises to "" (callers skip it). out and why may be null.
bool safe_relative_path(std::string_view path, std::string* out, std::string* why);

// A link target is safe when, resolved lexically from the directory of link_path (both
// relative to the extraction root), it stays inside the root. Hard link targets are
// archive paths (relative to the root, not to the link). Returns false and sets *why.
// The check is lexical: it assumes members are created without following symlinks in
// their parent paths, and it refuses a symlink target with ".." after a named component
// ("d/../x": on disk ".." climbs from wherever d points) and hard link targets with any
// "..". link_path may be given raw or normalised.
bool safe_link_target(std::string_view link_path, std::string_view target, bool hard,
                      std::string* why);

}  // namespace fastload::tar
