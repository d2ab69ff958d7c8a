// The tar stream and the tree around the files: which member goes where (Level, nested
// tars included), directories opened without following links, symbolic and hard links,
// directory modes and times, members adopted from an interrupted run.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "copy/extract_impl.hpp"
#include "copy/walk.hpp"

namespace fastload::copy {

// ---- the tar stream ------------------------------------------------------------------

tar::Action Level::on_member(const tar::Member& m) {
  std::string rel, why;
  if (!tar::safe_relative_path(m.path, &rel, &why)) throw im_.unsafe(m.path, why);
  if (rel.empty()) return tar::Action::kSkip;  // "./": the root itself
  std::string out = prefix_.empty() ? rel : prefix_ + "/" + rel;
  switch (m.type) {
    case tar::MemberType::kDir:
      for (const auto& p : im_.opt.exclude)
        if (glob_match(p, out)) return tar::Action::kSkip;
      im_.make_dir(out);
      im_.dir_meta.push_back({out, m.mode, m.mtime_ns});
      return tar::Action::kSkip;
    case tar::MemberType::kFile:
      if (im_.opt.nested && !inner_ && !m.sparse && out.size() > 4 &&
          out.compare(out.size() - 4, 4, ".tar") == 0) {
        std::string dir = out.substr(0, out.size() - 4);
        im_.ensure_dir(dir);
        im_.dir_meta.push_back({dir, 0755, m.mtime_ns});
        child_ = std::make_unique<Level>(im_, dir, parser_name() + ":" + m.path, true);
        current_ = kInner;
        return tar::Action::kRead;
      }
      if (!im_.selected(out)) return tar::Action::kSkip;
      if (auto it = im_.opt.complete.find(out);
          it != im_.opt.complete.end() && it->second.first == m.size &&
          it->second.second == m.mtime_ns) {
        im_.note_skipped(out);
        return tar::Action::kSkip;
      }
      if (im_.opt.adopt_existing && im_.adopt(out, m)) return tar::Action::kSkip;
      im_.start_file(out, m, &current_);
      extents_.clear();
      extent_ = 0;
      extent_left_ = 0;
      if (m.sparse && !m.extents.empty()) {
        extents_ = m.extents;
        im_.hole_to(current_, extents_[0].offset);
        extent_left_ = extents_[0].size;
      }
      return tar::Action::kRead;
    case tar::MemberType::kSymlink:
      if (!im_.selected(out)) return tar::Action::kSkip;
      if (!tar::safe_link_target(rel, m.link, false, &why)) throw im_.unsafe(m.path, why);
      im_.make_symlink(out, m.link, m.mtime_ns);
      return tar::Action::kSkip;
    case tar::MemberType::kHardlink: {
      if (!im_.selected(out)) return tar::Action::kSkip;
      std::string target;
      if (!tar::safe_link_target(rel, m.link, true, &why) ||
          !tar::safe_relative_path(m.link, &target, &why))
        throw im_.unsafe(m.path, why);
      im_.hardlinks.push_back({out, prefix_.empty() ? target : prefix_ + "/" + target});
      return tar::Action::kSkip;
    }
    case tar::MemberType::kCharDev:
    case tar::MemberType::kBlockDev:
    case tar::MemberType::kFifo:
      throw im_.unsafe(m.path, m.type == tar::MemberType::kFifo
                                   ? "FIFOs are not extracted"
                                   : "device nodes are not extracted");
  }
  return tar::Action::kSkip;
}

void Level::on_data(const char* data, size_t n) {
  if (current_ == kInner)
    child_->parser.feed(data, n, *child_);
  else if (current_ != kNone && extents_.empty())
    im_.append(current_, data, n);
  else if (current_ != kNone)
    // The data of a sparse member is its extents' back to back: each piece goes to
    // its extent's place in the file.
    while (n > 0) {
      const size_t k = size_t(std::min<uint64_t>(n, extent_left_));
      if (k == 0) break;  // not reached: the parser delivers exactly the extents' bytes
      im_.append(current_, data, k);
      data += k;
      n -= k;
      extent_left_ -= k;
      if (extent_left_ == 0 && extent_ + 1 < extents_.size()) {
        ++extent_;
        im_.hole_to(current_, extents_[extent_].offset);
        extent_left_ = extents_[extent_].size;
      }
    }
}

void Level::on_member_end() {
  if (current_ == kInner) {
    child_->parser.finish(*child_);
    child_.reset();
  } else if (current_ != kNone) {
    im_.end_file(current_);
  }
  current_ = kNone;
}

void Level::on_warning(const std::string& message) {
  if (im_.warnings.size() < ExtractJob::Impl::kMaxWarnings)
    im_.warnings.push_back(message);
  else
    ++im_.warnings_dropped;
}

// ---- directories ---------------------------------------------------------------------

// ensure_dir(), shared: a file in flight keeps its directory open after the cache drops it.
const std::shared_ptr<UniqueFd>& ExtractJob::Impl::dir_ref(const std::string& path) {
  if (path.empty()) return root;
  auto it = dir_fds.find(path);
  if (it != dir_fds.end()) return it->second;
  auto [parent, base] = split(path);
  int pfd = ensure_dir(parent);
  if (::mkdirat(pfd, base.c_str(), 0755) != 0 && errno != EEXIST)
    throw Error::os(errno, "create directory", full(path));
  int fd = ::openat(pfd, base.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    struct stat st;
    if (::fstatat(pfd, base.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
      throw unsafe(path, "a member would be written through the symbolic link '" + path + "'");
    throw Error::os(e == ELOOP ? ENOTDIR : e, "open directory", full(path));
  }
  if (dir_fds.size() >= kMaxCachedDirs) drop_dir_cache();
  dirs_made.insert(path);
  return dir_fds.emplace(path, std::make_shared<UniqueFd>(fd)).first->second;
}

// A directory member replaces what an earlier member (or an earlier run) left at its
// path that is no directory: a file extracted from Solaris tar's 'A' header of the same
// name, for one (an unknown type, written as a regular file as GNU tar writes it). GNU
// tar removes it and makes the directory; so does this. A symbolic link there is not
// removed: ensure_dir() refuses to go through it, as for any member below it.
void ExtractJob::Impl::make_dir(const std::string& out) {
  // A file of that name still being written is named first, then replaced.
  while (active_paths.count(out)) pump(true);
  if (!dirs_made.count(out)) {
    auto [parent, base] = split(out);
    int pfd = ensure_dir(parent);
    struct stat st;
    if (::fstatat(pfd, base.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(st.st_mode) &&
        !S_ISLNK(st.st_mode)) {
      if (::unlinkat(pfd, base.c_str(), 0) != 0 && errno != ENOENT)
        throw Error::os(errno, "replace", full(out));
      // Not reported as extracted: a run's dirs() names it now (the caller drops files
      // it was told of before for the same reason).
      std::erase_if(done, [&](const ExtractedFile& f) { return f.path == out; });
    }
  }
  ensure_dir(out);
}

// ---- links and metadata --------------------------------------------------------------

void ExtractJob::Impl::make_symlink(const std::string& out, const std::string& target, int64_t mtime_ns) {
  while (active_paths.count(out)) pump(true);
  if (dirs_made.count(out))
    throw unsafe(out, "a symbolic link member would replace the directory '" + out + "'");
  auto [parent, base] = split(out);
  int pfd = ensure_dir(parent);
  if (::unlinkat(pfd, base.c_str(), 0) != 0 && errno != ENOENT)
    throw Error::os(errno, "replace", full(out));
  if (::symlinkat(target.c_str(), pfd, base.c_str()) != 0)
    throw Error::os(errno, "create symbolic link", full(out));
  timespec t[2] = {to_timespec(mtime_ns), to_timespec(mtime_ns)};
  ::utimensat(pfd, base.c_str(), t, AT_SYMLINK_NOFOLLOW);
  links.push_back(ExtractedLink{out, target, false});
}

void ExtractJob::Impl::make_hardlinks() {
  for (const auto& h : hardlinks) {
    auto [tparent, tbase] = split(h.target);
    auto [parent, base] = split(h.path);
    int tfd = ensure_dir(tparent);
    int pfd = ensure_dir(parent);
    if (dirs_made.count(h.path))
      throw unsafe(h.path, "a hard link member would replace the directory '" + h.path + "'");
    if (::unlinkat(pfd, base.c_str(), 0) != 0 && errno != ENOENT)
      throw Error::os(errno, "replace", full(h.path));
    // The target was opened through verified directories and linkat does not follow
    // a final symlink (no AT_SYMLINK_FOLLOW): the link stays inside.
    if (::linkat(tfd, tbase.c_str(), pfd, base.c_str(), 0) != 0)
      throw Error::os(errno, "create hard link (to '" + h.target + "')", full(h.path));
    links.push_back(ExtractedLink{h.path, h.target, true});
  }
}

void ExtractJob::Impl::set_dir_metadata() {
  std::stable_sort(dir_meta.begin(), dir_meta.end(), [](const DirMeta& a, const DirMeta& b) {
    return std::count(a.path.begin(), a.path.end(), '/') >
           std::count(b.path.begin(), b.path.end(), '/');
  });
  for (const auto& d : dir_meta) {
    auto [parent, base] = split(d.path);
    int pfd = ensure_dir(parent);
    timespec t[2] = {to_timespec(d.mtime_ns), to_timespec(d.mtime_ns)};
    if (::fchmodat(pfd, base.c_str(), mode_t(d.mode & 07777), 0) != 0)
      throw Error::os(errno, "set mode of", full(d.path));
    if (::utimensat(pfd, base.c_str(), t, AT_SYMLINK_NOFOLLOW) != 0)
      throw Error::os(errno, "set times of", full(d.path));
  }
}

// ---- what is not written -------------------------------------------------------------

// A file a killed run renamed into place: whole if its size, mode and mtime match
// the member. Read back (from the page cache, usually) for its digests.
bool ExtractJob::Impl::adopt(const std::string& out, const tar::Member& m) {
  if (active_paths.count(out) || dirs_made.count(out)) return false;
  auto [parent, base] = split(out);
  int pfd = ensure_dir(parent);
  struct stat st;
  if (::fstatat(pfd, base.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
      uint64_t(st.st_size) != m.size || (st.st_mode & 07777) != (m.mode & 07777) ||
      int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec != m.mtime_ns)
    return false;
  UniqueFd fd(::openat(pfd, base.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return false;
  ExtractedFile f{out, m.size, m.mode, m.mtime_ns, {}, true};
  std::vector<char> buf(size_t(std::min<uint64_t>(opt.chunk_size, 1u << 20)));
  hash::Fl64Stream stream(0);
  uint64_t fill = 0, pos = 0;
  while (pos < m.size) {
    ssize_t n = ::pread(fd.get(), buf.data(),
                        size_t(std::min<uint64_t>(buf.size(), opt.chunk_size - fill)), off_t(pos));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    stream.update(buf.data(), size_t(n));
    fill += uint64_t(n);
    pos += uint64_t(n);
    if (fill == opt.chunk_size) {
      f.digests.push_back(stream.digest());
      stream = hash::Fl64Stream(0);
      fill = 0;
    }
  }
  if (fill > 0 || f.digests.empty()) f.digests.push_back(stream.digest());
  done.push_back(std::move(f));
  note_skipped(out);
  return true;
}

void ExtractJob::Impl::note_skipped(const std::string& out) {
  ++job.files_skipped_;
  reused.push_back(out);
}

bool ExtractJob::Impl::selected(const std::string& out) const {
  if (!opt.include.empty()) {
    bool any = false;
    for (const auto& p : opt.include) any = any || glob_match(p, out);
    if (!any) return false;
  }
  for (const auto& p : opt.exclude)
    if (glob_match(p, out)) return false;
  return true;
}

}  // namespace fastload::copy
