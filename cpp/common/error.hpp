// Native errors: an errno, the operation that failed and the path it failed on.
// The I/O layer returns -errno and never throws; code above it (copy, tar, index)
// turns a failure into an Error once, and the bindings map it to a Python exception.
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>
#include <utility>

namespace fastload {

// What kind of failure, so the bindings can choose the Python exception class
// without parsing messages.
enum class ErrorKind {
  kOs,             // a system call failed: err holds the errno
  kNoSpace,        // not enough free space on the destination
  kSourceChanged,  // a source file changed while it was being copied
  kUnsupported,    // a file type or link the caller did not allow
  kFormat,         // malformed input (archive, index)
  kIndexFormat,    // a shard index file that is corrupt, of another version, or stale
  kUnsafe,         // input that would write outside the destination
  kCancelled,      // the caller asked to stop
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, int err, std::string op, std::string path, const std::string& detail = {})
      : std::runtime_error(format(err, op, path, detail)),
        kind_(kind),
        err_(err),
        op_(std::move(op)),
        path_(std::move(path)) {}

  static Error os(int err, std::string op, std::string path) {
    return Error(ErrorKind::kOs, err, std::move(op), std::move(path));
  }

  ErrorKind kind() const noexcept { return kind_; }
  int err() const noexcept { return err_; }
  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }

 private:
  static std::string format(int err, const std::string& op, const std::string& path,
                            const std::string& detail);
  ErrorKind kind_;
  int err_;
  std::string op_;
  std::string path_;
};

}  // namespace fastload
