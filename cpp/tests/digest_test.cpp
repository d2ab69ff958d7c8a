// fl64: pinned values, streaming == one-shot, every path == the scalar one, sensitivity
// to flips, swaps, truncation and zero-extension, fl64_zeros, and a throughput print.
#include "hash/digest.hpp"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <vector>

namespace fastload::hash::detail {
// Test hooks defined in digest.cpp (not part of the API). Paths: 0 scalar, 1 AVX2, 2 AVX-512.
bool fl64_path_available(int path) noexcept;
uint64_t fl64_using(int path, const void* data, size_t len, uint64_t seed) noexcept;
}  // namespace fastload::hash::detail

namespace {

int g_failures = 0;

#define DIGEST_CHECK(cond)                                                          \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                 \
    }                                                                               \
  } while (0)

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

using fastload::hash::fl64;
using fastload::hash::fl64_zeros;
using fastload::hash::Fl64Stream;
namespace detail = fastload::hash::detail;

std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<unsigned char>(rng());
  return v;
}

// Bytes 0, 1, 2, ... 250, 0, 1, ... : reproducible anywhere, no RNG involved.
std::vector<unsigned char> pattern(size_t n) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i % 251);
  return v;
}

void test_known_answers() {
  // Pinned: a change of any of these values changes every stored manifest. Bump the
  // manifest's digest version if that is ever intended.
  struct Kat {
    size_t len;
    uint64_t seed;
    uint64_t want;
  };
  const Kat kats[] = {
      {0, 0, 0x83fc24e5ff995237ULL},      {1, 0, 0x4b3021322cd5c77dULL},
      {3, 0, 0x4c2c939425f2f62bULL},      {64, 0, 0x361dd13ec2e85d93ULL},
      {1000, 0, 0xb44644addc194dcfULL},   {1024, 0, 0x444643d4c4ba2b1aULL},
      {4099, 0, 0xfae297d52eeeb21fULL},   {100000, 0, 0xdac27dcb1fd8aa04ULL},
      {100000, 1, 0xb39bb2a9c2550a4fULL}, {3, 0xFEEDULL, 0x4600dceafdf5bbc0ULL},
  };
  for (const Kat& k : kats) {
    const auto data = pattern(k.len);
    const uint64_t got = fl64(data.data(), data.size(), k.seed);
    if (got != k.want) {
      std::fprintf(stderr,
                   "known answer len=%zu seed=%" PRIu64 ": got 0x%016" PRIx64 " want 0x%016" PRIx64
                   "\n",
                   k.len, k.seed, got, k.want);
    }
    DIGEST_CHECK(got == k.want);
  }
}

void test_paths_agree() {
  const auto data = random_bytes(70000, 1);
  for (int path = 1; path <= 2; ++path) {
    if (!detail::fl64_path_available(path)) {
      std::printf("path %d not available on this CPU: not compared\n", path);
      continue;
    }
    for (size_t len = 0; len <= 5000; ++len) {
      DIGEST_CHECK(detail::fl64_using(path, data.data(), len, len) ==
                   detail::fl64_using(0, data.data(), len, len));
    }
    // Unaligned starts and block-sized lengths.
    for (size_t off = 0; off < 64; off += 7) {
      for (size_t len : {1024, 2048, 65536, 65537, 69000}) {
        const size_t n = std::min(len, data.size() - off);
        DIGEST_CHECK(detail::fl64_using(path, data.data() + off, n, 9) ==
                     detail::fl64_using(0, data.data() + off, n, 9));
      }
    }
  }
  DIGEST_CHECK(fl64(data.data(), data.size(), 3) ==
               detail::fl64_using(0, data.data(), data.size(), 3));
}

