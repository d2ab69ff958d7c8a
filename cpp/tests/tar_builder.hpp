// Test-only helpers that write tar header blocks byte by byte, for the cases real tools
// do not produce (sizes past 8 GiB without 8 GiB of data, bad fields, unknown types).
// Shared by tar_test.cpp and fuzz_tar_test.cpp.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

namespace fastload::tar::testing {

inline constexpr size_t kBlock = 512;

// Octal digits, NUL-terminated, filling `width` bytes.
inline std::string octal(uint64_t v, size_t width) {
  std::string s(width - 1, '0');
  for (size_t i = width - 1; i-- > 0 && v;) {
    s[i] = static_cast<char>('0' + (v & 7));
    v >>= 3;
  }
  s.push_back('\0');
  return s;
}

// GNU base-256: 0x80 then the value big-endian.
inline std::string base256(uint64_t v, size_t width) {
  std::string s(width, '\0');
  s[0] = static_cast<char>(0x80);
  for (size_t i = width; i-- > 1;) {
    s[i] = static_cast<char>(v & 0xff);
    v >>= 8;
  }
  return s;
}

inline void put(std::string& b, size_t off, std::string_view v) {
  if (v.empty()) return;  // data() may be null
  std::memcpy(b.data() + off, v.data(), v.size());
}

// Recomputes the checksum (unsigned sum, "%06o\0 " as POSIX writers do).
inline void fix_checksum(std::string& b) {
  put(b, 148, "        ");
  unsigned sum = 0;
  for (unsigned char c : b.substr(0, kBlock)) sum += c;
  char buf[9];
  std::snprintf(buf, sizeof buf, "%06o", sum);
  put(b, 148, std::string_view(buf, 6));
  b[154] = '\0';
  b[155] = ' ';
}

// A POSIX ustar header (magic "ustar\0" "00"); sizes past the octal range use base-256.
inline std::string header(std::string_view name, char type, uint64_t size,
                          std::string_view link = {}, uint64_t mtime = 1700000000) {
  std::string b(kBlock, '\0');
  put(b, 0, name.substr(0, 100));
  put(b, 100, octal(0644, 8));
  put(b, 108, octal(1000, 8));
  put(b, 116, octal(1000, 8));
  put(b, 124, size < (uint64_t{1} << 33) ? octal(size, 12) : base256(size, 12));
  put(b, 136, octal(mtime, 12));
  b[156] = type;
  put(b, 157, link.substr(0, 100));
  put(b, 257, std::string_view("ustar\0" "00", 8));
  put(b, 265, "user");
  put(b, 297, "group");
  fix_checksum(b);
  return b;
}

inline std::string pad(std::string data) {
  data.resize((data.size() + kBlock - 1) / kBlock * kBlock, '\0');
  return data;
}

// One pax record "%d %s=%s\n", the length counting its own digits.
inline std::string pax_record(std::string_view key, std::string_view value) {
  const size_t body = 1 + key.size() + 1 + value.size() + 1;
  size_t n = body + 1;
  while (std::to_string(n).size() + body != n) ++n;
  return std::to_string(n) + " " + std::string(key) + "=" + std::string(value) + "\n";
}

// An extension header ('x', 'g', 'L', 'K') with its data, padded.
inline std::string extension(char type, std::string_view data) {
  const char* name = (type == 'L' || type == 'K') ? "././@LongLink" : "PaxHeaders/x";
  return header(name, type, data.size()) + pad(std::string(data));
}

// A regular file member with its data, padded.
inline std::string file(std::string_view name, std::string_view data) {
  return header(name, '0', data.size()) + pad(std::string(data));
}

inline std::string end_marker() { return std::string(2 * kBlock, '\0'); }

}  // namespace fastload::tar::testing
