// Streaming tar parsing, shared by extraction (stage() of archives) and the shard index
// builder. Two ways in, one decoder:
//
//   StreamParser  push model: feed() any split of the archive bytes (a file read in big
//                 sequential chunks, a gzip/zstd decoder's output, the data of a member
//                 that is itself a tar). Members and their data come out through a Sink.
//   scan_file()   pull model for seekable files: reads only the header blocks with pread
//                 and seeks over member data (index building, and skipped members).
//
// Formats: v7/ustar (with the 155-byte prefix), GNU (long names 'L' and long link names
// 'K', base-256 numeric fields), pax extended ('x') and global ('g') headers with path,
// linkpath, size, mtime (fractional), uid, gid. Header checksums are verified (signed
// and unsigned sums, as GNU tar accepts). GNU sparse members ('S', or pax GNU.sparse.*),
// multi-volume ('M'), and other unknown types are refused with an Error of kind kFormat
// naming the member. Corrupt or truncated input is an Error of kind kFormat naming the
// member (or the offset) and what is wrong; nothing is ever read past a member's end.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace fastload::tar {

enum class MemberType : uint8_t {
  kFile,      // '0', '\0', '7' (contiguous)
  kHardlink,  // '1': link is the (archive) path of an earlier member
  kSymlink,   // '2'
  kCharDev,   // '3'
  kBlockDev,  // '4'
  kDir,       // '5'
  kFifo,      // '6'
};

struct Member {
  std::string path;       // as stored (after pax/GNU long names and the ustar prefix)
  std::string link;       // hard or symbolic link target, as stored
  MemberType type = MemberType::kFile;
  uint64_t size = 0;      // bytes of data that follow the header (0 for non-files)
  uint32_t mode = 0;      // permission bits (07777)
  int64_t mtime_ns = 0;
  uint32_t uid = 0, gid = 0;
  uint64_t header_offset = 0;  // offset of the first header block of this member
                               // (including its pax/GNU extension headers)
  uint64_t data_offset = 0;    // offset of the member's data in the archive
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
  // The input ended. Throws Error(kFormat) if it ended inside a member or a header;
  // a missing end-of-archive marker (two zero blocks) is accepted, as GNU tar does.
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
// data runs past the end of the file), naming `name`.
void scan_file(int fd, uint64_t size, const std::string& name,
               const std::function<bool(const Member&)>& fn);

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
