// fl64: a 64-bit non-cryptographic checksum built for memory-bandwidth speed.
//
// Layout of the computation (every path below computes exactly this):
//   - the input is cut into 64-byte stripes; 16 stripes make a 1 KiB block;
//   - eight 64-bit lanes; lane i of a stripe is the little-endian word d at offset 8*i;
//   - with k = key[s][i] (s = the stripe's position inside its block) and v = d ^ k:
//       acc[i] += rot32(v) + lo32(v) * hi32(v)
//     The 32x32->64 product mixes; the rotated copy of v keeps the step injective in d,
//     so a single flipped bit always changes acc[i]: for a flip in bit j of the low half
//     the change is +-2^j * (hi32(v) + 2^32), for one in the high half +-2^j * (lo32(v) + 1),
//     and neither is 0 mod 2^64;
//   - after each full block: acc[i] = ((acc[i] ^ acc[i] >> 29) ^ scr[i]) * kScrambleMul,
//     a bijection, so a difference survives it, and the order of blocks matters;
//   - a final partial stripe is zero-padded and absorbed at its position, unscrambled;
//   - the eight lanes are chained into one word starting from seed and length: each
//     step is a bijection of the running word and of the lane, so a change confined to
//     one lane, or a change of length alone (truncation, zero-extension), always changes
//     the digest. Then a xorshift-multiply avalanche.
// The per-position keys make the value depend on where each stripe sits in its block
// (swapped stripes differ); the scramble makes it depend on block order.
//
// Paths: a portable scalar one, and AVX2 / AVX-512 ones for whole blocks chosen at run
// time (see best_blocks). The vector paths use 32x32->64 multiplies (vpmuludq) and
// 64-bit adds, so they give bit-identical results; digest_test checks that.
#include "hash/digest.hpp"

#include <algorithm>
#include <bit>
#include <cstring>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(FASTLOAD_FL64_PORTABLE)  // -DFASTLOAD_FL64_PORTABLE: the scalar path only
#define FASTLOAD_FL64_X86 1
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_*()
// placeholders; the pragma covers the header's lines only (diagnostic state is by location).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define FASTLOAD_FL64_X86 0
#endif

