#include "copy/walk.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <limits.h>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

#include "common/error.hpp"
#include "common/unique_fd.hpp"

namespace fastload::copy {
namespace {

constexpr size_t kStatBatch = 64;

std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

std::string base_name(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool any_match(const std::vector<std::string>& patterns, const std::string& path) {
  for (const auto& p : patterns)
    if (glob_match(p, path)) return true;
  return false;
}

// Splits a '/'-path into components, resolving "." and ".." lexically. Returns false when
// ".." would climb above the start.
bool normalize(const std::string& path, std::vector<std::string>* parts) {
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    std::string c = path.substr(i, j - i);
    if (c.empty() || c == ".") {
    } else if (c == "..") {
      if (parts->empty()) return false;
      parts->pop_back();
    } else {
      parts->push_back(std::move(c));
    }
    i = j + 1;
  }
  return true;
}

struct Task {
  std::string dir;                 // relative path of the directory
  std::vector<std::string> names;  // empty: list dir; otherwise: stat these names in dir
};

class Walker {
 public:
  Walker(const std::string& root, const WalkOptions& options) : root_(root), opt_(options) {
    char buf[PATH_MAX];
    if (!::realpath(root.c_str(), buf)) throw Error::os(errno, "resolve", root);
    root_abs_ = buf;
    root_fd_.reset(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!root_fd_) throw Error::os(errno, "open directory", root);
  }

  FlatTree run() {
    queue_.push_back(Task{"", {}});
    pending_ = 1;
    unsigned n = std::max(1u, opt_.threads);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned i = 0; i < n; ++i) threads.emplace_back([this] { loop(); });
    for (auto& t : threads) t.join();
    if (error_) throw *error_;
    std::sort(skipped_.begin(), skipped_.end());
    return FlatTree(std::move(batches_), std::move(skipped_));
  }

