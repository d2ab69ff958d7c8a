#include "copy/extract.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <unordered_set>

#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "copy/copier.hpp"
#include "copy/walk.hpp"
#include "hash/digest.hpp"
#include "io/mapped.hpp"
#include "tar/reader.hpp"

namespace fastload::copy {
namespace {

constexpr uint32_t kNone = ~0u;
constexpr int kFeedMapped = -2;          // feed_from(): the data lies in the mapping
constexpr uint64_t kMappedLag = 64u << 20;  // mapped pages kept this far behind the parser

// The process umask, without changing it (umask(2) can only set): from /proc, else the
// usual 022 (which at worst costs an fchmod per file).
uint32_t read_umask() {
  UniqueFd fd(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
  if (!fd) return 022;
  char buf[4096];
  ssize_t n = ::read(fd.get(), buf, sizeof buf - 1);
  if (n <= 0) return 022;
  buf[n] = 0;
  const char* p = std::strstr(buf, "\nUmask:");
  if (!p) return 022;
  return uint32_t(std::strtoul(p + 8, nullptr, 8)) & 0777;
}

constexpr size_t kMaxCachedDirs = 512;
constexpr size_t kBlockAlign = 4096;  // read blocks: O_DIRECT needs page alignment
enum Kind : uint64_t { kOpen = 1, kWrite, kClose };

uint64_t tag(uint32_t file, Kind kind, uint32_t slot = 0) {
  return (uint64_t(file) << 32) | (uint64_t(slot) << 4) | kind;
}

// Page-aligned memory: buffers for O_DIRECT reads and writes.
std::shared_ptr<char[]> aligned_buffer(size_t n) {
  return std::shared_ptr<char[]>(
      static_cast<char*>(::operator new[](n, std::align_val_t{kBlockAlign})),
      [](char* p) { ::operator delete[](p, std::align_val_t{kBlockAlign}); });
}

std::pair<std::string, std::string> split(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return {"", path};
  return {path.substr(0, slash), path.substr(slash + 1)};
}

timespec to_timespec(int64_t ns) {
  timespec t;
  t.tv_sec = time_t(ns / 1000000000);
  t.tv_nsec = long(ns % 1000000000);
  if (t.tv_nsec < 0) {
    t.tv_nsec += 1000000000;
    t.tv_sec -= 1;
  }
  return t;
}

}  // namespace

struct Level;

struct ExtractJob::Impl {
  struct File {
    bool active = false;
    std::string path;  // output path, relative to the destination
    std::string base;
    std::string tmp;   // temporary name, in the parent directory
    std::shared_ptr<UniqueFd> dir;  // the parent directory (kept open while in flight)
    int dir_fd = -1;                // dir's descriptor
    int fd = -1;
    bool opened = false;
    bool data_done = false;
    bool closing = false;
    uint32_t mode = 0;
    int64_t mtime_ns = 0;
    uint64_t appended = 0;  // bytes of data received
    uint32_t create_mode = 0600;
    bool anon = false;      // an O_TMPFILE: linked into place by name once whole
    bool chmod = true;      // the umask strips bits of the mode: set it after writing
    uint32_t slot = kNone;  // the arena slot being filled (data copied in)
    size_t fill = 0;
    uint64_t slot_offset = 0;
    unsigned writes = 0;  // writes queued or in flight
    std::vector<uint32_t> waiting;  // pieces not yet pushed, in file order (see flush())
    size_t waiting_head = 0;
    bool direct = false;        // opened O_DIRECT: see direct_end
    uint64_t direct_end = 0;    // pages below this are written O_DIRECT, the rest buffered
    hash::Fl64Stream stream = hash::Fl64Stream(0);
    uint64_t chunk_fill = 0;
    std::vector<uint64_t> digests;
  };
  // One write: a filled arena slot, or a span of a lent read block written in place.
  struct Piece {
    uint32_t file = 0;
    const char* buf = nullptr;
    size_t len = 0;
    size_t put = 0;
    uint64_t offset = 0;
    uint32_t slot = kNone;   // the arena slot to free once written
    uint32_t block = kNone;  // the read block to unpin once written
    bool direct = false;     // issued O_DIRECT
  };
  struct DirMeta {
    std::string path;
    uint32_t mode;
    int64_t mtime_ns;
  };
  struct Hardlink {
    std::string path, target;
  };
  struct Symlink {
    std::string path;
    int64_t mtime_ns;
  };

  Impl(ExtractJob& j, std::string d, std::string n, ExtractOptions o);
  ~Impl() { abort(); }

