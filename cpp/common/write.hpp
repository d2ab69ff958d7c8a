// Writing a whole buffer to a file descriptor, whatever the kernel takes per call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastload {

// Writes p[0, n) to fd: at offset `at` (pwrite), or at the file position when at < 0.
// Retries short writes and EINTR; throws Error (the errno, op "write", `what` as the path).
void write_all_at(int fd, const char* p, size_t n, int64_t at, const std::string& what);

}  // namespace fastload