 private:
  void loop() {
    for (;;) {
      Task task;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return !queue_.empty() || pending_ == 0 || error_; });
        if (pending_ == 0 || error_) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::vector<Task> more;
      FlatTree::Batch found;
      try {
        if (task.names.empty())
          list(task.dir, &more);
        else
          stat_batch(task.dir, task.names, &found, &more);
      } catch (const Error& e) {
        std::lock_guard lk(mu_);
        if (!error_) error_ = e;
      }
      std::lock_guard lk(mu_);
      if (!found.recs.empty()) batches_.push_back(std::move(found));
      for (auto& t : more) queue_.push_back(std::move(t));
      pending_ += more.size();
      --pending_;
      cv_.notify_all();
    }
  }

  void list(const std::string& dir, std::vector<Task>* more) {
    int fd = dir.empty() ? ::dup(root_fd_.get())
                         : ::openat(root_fd_.get(), dir.c_str(),
                                    O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) throw Error::os(errno, "open directory", join(root_, dir));
    DIR* d = ::fdopendir(fd);
    if (!d) {
      int e = errno;
      ::close(fd);
      throw Error::os(e, "open directory", join(root_, dir));
    }
    std::vector<std::string> batch;
    errno = 0;
    while (dirent* de = ::readdir(d)) {
      std::string name = de->d_name;
      if (name == "." || name == "..") continue;
      batch.push_back(std::move(name));
      if (batch.size() == kStatBatch) {
        more->push_back(Task{dir, std::move(batch)});
        batch.clear();
      }
      errno = 0;
    }
    int e = errno;
    ::closedir(d);
    if (e) throw Error::os(e, "read directory", join(root_, dir));
    if (!batch.empty()) more->push_back(Task{dir, std::move(batch)});
  }

  void stat_batch(const std::string& dir, const std::vector<std::string>& names,
                  FlatTree::Batch* found, std::vector<Task>* more) {
    UniqueFd dfd(dir.empty() ? ::dup(root_fd_.get())
                             : ::openat(root_fd_.get(), dir.c_str(),
                                        O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW));
    if (!dfd) throw Error::os(errno, "open directory", join(root_, dir));
    size_t bytes = 0;
    for (const auto& name : names) bytes += dir.size() + 1 + name.size();
    found->blob.reserve(bytes);
    found->recs.reserve(names.size());
    for (const auto& name : names) {
      std::string rel = join(dir, name);
      struct stat st;
      if (::fstatat(dfd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;  // vanished between readdir and stat
        throw Error::os(errno, "stat", join(root_, rel));
      }
      FlatTree::Rec e;
      std::string target_out;
      e.mode = st.st_mode & 07777;
      e.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
      if (S_ISDIR(st.st_mode)) {
        if (any_match(opt_.exclude, rel)) continue;  // prunes the subtree
        e.type = EntryType::kDir;
        more->push_back(Task{rel, {}});
      } else if (S_ISREG(st.st_mode)) {
        if (!selected(rel)) continue;
        e.type = EntryType::kFile;
        e.size = uint64_t(st.st_size);
        e.blocks = uint64_t(st.st_blocks);
      } else if (S_ISLNK(st.st_mode)) {
        if (!selected(rel)) continue;
        e.type = EntryType::kSymlink;
        std::string target(size_t(st.st_size) + 1, '\0');
        ssize_t n = ::readlinkat(dfd.get(), name.c_str(), target.data(), target.size());
        if (n < 0) throw Error::os(errno, "read link", join(root_, rel));
        target.resize(size_t(n));
        if (!link_stays_inside(root_abs_, rel, target, &target_out)) {
          refuse(rel, "symbolic link points outside the source tree (to '" + target + "')");
          continue;
        }
      } else {
        if (!selected(rel)) continue;
        const char* what = S_ISFIFO(st.st_mode)   ? "a FIFO"
                           : S_ISSOCK(st.st_mode) ? "a socket"
                           : S_ISCHR(st.st_mode)  ? "a character device"
                           : S_ISBLK(st.st_mode)  ? "a block device"
                                                  : "an unsupported file type";
        refuse(rel, std::string("is ") + what);
        continue;
      }
      e.off = uint32_t(found->blob.size());
      e.len = uint32_t(rel.size());
      found->blob += rel;
      if (e.type == EntryType::kSymlink)
        found->targets.emplace_back(uint32_t(found->recs.size()), std::move(target_out));
      found->recs.push_back(e);
    }
  }

  bool selected(const std::string& rel) const {
    if (!opt_.include.empty() && !any_match(opt_.include, rel)) return false;
    return !any_match(opt_.exclude, rel);
  }

  void refuse(const std::string& rel, const std::string& why) {
    if (opt_.skip_special) {
      std::lock_guard lk(mu_);
      skipped_.push_back(rel);
      return;
    }
    throw Error(ErrorKind::kUnsupported, 0, "refusing to stage", join(root_, rel),
                why + " (pass on_special='skip' to leave it out)");
  }

  std::string root_;
  std::string root_abs_;
  WalkOptions opt_;
  UniqueFd root_fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  size_t pending_ = 0;  // tasks queued or running
  std::vector<FlatTree::Batch> batches_;
  std::vector<std::string> skipped_;
  std::optional<Error> error_;
};

}  // namespace

bool glob_match(const std::string& pattern, const std::string& path) {
  if (::fnmatch(pattern.c_str(), path.c_str(), 0) == 0) return true;
  if (pattern.find('/') == std::string::npos)
    return ::fnmatch(pattern.c_str(), base_name(path).c_str(), 0) == 0;
  return false;
}

bool link_stays_inside(const std::string& root_abs, const std::string& link_path,
                       const std::string& target, std::string* out) {
  if (target.empty()) return false;
  std::vector<std::string> parts;
  if (target[0] == '/') {
    // Absolute: inside only if it names something under the root; made relative so the
    // copy points into the copy, not back to the source.
    std::vector<std::string> root_parts, t_parts;
    if (!normalize(root_abs, &root_parts) || !normalize(target, &t_parts)) return false;
    if (t_parts.size() < root_parts.size() ||
        !std::equal(root_parts.begin(), root_parts.end(), t_parts.begin()))
      return false;
    parts.assign(t_parts.begin() + long(root_parts.size()), t_parts.end());
  } else {
    auto slash = link_path.rfind('/');
    std::string dir = slash == std::string::npos ? "" : link_path.substr(0, slash);
    if (!normalize(dir.empty() ? target : dir + "/" + target, &parts)) return false;
  }
  if (target[0] != '/') {
    *out = target;  // relative targets are kept as they are
    return true;
  }
  // Relative path from the link's directory to parts.
  std::vector<std::string> link_dir;
  normalize(link_path, &link_dir);
  if (!link_dir.empty()) link_dir.pop_back();
  size_t common = 0;
  while (common < link_dir.size() && common < parts.size() && link_dir[common] == parts[common])
    ++common;
  std::string rel;
  for (size_t i = common; i < link_dir.size(); ++i) rel += rel.empty() ? ".." : "/..";
  for (size_t i = common; i < parts.size(); ++i) rel += (rel.empty() ? "" : "/") + parts[i];
  *out = rel.empty() ? "." : rel;
  return true;
}