  // Direct writes where the destination's filesystem reports the alignment they need
  // (ext4, XFS, btrfs; not tmpfs or network filesystems) and it divides the page and our
  // buffers' alignment.
  void init_direct_writes() {
    page_size = size_t(::sysconf(_SC_PAGESIZE));
    if (opt.direct_write_min == 0) return;
#ifdef STATX_DIOALIGN
    // Filesystems report it for regular files only: asked of an unnamed one.
    UniqueFd probe(::openat(root->get(), ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600));
    struct statx sx;
    if (!probe || ::statx(probe.get(), "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) != 0 ||
        !(sx.stx_mask & STATX_DIOALIGN) || sx.stx_dio_mem_align == 0 ||
        sx.stx_dio_offset_align == 0 || page_size % sx.stx_dio_offset_align != 0 ||
        kBlockAlign % sx.stx_dio_mem_align != 0 || page_size > kBlockAlign)
      return;
    dio_mem_align = sx.stx_dio_mem_align;
    dio_offset_align = sx.stx_dio_offset_align;
    direct_writes = true;
#endif
  }

  // ---- directories -------------------------------------------------------------------

  // Opens (creating if needed) the directory `path` below the destination, one
  // component at a time with O_NOFOLLOW from an already verified parent: no symlink,
  // whoever made it, is ever followed.
  int ensure_dir(const std::string& path) { return dir_ref(path)->get(); }

  // The same, shared: a file in flight keeps its directory open after the cache drops it.
  const std::shared_ptr<UniqueFd>& dir_ref(const std::string& path) {
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

  void drop_dir_cache() { dir_fds.clear(); }

  // ---- members -----------------------------------------------------------------------

  void start_file(const std::string& out, const tar::Member& m, uint32_t* index) {
    if (dirs_made.count(out))
      throw unsafe(out, "a file member would replace the directory '" + out + "'");
    // A path repeated in the archive: the later member wins, after the earlier is done
    // (both would write the same temporary).
    while (active_paths.count(out)) pump(true);
    while (free_files.empty()) pump(true);
    auto [parent, base] = split(out);
    std::shared_ptr<UniqueFd> dir = dir_ref(parent);
    uint32_t i = free_files.back();
    free_files.pop_back();
    File& f = files[i];
    f = File{};
    f.active = true;
    f.path = out;
    f.base = base;
    f.tmp = split(temp_name(base)).second;
    f.mode = m.mode;
    f.mtime_ns = m.mtime_ns;
    f.dir = dir;
    f.dir_fd = dir->get();
    active_paths.insert(out);
    ++active;
    // Created with its final mode when the umask keeps it (no fchmod after).
    f.create_mode = uint32_t(m.mode & 0777);
    f.chmod = (f.create_mode & ~umask_bits) != (m.mode & 07777);
    f.direct = direct_writes && m.size >= opt.direct_write_min;
    f.direct_end = m.size - m.size % page_size;
    push_open(i);
    *index = i;
  }

  void append(uint32_t i, const char* p, size_t n) {
    File& f = files[i];
    // Chunk digests, the same as the copier's: one per chunk_size bytes of content.
    for (size_t off = 0; off < n;) {
      size_t take = size_t(std::min<uint64_t>(n - off, opt.chunk_size - f.chunk_fill));
      f.stream.update(p + off, take);
      f.chunk_fill += take;
      off += take;
      if (f.chunk_fill == opt.chunk_size) {
        f.digests.push_back(f.stream.digest());
        f.stream = hash::Fl64Stream();
        f.chunk_fill = 0;
      }
    }
    if (lent_lo != nullptr && p >= lent_lo && p + n <= lent_hi) {
      // In the lent range (a read block, or the mapped archive): written from where it
      // lies, a read block pinned till then.
      if (f.slot != kNone) submit_slot(i);
      uint32_t k = new_piece();
      pieces[k] = Piece{i, p, n, 0, f.appended, kNone, lent_block};
      if (lent_block != kNone) ++block_pins[lent_block];
      f.appended += n;
      queue_piece(i, k);
      return;
    }
    while (n > 0) {
      if (f.slot == kNone) {
        while (free_slots.empty()) pump(true);
        f.slot = free_slots.back();
        free_slots.pop_back();
        f.fill = 0;
        f.slot_offset = f.appended;
      }
      size_t take = std::min(n, opt.slot_size - f.fill);
      std::memcpy(slot_data(f.slot) + f.fill, p, take);
      f.fill += take;
      f.appended += take;
      p += take;
      n -= take;
      if (f.fill == opt.slot_size) submit_slot(i);
    }
  }

  // A member's file is created unnamed (O_TMPFILE) where the filesystem can, and given
  // its name once whole: the inode is allocated without the directory's lock, which
  // creates and renames in one directory otherwise hold in turn, and a killed run leaves
  // no temporaries. Elsewhere it is written under a temporary name and renamed.
  void push_open(uint32_t i) {
    File& f = files[i];
    f.anon = tmpfile_ok;
    int direct = f.direct ? O_DIRECT : 0;
    if (f.anon) {
      push({.code = io::OpCode::kOpenAt, .dir_fd = f.dir_fd, .path = ".",
            .flags = O_TMPFILE | O_WRONLY | O_CLOEXEC | direct, .mode = f.create_mode},
           tag(i, kOpen));
      return;
    }
    push({.code = io::OpCode::kOpenAt, .dir_fd = f.dir_fd, .path = f.tmp.c_str(),
          .flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | direct,
          .mode = f.create_mode},
         tag(i, kOpen));
  }

  // The arena of write slots, allocated on first use (an uncompressed archive read
  // into lent blocks never copies).
  char* slot_data(uint32_t s) {
    if (!arena) arena = aligned_buffer(size_t(opt.slots) * opt.slot_size);
    return arena.get() + size_t(s) * opt.slot_size;
  }

  uint32_t new_piece() {
    while (free_pieces.empty()) pump(true);
    uint32_t k = free_pieces.back();
    free_pieces.pop_back();
    return k;
  }

  void submit_slot(uint32_t i) {
    File& f = files[i];
    uint32_t s = f.slot;
    f.slot = kNone;
    uint32_t k = new_piece();
    pieces[k] = Piece{i, slot_data(s), f.fill, 0, f.slot_offset, s, kNone};
    queue_piece(i, k);
  }

  void queue_piece(uint32_t i, uint32_t k) {
    File& f = files[i];
    Piece& tail = pieces[k];  // pieces never moves: the reference outlives new_piece()
    if (f.direct && tail.offset < f.direct_end && tail.offset + tail.len > f.direct_end) {
      // Split where the buffered tail begins: the part below goes first and direct.
      uint32_t head = new_piece();
      size_t n = size_t(f.direct_end - tail.offset);
      pieces[head] = Piece{i, tail.buf, n, 0, tail.offset, kNone, tail.block};
      if (tail.block != kNone) ++block_pins[tail.block];
      tail.buf += n;
      tail.len -= n;
      tail.offset += n;
      ++f.writes;
      f.waiting.push_back(head);
    }
    ++f.writes;
    f.waiting.push_back(k);
    flush(i);
  }

  // O_DIRECT writes need the buffer and the file offset aligned and whole sectors.
  bool direct_ok(const Piece& pc) const {
    return pc.offset + pc.len <= files[pc.file].direct_end &&
           reinterpret_cast<uintptr_t>(pc.buf) % dio_mem_align == 0 &&
           pc.offset % dio_offset_align == 0 && pc.len % dio_offset_align == 0;
  }

  // Pushes the file's waiting pieces, in order, once it is open. A piece O_DIRECT
  // cannot write (the tail below a page, a misaligned buffer) waits until the file's
  // direct writes are done: then O_DIRECT is cleared and the rest is written buffered.
  // A buffered write must never share a page with a direct write in flight.
  void flush(uint32_t i) {
    File& f = files[i];
    if (!f.opened) return;
    while (f.waiting_head < f.waiting.size()) {
      uint32_t k = f.waiting[f.waiting_head];
      if (f.direct && !direct_ok(pieces[k])) {
        size_t pending = f.waiting.size() - f.waiting_head;
        if (f.writes > pending) return;  // direct writes still in flight
        int fl = ::fcntl(f.fd, F_GETFL);
        if (fl < 0 || ::fcntl(f.fd, F_SETFL, fl & ~O_DIRECT) != 0)
          throw Error::os(errno, "clear O_DIRECT on", full(f.path));
        f.direct = false;
      }
      ++f.waiting_head;
      pieces[k].direct = f.direct;
      push_write(k);
    }
    f.waiting.clear();
    f.waiting_head = 0;
  }

  void push_write(uint32_t k) {
    const Piece& pc = pieces[k];
    // Writes only read .buf (it is not const because reads share io::Op).
    push({.code = io::OpCode::kWrite, .fd = files[pc.file].fd,
          .buf = const_cast<char*>(pc.buf + pc.put),
          .len = uint32_t(pc.len - pc.put), .offset = pc.offset + pc.put},
         tag(pc.file, kWrite, k));
  }

  void unpin(uint32_t b) {
    if (--block_pins[b] == 0) free_blocks.push_back(b);
  }

  void end_file(uint32_t i) {
    File& f = files[i];
    if (f.slot != kNone) submit_slot(i);
    if (f.chunk_fill > 0 || f.digests.empty()) f.digests.push_back(f.stream.digest());
    f.data_done = true;
    maybe_close(i);
  }

  void maybe_close(uint32_t i) {
    File& f = files[i];
    if (!f.data_done || !f.opened || f.writes > 0 || f.closing) return;
    timespec t[2] = {to_timespec(f.mtime_ns), to_timespec(f.mtime_ns)};
    if (f.chmod && ::fchmod(f.fd, mode_t(f.mode & 07777)) != 0)
      throw Error::os(errno, "set mode of", full(f.path));
    if (::futimens(f.fd, t) != 0) throw Error::os(errno, "set times of", full(f.path));
    if (f.anon) link_into_place(f);
    f.closing = true;
    push({.code = io::OpCode::kClose, .fd = f.fd}, tag(i, kClose));
    f.fd = -1;
  }

  // Names a whole O_TMPFILE. Where the name is taken (a repeated member, a re-run, a
  // symlink), it is linked under the temporary name and renamed over it, atomically.
  void link_into_place(File& f) {
    if (link_anon(f, f.base.c_str())) return;
    if (errno != EEXIST) throw Error::os(errno, "link into place", full(f.path));
    if (::unlinkat(f.dir_fd, f.tmp.c_str(), 0) != 0 && errno != ENOENT)
      throw Error::os(errno, "remove stale temporary of", full(f.path));
    if (!link_anon(f, f.tmp.c_str())) throw Error::os(errno, "link into place", full(f.path));
    f.anon = false;  // now named: renamed once closed, removed on abort
  }

  // linkat(2) of the open file: by descriptor where allowed (CAP_DAC_READ_SEARCH),
  // else through /proc/self/fd. Sets errno on failure.
  bool link_anon(const File& f, const char* as) {
    if (link_by_fd && ::linkat(f.fd, "", f.dir_fd, as, AT_EMPTY_PATH) == 0) return true;
    if (link_by_fd && errno != EPERM && errno != ENOENT && errno != EINVAL) return false;
    link_by_fd = false;
    char proc[40];
    std::snprintf(proc, sizeof proc, "/proc/self/fd/%d", f.fd);
    return ::linkat(AT_FDCWD, proc, f.dir_fd, as, AT_SYMLINK_FOLLOW) == 0;
  }

  void file_closed(uint32_t i) {
    File& f = files[i];
    if (!f.anon && ::renameat(f.dir_fd, f.tmp.c_str(), f.dir_fd, f.base.c_str()) != 0)
      throw Error::os(errno, "rename into place", full(f.path));
    f.dir.reset();
    f.dir_fd = -1;
    done.push_back(
        ExtractedFile{f.path, f.appended, f.mode, f.mtime_ns, std::move(f.digests), false});
    active_paths.erase(f.path);
    f.active = false;
    --active;
    free_files.push_back(i);
    job.files_done_.fetch_add(1, std::memory_order_relaxed);
  }

  void make_symlink(const std::string& out, const std::string& target, int64_t mtime_ns) {
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

  void make_hardlinks() {
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

  void set_dir_metadata() {
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

  // A file a killed run renamed into place: whole if its size, mode and mtime match
  // the member. Read back (from the page cache, usually) for its digests.
  bool adopt(const std::string& out, const tar::Member& m) {
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

  void note_skipped(const std::string& out) {
    ++job.files_skipped_;
    reused.push_back(out);
  }

  // ---- the engine --------------------------------------------------------------------

  void push(io::Op op, uint64_t user_data) {
    while (eng->in_flight() >= eng->capacity()) pump(true);
    op.user_data = user_data;
    int r = eng->push(op);
    if (r != 0) throw Error::os(-r, "queue I/O", full(""));
  }

  // Handles completions: with block, waits (in slices, so cancel is seen) for at least
  // one when anything is in flight. Throws the first error.
  void pump(bool block) {
    if (job.cancelled_.load(std::memory_order_acquire))
      throw Error(ErrorKind::kCancelled, 0, "extraction cancelled", name);
    io::Completion cq[256];
    int n = eng->reap(cq, 256, block && eng->in_flight() > 0 ? 1 : 0, 100);
    if (n < 0) throw Error::os(-n, "wait for I/O", full(""));
    for (int k = 0; k < n; ++k) complete(cq[k]);
  }

  void complete(const io::Completion& c) {
    uint32_t i = uint32_t(c.user_data >> 32);
    uint32_t s = uint32_t((c.user_data >> 4) & 0x0fffffff);
    File& f = files[i];
    bool retry = c.res == -EINTR || c.res == -EAGAIN;
    switch (Kind(c.user_data & 15)) {
      case kOpen:
        if (retry) return push_open(i);
        if (f.anon && !tmpfile_seen &&
            (c.res == -EOPNOTSUPP || c.res == -EISDIR || c.res == -EINVAL)) {
          tmpfile_ok = false;  // no O_TMPFILE here: named temporaries from now on
          return push_open(i);
        }
        if (f.direct && c.res == -EINVAL) {
          direct_writes = false;  // no O_DIRECT here: buffered writes from now on
          f.direct = false;
          return push_open(i);
        }
        if (f.anon && c.res >= 0) tmpfile_seen = true;
        if (c.res == -EEXIST) {
          // A temporary left by a killed run: a new inode, so the mode is the member's.
          if (::unlinkat(f.dir_fd, f.tmp.c_str(), 0) != 0)
            throw Error::os(errno, "remove stale temporary of", full(f.path));
          return push_open(i);
        }
        if (c.res < 0) throw Error::os(int(-c.res), "create", full(f.path));
        f.fd = int(c.res);
        f.opened = true;
        flush(i);
        maybe_close(i);
        return;
      case kWrite: {
        Piece& pc = pieces[s];
        if (retry) return push_write(s);
        if (c.res == -EINVAL && f.direct) {
          // The destination refuses this direct write after all: the file (and every
          // later one) is written buffered, this piece once no direct write is in flight.
          direct_writes = false;
          f.direct_end = 0;
          f.waiting.insert(f.waiting.begin() + ptrdiff_t(f.waiting_head), s);
          return flush(i);
        }
        // Written from the mapped archive: a page of it is gone, the archive shrank.
        if (c.res == -EFAULT && mapped) throw mapped->truncated();
        if (c.res < 0) throw Error::os(int(-c.res), "write", full(f.path));
        if (c.res == 0) throw Error::os(EIO, "write", full(f.path));
        pc.put += size_t(c.res);
        if (pc.put < pc.len) return push_write(s);
        job.bytes_out_.fetch_add(pc.len, std::memory_order_relaxed);
        if (pc.direct) job.bytes_direct_.fetch_add(pc.len, std::memory_order_relaxed);
        if (pc.slot != kNone) free_slots.push_back(pc.slot);
        if (pc.block != kNone) unpin(pc.block);
        free_pieces.push_back(s);
        --f.writes;
        flush(i);
        maybe_close(i);
        return;
      }
      case kClose:
        if (c.res < 0 && !retry) throw Error::os(int(-c.res), "close", full(f.path));
        file_closed(i);
        return;
    }
  }

  // The decoder thread's output goes to the outer tar parser; while waiting for it, the
  // parsing thread reaps write completions (and sees a cancel).
  Output parse_output();
  DecompressThread::Poll poll() {
    return [this] { pump(false); };
  }

  // After an error or cancel: let the kernel finish what it holds, then remove the
  // temporaries, so the destination keeps only whole files.
  void abort() noexcept {
    if (decoder) decoder->stop();
    if (!eng) return;
    io::Completion cq[256];
    while (eng->in_flight() > 0) {
      int n = eng->reap(cq, 256, 1, 100);
      if (n < 0) break;
      for (int k = 0; k < n; ++k) {
        uint32_t i = uint32_t(cq[k].user_data >> 32);
        if (Kind(cq[k].user_data & 15) == kOpen && cq[k].res >= 0) files[i].fd = int(cq[k].res);
        if (Kind(cq[k].user_data & 15) == kClose) files[i].fd = -1;
      }
    }
    for (auto& f : files) {
      if (!f.active) continue;
      if (f.fd >= 0) ::close(f.fd);
      if (f.dir_fd >= 0 && !f.anon) ::unlinkat(f.dir_fd, f.tmp.c_str(), 0);
      f = File{};
    }
    drop_dir_cache();
    eng.reset();
  }

  bool selected(const std::string& out) const {
    if (!opt.include.empty()) {
      bool any = false;
      for (const auto& p : opt.include) any = any || glob_match(p, out);
      if (!any) return false;
    }
    for (const auto& p : opt.exclude)
      if (glob_match(p, out)) return false;
    return true;
  }

  std::string full(const std::string& rel) const { return rel.empty() ? dst : dst + "/" + rel; }

  void check_lent(int b) const {
    if (b < 0 || size_t(b) >= block_lent.size() || !block_lent[size_t(b)])
      throw std::out_of_range("ExtractJob: read block " + std::to_string(b) + " is not lent");
  }

  Error unsafe(const std::string& member, const std::string& why) const {
    return Error(ErrorKind::kUnsafe, 0, "refusing archive member", name + ": " + member, why);
  }

  ExtractJob& job;
  std::string dst;
  std::string name;
  ExtractOptions opt;
  std::unique_ptr<io::Engine> eng;
  std::shared_ptr<UniqueFd> root;
  uint32_t umask_bits = 022;
  bool tmpfile_ok = true;     // O_TMPFILE works in the destination (until it fails)
  bool tmpfile_seen = false;  // ... and has worked once
  bool link_by_fd = true;     // linkat(AT_EMPTY_PATH) is allowed
  // O_DIRECT writes: whether new files use them, and the alignment the destination asks
  // of buffers and offsets (statx STATX_DIOALIGN).
  bool direct_writes = false;
  size_t dio_mem_align = kBlockAlign;
  size_t dio_offset_align = kBlockAlign;
  size_t page_size = kBlockAlign;
  std::unique_ptr<DecompressThread> decoder;  // compressed archives only
  std::unique_ptr<Level> outer;
  std::shared_ptr<char[]> arena;  // write slots (page-aligned, fit for O_DIRECT writes)
  std::vector<uint32_t> free_slots;
  std::vector<Piece> pieces;  // fixed size: references stay valid across pump()
  std::vector<uint32_t> free_pieces;
  std::shared_ptr<char[]> blocks;      // lent read blocks
  std::vector<uint32_t> block_pins;    // pieces writing from each, +1 while lent
  std::vector<bool> block_lent;
  std::vector<uint32_t> free_blocks;
  // While feeding: data in [lent_lo, lent_hi) is written from where it lies (null: none
  // is); lent_block, if any, is the read block it is in, pinned by each such write.
  uint32_t lent_block = kNone;
  const char* lent_lo = nullptr;
  const char* lent_hi = nullptr;
  void unlend() {
    lent_block = kNone;
    lent_lo = lent_hi = nullptr;
  }
  std::unique_ptr<io::MappedFile> mapped;  // the archive, with map_source()
  uint64_t mapped_released = 0;            // pages below this were released
  const io::MappedFile& mapping() const;
  std::vector<File> files;
  std::vector<uint32_t> free_files;
  size_t active = 0;
  std::unordered_set<std::string> active_paths;
  std::unordered_map<std::string, std::shared_ptr<UniqueFd>> dir_fds;
  std::unordered_set<std::string> dirs_made;
  std::vector<DirMeta> dir_meta;
  std::vector<Hardlink> hardlinks;
  std::vector<ExtractedLink> links;
  std::vector<ExtractedFile> done;
  std::vector<std::string> reused;
  bool dead = false;
  std::string engine_name;
};

// One tar stream: the archive itself, or a member tar inside it (nested).
struct Level final : tar::Sink {
  Level(ExtractJob::Impl& im, std::string prefix, const std::string& name, bool inner)
      : im_(im), prefix_(std::move(prefix)), inner_(inner), name_(name), parser(name) {}

  tar::Action on_member(const tar::Member& m) override {
    std::string rel, why;
    if (!tar::safe_relative_path(m.path, &rel, &why)) throw im_.unsafe(m.path, why);
    if (rel.empty()) return tar::Action::kSkip;  // "./": the root itself
    std::string out = prefix_.empty() ? rel : prefix_ + "/" + rel;
    switch (m.type) {
      case tar::MemberType::kDir:
        for (const auto& p : im_.opt.exclude)
          if (glob_match(p, out)) return tar::Action::kSkip;
        im_.ensure_dir(out);
        im_.dir_meta.push_back({out, m.mode, m.mtime_ns});
        return tar::Action::kSkip;
      case tar::MemberType::kFile:
        if (im_.opt.nested && !inner_ && out.size() > 4 &&
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

  void on_data(const char* data, size_t n) override {
    if (current_ == kInner)
      child_->parser.feed(data, n, *child_);
    else if (current_ != kNone)
      im_.append(current_, data, n);
  }

  void on_member_end() override {
    if (current_ == kInner) {
      child_->parser.finish(*child_);
      child_.reset();
    } else if (current_ != kNone) {
      im_.end_file(current_);
    }
    current_ = kNone;
  }

  std::string parser_name() const { return name_; }

  static constexpr uint32_t kInner = kNone - 1;
  ExtractJob::Impl& im_;
  std::string prefix_;
  bool inner_;
  std::string name_;
  uint32_t current_ = kNone;
  std::unique_ptr<Level> child_;
  tar::StreamParser parser;
};

Output ExtractJob::Impl::parse_output() {
  return [this](const char* p, size_t n) { outer->parser.feed(p, n, *outer); };
}

ExtractJob::Impl::Impl(ExtractJob& j, std::string d, std::string n, ExtractOptions o)
    : job(j), dst(std::move(d)), name(std::move(n)), opt(std::move(o)) {
  opt.slot_size = std::max<size_t>(opt.slot_size, kBlockAlign);
  opt.slot_size -= opt.slot_size % kBlockAlign;  // every slot page-aligned
  opt.slots = std::max(2u, opt.slots);
  opt.files_in_flight = std::max(1u, opt.files_in_flight);
  opt.chunk_size = std::max<uint64_t>(opt.chunk_size, 4096);
  root = std::make_shared<UniqueFd>(::open(dst.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!*root) throw Error::os(errno, "open directory", dst);
  umask_bits = read_umask();
  // FASTLOAD_TMPFILE=0: named temporaries even where O_TMPFILE works (tests run both).
  if (const char* v = std::getenv("FASTLOAD_TMPFILE"); v && std::string_view(v) == "0")
    tmpfile_ok = false;
  init_direct_writes();
  // A multiple of the alignment, so every block of the arena starts aligned.
  opt.read_block_size = std::max<size_t>(opt.read_block_size, kBlockAlign);
  opt.read_block_size -= opt.read_block_size % kBlockAlign;
  opt.read_blocks = std::max(1u, opt.read_blocks);
  uint32_t n_pieces = opt.slots + 4 * opt.files_in_flight;
  io::EngineOptions eo = opt.engine;
  eo.depth = std::max(eo.depth, 2 * opt.files_in_flight + n_pieces + 8);
  int err = 0;
  eng = io::make_engine(eo, &err);
  if (!eng) throw Error::os(-err, "start the I/O engine", "");
  if (auto dec = make_decompressor(opt.compression, name))
    decoder = std::make_unique<DecompressThread>(std::move(dec), opt.decoded_chunk,
                                                 opt.decoded_chunks);
  for (uint32_t s = opt.slots; s-- > 0;) free_slots.push_back(s);
  pieces.resize(n_pieces);
  for (uint32_t k = n_pieces; k-- > 0;) free_pieces.push_back(k);
  // Page-aligned, so the reader may fill them with O_DIRECT reads.
  blocks = aligned_buffer(size_t(opt.read_blocks) * opt.read_block_size);
  block_pins.assign(opt.read_blocks, 0);
  block_lent.assign(opt.read_blocks, false);
  for (uint32_t b = opt.read_blocks; b-- > 0;) free_blocks.push_back(b);
  files.resize(opt.files_in_flight);
  for (uint32_t i = opt.files_in_flight; i-- > 0;) free_files.push_back(i);
  outer = std::make_unique<Level>(*this, "", name, false);
  engine_name = eng->name();
}

ExtractJob::ExtractJob(std::string dst, std::string name, ExtractOptions options) {
  impl_ = std::make_unique<Impl>(*this, std::move(dst), std::move(name), std::move(options));
}

ExtractJob::~ExtractJob() = default;

void ExtractJob::feed(const char* data, size_t n) { feed_from(data, n, -1); }

void ExtractJob::feed_from(const char* data, size_t n, int block) {
  Impl& im = *impl_;
  if (im.dead) throw Error(ErrorKind::kCancelled, 0, "extraction already failed", im.name);
  try {
    bytes_in_.fetch_add(n, std::memory_order_relaxed);
    if (im.decoder) {
      im.decoder->feed(data, n, im.parse_output(), im.poll());
    } else if (block == kFeedMapped) {
      // Data anywhere in the mapping is written from where it lies. Parsing reads the
      // mapping: a SIGBUS there (the archive shrank) throws, and the job is dead.
      im.lent_lo = im.mapped->data();
      im.lent_hi = im.lent_lo + im.mapped->size();
      im.mapped->guard([&] { im.outer->parser.feed(data, n, *im.outer); });
      im.unlend();
    } else {
      if (block >= 0) {
        im.lent_block = uint32_t(block);
        im.lent_lo = data;
        im.lent_hi = data + n;
      }
      im.outer->parser.feed(data, n, *im.outer);
      im.unlend();
    }
    im.pump(false);
  } catch (...) {
    im.unlend();
    im.dead = true;
    im.abort();
    throw;
  }
}

int ExtractJob::lend(bool wait) {
  Impl& im = *impl_;
  if (im.dead) throw Error(ErrorKind::kCancelled, 0, "extraction already failed", im.name);
  try {
    im.pump(false);
    while (im.free_blocks.empty()) {
      if (!wait) return -1;
      if (im.eng->in_flight() == 0)
        throw std::logic_error("ExtractJob::lend: every read block is lent and none released");
      im.pump(true);
    }
  } catch (const Error&) {
    im.dead = true;
    im.abort();
    throw;
  }
  uint32_t b = im.free_blocks.back();
  im.free_blocks.pop_back();
  im.block_pins[b] = 1;
  im.block_lent[b] = true;
  return int(b);
}

char* ExtractJob::block(int b) const {
  impl_->check_lent(b);
  return impl_->blocks.get() + size_t(b) * impl_->opt.read_block_size;
}

size_t ExtractJob::block_size() const { return impl_->opt.read_block_size; }

std::shared_ptr<char[]> ExtractJob::block_storage() const { return impl_->blocks; }

void ExtractJob::feed_block(int b, size_t n) {
  impl_->check_lent(b);
  if (n > impl_->opt.read_block_size) throw std::out_of_range("ExtractJob::feed_block: n > block size");
  feed_from(impl_->blocks.get() + size_t(b) * impl_->opt.read_block_size, n, b);
}

void ExtractJob::map_source(int fd, uint64_t size) {
  Impl& im = *impl_;
  if (im.opt.compression != Compression::kNone)
    throw std::logic_error("ExtractJob::map_source: the archive is compressed");
  if (im.mapped) throw std::logic_error("ExtractJob::map_source: already mapped");
  im.mapped = std::make_unique<io::MappedFile>(fd, size, im.name);
}

const io::MappedFile& ExtractJob::Impl::mapping() const {
  if (!mapped) throw std::logic_error("ExtractJob: the archive is not mapped (map_source)");
  return *mapped;
}

void ExtractJob::populate(uint64_t offset, uint64_t n) const { impl_->mapping().populate(offset, n); }

void ExtractJob::feed_mapped(uint64_t offset, size_t n) {
  Impl& im = *impl_;
  const io::MappedFile& m = im.mapping();
  if (offset > m.size() || n > m.size() - offset)
    throw std::out_of_range("ExtractJob::feed_mapped: past the end of the archive");
  feed_from(m.data() + offset, n, kFeedMapped);
  // Pages well behind are taken out of the process (the page cache keeps them): the
  // mapping adds little to the resident size, whatever the archive's.
  uint64_t behind = offset > kMappedLag ? offset - kMappedLag : 0;
  if (behind > im.mapped_released + kMappedLag) {
    m.release(im.mapped_released, behind - im.mapped_released);
    im.mapped_released = behind;
  }
}

void ExtractJob::release(int b) {
  Impl& im = *impl_;
  im.check_lent(b);
  im.block_lent[size_t(b)] = false;
  im.unpin(uint32_t(b));
}

void ExtractJob::finish() {
  Impl& im = *impl_;
  if (im.dead) throw Error(ErrorKind::kCancelled, 0, "extraction already failed", im.name);
  try {
    if (im.decoder) im.decoder->finish(im.parse_output(), im.poll());
    im.outer->parser.finish(*im.outer);
    while (im.active > 0) im.pump(true);
    im.make_hardlinks();
    im.set_dir_metadata();
    im.abort();  // nothing in flight: just releases the engine and directories
  } catch (...) {
    im.dead = true;
    im.abort();
    throw;
  }
}

uint64_t ExtractJob::skippable() const {
  if (impl_->opt.compression != Compression::kNone || impl_->dead) return 0;
  return impl_->outer->parser.skippable();
}

void ExtractJob::skipped(uint64_t n) {
  bytes_in_.fetch_add(n, std::memory_order_relaxed);
  impl_->outer->parser.skipped(n, *impl_->outer);
}

void ExtractJob::abort() noexcept {
  impl_->dead = true;
  impl_->abort();
}

std::vector<ExtractedFile> ExtractJob::take_done() { return std::exchange(impl_->done, {}); }

std::vector<std::string> ExtractJob::take_reused() { return std::exchange(impl_->reused, {}); }

std::vector<ExtractedLink> ExtractJob::links() const { return impl_->links; }

std::vector<std::string> ExtractJob::dirs() const {
  std::vector<std::string> out(impl_->dirs_made.begin(), impl_->dirs_made.end());
  std::sort(out.begin(), out.end());
  return out;
}

std::string ExtractJob::engine_name() const { return impl_->engine_name; }

}  // namespace fastload::copy
