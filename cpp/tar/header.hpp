// Tar header block decoding, shared by StreamParser and scan_file() so that both read
// an archive identically (same members, same offsets, same errors and warnings).
//
// The decoder sees the archive as a sequence of 512-byte header blocks, each followed by
// some data. It does no I/O: the caller hands it one header block at a time, and when a
// block is an extension header (pax 'x'/'X'/'g', GNU 'L'/'K') the caller collects its
// data and hands that back through apply_extension() before the next block. A member
// whose description goes on past its header (an old GNU sparse header's extension
// blocks, a pax 1.0 sparse map at the start of its data) asks for the following blocks
// one at a time through more().
//
// The reference is GNU tar: whatever it extracts, the decoder reads the same way (the
// same members, names, sizes, framing); where GNU tar fails (exit status 2), the archive
// is refused with an Error(kFormat) naming the member and what is wrong; where GNU tar
// warns and goes on, a warning is queued (take_warnings()) and decoding goes on.
//
// Framing rules (what a reader must agree on with writers):
//  - data of `size` bytes, padded to a block, follows regular files ('0', '\0', '7' and
//    any unknown type, which GNU tar extracts as a regular file), extension headers,
//    GNU dump directories ('D') and volume labels ('V');
//  - directories, links, devices and fifos carry no data, whatever their size field says
//    (GNU tar reads the next block as a header). Some writers store a body after a hard
//    link all the same: when the block after such a member is not a header, the member's
//    size (padded) is skipped as its body (Step::body);
//  - a sparse member's data is its extents back to back, each padded to a block, then
//    whatever the size field counts beyond those blocks, padded (GNU tar's reading,
//    exactly: the size may or may not count the extents' padding);
//  - names: pax (the member's 'x' header) over pax global ('g') over GNU long names over
//    the ustar name and prefix (the prefix only with the POSIX magic "ustar\0"); of two
//    'x' headers, or two 'L' or 'K', before one member the last wins; GNU.sparse.name
//    over every other name;
//  - pax 'g' keys (path, linkpath, size, mtime, uid, gid) apply to every later member,
//    as GNU tar applies them;
//  - an empty member name is "." (GNU tar's substitution).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tar/reader.hpp"

namespace fastload::tar::detail {

inline constexpr size_t kBlockSize = 512;
// Data caps for extension headers: their data is held in memory. GNU long names are
// paths (PATH_MAX is 4 KiB); pax headers may carry a few large keys (xattrs, comments).
inline constexpr uint64_t kMaxLongNameSize = uint64_t{1} << 20;
inline constexpr uint64_t kMaxPaxSize = uint64_t{8} << 20;
// The largest member size accepted; keeps every offset computation far from overflow.
inline constexpr uint64_t kMaxMemberSize = uint64_t{1} << 62;
// Extents of one sparse member held in memory (16 bytes each).
inline constexpr size_t kMaxSparseExtents = size_t{1} << 21;

// n rounded up to a whole number of blocks (n <= kMaxMemberSize).
constexpr uint64_t padded(uint64_t n) { return (n + kBlockSize - 1) & ~uint64_t{kBlockSize - 1}; }

bool all_zero(const char* p, size_t n);

// Decodes a numeric header field as GNU tar does: one leading NUL and leading white
// space skipped, then octal digits ending at the field's end, a NUL or white space
// (what follows that is not looked at), or GNU/star base-256 (first byte 0x80 positive,
// 0xff negative, big-endian two's complement in the rest). An all-NUL field is 0.
// nullopt when malformed (an all-blank field, other characters) or out of int64 range.
std::optional<int64_t> decode_number(const char* field, size_t len);

// Header checksum: the stored octal value must equal the byte sum of the block with the
// checksum field read as spaces, summing bytes either unsigned (POSIX) or signed (some
// historic writers); GNU tar accepts both.
bool checksum_ok(const char* block);

// A block GNU tar would read as a header: all zeros, or a valid checksum.
bool header_like(const char* block);

// Parses a decimal pax time "[-]sec[.frac]" into nanoseconds as GNU tar does: what
// follows the number is ignored, fraction digits past nine are dropped (a negative time
// is rounded down), values past int64 nanoseconds saturate. nullopt when there is no
// number, or the seconds are out of int64 range.
std::optional<int64_t> parse_pax_time(std::string_view v);

// Escapes a name for an error message: control bytes and invalid UTF-8 become \xNN, and
// long names are shortened, so a hostile name cannot forge or flood a message;
// ascii_only escapes every byte outside printable ASCII (data that is not a name).
std::string printable(std::string_view s, size_t max_shown = 120, bool ascii_only = false);

class HeaderDecoder {
 public:
  // name: how errors name the archive.
  explicit HeaderDecoder(std::string name);

