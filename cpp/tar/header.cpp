#include "tar/header.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
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
constexpr size_t kDevMajorOff = 329, kDevMinorOff = 337;
constexpr size_t kPrefixOff = 345, kPrefixLen = 155;

constexpr int64_t kNsPerSec = 1'000'000'000;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();

// A NUL-terminated string field that may fill its whole width without a terminator.
std::string_view field_str(const char* p, size_t len) {
  const void* nul = std::memchr(p, '\0', len);
  return {p, nul ? static_cast<size_t>(static_cast<const char*>(nul) - p) : len};
}

// The POSIX ustar magic "ustar\0" (GNU writes "ustar  \0" and uses the prefix area for
// other fields, so only POSIX headers have a prefix).
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

// Strict unsigned decimal (pax size, uid, gid): digits only, no sign, <= max.
std::optional<uint64_t> parse_decimal(std::string_view v, uint64_t max) {
  if (v.empty()) return std::nullopt;
  uint64_t n = 0;
  for (char c : v) {
    if (c < '0' || c > '9') return std::nullopt;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (n > (max - d) / 10) return std::nullopt;
    n = n * 10 + d;
  }
  return n;
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

}  // namespace

bool all_zero(const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != 0) return false;
  return true;
}

std::optional<int64_t> decode_number(const char* field, size_t len) {
  const auto* u = reinterpret_cast<const unsigned char*>(field);
  if (len > 0 && (u[0] & 0x80)) {
    // Base-256: the first byte only carries the sign (GNU and star write 0x80 / 0xff).
    if (u[0] == 0x80) {
      uint64_t v = 0;
      for (size_t i = 1; i < len; ++i) {
        if (v >> 55) return std::nullopt;  // the shift would pass 2^63
        v = (v << 8) | u[i];
      }
      return static_cast<int64_t>(v);
    }
    if (u[0] == 0xff) {
      uint64_t v = ~uint64_t{0};  // sign extension of the 0xff lead byte
      for (size_t i = 1; i < len; ++i) {
        if ((v >> 56) != 0xff) return std::nullopt;  // significant bits would be lost
        v = (v << 8) | u[i];
      }
      const auto s = static_cast<int64_t>(v);
      if (s >= 0) return std::nullopt;  // below INT64_MIN
      return s;
    }
    return std::nullopt;
  }
  // Octal, as POSIX writes it and Python's tarfile reads it: the field ends at the first
  // NUL; white space around the digits is allowed, anything else is not.
  const auto blank = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  // GNU tar skips one leading NUL and reads the digits after it; tarfile reads 0. Such a
  // field would frame the archive differently for each, so it is refused.
  if (len > 1 && field[0] == '\0')
    for (size_t i = 1; i < len; ++i)
      if (field[i] != '\0' && !blank(field[i])) return std::nullopt;
  std::string_view s = field_str(field, len);
  while (!s.empty() && blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && blank(s.back())) s.remove_suffix(1);
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '7') return std::nullopt;
    if (v >> 60) return std::nullopt;
    v = v * 8 + static_cast<uint64_t>(c - '0');
  }
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

std::optional<int64_t> parse_pax_time(std::string_view v) {
  bool neg = false;
  if (!v.empty() && v.front() == '-') {
    neg = true;
    v.remove_prefix(1);
  }
  const size_t dot = v.find('.');
  std::string_view ipart = v.substr(0, dot);
  std::string_view fpart = dot == std::string_view::npos ? std::string_view{} : v.substr(dot + 1);
  if (ipart.empty()) return std::nullopt;
  uint64_t sec = 0;
  bool saturated = false;
  for (char c : ipart) {
    if (c < '0' || c > '9') return std::nullopt;
    if (sec > static_cast<uint64_t>(kInt64Max / kNsPerSec)) saturated = true;
    else sec = sec * 10 + static_cast<uint64_t>(c - '0');
  }
  uint64_t frac = 0;
  size_t digits = 0;
  for (char c : fpart) {
    if (c < '0' || c > '9') return std::nullopt;
    if (digits < 9) {
      frac = frac * 10 + static_cast<uint64_t>(c - '0');
      ++digits;
    }
  }
  for (; digits < 9; ++digits) frac *= 10;
  // sec <= ~9.2e10 here, so sec * 1e9 + frac fits in uint64 unless saturated.
  const uint64_t limit = neg ? uint64_t{1} << 63 : static_cast<uint64_t>(kInt64Max);
  if (saturated || sec > limit / kNsPerSec) return neg ? kInt64Min : kInt64Max;
  const uint64_t ns = sec * kNsPerSec + frac;
  if (ns > limit) return neg ? kInt64Min : kInt64Max;
  return neg ? static_cast<int64_t>(0 - ns) : static_cast<int64_t>(ns);
}

