// The one permutation (common/permutation.hpp): SplitMix64's published first output,
// pack's pinned orders (one word: the order pack has always written), a permutation of
// every size, determined by its words and changed by each of them.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "check.hpp"
#include "common/permutation.hpp"

using namespace fastload;

namespace {

std::vector<int64_t> perm(size_t n, std::vector<uint64_t> words) {
  std::vector<int64_t> out(n);
  permutation(words, out);
  return out;
}

void test_mix() {
  // SplitMix64 seeded with 0: its first output is mix64(0 + golden).
  CHECK_EQ(mix64(0x9E3779B97F4A7C15ull), 0xE220A8397B1DCDAFull);
  CHECK_EQ(mix64(0), uint64_t(0));
}

void test_pinned() {
  // tests/packing/test_writer.py pins the same values through Python.
  CHECK(perm(10, {0}) == (std::vector<int64_t>{2, 4, 6, 8, 5, 1, 7, 0, 9, 3}));
  CHECK(perm(10, {12345}) == (std::vector<int64_t>{8, 1, 5, 4, 0, 2, 9, 6, 7, 3}));
  CHECK(perm(0, {1, 2}).empty());
  CHECK(perm(1, {1, 2}) == (std::vector<int64_t>{0}));
}

void test_is_a_permutation() {
  for (size_t n : {2, 3, 17, 1000, 65537}) {
    std::vector<int64_t> p = perm(n, {7, 1, n});
    CHECK(p == perm(n, {7, 1, n}));  // the same words, the same order
    std::vector<int64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    CHECK(sorted == all);
  }
}

void test_every_word_counts() {
  const std::vector<int64_t> base = perm(50, {3, 4, 5});
  CHECK(perm(50, {4, 4, 5}) != base);
  CHECK(perm(50, {3, 5, 5}) != base);
  CHECK(perm(50, {3, 4, 6}) != base);
  CHECK(perm(50, {3, 4}) != base);
  CHECK(perm(50, {3, 4, 5, 0}) != base);
  CHECK(perm(50, {}) == perm(50, {0}));
}

}  // namespace

int main() {
  test_mix();
  test_pinned();
  test_is_a_permutation();
  test_every_word_counts();
  return test::exit_code();
}