namespace fastload::hash {
namespace {

constexpr size_t kLanes = 8;
constexpr size_t kStripe = 64;
constexpr size_t kStripesPerBlock = 16;
constexpr size_t kBlock = kStripe * kStripesPerBlock;
constexpr uint64_t kScrambleMul = 0x9E3779B1u;  // odd, fits 32 bits (one vpmuludq per half)

// Key material: drawn once from a splitmix64 sequence with a fixed start, at compile time.
struct Tables {
  uint64_t key[kStripesPerBlock][kLanes];
  uint64_t scramble[kLanes];
  uint64_t iv[kLanes];
  // What one all-zero stripe adds to each lane at each position, and a whole zero block:
  // fl64_zeros() needs only these.
  uint64_t zero_stripe[kStripesPerBlock][kLanes];
  uint64_t zero_block[kLanes];
};

constexpr uint64_t splitmix_next(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ull;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t rot32(uint64_t v) { return (v << 32) | (v >> 32); }

constexpr uint64_t lane_step(uint64_t d, uint64_t k) {
  const uint64_t v = d ^ k;
  return rot32(v) + (v & 0xFFFFFFFFull) * (v >> 32);
}

constexpr Tables make_tables() {
  Tables t{};
  uint64_t state = 0x666C36345F763121ull;  // "fl64_v1!"
  for (auto& row : t.key) {
    for (auto& k : row) k = splitmix_next(state);
  }
  for (auto& s : t.scramble) s = splitmix_next(state);
  for (auto& v : t.iv) v = splitmix_next(state);
  for (size_t i = 0; i < kLanes; ++i) {
    uint64_t sum = 0;
    for (size_t s = 0; s < kStripesPerBlock; ++s) {
      t.zero_stripe[s][i] = lane_step(0, t.key[s][i]);
      sum += t.zero_stripe[s][i];
    }
    t.zero_block[i] = sum;
  }
  return t;
}

alignas(64) constexpr Tables kT = make_tables();

inline uint64_t load_le64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
  return v;
}

inline void scramble_scalar(uint64_t* acc) {
  for (size_t i = 0; i < kLanes; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 29;
    a ^= kT.scramble[i];
    acc[i] = a * kScrambleMul;
  }
}

// Absorbs n stripes starting at block position pos; the caller keeps pos + n <= 16
// and scrambles when a block completes.
inline void stripes_scalar(uint64_t* acc, const unsigned char* p, size_t n, size_t pos) {
  for (size_t s = 0; s < n; ++s, p += kStripe) {
    const uint64_t* key = kT.key[pos + s];
    for (size_t i = 0; i < kLanes; ++i) acc[i] += lane_step(load_le64(p + 8 * i), key[i]);
  }
}

void blocks_scalar(uint64_t* acc, const unsigned char* p, size_t nblocks) {
  for (size_t b = 0; b < nblocks; ++b, p += kBlock) {
    stripes_scalar(acc, p, kStripesPerBlock, 0);
    scramble_scalar(acc);
  }
}

#if FASTLOAD_FL64_X86
__attribute__((target("avx2"))) inline __m256i step_avx2(__m256i acc, __m256i d, __m256i k) {
  const __m256i v = _mm256_xor_si256(d, k);
  const __m256i prod = _mm256_mul_epu32(v, _mm256_srli_epi64(v, 32));
  const __m256i rot = _mm256_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1));
  return _mm256_add_epi64(acc, _mm256_add_epi64(prod, rot));
}

__attribute__((target("avx2"))) inline __m256i scramble_avx2(__m256i a, __m256i s, __m256i m) {
  a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 29));
  a = _mm256_xor_si256(a, s);
  // a * m mod 2^64 with m < 2^32: lo32(a)*m + (hi32(a)*m << 32).
  const __m256i lo = _mm256_mul_epu32(a, m);
  const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

__attribute__((target("avx2"))) void blocks_avx2(uint64_t* acc, const unsigned char* p,
                                                 size_t nblocks) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4));
  const __m256i s0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kT.scramble));
  const __m256i s1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kT.scramble + 4));
  const __m256i m = _mm256_set1_epi64x(static_cast<long long>(kScrambleMul));
  for (size_t b = 0; b < nblocks; ++b, p += kBlock) {
#pragma GCC unroll 16
    for (size_t s = 0; s < kStripesPerBlock; ++s) {
      const unsigned char* q = p + s * kStripe;
      const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
      a0 = step_avx2(a0, d0, _mm256_load_si256(reinterpret_cast<const __m256i*>(kT.key[s])));
      a1 = step_avx2(a1, d1, _mm256_load_si256(reinterpret_cast<const __m256i*>(kT.key[s] + 4)));
    }
    a0 = scramble_avx2(a0, s0, m);
    a1 = scramble_avx2(a1, s1, m);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
}

__attribute__((target("avx512f"))) inline __m512i step_avx512(__m512i acc, __m512i d, __m512i k) {
  const __m512i v = _mm512_xor_si512(d, k);
  const __m512i prod = _mm512_mul_epu32(v, _mm512_srli_epi64(v, 32));
  return _mm512_add_epi64(acc, _mm512_add_epi64(prod, _mm512_ror_epi64(v, 32)));
}

