// Raw system calls for the I/O engine: one thin wrapper per call, each returning the
// result or -errno. errno is read once, right after the call, and never left for the
// caller to inspect; nothing here retries or throws. Higher layers (pread_pool.cpp,
// uring.cpp) decide about EINTR.
#pragma once

#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

namespace fastload::io::sys {

// Folds the libc convention (-1 and errno) into the kernel one (-errno).
inline long ret_or_errno(long ret) noexcept { return ret < 0 ? -errno : ret; }

inline int io_uring_setup(unsigned entries, io_uring_params* p) noexcept {
  return static_cast<int>(ret_or_errno(::syscall(__NR_io_uring_setup, entries, p)));
}

// arg/argsz: a sigset_t (without IORING_ENTER_EXT_ARG) or an io_uring_getevents_arg.
inline int io_uring_enter(int ring_fd, unsigned to_submit, unsigned min_complete,
                          unsigned flags, const void* arg, size_t argsz) noexcept {
  return static_cast<int>(ret_or_errno(
      ::syscall(__NR_io_uring_enter, ring_fd, to_submit, min_complete, flags, arg, argsz)));
}

inline int io_uring_register(int ring_fd, unsigned opcode, const void* arg,
                             unsigned nr_args) noexcept {
  return static_cast<int>(
      ret_or_errno(::syscall(__NR_io_uring_register, ring_fd, opcode, arg, nr_args)));
}

inline int openat(int dir_fd, const char* path, int flags, unsigned mode) noexcept {
  return static_cast<int>(ret_or_errno(::openat(dir_fd, path, flags, mode)));
}

inline int close(int fd) noexcept { return static_cast<int>(ret_or_errno(::close(fd))); }

inline long pread(int fd, void* buf, size_t len, uint64_t off) noexcept {
  return ret_or_errno(::pread(fd, buf, len, static_cast<off_t>(off)));
}

inline long pwrite(int fd, const void* buf, size_t len, uint64_t off) noexcept {
  return ret_or_errno(::pwrite(fd, buf, len, static_cast<off_t>(off)));
}

// Through syscall(2) rather than glibc's statx() so the pool and io_uring report the
// same kernel errors (glibc may emulate statx with fstatat on old kernels).
inline int statx(int dir_fd, const char* path, int flags, unsigned mask,
                 struct statx* buf) noexcept {
  return static_cast<int>(
      ret_or_errno(::syscall(__NR_statx, dir_fd, path, flags, mask, buf)));
}

inline int fsync(int fd) noexcept { return static_cast<int>(ret_or_errno(::fsync(fd))); }

}  // namespace fastload::io::sys