std::string printable(std::string_view s) {
  constexpr size_t kMaxShown = 256;
  std::string out;
  out.reserve(std::min(s.size(), kMaxShown) + 8);
  size_t i = 0;
  while (i < s.size() && i < kMaxShown) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 1;
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else if (c >= 0x80 && (n = utf8_len(s, i)) != 0) {
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

void HeaderDecoder::fail(uint64_t offset, std::string_view member, std::string_view what) const {
  std::string detail;
  if (!member.empty()) detail = "member '" + printable(member) + "' (header at offset ";
  else detail = "(at offset ";
  detail += std::to_string(offset) + "): ";
  detail += what;
  throw Error(ErrorKind::kFormat, 0, "malformed tar", name_, detail);
}

std::string HeaderDecoder::name_for_error(const char* block) const {
  if (local_.path) return *local_.path;
  if (long_name_) return *long_name_;
  return ustar_name(block);
}

void HeaderDecoder::reset_pending() {
  local_ = Local{};
  long_name_.reset();
  long_link_.reset();
  pending_ = false;
  member_start_.reset();
}

void HeaderDecoder::check_can_end(uint64_t offset) const {
  if (!pending_) return;
  fail(offset, {},
       "archive ends after an extension header (at offset " + std::to_string(first_offset_) +
           ") with no member after it");
}

HeaderDecoder::Step HeaderDecoder::decode(const char* b, uint64_t offset, Member* m) {
  // Zero blocks are told apart before the checksum (their checksum field is empty). One
  // may not follow extension headers: they would describe nothing.
  if (all_zero(b, kBlockSize)) {
    if (pending_)
      fail(offset, {},
           "end-of-archive block after an extension header (at offset " +
               std::to_string(first_offset_) + ") with no member after it");
    return {Kind::kZero, 0};
  }
  if (!checksum_ok(b)) fail(offset, name_for_error(b), "header checksum mismatch");
  const auto num = [&](size_t off, size_t len, const char* what) -> int64_t {
    const std::optional<int64_t> v = decode_number(b + off, len);
    if (!v) fail(offset, name_for_error(b), std::string("malformed numeric field '") + what + "'");
    return *v;
  };
  // Every numeric field must be well-formed in every header, extension headers included:
  // tarfile treats a malformed one as the end of the archive and silently drops the rest,
  // so accepting it would make the two readers see different archives.
  const int64_t mode = num(kModeOff, kIdLen, "mode");
  const int64_t uid = num(kUidOff, kIdLen, "uid");
  const int64_t gid = num(kGidOff, kIdLen, "gid");
  const int64_t mtime_s = num(kMtimeOff, kBigLen, "mtime");
  num(kDevMajorOff, kIdLen, "devmajor");
  num(kDevMinorOff, kIdLen, "devminor");
  // The size field frames what follows, so it is bounded for every kind of header
  // before the type is looked at (a pax size replaces it only for a member).
  const int64_t raw_size = num(kSizeOff, kBigLen, "size");
  if (raw_size < 0 || static_cast<uint64_t>(raw_size) > kMaxMemberSize)
    fail(offset, name_for_error(b), "size out of range: " + std::to_string(raw_size));
  const auto header_size = static_cast<uint64_t>(raw_size);

  const char type = b[kTypeOff];
  switch (type) {
    case 'x':
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
      if ((type == 'x' && local_.seen) || (type == 'L' && long_name_) || (type == 'K' && long_link_))
        fail(offset, name_for_error(b),
             std::string("two '") + type + "' headers for one member (readers disagree on which applies)");
      // The caller collects header_size bytes and hands them to apply_extension().
      if (!pending_) first_offset_ = offset;
      pending_ = true;
      if (type != 'g' && !member_start_) member_start_ = offset;
      ext_type_ = type;
      ext_offset_ = offset;
      return {Kind::kExtension, header_size};
    }
    case 'V': {  // a volume label names the archive, not a member
      // A pax size still frames its data (GNU tar and tarfile agree on that).
      const uint64_t size = local_.size.value_or(header_size);
      reset_pending();
      return {Kind::kIgnored, size};
    }
    case 'S':
      fail(offset, name_for_error(b), "GNU sparse members (type 'S') are not supported");
    case 'M':
      fail(offset, name_for_error(b),
           "GNU multi-volume continuations (type 'M') are not supported");
    case 'N':
      fail(offset, name_for_error(b), "GNU old long-name members (type 'N') are not supported");
    default:
      break;
  }

  // A member header. *m is written only from here on; the pending extension state is
  // consumed by this member alone (reset below; an error ends the parse anyway).
  Member& out = *m;
  out = Member{};
  switch (type) {
    case '0':
    case '\0':
    case '7': out.type = MemberType::kFile; break;
    case '1': out.type = MemberType::kHardlink; break;
    case '2': out.type = MemberType::kSymlink; break;
    case '3': out.type = MemberType::kCharDev; break;
    case '4': out.type = MemberType::kBlockDev; break;
    case '5': out.type = MemberType::kDir; break;
    case '6': out.type = MemberType::kFifo; break;
    default:
      fail(offset, name_for_error(b),
           "unsupported member type '" + printable(std::string_view(&type, 1)) + "'");
  }

  // The prefix field belongs to POSIX headers; GNU headers keep times there (incremental
  // archives). tarfile prepends it whatever the magic, GNU tar only for POSIX: refused.
  if (!posix_magic(b) && b[kPrefixOff] != '\0')
    fail(offset, name_for_error(b), "prefix field set in a non-POSIX header (readers disagree)");
  // Names: pax over GNU long names over the ustar fields.
  if (local_.path) out.path = *local_.path;
  else if (long_name_) out.path = *long_name_;
  else out.path = ustar_name(b);
  if (local_.linkpath) out.link = *local_.linkpath;
  else if (long_link_) out.link = *long_link_;
  else out.link = std::string(field_str(b + kLinkOff, kLinkLen));
  if ((local_.path && long_name_ && *local_.path != *long_name_) ||
      (local_.linkpath && long_link_ && *local_.linkpath != *long_link_))
    fail(offset, out.path, "a pax path and a GNU long name disagree (readers differ on which applies)");
  if (local_.sparse)
    fail(offset, local_.sparse_name ? *local_.sparse_name : out.path,
         "GNU sparse members (pax GNU.sparse.*) are not supported");

  if (mode < 0) fail(offset, out.path, "negative mode");
  out.mode = static_cast<uint32_t>(mode & 07777);

  // The effective value (pax over the header) is range-checked, not the overridden one.
  const auto id = [&](int64_t h, const char* what, const std::optional<std::optional<uint32_t>>& local,
                      const std::optional<uint32_t>& global) -> uint32_t {
    if (local && *local) return **local;
    if (!local && global) return *global;
    if (h < 0 || h > int64_t{std::numeric_limits<uint32_t>::max()})
      fail(offset, out.path, std::string(what) + " out of range: " + std::to_string(h));
    return static_cast<uint32_t>(h);
  };
  out.uid = id(uid, "uid", local_.uid, global_.uid);
  out.gid = id(gid, "gid", local_.gid, global_.gid);
  if (local_.mtime_ns && *local_.mtime_ns) out.mtime_ns = **local_.mtime_ns;
  else if (!local_.mtime_ns && global_.mtime_ns) out.mtime_ns = *global_.mtime_ns;
  else out.mtime_ns = seconds_to_ns(mtime_s);

  uint64_t size = local_.size ? *local_.size : header_size;
  switch (out.type) {
    case MemberType::kFile:
      // v7 and BSD tar mark a directory by a trailing slash on a regular-file header.
      // With data after it, readers disagree on whether the data is skipped: refuse.
      if (!out.path.empty() && out.path.back() == '/') {
        if (size != 0) fail(offset, out.path, "regular file name ends with '/'");
        out.type = MemberType::kDir;
      }
      break;
    case MemberType::kDir:
      size = 0;  // GNU tar and tarfile both ignore a directory's size field
      break;
    default:
      if (size != 0)
        fail(offset, out.path,
             "a link, device or fifo member with a nonzero size (" + std::to_string(size) + ")");
      break;
  }
  out.size = size;
  out.header_offset = member_start_.value_or(offset);
  out.data_offset = offset + kBlockSize;
  reset_pending();
  return {Kind::kMember, size};
}

void HeaderDecoder::apply_extension(std::string_view data) {
  const char type = std::exchange(ext_type_, 0);
  if (type == 'L' || type == 'K') {
    // GNU writes the name and a terminating NUL, counted in the size. Without a NUL in
    // the data, tarfile reads on into the padding while GNU tar stops at the size:
    // refused rather than guessed.
    const void* nul = data.empty() ? nullptr : std::memchr(data.data(), '\0', data.size());
    if (!nul)
      fail(ext_offset_, {},
           std::string("GNU long ") + (type == 'L' ? "name" : "link name") +
               " is not NUL-terminated within its size");
    const size_t n = static_cast<size_t>(static_cast<const char*>(nul) - data.data());
    (type == 'L' ? long_name_ : long_link_) = std::string(data.data(), n);
    return;
  }
  if (type == 'x') local_.seen = true;
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
    // Some writers pad the data with NULs after the last record; tolerate only that.
    if (data[pos] == '\0') {
      if (!all_zero(data.data() + pos, data.size() - pos)) bad(pos, "data after NUL padding");
      break;
    }
    // "%d %s=%s\n": the length counts the whole record, its own digits included.
    size_t i = pos;
    uint64_t len = 0;
    while (i < data.size() && data[i] >= '0' && data[i] <= '9') {
      len = len * 10 + static_cast<uint64_t>(data[i] - '0');
      if (len > data.size()) bad(pos, "record length runs past the header data");
      ++i;
    }
    if (i == pos || i >= data.size() || data[i] != ' ') bad(pos, "malformed record length");
    if (len > data.size() - pos) bad(pos, "record length runs past the header data");
    const size_t body = i + 1;  // first byte of "key=value\n"
    const size_t end = pos + static_cast<size_t>(len);
    if (end <= body || data[end - 1] != '\n') bad(pos, "record does not end with a newline");
    const std::string_view kv = data.substr(body, end - 1 - body);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos || eq == 0) bad(pos, "record without a keyword");
    const std::string_view key = kv.substr(0, eq);
    const std::string_view value = kv.substr(eq + 1);

    if (key.starts_with("GNU.sparse.")) {
      if (global) bad(pos, "GNU sparse keys in a global header are not supported");
      local_.sparse = true;
      if (key == "GNU.sparse.name") local_.sparse_name = std::string(value);
    } else if (key == "path" || key == "linkpath") {
      // Paths in a global header would name every later member the same: ignored.
      if (!global) {
        auto& slot = key == "path" ? local_.path : local_.linkpath;
        if (value.empty()) slot.reset();
        else slot = std::string(value);
      }
    } else if (key == "size") {
      if (global) bad(pos, "'size' in a global header is not supported");
      if (value.empty()) {
        local_.size.reset();
      } else {
        const std::optional<uint64_t> v = parse_decimal(value, kMaxMemberSize);
        if (!v) bad(pos, "malformed size '" + printable(value) + "'");
        local_.size = *v;
      }
    } else if (key == "mtime") {
      std::optional<int64_t> v;
      if (!value.empty()) {
        v = parse_pax_time(value);
        if (!v) bad(pos, "malformed mtime '" + printable(value) + "'");
      }
      if (global) global_.mtime_ns = v;
      else local_.mtime_ns.emplace(v);
    } else if (key == "uid" || key == "gid") {
      std::optional<uint32_t> v;
      if (!value.empty()) {
        const std::optional<uint64_t> n = parse_decimal(value, std::numeric_limits<uint32_t>::max());
        if (!n) bad(pos, "malformed " + std::string(key) + " '" + printable(value) + "'");
        v = static_cast<uint32_t>(*n);
      }
      if (global) (key == "uid" ? global_.uid : global_.gid) = v;
      else (key == "uid" ? local_.uid : local_.gid).emplace(v);
    }
    // Other keys (atime, ctime, uname, gname, comment, hdrcharset, SCHILY.*, ...) carry
    // nothing a member needs here.
    pos = end;
  }
}

}  // namespace fastload::tar::detail
