#include "common/permutation.hpp"

#include <algorithm>
#include <utility>
#include <vector>

namespace fastload {

void permutation(std::span<const uint64_t> words, std::span<int64_t> out) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  uint64_t start = mix64(words.empty() ? 0 : words[0]);
  for (size_t k = 1; k < words.size(); ++k) start = mix64(start ^ words[k]);
  const size_t n = out.size();
  std::vector<std::pair<uint64_t, uint64_t>> keyed(n);  // (key, index): sorted, a stable argsort
  uint64_t x = start;
  for (size_t i = 0; i < n; ++i) {
    x += kGolden;
    keyed[i] = {mix64(x), i};
  }
  std::sort(keyed.begin(), keyed.end());
  for (size_t i = 0; i < n; ++i) out[i] = int64_t(keyed[i].second);
}

}  // namespace fastload
