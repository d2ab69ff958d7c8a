#include "copy/objects.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "common/error.hpp"
#include "common/timespec.hpp"
#include "common/write.hpp"
#include "copy/copier.hpp"
#include "hash/digest.hpp"

namespace fastload::copy {

ObjectWriter::ObjectWriter(const std::string& root, uint32_t mode, uint64_t stripe)
    : root_path_(root), mode_(mode & 07777), stripe_(stripe ? stripe : 1) {
  root_.reset(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!root_) throw Error::os(errno, "open", root);
}

// O_TMPFILE in the object's folder where the file system has them; else (or once it
// refused one) the named temporary, whose name goes to `named`.
UniqueFd ObjectWriter::open_temp(const ObjectBody& b, std::string& named) {
  const std::string path = root_path_ + "/" + b.name;
  if (tmpfile_) {
    const auto slash = b.name.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : b.name.substr(0, slash);
    UniqueFd fd(::openat(root_.get(), dir.c_str(), O_WRONLY | O_TMPFILE | O_CLOEXEC, mode_));
    if (fd) return fd;
    // Refused by the file system (or an older kernel): named temporaries from now on.
    // Anything else (no room, no permission, a read-only file system) is the file's error.
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
      throw Error::os(errno, "create", path);
    }
    tmpfile_ = false;
  }
  // Created new (O_EXCL), so it has this writer's mode: a temporary a killed run left at
  // the name (whose mode, owner or links are its own) is removed first, never reused.
  named = temp_name(b.name);
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW;
  UniqueFd fd(::openat(root_.get(), named.c_str(), flags, mode_));
  if (!fd && errno == EEXIST) {
    if (::unlinkat(root_.get(), named.c_str(), 0) != 0) {
      const int err = errno;
      named.clear();  // not ours: left alone
      throw Error::os(err, "remove stale temporary of", path);
    }
    fd.reset(::openat(root_.get(), named.c_str(), flags, mode_));
  }
  if (!fd) {
    const int err = errno;
    named.clear();
    throw Error::os(err, "create", path);
  }
  return fd;
}

// Links the anonymous temporary `fd` to rel: 0 or errno. AT_EMPTY_PATH where this process
// may (CAP_DAC_READ_SEARCH on older kernels), else through /proc/self/fd.
int ObjectWriter::link_into_place(int fd, const std::string& rel) {
  if (empty_path_link_) {
    if (::linkat(fd, "", root_.get(), rel.c_str(), AT_EMPTY_PATH) == 0) return 0;
    if (errno != ENOENT && errno != EPERM) return errno;
    empty_path_link_ = false;
  }
  char proc[40];
  std::snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  return ::linkat(AT_FDCWD, proc, root_.get(), rel.c_str(), AT_SYMLINK_FOLLOW) == 0 ? 0 : errno;
}

std::vector<uint64_t> ObjectWriter::write(const ObjectBody& b) {
  const std::string path = root_path_ + "/" + b.name;
  std::string named;  // the named temporary, while there is one to remove on a failure
  UniqueFd fd = open_temp(b, named);
  try {
    write_all_at(fd.get(), b.data, b.size, 0, path);
    std::vector<uint64_t> digests;
    digests.reserve(b.size / stripe_ + 1);
    for (size_t at = 0; at < b.size || digests.empty(); at += stripe_) {
      const size_t n = b.size - at < stripe_ ? b.size - at : size_t(stripe_);
      digests.push_back(hash::fl64(b.data + at, n));
    }
    const timespec times[2] = {to_timespec(b.mtime_ns), to_timespec(b.mtime_ns)};
    if (::futimens(fd.get(), times) != 0) throw Error::os(errno, "set times of", path);
    // Before the link: a file at its final name carries its mark, or none (a refusal, as
    // of a file system without user attributes, leaves it unmarked: not trusted later).
    if (!b.mark.empty()) ::fsetxattr(fd.get(), kObjectMark, b.mark.data(), b.mark.size(), 0);
    if (named.empty()) {
      int err = link_into_place(fd.get(), b.name);
      if (err == EEXIST) {
        // An older copy stays until replaced whole: linked to the temporary name, then
        // renamed over it, as a named temporary is.
        const std::string tmp = temp_name(b.name);
        ::unlinkat(root_.get(), tmp.c_str(), 0);  // an earlier run's leftover
        err = link_into_place(fd.get(), tmp);
        if (err == 0) named = tmp;
      }
      if (err != 0) throw Error::os(err, "link into place", path);
    }
    if (!named.empty()) {
      if (::renameat(root_.get(), named.c_str(), root_.get(), b.name.c_str()) != 0) {
        throw Error::os(errno, "rename into place", path);
      }
      named.clear();
    }
    return digests;
  } catch (...) {
    if (!named.empty()) ::unlinkat(root_.get(), named.c_str(), 0);  // a full disk, say
    throw;
  }
}

void ObjectWriter::write_all(const std::vector<ObjectBody>& bodies,
                             std::vector<std::vector<uint64_t>>& digests,
                             std::vector<std::exception_ptr>& errors) {
  digests.assign(bodies.size(), {});
  errors.assign(bodies.size(), nullptr);
  for (size_t i = 0; i < bodies.size(); ++i) {
    try {
      digests[i] = write(bodies[i]);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  }
}

}  // namespace fastload::copy