void test_stream_matches_oneshot() {
  std::mt19937_64 rng(7);
  const auto data = random_bytes(300000, 2);
  for (int trial = 0; trial < 400; ++trial) {
    const size_t len = trial < 200 ? rng() % 5000 : rng() % data.size();
    const uint64_t seed = rng() % 4;
    Fl64Stream st(seed);
    size_t at = 0;
    while (at < len) {
      // Mix tiny pieces (buffering), mid ones and big ones (block path).
      const size_t kind = rng() % 3;
      const size_t cap = kind == 0 ? 70 : kind == 1 ? 3000 : 100000;
      const size_t n = std::min(len - at, static_cast<size_t>(rng() % (cap + 1)));
      st.update(data.data() + at, n);
      at += n;
      if (rng() % 16 == 0) DIGEST_CHECK(st.digest() == fl64(data.data(), at, seed));
    }
    DIGEST_CHECK(st.digest() == fl64(data.data(), len, seed));
    DIGEST_CHECK(st.digest() == st.digest());  // digest() does not reset
  }
  // Byte at a time over a few blocks.
  Fl64Stream st;
  for (size_t i = 0; i < 5000; ++i) st.update(data.data() + i, 1);
  DIGEST_CHECK(st.digest() == fl64(data.data(), 5000));
  Fl64Stream empty(5);
  empty.update(nullptr, 0);
  DIGEST_CHECK(empty.digest() == fl64(nullptr, 0, 5));
  Fl64Stream partial;
  partial.update(data.data(), 10);
  partial.update(nullptr, 0);  // an empty update with a partial stripe buffered
  DIGEST_CHECK(partial.digest() == fl64(data.data(), 10));
}

