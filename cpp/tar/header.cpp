#include "tar/header.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

#include "common/error.hpp"

namespace fastload::tar::detail {

namespace {

// ustar field offsets and lengths (POSIX.1-1988; GNU uses the same positions).
constexpr size_t kNameOff = 0, kNameLen = 100;
constexpr size_t kModeOff = 100, kUidOff = 108, kGidOff = 116, kIdLen = 8;
constexpr size_t kSizeOff = 124, kMtimeOff = 136, kBigLen = 12;
constexpr size_t kChksumOff = 148, kChksumLen = 8;
constexpr size_t kTypeOff = 156;
constexpr size_t kLinkOff = 157, kLinkLen = 100;
constexpr size_t kMagicOff = 257;
constexpr size_t kPrefixOff = 345, kPrefixLen = 155;
// Old GNU sparse headers: 4 entries (offset, numbytes; 12 bytes each) in the header,
// 21 in each extension block, each followed by an "is extended" flag.
constexpr size_t kSparseOff = 386, kSparseInHeader = 4, kIsExtendedOff = 482;
constexpr size_t kRealSizeOff = 483;
constexpr size_t kSparseInBlock = 21, kBlockIsExtendedOff = 504, kSparseEntry = 24;

constexpr int64_t kNsPerSec = 1'000'000'000;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();

bool blank(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

// A NUL-terminated string field that may fill its whole width without a terminator.
std::string_view field_str(const char* p, size_t len) {
  const void* nul = std::memchr(p, '\0', len);
  return {p, nul ? static_cast<size_t>(static_cast<const char*>(nul) - p) : len};
}

// The POSIX ustar magic "ustar\0" (GNU writes "ustar  \0" and uses the prefix area for
// other fields: times, the sparse map; so only POSIX headers have a prefix, as in GNU tar).
bool posix_magic(const char* b) { return std::memcmp(b + kMagicOff, "ustar\0", 6) == 0; }

std::string ustar_name(const char* b) {
  std::string name(field_str(b + kNameOff, kNameLen));
  if (posix_magic(b)) {
    std::string_view prefix = field_str(b + kPrefixOff, kPrefixLen);
    if (!prefix.empty()) name = std::string(prefix) + "/" + name;
  }
  return name;
}

int64_t seconds_to_ns(int64_t s) {
  if (s > kInt64Max / kNsPerSec) return kInt64Max;
  if (s < kInt64Min / kNsPerSec) return kInt64Min;
  return s * kNsPerSec;
}

enum class Parsed : uint8_t { kOk, kMalformed, kRange };

// A pax decimal number as GNU tar reads one (size, uid, gid): digits, nothing after
// them; a '-' before them is out of range, as is a value past max.
Parsed parse_decimal(std::string_view v, uint64_t max, uint64_t* out) {
  size_t i = 0;
  const bool neg = !v.empty() && v[0] == '-';
  if (neg) i = 1;
  if (i >= v.size() || v[i] < '0' || v[i] > '9') return Parsed::kMalformed;
  uint64_t n = 0;
  bool over = false;
  for (; i < v.size() && v[i] >= '0' && v[i] <= '9'; ++i) {
    const uint64_t d = static_cast<uint64_t>(v[i] - '0');
    if (n > (max - d) / 10) over = true;
    else n = n * 10 + d;
  }
  if (i != v.size()) return Parsed::kMalformed;
  if (over || (neg && n != 0)) return Parsed::kRange;
  *out = n;
  return Parsed::kOk;
}

// Length of the valid UTF-8 sequence at s[i], or 0 if there is none (overlong forms,
// surrogates and code points past U+10FFFF are invalid).
size_t utf8_len(std::string_view s, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = at(i);
  size_t n;
  unsigned char lo = 0x80, hi = 0xbf;  // range of the second byte
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (s.size() - i < n) return 0;
  if (at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (at(i + k) < 0x80 || at(i + k) > 0xbf) return 0;
  return n;
}

// What a block that is no tar header looks like: its first bytes, and the format they
// announce when it is a well-known one.
std::string describe_start(const char* b) {
  const std::string_view s(b, kBlockSize);
  // Bytes of unknown data: random ones can form valid UTF-8, which would put stray
  // characters (or terminal controls' look-alikes) on the user's screen.
  std::string out = "it starts with \"" + printable(s.substr(0, 16), 16, true) + "\"";
  static const struct {
    std::string_view magic;
    const char* what;
  } kKnown[] = {
      {"\x1f\x8b", "gzip data"},
      {"\x28\xb5\x2f\xfd", "zstd data"},
      {"BZh", "bzip2 data"},
      {"\xfd" "7zXZ", "xz data"},
      {"\x04\x22\x4d\x18", "lz4 data"},
      {"PK\x03\x04", "a zip archive"},
      {"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"},
      {"Rar!", "a RAR archive"},
      {"070701", "a cpio archive"},
      {"070707", "a cpio archive"},
      {"\x7f" "ELF", "an ELF binary"},
      {"%PDF", "a PDF document"},
      {"\x89PNG", "a PNG image"},
      {"\x93NUMPY", "a NumPy array"},
  };
  for (const auto& k : kKnown)
    if (s.starts_with(k.magic)) return out + ": " + k.what + "?";
  size_t i = 0;
  while (i < 64 && blank(static_cast<unsigned char>(s[i]))) ++i;
  if (s[i] == '<') return out + ": an HTML or XML page?";
  if (s[i] == '{' || s[i] == '[') return out + ": JSON?";
  return out;
}

}  // namespace

bool all_zero(const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != 0) return false;
  return true;
}

std::optional<int64_t> decode_number(const char* field, size_t len) {
  const auto* u = reinterpret_cast<const unsigned char*>(field);
  size_t i = 0;
  // A NUL before the digits (a writer whose previous field overflowed) is skipped, and
  // so is white space; a field of blanks only holds no number.
  if (len > 0 && u[0] == 0) i = 1;
  for (;; ++i) {
    if (i == len) return std::nullopt;
    if (!blank(u[i])) break;
  }
  if (u[i] == 0x80 || u[i] == 0xff) {
    // Base-256 to the end of the field: the first byte only carries the sign (GNU and
    // star write 0x80 / 0xff).
    const bool negative = u[i] == 0xff;
    uint64_t v = negative ? ~uint64_t{0} : 0;
    for (++i; i < len; ++i) {
      if (negative ? (v >> 56) != 0xff : (v >> 55) != 0) return std::nullopt;
      v = (v << 8) | u[i];
    }
    const auto s = static_cast<int64_t>(v);
    if (negative && s >= 0) return std::nullopt;  // below INT64_MIN
    return s;
  }
  uint64_t v = 0;
  for (; i < len && u[i] >= '0' && u[i] <= '7'; ++i) {
    if (v >> 60) return std::nullopt;
    v = v * 8 + static_cast<uint64_t>(u[i] - '0');
  }
  // What ends the digits must be the end, a NUL or white space; after that GNU tar does
  // not look (so neither does this).
  if (i != len && u[i] != 0 && !blank(u[i])) return std::nullopt;
  if (v > static_cast<uint64_t>(kInt64Max)) return std::nullopt;
  return static_cast<int64_t>(v);
}

bool checksum_ok(const char* block) {
  const std::optional<int64_t> stored = decode_number(block + kChksumOff, kChksumLen);
  if (!stored) return false;
  int64_t usum = 0, ssum = 0;
  for (size_t i = 0; i < kBlockSize; ++i) {
    const char c = (i >= kChksumOff && i < kChksumOff + kChksumLen) ? ' ' : block[i];
    usum += static_cast<unsigned char>(c);
    ssum += static_cast<signed char>(c);
  }
  return *stored == usum || *stored == ssum;
}

bool header_like(const char* block) { return all_zero(block, kBlockSize) || checksum_ok(block); }

std::optional<int64_t> parse_pax_time(std::string_view v) {
  const bool neg = !v.empty() && v.front() == '-';
  if (neg) v.remove_prefix(1);
  if (v.empty() || v.front() < '0' || v.front() > '9') return std::nullopt;
  uint64_t sec = 0;
  size_t i = 0;
  for (; i < v.size() && v[i] >= '0' && v[i] <= '9'; ++i) {
    const uint64_t d = static_cast<uint64_t>(v[i] - '0');
    const uint64_t limit = neg ? uint64_t{1} << 63 : static_cast<uint64_t>(kInt64Max);
    if (sec > (limit - d) / 10) return std::nullopt;  // out of time_t range: GNU ignores it
    sec = sec * 10 + d;
  }
  uint64_t frac = 0;
  size_t digits = 0;
  bool trailing_nonzero = false;
  if (i < v.size() && v[i] == '.') {
    for (++i; i < v.size() && v[i] >= '0' && v[i] <= '9'; ++i) {
      if (digits < 9) {
        frac = frac * 10 + static_cast<uint64_t>(v[i] - '0');
        ++digits;
      } else if (v[i] != '0') {
        trailing_nonzero = true;
      }
    }
  }
  for (; digits < 9; ++digits) frac *= 10;
  // Whatever follows the number is ignored (GNU tar's reading).
  if (!neg) {
    if (sec > static_cast<uint64_t>(kInt64Max / kNsPerSec)) return kInt64Max;
    const uint64_t ns = sec * kNsPerSec + frac;
    return ns > static_cast<uint64_t>(kInt64Max) ? kInt64Max : static_cast<int64_t>(ns);
  }
  // Negative times are rounded towards minus infinity, as GNU tar does.
  if (trailing_nonzero) ++frac;
  if (sec > static_cast<uint64_t>(kInt64Max / kNsPerSec)) return kInt64Min;
  const uint64_t ns = sec * kNsPerSec + frac;
  if (ns > uint64_t{1} << 63) return kInt64Min;
  return static_cast<int64_t>(0 - ns);
}

std::string printable(std::string_view s, size_t max_shown, bool ascii_only) {
  std::string out;
  out.reserve(std::min(s.size(), max_shown) + 8);
  size_t i = 0;
  while (i < s.size() && i < max_shown) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 1;
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else if (c >= 0x80 && !ascii_only && (n = utf8_len(s, i)) != 0) {
      out.append(s.substr(i, n));
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
      n = 1;
    }
    i += n;
  }
  if (i < s.size()) out += "...";
  return out;
}

HeaderDecoder::HeaderDecoder(std::string name) : name_(std::move(name)) {}

namespace {

std::string where(uint64_t offset, std::string_view member) {
  std::string s;
  if (!member.empty()) s = "member '" + printable(member) + "' (header at offset ";
  else s = "(at offset ";
  return s + std::to_string(offset) + "): ";
}

}  // namespace

void HeaderDecoder::fail(uint64_t offset, std::string_view member, std::string_view what) const {
  throw Error(ErrorKind::kFormat, 0, "malformed tar", name_, where(offset, member) + std::string(what));
}

void HeaderDecoder::warn(uint64_t offset, std::string_view member, std::string_view what) {
  warnings_.push_back("tar '" + name_ + "': " + where(offset, member) + std::string(what));
}

std::vector<std::string> HeaderDecoder::take_warnings() { return std::exchange(warnings_, {}); }

void HeaderDecoder::body_skipped(const Member& m, uint64_t offset, uint64_t body) {
  (void)offset;
  warn(m.header_offset, m.path,
       std::to_string(body) + " bytes of data after a " +
           (m.type == MemberType::kHardlink ? "hard link"
            : m.type == MemberType::kDir    ? "directory"
            : m.type == MemberType::kSymlink ? "symbolic link"
                                             : "special file") +
           " header skipped");
}

void HeaderDecoder::lone_zero_block(uint64_t offset) {
  warn(offset, {},
       "a lone zero block ends the archive; what follows it is ignored (as GNU tar does; "
       "`tar --ignore-zeros` reads on)");
}

void HeaderDecoder::partial_block(uint64_t offset, size_t n) {
  warn(offset, {}, std::to_string(n) + " bytes after the last whole block ignored");
}

void HeaderDecoder::fail_cut(const Member& m, uint64_t area, uint64_t missing) const {
  if (m.sparse)
    fail(m.header_offset, m.path,
         "archive ends inside the sparse member's data (" + std::to_string(missing) + " of " +
             std::to_string(area) + " bytes missing)");
  const uint64_t pad = area - m.data_size;
  if (missing <= pad) fail(m.header_offset, m.path, "archive ends inside the padding after the member's data");
  fail(m.header_offset, m.path,
       "archive ends inside the member's data (" + std::to_string(missing - pad) + " of " +
           std::to_string(m.data_size) + " bytes missing)");
}

void HeaderDecoder::fail_more_cut(uint64_t offset) const {
  if (!pending_) fail(offset, {}, "archive ends inside a header");
  fail(pending_->m.header_offset, pending_->m.path,
       pending_->old_gnu ? "archive ends inside the sparse member's extension headers"
                         : "archive ends inside the sparse member's map");
}

std::string HeaderDecoder::name_for_error(const char* block) const {
  if (local_.path && *local_.path) return **local_.path;
  if (!local_.path && global_.path) return *global_.path;
  if (long_name_) return *long_name_;
  return ustar_name(block);
}

void HeaderDecoder::reset_pending() {
  local_ = Local{};
  long_name_.reset();
  long_link_.reset();
  member_start_.reset();
}

HeaderDecoder::Step HeaderDecoder::decode(const char* b, uint64_t offset, Member* m) {
  if (all_zero(b, kBlockSize)) {
    // Extension headers with no member after them describe nothing: dropped, as GNU
    // tar drops them.
    reset_pending();
    return {Kind::kZero};
  }
  if (!checksum_ok(b)) {
    if (offset == 0)
      throw Error(ErrorKind::kFormat, 0, "not a tar archive", name_,
                  "no tar header at offset 0 (" + describe_start(b) + ")");
    // A name is shown only when the block looks like it holds one.
    std::string name = name_for_error(b);
    if (name.empty() || printable(name) != name) {
      fail(offset, {},
           "no valid tar header here (header checksum mismatch; " + describe_start(b) +
               "): the archive is corrupt");
    }
    fail(offset, name, "header checksum mismatch (the archive is corrupt)");
  }
  const char type = b[kTypeOff];
  // The size field frames what follows, so it is bounded for every kind of header before
  // the type is looked at. GNU tar reads none for a hard link (its data is the target's):
  // there it only says how large a body to skip, if one follows.
  uint64_t header_size = 0;
  {
    const std::optional<int64_t> raw = decode_number(b + kSizeOff, kBigLen);
    if (type == '1') {
      if (raw && *raw > 0 && static_cast<uint64_t>(*raw) <= kMaxMemberSize)
        header_size = static_cast<uint64_t>(*raw);
    } else {
      if (!raw) fail(offset, name_for_error(b), "malformed numeric field 'size'");
      if (*raw < 0 || static_cast<uint64_t>(*raw) > kMaxMemberSize)
        fail(offset, name_for_error(b), "size out of range: " + std::to_string(*raw));
      header_size = static_cast<uint64_t>(*raw);
    }
  }

  switch (type) {
    case 'x':
    case 'X':  // Solaris: a pax extended header, as GNU tar reads it
    case 'g':
    case 'L':
    case 'K': {
      const bool gnu = type == 'L' || type == 'K';
      const uint64_t cap = gnu ? kMaxLongNameSize : kMaxPaxSize;
      if (header_size > cap)
        fail(offset, name_for_error(b),
             std::string(gnu ? "GNU long name" : "pax") + " header of " +
                 std::to_string(header_size) + " bytes exceeds the limit of " +
                 std::to_string(cap));
      // The caller collects header_size bytes and hands them to apply_extension().
      if (type != 'g' && !member_start_) member_start_ = offset;
      ext_type_ = type == 'X' ? 'x' : type;
      ext_offset_ = offset;
      return {Kind::kExtension, header_size};
    }
    case 'V': {  // a volume label names the archive, not a member
      uint64_t size = header_size;
      if (local_.size) size = local_.size->value_or(header_size);
      else if (global_.size) size = *global_.size;
      reset_pending();
      return {Kind::kIgnored, 0, padded(size)};
    }
    case 'M':
      fail(offset, name_for_error(b),
           "GNU multi-volume continuations (type 'M') cannot be extracted from one volume "
           "(GNU tar refuses them too)");
    default:
      break;
  }

  // A member header. The pending extension state is consumed by this member alone.
  Member out;
  out.header_offset = member_start_.value_or(offset);
  out.data_offset = offset + kBlockSize;
  // Names: pax over pax global over GNU long names over the ustar fields.
  if (local_.path && *local_.path) out.path = **local_.path;
  else if (!local_.path && global_.path) out.path = *global_.path;
  else if (long_name_) out.path = *long_name_;
  else out.path = ustar_name(b);
  if (local_.sparse_name) out.path = *local_.sparse_name;
  if (local_.linkpath && *local_.linkpath) out.link = **local_.linkpath;
  else if (!local_.linkpath && global_.linkpath) out.link = *global_.linkpath;
  else if (long_link_) out.link = *long_link_;
  else out.link = std::string(field_str(b + kLinkOff, kLinkLen));
  if (out.path.empty()) {
    out.path = ".";
    warn(offset, {}, "substituting '.' for an empty member name (as GNU tar does)");
  }

  const auto num = [&](size_t off, size_t len, const char* what) -> int64_t {
    const std::optional<int64_t> v = decode_number(b + off, len);
    if (!v) fail(offset, out.path, std::string("malformed numeric field '") + what + "'");
    return *v;
  };
  // GNU tar keeps the permission bits of whatever value (a negative base-256 one too).
  out.mode = static_cast<uint32_t>(static_cast<uint64_t>(num(kModeOff, kIdLen, "mode")) & 07777);
  if (local_.mtime_ns && *local_.mtime_ns) out.mtime_ns = **local_.mtime_ns;
  else if (!local_.mtime_ns && global_.mtime_ns) out.mtime_ns = *global_.mtime_ns;
  else out.mtime_ns = seconds_to_ns(num(kMtimeOff, kBigLen, "mtime"));
  // Owners are not applied by extraction: a malformed one is noted, not fatal.
  const auto id = [&](size_t off, const char* what, const std::optional<std::optional<uint32_t>>& local,
                      const std::optional<uint32_t>& global) -> uint32_t {
    if (local && *local) return **local;
    if (!local && global) return *global;
    const std::optional<int64_t> v = decode_number(b + off, kIdLen);
    if (!v || *v < 0 || *v > int64_t{std::numeric_limits<uint32_t>::max()}) {
      warn(offset, out.path, std::string("malformed or out-of-range ") + what + " field ignored");
      return 0;
    }
    return static_cast<uint32_t>(*v);
  };
  out.uid = id(kUidOff, "uid", local_.uid, global_.uid);
  out.gid = id(kGidOff, "gid", local_.gid, global_.gid);

  uint64_t size = header_size;
  if (local_.size) size = local_.size->value_or(header_size);
  else if (global_.size) size = *global_.size;

  const bool pax_sparse =
      (local_.sparse_major && *local_.sparse_major > 0) || !local_.sparse_map.empty();
  Step step{Kind::kMember};
  if (type == 'S' || pax_sparse) {
    // GNU tar extracts a pax sparse member as a sparse file whatever its type flag.
    out.type = MemberType::kFile;
    Pending p;
    p.stored = size;
    if (type == 'S') {
      p.old_gnu = true;
      const std::optional<int64_t> real = decode_number(b + kRealSizeOff, kBigLen);
      if (!real || *real < 0 || static_cast<uint64_t>(*real) > kMaxMemberSize)
        fail(offset, out.path, "invalid sparse member: malformed real size");
      p.real = static_cast<uint64_t>(*real);
      p.m = std::move(out);
      reset_pending();
      const bool all_used = old_gnu_entries(p, b + kSparseOff, kSparseInHeader, offset);
      if (all_used && b[kIsExtendedOff] != 0) {
        pending_ = std::move(p);
        return {Kind::kMore};
      }
      return finish_sparse(p, offset + kBlockSize, m);
    }
    const uint64_t major = local_.sparse_major.value_or(0);
    const uint64_t minor = local_.sparse_minor.value_or(0);
    if (major > 1 || (major == 1 && minor != 0))
      fail(offset, out.path,
           "unsupported GNU sparse format " + std::to_string(major) + "." + std::to_string(minor));
    if (local_.sparse_open) fail(offset, out.path, "invalid sparse member: GNU.sparse.offset without GNU.sparse.numbytes");
    p.real = local_.sparse_real.value_or(size);
    if (p.real > kMaxMemberSize) fail(offset, out.path, "invalid sparse member: real size out of range");
    if (major == 1) {  // 1.0: the map is at the start of the data
      p.m = std::move(out);
      reset_pending();
      pending_ = std::move(p);
      return {Kind::kMore};
    }
    if (local_.sparse_numblocks && *local_.sparse_numblocks != local_.sparse_map.size())
      fail(offset, out.path,
           "invalid sparse member: GNU.sparse.numblocks says " +
               std::to_string(*local_.sparse_numblocks) + " extents, the map has " +
               std::to_string(local_.sparse_map.size()));
    p.m = std::move(out);
    p.m.extents = std::move(local_.sparse_map);
    reset_pending();
    return finish_sparse(p, offset + kBlockSize, m);
  }

  switch (type) {
    case '0':
    case '\0':
    case '7':
      if (type == '7' && !warned_contiguous_) {
        warned_contiguous_ = true;
        warn(offset, out.path, "contiguous files (type '7') are extracted as regular files");
      }
      // v7 and BSD tar mark a directory by a trailing slash on a regular-file header.
      if (out.path.back() == '/') {
        out.type = MemberType::kDir;
        step.body = size;
      } else {
        out.type = MemberType::kFile;
        out.size = out.data_size = size;
        step.area = padded(size);
      }
      break;
    case '1': out.type = MemberType::kHardlink; step.body = size; break;
    // GNU tar skips the size of a symlink, device or fifo (whatever is there).
    case '2': out.type = MemberType::kSymlink; step.area = padded(size); break;
    case '3': out.type = MemberType::kCharDev; step.area = padded(size); break;
    case '4': out.type = MemberType::kBlockDev; step.area = padded(size); break;
    case '5': out.type = MemberType::kDir; step.body = size; break;
    case '6': out.type = MemberType::kFifo; step.area = padded(size); break;
    case 'D':  // a GNU dump directory: its data lists the directory's entries (unused)
      out.type = MemberType::kDir;
      step.area = padded(size);
      break;
    default:
      warn(offset, out.path,
           "unknown type '" + printable(std::string_view(&type, 1)) +
               "', extracted as a regular file (as GNU tar does)");
      out.type = MemberType::kFile;
      out.size = out.data_size = size;
      step.area = padded(size);
      break;
  }
  reset_pending();
  *m = std::move(out);
  return step;
}

bool HeaderDecoder::old_gnu_entries(Pending& p, const char* e, size_t count, uint64_t offset) {
  for (size_t i = 0; i < count; ++i) {
    const char* entry = e + i * kSparseEntry;
    // GNU tar ends the map at the first entry whose numbytes field is empty.
    if (entry[12] == '\0') return false;
    const std::optional<int64_t> off = decode_number(entry, 12);
    const std::optional<int64_t> n = decode_number(entry + 12, 12);
    if (!off || !n || *off < 0 || *n < 0)
      fail(offset, p.m.path, "invalid sparse member: malformed sparse map entry");
    if (p.m.extents.size() >= kMaxSparseExtents)
      fail(offset, p.m.path, "sparse map of more than " + std::to_string(kMaxSparseExtents) + " extents");
    p.m.extents.push_back({static_cast<uint64_t>(*off), static_cast<uint64_t>(*n)});
  }
  return true;
}

bool HeaderDecoder::sparse_map_block(Pending& p, const char* block, uint64_t offset) {
  // "count\n" then count pairs "offset\nsize\n", in decimal, over as many blocks as it
  // takes; the data starts at the next block.
  for (size_t i = 0; i < kBlockSize; ++i) {
    const char c = block[i];
    if (c >= '0' && c <= '9') {
      const uint64_t d = static_cast<uint64_t>(c - '0');
      if (p.cur > (kMaxMemberSize - d) / 10) fail(offset, p.m.path, "invalid sparse map: number out of range");
      p.cur = p.cur * 10 + d;
      p.in_number = true;
      continue;
    }
    if (c != '\n' || !p.in_number) fail(offset, p.m.path, "invalid sparse map: not a decimal number and a newline");
    const uint64_t v = std::exchange(p.cur, 0);
    p.in_number = false;
    if (!p.count) {
      if (v > kMaxSparseExtents)
        fail(offset, p.m.path, "sparse map of more than " + std::to_string(kMaxSparseExtents) + " extents");
      p.count = v;
      p.numbers.reserve(static_cast<size_t>(2 * v));
    } else {
      p.numbers.push_back(v);
    }
    if (p.numbers.size() == 2 * *p.count) {
      for (size_t k = 0; k < p.numbers.size(); k += 2) p.m.extents.push_back({p.numbers[k], p.numbers[k + 1]});
      p.numbers = {};
      return true;
    }
  }
  return false;
}

HeaderDecoder::Step HeaderDecoder::more(const char* block, uint64_t offset, Member* m) {
  if (!pending_) throw std::logic_error("tar::HeaderDecoder::more without a member waiting");
  Pending& p = *pending_;
  if (p.old_gnu) {
    const bool all_used = old_gnu_entries(p, block, kSparseInBlock, offset);
    if (all_used && block[kBlockIsExtendedOff] != 0) return {Kind::kMore};
  } else {
    ++p.map_blocks;
    if (p.map_blocks * kBlockSize > padded(p.stored))
      fail(p.m.header_offset, p.m.path, "invalid sparse member: its map runs past its data");
    if (!sparse_map_block(p, block, offset)) return {Kind::kMore};
  }
  Pending done = std::move(p);
  pending_.reset();
  return finish_sparse(done, offset + kBlockSize, m);
}

HeaderDecoder::Step HeaderDecoder::finish_sparse(Pending& p, uint64_t data_offset, Member* m) {
  Member& out = p.m;
  // GNU tar writes the extents in order, truncating the file at an empty one; extents out
  // of order, overlapping, or an empty one before the end of an earlier one (which would
  // cut it) come from no writer and are refused. The file ends where the last one does.
  uint64_t end = 0, sum = 0, area = 0;
  std::vector<SparseExtent> kept;
  kept.reserve(out.extents.size());
  for (const SparseExtent& e : out.extents) {
    if (e.size > p.real || e.offset > p.real - e.size)
      fail(out.header_offset, out.path,
           "invalid sparse member: an extent (" + std::to_string(e.size) + " bytes at " +
               std::to_string(e.offset) + ") past its real size " + std::to_string(p.real));
    if (e.offset < end)
      fail(out.header_offset, out.path,
           "invalid sparse member: extents out of order or overlapping (at " +
               std::to_string(e.offset) + ")");
    end = e.offset + e.size;
    if (e.size == 0) continue;
    sum += e.size;
    area += padded(e.size);
    kept.push_back(e);
  }
  const uint64_t map_bytes = p.map_blocks * kBlockSize;
  const uint64_t rest = p.stored > map_bytes ? p.stored - map_bytes : 0;
  if (sum > rest)
    fail(out.header_offset, out.path,
         "invalid sparse member: its extents hold " + std::to_string(sum) +
             " bytes, its size says " + std::to_string(rest));
  // GNU tar reads each extent as whole blocks and counts them so (a block read is 512
  // bytes of the size, padding included), then skips what the size counts beyond, in
  // whole blocks. A writer whose size counts each extent's padding (GNU tar counts only
  // the data) thus has nothing after the extents: subtracting the extents' unpadded sum
  // instead would skip their padding a second time, into the next header.
  if (rest > area) area += padded(rest - area);
  out.extents = std::move(kept);
  out.sparse = true;
  out.size = end;
  out.data_size = sum;
  out.data_offset = data_offset;
  *m = std::move(out);
  return {Kind::kMember, 0, area};
}

void HeaderDecoder::apply_extension(std::string_view data) {
  const char type = std::exchange(ext_type_, 0);
  if (type == 'L' || type == 'K') {
    // GNU writes the name and a terminating NUL, counted in the size; GNU tar reads the
    // name up to the first NUL, or the whole data. Of two, the last wins.
    const void* nul = data.empty() ? nullptr : std::memchr(data.data(), '\0', data.size());
    const size_t n = nul ? static_cast<size_t>(static_cast<const char*>(nul) - data.data()) : data.size();
    (type == 'L' ? long_name_ : long_link_) = std::string(data.data(), n);
    return;
  }
  if (type == 'x') {
    // A second 'x' header before one member replaces the first (GNU tar).
    local_ = Local{};
  }
  parse_pax(data, type == 'g');
}

void HeaderDecoder::parse_pax(std::string_view data, bool global) {
  const auto bad = [&](size_t pos, const std::string& what) {
    fail(ext_offset_, {},
         std::string(global ? "pax global" : "pax") + " header record at byte " +
             std::to_string(pos) + ": " + what);
  };
  size_t pos = 0;
  while (pos < data.size()) {
    // "%d %s=%s\n": the length counts the whole record, its own digits included. A NUL
    // where a record would start ends the records (writers pad with NULs), as in GNU tar.
    size_t i = pos;
    while (i < data.size() && (data[i] == ' ' || data[i] == '\t')) ++i;
    if (i == data.size() || data[i] == '\0') break;
    if (data[i] < '0' || data[i] > '9') bad(pos, "malformed record length");
    uint64_t len = 0;
    while (i < data.size() && data[i] >= '0' && data[i] <= '9') {
      len = len * 10 + static_cast<uint64_t>(data[i] - '0');
      if (len > data.size()) bad(pos, "record length runs past the header data");
      ++i;
    }
    if (len > data.size() - pos) bad(pos, "record length runs past the header data");
    const size_t digits_end = i;
    while (i < data.size() && (data[i] == ' ' || data[i] == '\t')) ++i;
    if (i == digits_end) bad(pos, "malformed record length");
    const size_t end = pos + static_cast<size_t>(len);
    if (end <= i) bad(pos, "record length too short");
    if (data[end - 1] != '\n') bad(pos, "record does not end with a newline");
    const std::string_view kv = data.substr(i, end - 1 - i);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) bad(pos, "record without '='");
    pax_key(kv.substr(0, eq), kv.substr(eq + 1), global, pos);
    pos = end;
  }
}