__attribute__((target("avx512f"))) void blocks_avx512(uint64_t* acc, const unsigned char* p,
                                                      size_t nblocks) {
  __m512i a = _mm512_loadu_si512(acc);
  const __m512i s = _mm512_load_si512(kT.scramble);
  const __m512i m = _mm512_set1_epi64(static_cast<long long>(kScrambleMul));
  for (size_t b = 0; b < nblocks; ++b, p += kBlock) {
#pragma GCC unroll 16
    for (size_t j = 0; j < kStripesPerBlock; ++j) {
      a = step_avx512(a, _mm512_loadu_si512(p + j * kStripe), _mm512_load_si512(kT.key[j]));
    }
    a = _mm512_xor_si512(a, _mm512_srli_epi64(a, 29));
    a = _mm512_xor_si512(a, s);
    const __m512i lo = _mm512_mul_epu32(a, m);
    const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
  }
  _mm512_storeu_si512(acc, a);
}
#endif

using BlocksFn = void (*)(uint64_t*, const unsigned char*, size_t);

// Path numbers, shared with detail::fl64_using (digest_test): 0 scalar, 1 AVX2, 2 AVX-512.
bool path_available(int path) {
  if (path == 0) return true;
#if FASTLOAD_FL64_X86
  __builtin_cpu_init();
  if (path == 1) return __builtin_cpu_supports("avx2");
  if (path == 2) return __builtin_cpu_supports("avx512f");
#endif
  return false;
}

BlocksFn blocks_for(int path) {
#if FASTLOAD_FL64_X86
  if (path == 1) return blocks_avx2;
  if (path == 2) return blocks_avx512;
#endif
  (void)path;
  return blocks_scalar;
}

// Measured on the Sapphire Rapids class Xeon this was written on: in cache (a chunk that
// was just read) AVX-512 does ~65 GB/s and AVX2 ~42; streaming from DRAM AVX2 is slightly
// ahead (~12 vs ~11 GB/s). So AVX-512 for calls up to a few MiB, AVX2 above.
constexpr size_t kWideMaxBytes = size_t{4} << 20;

BlocksFn best_blocks(size_t len) {
  static const BlocksFn narrow = blocks_for(path_available(1) ? 1 : 0);
  static const BlocksFn wide = path_available(2) ? blocks_for(2) : narrow;
  return len <= kWideMaxBytes ? wide : narrow;
}

// Absorbs whole stripes from p (len bytes; a trailing partial stripe is left for the
// caller), advancing *pos (the block position) and scrambling at block boundaries.
// Returns how many bytes were absorbed.
size_t absorb_stripes(uint64_t* acc, unsigned* pos, const unsigned char* p, size_t len,
                      BlocksFn blocks) {
  size_t nstripes = len / kStripe;
  const unsigned char* const start = p;
  if (*pos != 0 && nstripes > 0) {
    const size_t n = std::min(nstripes, kStripesPerBlock - *pos);
    stripes_scalar(acc, p, n, *pos);
    p += n * kStripe;
    nstripes -= n;
    *pos += static_cast<unsigned>(n);
    if (*pos == kStripesPerBlock) {
      scramble_scalar(acc);
      *pos = 0;
    }
  }
  if (*pos == 0 && nstripes >= kStripesPerBlock) {
    const size_t nblocks = nstripes / kStripesPerBlock;
    blocks(acc, p, nblocks);
    p += nblocks * kBlock;
    nstripes -= nblocks * kStripesPerBlock;
  }
  if (nstripes > 0) {  // fewer than a block left, and *pos == 0 here
    stripes_scalar(acc, p, nstripes, *pos);
    p += nstripes * kStripe;
    *pos += static_cast<unsigned>(nstripes);
  }
  return static_cast<size_t>(p - start);
}

// Absorbs a final partial stripe (0 < n < 64 bytes) zero-padded, at position pos.
void absorb_tail(uint64_t* acc, unsigned pos, const unsigned char* p, size_t n) {
  unsigned char pad[kStripe] = {};
  std::memcpy(pad, p, n);
  stripes_scalar(acc, pad, 1, pos);
}

