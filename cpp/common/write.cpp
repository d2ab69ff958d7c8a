#include "common/write.hpp"

#include <unistd.h>

#include <cerrno>

#include "common/error.hpp"

namespace fastload {

void write_all_at(int fd, const char* p, size_t n, int64_t at, const std::string& what) {
  while (n > 0) {
    const ssize_t r = at < 0 ? ::write(fd, p, n) : ::pwrite(fd, p, n, off_t(at));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error::os(errno, "write", what);
    }
    if (r == 0) throw Error::os(EIO, "write", what);
    p += r;
    n -= size_t(r);
    if (at >= 0) at += r;
  }
}

}  // namespace fastload