void HeaderDecoder::pax_key(std::string_view key, std::string_view value, bool global, size_t pos) {
  const auto what = [&] {
    return std::string(global ? "pax global" : "pax") + " header record at byte " + std::to_string(pos);
  };
  // GNU tar reports a malformed value and goes on without it.
  const auto ignored = [&](const char* why) {
    warn(ext_offset_, {}, what() + ": " + why + " " + std::string(key) + "='" + printable(value, 40) + "' ignored");
  };
  const auto strict = [&](uint64_t max) -> uint64_t {
    uint64_t v = 0;
    if (parse_decimal(value, max, &v) != Parsed::kOk)
      fail(ext_offset_, {}, what() + ": invalid " + std::string(key) + " '" + printable(value, 40) + "'");
    return v;
  };
  if (key.starts_with("GNU.sparse.")) {
    const std::string_view k = key.substr(11);
    if (k != "major" && k != "minor" && k != "name" && k != "realsize" && k != "size" &&
        k != "numblocks" && k != "offset" && k != "numbytes" && k != "map")
      return;  // unknown GNU.sparse keys are ignored
    if (global)
      fail(ext_offset_, {}, what() + ": GNU sparse keys in a global header are not supported");
    if (k == "name") {
      local_.sparse_name = std::string(value);
    } else if (k == "major") {
      local_.sparse_major = strict(kMaxMemberSize);
    } else if (k == "minor") {
      local_.sparse_minor = strict(kMaxMemberSize);
    } else if (k == "realsize" || k == "size") {
      local_.sparse_real = strict(kMaxMemberSize);
    } else if (k == "numblocks") {
      local_.sparse_numblocks = strict(kMaxSparseExtents);
    } else if (k == "offset") {
      if (local_.sparse_open) fail(ext_offset_, {}, what() + ": GNU.sparse.offset without its numbytes");
      if (local_.sparse_map.size() >= kMaxSparseExtents)
        fail(ext_offset_, {}, what() + ": sparse map of more than " + std::to_string(kMaxSparseExtents) + " extents");
      local_.sparse_map.push_back({strict(kMaxMemberSize), 0});
      local_.sparse_open = true;
    } else if (k == "numbytes") {
      if (!local_.sparse_open) fail(ext_offset_, {}, what() + ": GNU.sparse.numbytes without an offset");
      local_.sparse_map.back().size = strict(kMaxMemberSize);
      local_.sparse_open = false;
    } else {  // map: "offset,size,offset,size,..." (format 0.1)
      std::vector<SparseExtent> map;
      std::vector<uint64_t> nums;
      size_t start = 0;
      while (!value.empty()) {
        const size_t comma = value.find(',', start);
        const std::string_view n = value.substr(start, comma == std::string_view::npos ? value.npos : comma - start);
        uint64_t v = 0;
        if (parse_decimal(n, kMaxMemberSize, &v) != Parsed::kOk)
          fail(ext_offset_, {}, what() + ": invalid GNU.sparse.map");
        nums.push_back(v);
        if (nums.size() > 2 * kMaxSparseExtents)
          fail(ext_offset_, {}, what() + ": sparse map of more than " + std::to_string(kMaxSparseExtents) + " extents");
        if (comma == std::string_view::npos) break;
        start = comma + 1;
      }
      if (nums.size() % 2 != 0) fail(ext_offset_, {}, what() + ": invalid GNU.sparse.map (odd count)");
      for (size_t i = 0; i < nums.size(); i += 2) map.push_back({nums[i], nums[i + 1]});
      local_.sparse_map = std::move(map);
      local_.sparse_open = false;
    }
    return;
  }
  if (key == "path" || key == "linkpath") {
    // An empty value means the header's own field (POSIX), also over a global value.
    std::optional<std::string> v;
    if (!value.empty()) v = std::string(value);
    if (global) (key == "path" ? global_.path : global_.linkpath) = std::move(v);
    else (key == "path" ? local_.path : local_.linkpath).emplace(std::move(v));
  } else if (key == "size") {
    std::optional<uint64_t> v;
    if (!value.empty()) {
      uint64_t n = 0;
      const Parsed r = parse_decimal(value, static_cast<uint64_t>(kInt64Max), &n);
      if (r != Parsed::kOk) return ignored(r == Parsed::kRange ? "out-of-range" : "malformed");
      if (n > kMaxMemberSize)
        fail(ext_offset_, {}, what() + ": size out of range: " + std::to_string(n));
      v = n;
    }
    if (global) global_.size = v;
    else local_.size.emplace(v);
  } else if (key == "mtime") {
    std::optional<int64_t> v;
    if (!value.empty()) {
      v = parse_pax_time(value);
      if (!v) return ignored("malformed or out-of-range");
    }
    if (global) global_.mtime_ns = v;
    else local_.mtime_ns.emplace(v);
  } else if (key == "uid" || key == "gid") {
    std::optional<uint32_t> v;
    if (!value.empty()) {
      uint64_t n = 0;
      const Parsed r = parse_decimal(value, std::numeric_limits<uint32_t>::max(), &n);
      if (r != Parsed::kOk) return ignored(r == Parsed::kRange ? "out-of-range" : "malformed");
      v = static_cast<uint32_t>(n);
    }
    if (global) (key == "uid" ? global_.uid : global_.gid) = v;
    else (key == "uid" ? local_.uid : local_.gid).emplace(v);
  }
  // Other keys (atime, ctime, uname, gname, comment, hdrcharset, SCHILY.*, ...) carry
  // nothing a member needs here.
}

}  // namespace fastload::tar::detail
