// Test-only helpers that write tar header blocks byte by byte, for the cases real tools
// do not produce (sizes past 8 GiB without 8 GiB of data, bad fields, unknown types).
// Also a mutation fuzzer's corpus and mutator. Shared by tar_test.cpp and
// fuzz_tar_test.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

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

// Small valid archives of every header kind, the seeds of the mutation fuzzers.
inline std::vector<std::string> sample_archives() {
  std::vector<std::string> c;
  c.push_back(file("a.txt", "hello") + file("b/c.bin", std::string(700, 'x')) +
              end_marker());
  c.push_back(header("dir/", '5', 0) + header("dir/l", '2', 0, "../a") +
              header("h", '1', 0, "dir/f") + file("empty", "") + end_marker());
  c.push_back(extension('L', std::string(150, 'n') + '\0') + file("short", "data") +
              extension('K', std::string(120, 'k') + '\0') + header("s", '2', 0) +
              end_marker());
  c.push_back(extension('g', pax_record("mtime", "1.5") + pax_record("uid", "3")) +
              extension('x', pax_record("path", "p/\xc3\xa9") +
                                     pax_record("size", "3") +
                                     pax_record("mtime", "-2.25")) +
              header("x", '0', 0) + pad("abc") + file("z", "1") + end_marker());
  c.push_back(header("huge", '0', uint64_t{10} << 30) + std::string(1000, 'h'));
  c.push_back(header("LABEL", 'V', 0) + file("../evil", "x") +
              header("/abs", '2', 0, "/etc/passwd") + end_marker());
  c.push_back(extension('x', pax_record("GNU.sparse.name", "s") +
                                     pax_record("GNU.sparse.major", "1")) +
              file("s", "") + std::string(512, '\0'));
  c.push_back(file("a", "1") + file("b", "22"));  // no end marker
  c.push_back(std::string());
  return c;
}

// Makes a header-shaped block valid again, so mutants get past the checksum.
inline void fix_checksums(std::string& a) {
  for (size_t off = 0; off + 512 <= a.size(); off += 512) {
    std::string b = a.substr(off, 512);
    bool zero = true;
    for (char ch : b) zero = zero && ch == 0;
    if (zero) continue;
    fix_checksum(b);
    a.replace(off, 512, b);
  }
}

// Applies 1..6 random mutations (bit flips, interesting bytes, truncation, splices,
// numeric fields, repeated blocks, type flags, appended entries), then usually makes
// the checksums valid again.
inline std::string mutate(std::string a, const std::vector<std::string>& pool, std::mt19937_64& rng) {
  static const char kInteresting[] = {0, '\xff', '\x80', '0', '7', '8', '/', '.', ' ', '\n', '=',
                                      'x', 'g', 'L', 'K', '5', '1', '2', 'S', 'V'};
  const int rounds = 1 + static_cast<int>(rng() % 6);
  for (int r = 0; r < rounds; ++r) {
    const size_t pos = a.empty() ? 0 : rng() % a.size();
    switch (rng() % 9) {
      case 0:  // bit flip
        if (!a.empty()) a[pos] = static_cast<char>(a[pos] ^ (1 << (rng() % 8)));
        break;
      case 1:  // interesting byte
        if (!a.empty()) a[pos] = kInteresting[rng() % sizeof kInteresting];
        break;
      case 2:  // random byte
        if (!a.empty()) a[pos] = static_cast<char>(rng());
        break;
      case 3:  // truncate
        a.resize(a.empty() ? 0 : rng() % (a.size() + 1));
        break;
      case 4: {  // splice a piece of another entry, overwriting or inserting
        const std::string& o = pool[rng() % pool.size()];
        if (o.empty()) break;
        const size_t from = rng() % o.size();
        const size_t len = std::min<size_t>(1 + rng() % 1024, o.size() - from);
        if (rng() % 2) a.insert(std::min(pos, a.size()), o, from, len);
        else a.replace(std::min(pos, a.size()), len, o, from, len);
        break;
      }
      case 5: {  // a numeric field of a block rewritten with random octal digits
        if (a.size() < 512) break;
        const size_t blk = (rng() % (a.size() / 512)) * 512;
        static const size_t kFields[][2] = {{100, 8}, {108, 8}, {116, 8}, {124, 12}, {136, 12}};
        const auto& f = kFields[rng() % 5];
        for (size_t i = 0; i < f[1]; ++i) a[blk + f[0] + i] = static_cast<char>('0' + rng() % 8);
        if (rng() % 2) a[blk + f[0] + f[1] - 1] = '\0';
        break;
      }
      case 6:  // a block repeated
        if (a.size() >= 512) {
          const size_t blk = (rng() % (a.size() / 512)) * 512;
          a.insert(blk, a.substr(blk, 512));
        }
        break;
      case 7:  // a type flag changed
        if (a.size() >= 512) a[(rng() % (a.size() / 512)) * 512 + 156] = kInteresting[rng() % sizeof kInteresting];
        break;
      case 8:  // a whole valid entry appended
        a += pool[rng() % pool.size()];
        break;
    }
  }
  if (rng() % 4 != 0) fix_checksums(a);
  if (a.size() > (1 << 16)) a.resize(1 << 16);
  return a;
}

}  // namespace fastload::tar::testing