void test_bit_flips() {
  for (size_t len : {1, 7, 64, 100, 1024, 2053}) {
    auto data = random_bytes(len, 10 + len);
    const uint64_t base = fl64(data.data(), len);
    std::set<uint64_t> seen{base};
    for (size_t bit = 0; bit < 8 * len; ++bit) {
      data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
      const uint64_t h = fl64(data.data(), len);
      DIGEST_CHECK(h != base);
      DIGEST_CHECK(seen.insert(h).second);  // all single flips distinct from each other too
      data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    }
  }
  // Sparse flips deep in a large buffer (after many scrambles), and on all-zero data.
  auto big = random_bytes(1 << 20, 11);
  std::vector<unsigned char> zero(1 << 20);
  const uint64_t big0 = fl64(big.data(), big.size());
  const uint64_t zero0 = fl64(zero.data(), zero.size());
  for (size_t bit = 3; bit < 8 * big.size(); bit += 99991) {
    big[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    zero[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    DIGEST_CHECK(fl64(big.data(), big.size()) != big0);
    DIGEST_CHECK(fl64(zero.data(), zero.size()) != zero0);
    big[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    zero[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
  }
}

void test_swaps() {
  auto data = random_bytes(16384, 12);
  const uint64_t base = fl64(data.data(), data.size());
  auto swapped = [&](size_t a, size_t b, size_t n) {
    auto copy = data;
    std::swap_ranges(copy.begin() + a, copy.begin() + a + n, copy.begin() + b);
    return fl64(copy.data(), copy.size());
  };
  DIGEST_CHECK(swapped(0, 8, 8) != base);            // two words of one stripe
  DIGEST_CHECK(swapped(0, 4, 4) != base);            // halves of one word
  DIGEST_CHECK(swapped(0, 64, 64) != base);          // adjacent stripes of one block
  DIGEST_CHECK(swapped(64, 1024 + 64, 64) != base);  // same position, different blocks
  DIGEST_CHECK(swapped(0, 1024, 1024) != base);      // whole blocks
  DIGEST_CHECK(swapped(4096, 12288, 4096) != base);
  // Repeated content: identical stripes/blocks in a different order must still differ.
  std::vector<unsigned char> ab(4096, 0xAA);
  std::fill(ab.begin() + 2048, ab.end(), 0x55);
  std::vector<unsigned char> ba(4096, 0x55);
  std::fill(ba.begin() + 2048, ba.end(), 0xAA);
  DIGEST_CHECK(fl64(ab.data(), ab.size()) != fl64(ba.data(), ba.size()));
}

void test_length_changes() {
  const auto data = random_bytes(5000, 13);
  std::set<uint64_t> prefixes;
  for (size_t len = 0; len <= data.size(); ++len) {
    DIGEST_CHECK(prefixes.insert(fl64(data.data(), len)).second);  // truncation
  }
  // Zero-extension: x and x + k zero bytes must differ, on both sides of block edges.
  for (size_t len : {0, 1, 63, 64, 1000, 1023, 1024, 3000}) {
    std::vector<unsigned char> buf(len + 200, 0);
    std::memcpy(buf.data(), data.data(), len);
    std::set<uint64_t> ext;
    for (size_t k = 0; k <= 200; ++k) DIGEST_CHECK(ext.insert(fl64(buf.data(), len + k)).second);
  }
  // The seed matters.
  DIGEST_CHECK(fl64(data.data(), 100, 0) != fl64(data.data(), 100, 1));
}

void test_zeros() {
  std::vector<unsigned char> zero((1 << 20) + 4096, 0);
  for (size_t len = 0; len <= 4200; ++len) {
    DIGEST_CHECK(fl64_zeros(len) == fl64(zero.data(), len));
  }
  for (size_t len : {65535, 65536, 65537, 1 << 20, (1 << 20) + 1, (1 << 20) + 4095}) {
    for (uint64_t seed : {0ull, 1ull, 0xABCDEFull}) {
      DIGEST_CHECK(fl64_zeros(len, seed) == fl64(zero.data(), len, seed));
    }
  }
  // A multi-GB hole against streaming a zero page.
  const uint64_t big = (3ull << 30) + 777;
  Fl64Stream st(4);
  for (uint64_t left = big; left > 0;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, zero.size()));
    st.update(zero.data(), n);
    left -= n;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t z = fl64_zeros(big, 4);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  DIGEST_CHECK(z == st.digest());
  std::printf("fl64_zeros(3 GiB): %.2f ms\n", s * 1e3);
}

// Best-of-reps wall time of one digest of `n` bytes through `path` (-1: the dispatcher).
double best_gbps(int path, const std::vector<unsigned char>& data, size_t n, int reps,
                 uint64_t* out) {
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    *out = path < 0 ? fl64(data.data(), n) : detail::fl64_using(path, data.data(), n, 0);
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return static_cast<double>(n) / best / 1e9;
}

void print_throughput() {
  // 256 MiB: streaming from memory (or the LLC where it is that large); 1 MiB: a chunk
  // that was just read, in cache. Printed, not asserted: timings belong to benchmarks.
  const size_t big = kSanitized ? (16u << 20) : (256u << 20);
  const auto data = random_bytes(big, 99);
  const char* names[] = {"dispatch", "scalar", "avx2", "avx512"};
#if !defined(__OPTIMIZE__)
  std::printf(
      "note: unoptimized build; configure with -DCMAKE_BUILD_TYPE=Release for real figures\n");
#endif
  for (const size_t n : {big, size_t{1} << 20}) {
    const int reps = n == big ? (kSanitized ? 2 : 8) : (kSanitized ? 4 : 500);
    for (int path = -1; path <= 2; ++path) {
      if (path >= 0 && !detail::fl64_path_available(path)) continue;
      uint64_t h = 0;
      const double gbps = best_gbps(path, data, n, reps, &h);
      std::printf("fl64 %-8s %4zu MiB: %6.2f GB/s (best of %d) [%016" PRIx64 "]%s\n",
                  names[path + 1], n >> 20, gbps, reps, h, kSanitized ? " (sanitizer build)" : "");
    }
  }
}

}  // namespace

int main() {
  test_known_answers();
  test_paths_agree();
  test_stream_matches_oneshot();
  test_bit_flips();
  test_swaps();
  test_length_changes();
  test_zeros();
  print_throughput();
  if (g_failures != 0) {
    std::fprintf(stderr, "digest_test: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("digest_test: ok\n");
  return 0;
}
