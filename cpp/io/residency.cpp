#include "io/residency.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

namespace fastload::io {

uint64_t cached_bytes(int fd, uint64_t offset, uint64_t length, int* err) noexcept {
  *err = 0;
  if (length == 0) return 0;
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = offset - offset % page;
  const uint64_t end = offset + length;
  const uint64_t span = end - start;
  void* map = ::mmap(nullptr, span, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(start));
  if (map == MAP_FAILED) {
    *err = -errno;
    return 0;
  }
  uint64_t total = 0;
  try {
    std::vector<unsigned char> vec((span + page - 1) / page);
    if (::mincore(map, span, vec.data()) != 0) {
      *err = -errno;
    } else {
      for (uint64_t i = 0; i < vec.size(); ++i) {
        if (!(vec[i] & 1)) continue;
        const uint64_t lo = std::max(start + i * page, offset);
        const uint64_t hi = std::min(start + (i + 1) * page, end);
        total += hi - lo;
      }
    }
  } catch (...) {  // the vector's allocation
    *err = -ENOMEM;
  }
  ::munmap(map, span);
  return *err ? 0 : total;
}

}  // namespace fastload::io