  enum class Kind : uint8_t {
    kZero,       // an all-zero block (end of archive)
    kMember,     // a member header: *m is filled
    kExtension,  // an extension header: its data_size bytes go to apply_extension()
    kIgnored,    // a volume label: skip `area` bytes, report nothing
    kMore,       // the member goes on in the next block: hand it to more()
  };
  struct Step {
    Kind kind = Kind::kZero;
    uint64_t data_size = 0;  // kExtension: unpadded bytes of data after the block
    // kMember, kIgnored: bytes after the header (and extension or map blocks) that belong
    // to the entry, padding included. A member's data, m->data_size bytes delivered,
    // lies within them as described by Member (whole, or its sparse extents).
    uint64_t area = 0;
    // kMember with area 0: a size the member's type carries no data for. When the next
    // block is not header_like(), padded(body) bytes from it are the member's body, to be
    // skipped (call body_skipped() to note it); otherwise the next block is a header.
    uint64_t body = 0;
  };

  // Decodes the 512-byte block at archive offset `offset`. Must not be called while an
  // extension header's data or a kMore is outstanding. Throws Error(kFormat).
  Step decode(const char* block, uint64_t offset, Member* m);
  // The next block of a member that returned kMore (at `offset`). Throws Error(kFormat).
  Step more(const char* block, uint64_t offset, Member* m);
  // The data of the extension header returned by the last decode(), exactly data_size
  // bytes. Throws Error(kFormat).
  void apply_extension(std::string_view data);
  // Warnings to report for what was decoded so far (cleared).
  std::vector<std::string> take_warnings();
  bool has_warnings() const { return !warnings_.empty(); }

  // Notes the body of the member before `offset` (a link with data): skipped.
  void body_skipped(const Member& m, uint64_t offset, uint64_t body);
  // Notes a zero block at `offset` followed by a non-zero one: the archive ends there.
  void lone_zero_block(uint64_t offset);
  // Notes bytes past the last whole block at `offset` (ignored, as GNU tar does).
  void partial_block(uint64_t offset, size_t n);
  // The archive ended while a member's sparse map (kMore) was being read.
  [[noreturn]] void fail_more_cut(uint64_t offset) const;
  // The message for an archive that ends inside an entry's area: `missing` of its
  // `area` bytes were not there.
  [[noreturn]] void fail_cut(const Member& m, uint64_t area, uint64_t missing) const;

  // Throws Error(kFormat) naming the archive, the member (when not empty) and the offset.
  [[noreturn]] void fail(uint64_t offset, std::string_view member, std::string_view what) const;
  void warn(uint64_t offset, std::string_view member, std::string_view what);
  const std::string& name() const { return name_; }

 private:
  // Pax values that apply to one member ('x'). For the keys a global header may set, an
  // inner nullopt (a record with an empty value) means "use the header's field", also
  // overriding the global value.
  struct Local {
    std::optional<std::optional<std::string>> path, linkpath;
    std::optional<std::optional<uint64_t>> size;
    std::optional<std::optional<int64_t>> mtime_ns;
    std::optional<std::optional<uint32_t>> uid, gid;
    // GNU.sparse.*: format 0.0 (offset/numbytes pairs), 0.1 (map), 1.0 (map in data).
    std::optional<uint64_t> sparse_major, sparse_minor, sparse_real, sparse_numblocks;
    std::optional<std::string> sparse_name;
    std::vector<SparseExtent> sparse_map;
    bool sparse_open = false;  // a GNU.sparse.offset waits for its numbytes
  };
  // Pax values from 'g' headers, applying to every later member.
  struct Global {
    std::optional<std::string> path, linkpath;
    std::optional<uint64_t> size;
    std::optional<int64_t> mtime_ns;
    std::optional<uint32_t> uid, gid;
  };
  // A member whose sparse map is still being read (kMore).
  struct Pending {
    Member m;
    uint64_t stored = 0;    // bytes the header's size counts (map blocks included)
    uint64_t real = 0;      // the real size the extents must fit in
    bool old_gnu = false;   // extension blocks of an 'S' header, else a pax 1.0 map
    uint64_t map_blocks = 0;
    // pax 1.0 map text: numbers read so far, the one being read.
    std::optional<uint64_t> count;
    std::vector<uint64_t> numbers;
    uint64_t cur = 0;
    bool in_number = false;
  };

  void parse_pax(std::string_view data, bool global);
  void pax_key(std::string_view key, std::string_view value, bool global, size_t pos);
  std::string name_for_error(const char* block) const;
  void reset_pending();
  // Finishes a sparse member whose extents are all known; fills *m and the step.
  Step finish_sparse(Pending& p, uint64_t offset, Member* m);
  // Parses a pax 1.0 map block; true when the map is complete.
  bool sparse_map_block(Pending& p, const char* block, uint64_t offset);
  // Reads old GNU sparse entries (24 bytes each); false at the first empty one.
  bool old_gnu_entries(Pending& p, const char* entries, size_t count, uint64_t offset);

  std::string name_;
  Global global_;
  Local local_;
  std::optional<std::string> long_name_, long_link_;
  // Offset of the first 'x', 'X', 'L' or 'K' header since the last member: where the
  // member starts. A 'g' header belongs to no member.
  std::optional<uint64_t> member_start_;
  char ext_type_ = 0;        // type of the extension whose data is awaited
  uint64_t ext_offset_ = 0;  // and its header's offset
  std::optional<Pending> pending_;
  bool warned_contiguous_ = false;
  std::vector<std::string> warnings_;
};

}  // namespace fastload::tar::detail
