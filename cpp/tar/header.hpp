// Tar header block decoding, shared by StreamParser and scan_file() so that both read
// an archive identically (same members, same offsets, same errors).
//
// The decoder sees the archive as a sequence of 512-byte header blocks, each followed by
// some data. It does no I/O: the caller hands it one header block at a time, and when a
// block is an extension header (pax 'x'/'g', GNU 'L'/'K') the caller collects its data
// and hands that back through apply_extension() before the next block. The decoder keeps
// what extension headers say about the member after them (and, for pax 'g', about every
// member after them).
//
// Framing rules (what a reader must agree on with writers, GNU tar and Python's tarfile):
//  - data of `size` bytes, padded to a block, follows regular files ('0', '\0', '7'),
//    extension headers and volume labels ('V'); directories have no data whatever their
//    size field says (GNU tar and tarfile agree); hard links, symlinks, devices and fifos
//    must have size 0 (GNU tar and tarfile disagree on whether data follows them, so a
//    nonzero size is refused rather than guessed);
//  - pax records override GNU long names, which override the ustar name and prefix;
//    where readers disagree (tarfile lets the first of two 'x' or 'L' headers win, GNU
//    tar the last; tarfile lets an 'L' before an 'x' win, GNU tar the pax path), the
//    archive is refused: two 'x', 'L' or 'K' headers for one member, or a pax path
//    (linkpath) that differs from a GNU long name (link name), a GNU long name without
//    its NUL, or a non-POSIX header with its prefix field set (GNU incremental archives);
//  - pax 'g' headers apply mtime, uid and gid to every later member; path and linkpath in
//    them are ignored, size is refused (it would reframe every later member).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tar/reader.hpp"

namespace fastload::tar::detail {

inline constexpr size_t kBlockSize = 512;
// Data caps for extension headers: their data is held in memory. GNU long names are
// paths (PATH_MAX is 4 KiB); pax headers may carry a few large keys (xattrs, comments).
inline constexpr uint64_t kMaxLongNameSize = uint64_t{1} << 20;
inline constexpr uint64_t kMaxPaxSize = uint64_t{8} << 20;
// The largest member size accepted; keeps every offset computation far from overflow.
inline constexpr uint64_t kMaxMemberSize = uint64_t{1} << 62;

// n rounded up to a whole number of blocks (n <= kMaxMemberSize).
constexpr uint64_t padded(uint64_t n) { return (n + kBlockSize - 1) & ~uint64_t{kBlockSize - 1}; }

bool all_zero(const char* p, size_t n);

// Decodes a numeric header field: octal digits (leading and trailing spaces, NUL
// terminated; an all-blank field is 0) or GNU/star base-256 (first byte 0x80 positive,
// 0xff negative, big-endian two's complement in the rest). nullopt when malformed or out
// of int64 range.
std::optional<int64_t> decode_number(const char* field, size_t len);

// Header checksum: the stored octal value must equal the byte sum of the block with the
// checksum field read as spaces, summing bytes either unsigned (POSIX) or signed (some
// historic writers); GNU tar accepts both.
bool checksum_ok(const char* block);

// Parses a decimal pax time "[-]sec[.frac]" into nanoseconds (extra fraction digits are
// truncated, out-of-range values saturate). nullopt when malformed.
std::optional<int64_t> parse_pax_time(std::string_view v);

// Escapes a name for an error message: control bytes and invalid UTF-8 become \xNN, and
// long names are shortened, so a hostile name cannot forge or flood a message.
std::string printable(std::string_view s);

class HeaderDecoder {
 public:
  // name: how errors name the archive.
  explicit HeaderDecoder(std::string name);

  enum class Kind : uint8_t {
    kZero,       // an all-zero block (end-of-archive marker, first or second block)
    kMember,     // a member header: *m is filled
    kExtension,  // an extension header: its data_size bytes go to apply_extension()
    kIgnored,    // a volume label: skip its data_size bytes, report nothing
  };
  struct Step {
    Kind kind;
    uint64_t data_size;  // unpadded bytes of data after the block
  };

  // Decodes the 512-byte block at archive offset `offset`. Must not be called while an
  // extension header's data is outstanding. Throws Error(kFormat).
  Step decode(const char* block, uint64_t offset, Member* m);
  // The data of the extension header returned by the last decode(), exactly data_size
  // bytes. Throws Error(kFormat).
  void apply_extension(std::string_view data);
  // Throws Error(kFormat) unless the archive may end at `offset` (no extension header is
  // waiting for the member it describes).
  void check_can_end(uint64_t offset) const;

  // Throws Error(kFormat) naming the archive, the member (when not empty) and the offset.
  [[noreturn]] void fail(uint64_t offset, std::string_view member, std::string_view what) const;
  const std::string& name() const { return name_; }

 private:
  // Pax values that apply to one member ('x'). For the keys a global header may set, an
  // inner nullopt (a record with an empty value) means "use the header's field", also
  // overriding the global value.
  struct Local {
    std::optional<std::string> path, linkpath;
    std::optional<uint64_t> size;
    std::optional<std::optional<int64_t>> mtime_ns;
    std::optional<std::optional<uint32_t>> uid, gid;
    bool seen = false;    // an 'x' header was read for the member
    bool sparse = false;  // a GNU.sparse.* key was seen: refused with the member's name
    std::optional<std::string> sparse_name;  // GNU.sparse.name: the real name (format 1.0)
  };
  // Pax values from 'g' headers, applying to every later member.
  struct Global {
    std::optional<int64_t> mtime_ns;
    std::optional<uint32_t> uid, gid;
  };

  void parse_pax(std::string_view data, bool global);
  std::string name_for_error(const char* block) const;
  void reset_pending();

  std::string name_;
  Global global_;
  Local local_;
  std::optional<std::string> long_name_, long_link_;
  bool pending_ = false;          // extension headers seen since the last member
  uint64_t first_offset_ = 0;     // offset of the first of them
  // Offset of the first 'x', 'L' or 'K' header since the last member: where the member
  // starts. A 'g' header belongs to no member (tarfile does not count it either).
  std::optional<uint64_t> member_start_;
  char ext_type_ = 0;             // type of the extension whose data is awaited
  uint64_t ext_offset_ = 0;       // and its header's offset
};

}  // namespace fastload::tar::detail