FlatTree::FlatTree(std::vector<Batch> batches, std::vector<std::string> skipped)
    : batches_(std::move(batches)), skipped_(std::move(skipped)) {
  size_t n = 0;
  for (const auto& b : batches_) n += b.recs.size();
  order_.reserve(n);
  for (uint64_t k = 0; k < batches_.size(); ++k) {
    const Batch& b = batches_[k];
    for (uint32_t i = 0; i < b.recs.size(); ++i) {
      const Rec& r = b.recs[i];
      order_.push_back(k << 32 | i);
      path_bytes_ += r.len;
      if (r.type == EntryType::kFile) {
        ++files_;
        total_bytes_ += r.size;
      }
    }
  }
  auto path = [this](uint64_t ref) {
    const Rec& r = rec(ref);
    return std::string_view(batches_[ref >> 32].blob).substr(r.off, r.len);
  };
  // string_view compares as memcmp does (unsigned bytes): the order of the paths' bytes.
  std::sort(order_.begin(), order_.end(),
            [&](uint64_t a, uint64_t b) { return path(a) < path(b); });
}

void FlatTree::fill_columns(const Columns& out) const {
  int64_t at = 0;
  out.offsets[0] = 0;
  for (size_t i = 0; i < order_.size(); ++i) {
    const Rec& r = rec(order_[i]);
    std::memcpy(out.paths + at, batches_[order_[i] >> 32].blob.data() + r.off, r.len);
    at += r.len;
    out.offsets[i + 1] = at;
    out.kind[i] = uint8_t(r.type);
    out.size[i] = int64_t(r.size);
    out.blocks[i] = int64_t(r.blocks);
    out.mode[i] = r.mode;
    out.mtime_ns[i] = r.mtime_ns;
  }
}

std::vector<std::pair<uint64_t, std::string>> FlatTree::targets() const {
  std::vector<std::pair<uint64_t, std::string>> out;
  for (size_t i = 0; i < order_.size(); ++i) {
    const Batch& b = batches_[order_[i] >> 32];
    if (b.targets.empty() || b.recs[uint32_t(order_[i])].type != EntryType::kSymlink) continue;
    for (const auto& [k, t] : b.targets)
      if (k == uint32_t(order_[i])) out.emplace_back(i, t);
  }
  return out;
}

Tree FlatTree::to_tree() const {
  Tree tree;
  tree.entries.reserve(order_.size());
  for (uint64_t ref : order_) {
    const Batch& b = batches_[ref >> 32];
    const Rec& r = b.recs[uint32_t(ref)];
    Entry e;
    e.path = b.blob.substr(r.off, r.len);
    e.type = r.type;
    e.size = r.size;
    e.blocks = r.blocks;
    e.mode = r.mode;
    e.mtime_ns = r.mtime_ns;
    for (const auto& [k, t] : b.targets)
      if (k == uint32_t(ref)) e.target = t;
    tree.entries.push_back(std::move(e));
  }
  tree.files = files_;
  tree.total_bytes = total_bytes_;
  tree.skipped = skipped_;
  return tree;
}

FlatTree walk_flat(const std::string& root, const WalkOptions& options) {
  return Walker(root, options).run();
}

Tree walk(const std::string& root, const WalkOptions& options) {
  return walk_flat(root, options).to_tree();
}

Tree stat_file(const std::string& root, const std::string& rel) {
  const std::string full = root.empty() ? rel : root + "/" + rel;
  struct stat st;
  if (::lstat(full.c_str(), &st) != 0) throw Error::os(errno, "stat", full);
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorKind::kUnsupported, 0, "refusing to stage", full, "not a regular file");
  Entry e;
  e.path = rel;
  e.type = EntryType::kFile;
  e.size = uint64_t(st.st_size);
  e.blocks = uint64_t(st.st_blocks);
  e.mode = st.st_mode & 07777;
  e.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  Tree t;
  t.total_bytes = e.size;
  t.files = 1;
  t.entries.push_back(std::move(e));
  return t;
}

}  // namespace fastload::copy
