// The one permutation fastload shuffles with: pack's sample order (--shuffle --seed) and
// the datasets' epoch order (shard order, then each block's sample order) are both
// permutation(n, words) of their own words.
//
// Defined here, bit for bit, by nothing but 64-bit integer arithmetic, so that an order
// never changes under another numpy, compiler, platform or thread count:
//   mix(x)     SplitMix64's finaliser: x ^= x >> 30; x *= 0xBF58476D1CE4E5B9;
//              x ^= x >> 27; x *= 0x94D049BB133111EB; x ^= x >> 31 (mod 2^64)
//   start      mix(words[0]), then for each further word w: start = mix(start ^ w)
//              (no words: start = mix(0))
//   key(i)     mix(start + (i + 1) * 0x9E3779B97F4A7C15), i = 0 .. n-1 (mod 2^64)
//   result     the indices i ordered by key(i), ties (a 64-bit collision) by i.
// A one-word permutation is pack's order since its first release. Each step of `start`
// is a bijection of the new word for a given prefix, so words that differ in their last
// word never share a start.
#pragma once

#include <cstdint>
#include <span>

namespace fastload {

// SplitMix64's finaliser (a bijection of 64-bit integers).
constexpr uint64_t mix64(uint64_t x) noexcept {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// Writes the permutation of 0 .. out.size()-1 determined by words into out.
void permutation(std::span<const uint64_t> words, std::span<int64_t> out);

}  // namespace fastload