void init_acc(uint64_t* acc, uint64_t seed) {
  // The seed enters the lanes too (not only the final chain) so that different seeds
  // give unrelated collision sets, through the nonlinear scrambles.
  for (size_t i = 0; i < kLanes; ++i) acc[i] = kT.iv[i] ^ (seed * 0xD1342543DE82EF95ull + i);
}

uint64_t finalize(const uint64_t* acc, uint64_t total, uint64_t seed) {
  uint64_t h = seed ^ (total * 0x9FB21C651E98DF25ull);
  for (size_t i = 0; i < kLanes; ++i) {
    h = (h ^ acc[i]) * 0xE7037ED1A0B428DBull;
    h ^= h >> 32;
  }
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 29;
  h *= 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 32;
  return h;
}

uint64_t oneshot(const void* data, size_t len, uint64_t seed, BlocksFn blocks) {
  uint64_t acc[kLanes];
  init_acc(acc, seed);
  unsigned pos = 0;
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t done = len == 0 ? 0 : absorb_stripes(acc, &pos, p, len, blocks);
  if (done < len) absorb_tail(acc, pos, p + done, len - done);
  return finalize(acc, len, seed);
}

}  // namespace

namespace detail {
// Test hooks (declared in digest_test.cpp, not part of the API): the one-shot digest
// through one given path, and whether this CPU can run it.
bool fl64_path_available(int path) noexcept { return path_available(path); }
uint64_t fl64_using(int path, const void* data, size_t len, uint64_t seed) noexcept {
  return oneshot(data, len, seed, blocks_for(path_available(path) ? path : 0));
}
}  // namespace detail

uint64_t fl64(const void* data, size_t len, uint64_t seed) noexcept {
  return oneshot(data, len, seed, best_blocks(len));
}

Fl64Stream::Fl64Stream(uint64_t seed) noexcept : seed_(seed) { init_acc(acc_, seed); }

void Fl64Stream::update(const void* data, size_t len) noexcept {
  if (len == 0) return;  // data may be null then: memcpy must not see it
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += len;
  if (buffered_ > 0) {
    const size_t take = std::min(len, sizeof buf_ - buffered_);
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    len -= take;
    if (buffered_ < sizeof buf_) return;
    absorb_stripes(acc_, &pos_, buf_, sizeof buf_, blocks_scalar);
    buffered_ = 0;
  }
  if (len == 0) return;
  const size_t done = absorb_stripes(acc_, &pos_, p, len, best_blocks(len));
  std::memcpy(buf_, p + done, len - done);
  buffered_ = len - done;
}

uint64_t Fl64Stream::digest() const noexcept {
  uint64_t acc[kLanes];
  std::memcpy(acc, acc_, sizeof acc);
  if (buffered_ > 0) absorb_tail(acc, pos_, buf_, buffered_);
  return finalize(acc, total_, seed_);
}

uint64_t fl64_zeros(uint64_t len, uint64_t seed) noexcept {
  // Same steps as absorbing len zero bytes, with each stripe's contribution read from
  // the precomputed tables: O(len / 1 KiB) register arithmetic, no data touched.
  uint64_t acc[kLanes];
  init_acc(acc, seed);
  const uint64_t nstripes = len / kStripe;
  const uint64_t nblocks = nstripes / kStripesPerBlock;
  for (uint64_t b = 0; b < nblocks; ++b) {
    for (size_t i = 0; i < kLanes; ++i) acc[i] += kT.zero_block[i];
    scramble_scalar(acc);
  }
  const size_t rest = static_cast<size_t>(nstripes % kStripesPerBlock);
  // The zero-padded tail of a zero input is one more zero stripe at position `rest`.
  const size_t upto = rest + (len % kStripe != 0 ? 1 : 0);
  for (size_t s = 0; s < upto; ++s) {
    for (size_t i = 0; i < kLanes; ++i) acc[i] += kT.zero_stripe[s][i];
  }
  return finalize(acc, len, seed);
}

}  // namespace fastload::hash
