#include "copy/copier.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>

#include "common/timespec.hpp"
#include "common/unique_fd.hpp"
#include "hash/digest.hpp"
#include "io/fs.hpp"

namespace fastload::copy {
namespace {

constexpr uint32_t kPad = 4096;  // room after each buffer for the one-byte EOF probe
constexpr int kPollMs = 100;     // how often the loop looks at the cancel flag
constexpr size_t kFilesPerSubmitter = 32;  // fewer files than this per submitter: fewer of them

// user_data layout: [file slot:32][buffer:27][big:1][op:4]
constexpr uint32_t kFuseMagic = 0x65735546;  // statfs(2)'s FUSE_SUPER_MAGIC

enum Kind : uint64_t { kOpenSrc = 1, kOpenDst, kRead, kWrite, kCloseSrc, kCloseDst };

uint64_t tag(uint32_t slot, Kind kind, bool big = false, uint32_t buffer = 0) {
  return (uint64_t(slot) << 32) | (uint64_t(buffer) << 5) | (uint64_t(big) << 4) | kind;
}

std::string join(const std::string& root, const std::string& rel) {
  if (rel.empty()) return root;
  if (root.empty() || root.back() == '/') return root + rel;
  return root + "/" + rel;
}

struct Stripe {
  uint32_t file_slot = 0;
  uint64_t index = 0;   // stripe number within the file
  uint64_t offset = 0;
  uint64_t len = 0;     // bytes this stripe holds
  uint64_t got = 0;     // bytes read so far
  uint64_t put = 0;     // bytes written so far
  bool last = false;    // asks for one byte more to detect growth
  bool read_done = false;
  char* buf = nullptr;
  int buf_index = -1;   // registered buffer, or -1
};

struct FileState {
  bool active = false;
  uint32_t task = 0;
  std::string src_path;  // relative, kept alive for the engine
  std::string tmp_path;
  int src_fd = -1;
  int dst_fd = -1;
  bool dst_open = false;
  uint64_t nstripes = 0;
  uint64_t next_stripe = 0;
  uint64_t stripes_done = 0;
  unsigned ops = 0;  // operations in flight for this file
  unsigned closes = 0;
  bool closing = false;
  bool sparse = false;
  bool failed = false;  // this file caused the job's error: never rename it into place
  bool excl = false;    // the temporary is being created with O_EXCL and its final mode
  bool chmod = true;    // its mode is still to be set (fchmod)
  bool leftover = false;  // an earlier run left its temporary: truncated, not created
  bool anon = false;      // the temporary is an O_TMPFILE: linked into place, not renamed
  bool direct_src = false;  // the source is open O_DIRECT (a small file on FUSE)
  bool unknown = false;     // its task's size and mode come from fstat once open
  std::string dir_path;   // anon: the folder it is made in (relative; "." for the root)
  std::vector<std::pair<uint64_t, uint64_t>> data;  // sparse: data extents [start, end)
  std::vector<uint64_t> digests;
  std::vector<uint32_t> waiting_write;  // big stripes read before the temporary was open
  Stripe small;                         // the file's own stripe when it is small
};

}  // namespace

std::string temp_name(const std::string& rel) {
  auto slash = rel.rfind('/');
  std::string dir = slash == std::string::npos ? "" : rel.substr(0, slash + 1);
  std::string base = slash == std::string::npos ? rel : rel.substr(slash + 1);
  if (base.size() + 9 > 255) {  // ".{base}.fl-tmp" must fit NAME_MAX
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(hash::fl64(base.data(), base.size())));
    return dir + "." + hex + ".fl-tmp";
  }
  return dir + "." + base + ".fl-tmp";
}

// The state machine of one submitter: its own engine, buffers and files in flight, on
// its own thread. Submitters share nothing on the hot path but the job's next-task
// counter (one fetch_add per file), the counters of progress and the done list.
class Runner {
 public:
  Runner(CopyJob& job, CopyOptions opt) : job_(job), opt_(std::move(opt)), tasks_(job.tasks_) {}

  ~Runner() {
    if (region_ != MAP_FAILED) ::munmap(region_, region_size_);
  }

  void run(io::Engine& engine) {
    eng_ = &engine;
    open_roots();
    allocate_buffers();
    files_.resize(std::max(1u, opt_.files_in_flight));
    for (uint32_t i = 0; i < files_.size(); ++i) free_files_.push_back(i);
    std::vector<io::Completion> cq(512);
    while (true) {
      if (!error_ && job_.cancel_.cancelled())
        fail(Error(ErrorKind::kCancelled, 0, "staging cancelled", job_.dst_root_));
      // Another submitter failed: stop as if cancelled (the job keeps its error).
      if (!error_ && job_.halt_.load(std::memory_order_relaxed))
        fail(Error(ErrorKind::kCancelled, 0, "staging stopped", job_.dst_root_));
      if (!error_) admit();
      if (eng_->in_flight() == 0) {
        if (error_ || (exhausted_ && active_ == 0)) break;
      }
      int n = eng_->reap(cq.data(), unsigned(cq.size()), eng_->in_flight() ? 1 : 0, kPollMs);
      if (n < 0) {
        fail(Error::os(-n, "wait for I/O", job_.dst_root_));
        // Without a working engine nothing more will complete.
        break;
      }
      for (int i = 0; i < n; ++i) complete(cq[size_t(i)]);
    }
    for (int k = 0; k < kBusyKinds; ++k)
      job_.busy_ns_[k].fetch_add(busy_ns_[k], std::memory_order_relaxed);
    if (error_) {
      cleanup_after_error();
      throw *error_;
    }
  }

 private:
  // ---- setup -------------------------------------------------------------------------

  void open_roots() {
    src_root_.reset(::open(job_.src_root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!src_root_) throw Error::os(errno, "open directory", job_.src_root_);
    if (opt_.write) {
      dst_root_.reset(::open(job_.dst_root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (!dst_root_) throw Error::os(errno, "open directory", job_.dst_root_);
      direct_dst_ = !network(job_.dst_root_);
      umask_ = read_umask();
    }
    int net = opt_.src_network, fuse = opt_.src_fuse;  // told, else one statfs
    if (net < 0 || fuse < 0) {
      uint32_t magic = 0;
      const bool known = io::fs_magic(job_.src_root_, &magic) == 0;
      if (net < 0) net = known && network(magic);
      if (fuse < 0) fuse = known && magic == kFuseMagic;
    }
    direct_src_close_ = net == 0;
    direct_src_ = fuse == 1;
  }

  // Whether path (or the file system of that magic) is a network or FUSE one (unknown
  // kinds count as local).
  static bool network(const std::string& path) {
    uint32_t magic = 0;
    return io::fs_magic(path, &magic) == 0 && network(magic);
  }
  static bool network(uint32_t magic) {
    const io::FsKind* fs = io::find_fs(magic);
    return fs != nullptr && fs->network;
  }

  void allocate_buffers() {
    small_size_ = size_t(std::max<uint64_t>(opt_.small_size, 4096));
    big_size_ = size_t(std::max<uint64_t>(opt_.stripe_size, 4096));
    size_t nsmall = std::max(1u, opt_.files_in_flight);
    // Big buffers only for a job that has big files, no more than its stripes: a job of
    // small files neither maps nor pins them (registering pins, and so zeroes, every page).
    // Files whose size is learned at their open may be big: their buffers are mapped
    // (touched only if used) but not registered.
    size_t nbig = 0;
    bool unknown = false;
    const size_t want_big = std::max(1u, opt_.big_buffers);
    for (size_t i = 0; i < tasks_.size() && nbig < want_big; ++i) {
      if (tasks_[i].stat_at_open) {
        nbig = want_big;
        unknown = true;
      } else if (tasks_[i].size >= small_size_) {
        nbig = std::min(want_big, nbig + size_t((tasks_[i].size + big_size_ - 1) / big_size_));
      }
    }
    small_stride_ = small_size_ + kPad;
    big_stride_ = big_size_ + kPad;
    size_t small_bytes = nsmall * small_stride_;
    region_size_ = small_bytes + nbig * big_stride_;
    // Anonymous memory is faulted in lazily, so small files touch only what they use.
    region_ = ::mmap(nullptr, region_size_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region_ == MAP_FAILED) throw Error::os(errno, "allocate buffers", "");
    small_base_ = static_cast<char*>(region_);
    big_base_ = small_base_ + small_bytes;
    big_.resize(nbig);
    for (uint32_t i = 0; i < nbig; ++i) free_big_.push_back(i);
    // Fixed buffers save the kernel a page-pinning walk per read; worth it only for the
    // big stripes, and only if the backend (and RLIMIT_MEMLOCK) allow it.
    iovec iov[2] = {{small_base_, small_bytes}, {big_base_, nbig * big_stride_}};
    fixed_ = nbig > 0 && !unknown && eng_->register_buffers(std::span<const iovec>(iov, 2)) == 0;
  }

  // ---- admission ---------------------------------------------------------------------

  void admit() {
    while (!error_ && !free_files_.empty() && !exhausted_ &&
           eng_->in_flight() + 2 <= eng_->capacity()) {
      size_t task = job_.next_task_.fetch_add(1, std::memory_order_relaxed);
      if (task >= tasks_.size()) {
        exhausted_ = true;
        break;
      }
      uint32_t slot = free_files_.front();
      free_files_.pop_front();
      start_file(slot, uint32_t(task));
    }
    // Stripes of active big files waiting for a buffer.
    while (!free_big_.empty() && !want_big_.empty() && eng_->in_flight() < eng_->capacity()) {
      uint32_t slot = want_big_.front();
      FileState& f = files_[slot];
      if (!f.active || f.closing || f.src_fd < 0 || is_small(f) || f.next_stripe >= f.nstripes) {
        want_big_.pop_front();
        continue;
      }
      issue_next_stripe(slot);
      if (f.next_stripe >= f.nstripes) want_big_.pop_front();
    }
  }

  void start_file(uint32_t slot, uint32_t task) {
    FileState& f = files_[slot];
    const FileTask& t = tasks_[task];
    f = FileState{};
    f.active = true;
    f.task = task;
    f.src_path = t.src;
    ++active_;
    if (t.stat_at_open) {  // sized once open (on_src_open); O_DIRECT till found big
      f.unknown = true;
      f.nstripes = 1;
      f.direct_src = direct_src_;
      open_src(slot);
      return;
    }
    size_stripes(f);
    f.direct_src = direct_src_ && t.size < small_size_;
    open_src(slot);
    if (opt_.write) {
      f.tmp_path = temp_name(t.dst);
      open_dst(slot);
    }
  }

  void size_stripes(FileState& f) {
    const FileTask& t = tasks_[f.task];
    f.nstripes = t.size == 0 ? 1 : (t.size + big_size_ - 1) / big_size_;
    if (t.size < small_size_) f.nstripes = 1;
    f.digests.assign(f.nstripes, 0);
  }

  // A stat_at_open task's source is open: its size, blocks, mode and time from fstat
  // (a regular file still, else it changed since it was listed); false after an error.
  bool learn(uint32_t slot) {
    FileState& f = files_[slot];
    FileTask& t = tasks_[f.task];
    struct stat st;
    if (::fstat(f.src_fd, &st) != 0) {
      file_error(slot, Error::os(errno, "stat", src_name(f)));
      return false;
    }
    if (!S_ISREG(st.st_mode)) {
      file_error(slot, changed(f, "is no longer a regular file"));
      return false;
    }
    t.size = uint64_t(st.st_size);
    t.blocks = uint64_t(st.st_blocks);
    t.mode = uint32_t(st.st_mode & 07777);
    t.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    job_.bytes_total_.fetch_add(t.size, std::memory_order_relaxed);
    f.unknown = false;
    size_stripes(f);
    if (f.direct_src && !is_small(f)) {  // read through the page cache, in stripes
      f.direct_src = false;
      int fl = ::fcntl(f.src_fd, F_GETFL);
      if (fl < 0 || ::fcntl(f.src_fd, F_SETFL, fl & ~O_DIRECT) != 0) {
        file_error(slot, Error::os(errno, "read", src_name(f)));
        return false;
      }
    }
    return true;
  }

  // The temporary is created with the file's final mode where the umask keeps it and the
  // owner may read and write it (no fchmod then); O_EXCL, since an existing temporary (an
  // interrupted run's) keeps its old mode: that one is truncated and chmod-ed as before.
  //
  // On a local destination whose file system has them, the temporary is an O_TMPFILE in
  // the file's folder, linked to its final name once whole: no name to create, look up,
  // rename and remove (each a search of the folder), and nothing left by a crash.
  void open_dst(uint32_t slot) {
    FileState& f = files_[slot];
    const uint32_t mode = tasks_[f.task].mode & 07777;
    const bool keeps = umask_ >= 0 && (mode & 07000) == 0 && (mode & 0600) == 0600 &&
                       (mode & uint32_t(umask_)) == 0;
    if (tmpfile_ && direct_dst_ && !f.leftover && !f.excl) {  // (again on a retry)
      const std::string& dst = tasks_[f.task].dst;
      auto slash = dst.rfind('/');
      f.dir_path = slash == std::string::npos ? "." : dst.substr(0, slash);
      f.anon = true;
      f.chmod = !keeps;
      issue({.code = io::OpCode::kOpenAt, .dir_fd = dst_root_.get(), .path = f.dir_path.c_str(),
             .flags = O_WRONLY | O_TMPFILE | O_CLOEXEC, .mode = keeps ? mode : 0600},
            slot, tag(slot, kOpenDst), true);
      return;
    }
    if (!f.leftover && !f.excl && keeps) f.excl = true;
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | (f.excl ? O_EXCL : O_TRUNC);
    issue({.code = io::OpCode::kOpenAt, .dir_fd = dst_root_.get(), .path = f.tmp_path.c_str(),
           .flags = flags, .mode = f.excl ? mode : 0600},
          slot, tag(slot, kOpenDst), direct_dst_);
  }

  // The process's umask, from /proc/self/status (umask(2) cannot read it without setting
  // it, racing other threads), or -1 where it cannot be read.
  static int read_umask() {
    UniqueFd fd(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
    if (!fd) return -1;
    char buf[4096];
    ssize_t n = ::read(fd.get(), buf, sizeof buf - 1);
    if (n <= 0) return -1;
    buf[n] = 0;
    const char* at = std::strstr(buf, "\nUmask:");
    if (!at) return -1;
    char* end = nullptr;
    long v = std::strtol(at + 7, &end, 8);
    return end == at + 7 || v < 0 || v > 0777 ? -1 : int(v);
  }

  bool is_small(const FileState& f) const { return tasks_[f.task].size < small_size_; }

  // Issues the next stripe of file `slot` if a buffer is free. Holes of sparse files are
  // completed here without I/O.
  void issue_next_stripe(uint32_t slot) {
    FileState& f = files_[slot];
    const FileTask& t = tasks_[f.task];
    while (f.next_stripe < f.nstripes) {
      uint64_t idx = f.next_stripe;
      uint64_t off = idx * big_size_;
      uint64_t len = std::min<uint64_t>(big_size_, t.size - std::min(t.size, off));
      if (is_small(f)) len = t.size;
      bool last = idx + 1 == f.nstripes;
      if (f.sparse && !last && is_hole(f, off, off + len)) {
        ++f.next_stripe;
        f.digests[idx] = hash::fl64_zeros(len);
        stripe_finished(slot, len);
        if (error_ || !f.active) return;
        continue;
      }
      Stripe* s;
      uint32_t b = 0;
      if (is_small(f)) {
        s = &f.small;
        s->buf = small_base_ + size_t(slot) * small_stride_;
        s->buf_index = fixed_ ? 0 : -1;
      } else {
        if (free_big_.empty()) return;
        b = free_big_.front();
        free_big_.pop_front();
        s = &big_[b];
        s->buf = big_base_ + size_t(b) * big_stride_;
        s->buf_index = fixed_ ? 1 : -1;
      }
      s->file_slot = slot;
      s->index = idx;
      s->offset = off;
      s->len = len;
      s->got = s->put = 0;
      s->last = last;
      s->read_done = false;
      ++f.next_stripe;
      submit_read(slot, *s, !is_small(f), b);
      return;
    }
  }

  bool is_hole(const FileState& f, uint64_t start, uint64_t end) const {
    for (const auto& [a, b] : f.data)
      if (a < end && b > start) return false;
    return true;
  }

  void submit_read(uint32_t slot, Stripe& s, bool big, uint32_t b) {
    uint64_t want = s.len - s.got + (s.last ? 1 : 0);
    push({.code = io::OpCode::kRead, .fd = files_[slot].src_fd, .buf = s.buf + s.got,
          .len = uint32_t(want), .offset = s.offset + s.got, .buf_index = s.buf_index},
         slot, tag(slot, kRead, big, b));
  }

  // A small file's write goes straight to a local destination's page cache: handing it
  // to a worker cost more CPU than the copy itself (RESULTS.md, issue 33: CPU per file).
  // A big file's stripes stay on the engine, where writeback throttling of gigabytes
  // stalls a worker, not the submitter.
  void submit_write(uint32_t slot, Stripe& s, bool big, uint32_t b) {
    issue({.code = io::OpCode::kWrite, .fd = files_[slot].dst_fd, .buf = s.buf + s.put,
           .len = uint32_t(s.len - s.put), .offset = s.offset + s.put,
           .buf_index = s.buf_index},
          slot, tag(slot, kWrite, big, b), direct_dst_ && !big);
  }

  // Pushes the operation to the engine, or (direct) runs it now on this thread and
  // handles its completion before returning: the caller must hold no state that the
  // completion may change (it may finish the file and free its slot).
  void issue(io::Op op, uint32_t slot, uint64_t user_data, bool direct) {
    if (!direct) return push(op, slot, user_data);
    op.user_data = user_data;
    ++files_[slot].ops;
    busy_begin(busy_kind(Kind(user_data & 15)));
    complete(io::Completion{user_data, eng_->run_now(op)});
  }

  void push(io::Op op, uint32_t slot, uint64_t user_data) {
    op.user_data = user_data;
    int r = eng_->push(op);
    if (r != 0) {  // admission keeps us under capacity; a refusal is a bug, not I/O
      fail(Error::os(-r, "queue I/O", join(job_.src_root_, files_[slot].src_path)));
      return;
    }
    ++files_[slot].ops;
    busy_begin(busy_kind(Kind(user_data & 15)));
  }

  // ---- where the time goes: the time each kind of operation had one in flight -------

  static int busy_kind(Kind k) { return k == kRead ? 0 : k == kWrite ? 1 : 2; }
  static uint64_t now_ns() {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
  }
  void busy_begin(int k) {
    if (busy_open_[k]++ == 0) busy_since_[k] = now_ns();
  }
  void busy_end(int k) {
    if (busy_open_[k] > 0 && --busy_open_[k] == 0) busy_ns_[k] += now_ns() - busy_since_[k];
  }

  // ---- completions -------------------------------------------------------------------

  void complete(const io::Completion& c) {
    uint32_t slot = uint32_t(c.user_data >> 32);
    auto kind = Kind(c.user_data & 15);
    bool big = (c.user_data >> 4) & 1;
    uint32_t b = uint32_t((c.user_data >> 5) & ((1u << 27) - 1));
    FileState& f = files_[slot];
    --f.ops;
    busy_end(busy_kind(kind));
    int64_t res = c.res;
    bool retry = res == -EINTR || res == -EAGAIN;
    switch (kind) {
      case kOpenSrc:
        if (retry) return reopen(slot, true);
        if (res == -EINVAL && f.direct_src) {  // a FUSE server that refuses O_DIRECT
          direct_src_ = false;
          f.direct_src = false;
          return reopen(slot, true);
        }
        if (res < 0) return file_error(slot, Error::os(int(-res), "open", src_name(f)));
        f.src_fd = int(res);
        if (error_) return maybe_retire(slot);
        on_src_open(slot);
        return;
      case kOpenDst:
        if (retry) return reopen(slot, false);
        if (f.anon && (res == -EOPNOTSUPP || res == -EISDIR || res == -EINVAL)) {
          tmpfile_ = false;  // not on this file system: named temporaries from now on
          f.anon = false;
          f.chmod = true;
          return reopen(slot, false);
        }
        if (res == -EEXIST && f.excl) {  // an earlier run's temporary: truncate it
          f.excl = false;
          f.leftover = true;
          return reopen(slot, false);
        }
        if (res >= 0 && f.excl) f.chmod = false;
        if (res < 0) return file_error(slot, Error::os(int(-res), "create", dst_name(f, true)));
        f.dst_fd = int(res);
        f.dst_open = true;
        if (error_) return maybe_retire(slot);
        on_dst_open(slot);
        return;
      case kRead:
        return on_read(slot, big ? big_[b] : f.small, big, b, res);
      case kWrite:
        return on_write(slot, big ? big_[b] : f.small, big, b, res);
      case kCloseSrc:
      case kCloseDst:
        if (res < 0 && !retry)
          file_error(slot, Error::os(int(-res), "close",
                                     kind == kCloseSrc ? src_name(f) : dst_name(f, true)));
        if (--f.closes == 0) finish_file(slot);
        return;
    }
  }

  void reopen(uint32_t slot, bool src) {
    if (error_) return maybe_retire(slot);
    if (src)
      open_src(slot);
    else
      open_dst(slot);
  }

  void open_src(uint32_t slot) {
    FileState& f = files_[slot];
    push({.code = io::OpCode::kOpenAt, .dir_fd = src_root_.get(), .path = f.src_path.c_str(),
          .flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | (f.direct_src ? O_DIRECT : 0)},
         slot, tag(slot, kOpenSrc));
  }

  void on_src_open(uint32_t slot) {
    FileState& f = files_[slot];
    const bool learned = f.unknown;
    if (learned && !learn(slot)) return;
    const FileTask& t = tasks_[f.task];
    if (!is_small(f)) {
      ::posix_fadvise(f.src_fd, 0, 0, POSIX_FADV_SEQUENTIAL);
      if (t.blocks * 512 < t.size) map_sparse(f);
    }
    if (is_small(f)) {
      issue_next_stripe(slot);
    } else {
      issue_next_stripe(slot);
      if (f.active && f.next_stripe < f.nstripes) want_big_.push_back(slot);
    }
    // The temporary last: its open may complete (and finish the file) at once.
    if (learned && opt_.write && f.active && !error_) {
      f.tmp_path = temp_name(t.dst);
      open_dst(slot);
    }
  }

  // Finds the data extents of a sparse source, so holes are neither read nor written.
  void map_sparse(FileState& f) {
    const FileTask& t = tasks_[f.task];
    off_t pos = 0;
    while (uint64_t(pos) < t.size) {
      off_t d = ::lseek(f.src_fd, pos, SEEK_DATA);
      if (d < 0) break;  // ENXIO: no data past pos (or SEEK_DATA unsupported: treat as dense)
      off_t h = ::lseek(f.src_fd, d, SEEK_HOLE);
      if (h < 0) h = off_t(t.size);
      f.data.emplace_back(uint64_t(d), uint64_t(h));
      pos = h;
    }
    if (errno == EINVAL && f.data.empty()) return;  // unsupported: copy densely
    f.sparse = true;
  }

  void on_dst_open(uint32_t slot) {
    FileState& f = files_[slot];
    const FileTask& t = tasks_[f.task];
    // Sizing the file first leaves the holes of a sparse source as holes.
    if (!is_small(f) && ::ftruncate(f.dst_fd, off_t(t.size)) != 0)
      return file_error(slot, Error::os(errno, "resize", dst_name(f, true)));
    if (is_small(f)) {
      if (f.small.read_done && f.small.len > 0) submit_write(slot, f.small, false, 0);
    } else {
      auto waiting = std::move(f.waiting_write);
      f.waiting_write.clear();
      for (uint32_t b : waiting) submit_write(slot, big_[b], true, b);
    }
    maybe_finish_stripes(slot);
  }

  void on_read(uint32_t slot, Stripe& s, bool big, uint32_t b, int64_t res) {
    FileState& f = files_[slot];
    if (error_) return release(slot, big, b);
    if (res == -EINTR || res == -EAGAIN) return submit_read(slot, s, big, b);
    if (res == -EINVAL && f.direct_src) {  // refused O_DIRECT after all: read it buffered
      direct_src_ = false;
      f.direct_src = false;
      int fl = ::fcntl(f.src_fd, F_GETFL);
      if (fl >= 0 && ::fcntl(f.src_fd, F_SETFL, fl & ~O_DIRECT) == 0)
        return submit_read(slot, s, big, b);
    }
    if (res < 0) {
      release(slot, big, b);
      return file_error(slot, Error::os(int(-res), "read", src_name(f)));
    }
    if (res == 0 && s.got < s.len) {
      release(slot, big, b);
      return file_error(slot, changed(f, "is shorter than when it was listed"));
    }
    s.got += uint64_t(res);
    if (s.got > s.len) {
      release(slot, big, b);
      return file_error(slot, changed(f, "grew while it was being copied"));
    }
    if (s.got < s.len) return submit_read(slot, s, big, b);
    s.read_done = true;
    files_[slot].digests[s.index] = hash::fl64(s.buf, s.len);
    if (!opt_.write || s.len == 0) {
      release(slot, big, b);
      return stripe_finished(slot, s.len);
    }
    if (!f.dst_open) {
      if (big) f.waiting_write.push_back(b);
      return;  // written once the temporary is open
    }
    submit_write(slot, s, big, b);
  }

  void on_write(uint32_t slot, Stripe& s, bool big, uint32_t b, int64_t res) {
    FileState& f = files_[slot];
    if (error_) return release(slot, big, b);
    if (res == -EINTR || res == -EAGAIN) return submit_write(slot, s, big, b);
    if (res < 0) {
      release(slot, big, b);
      return file_error(slot, Error::os(int(-res), "write", dst_name(f, false)));
    }
    if (res == 0) {  // a zero-length write of a non-empty range would spin forever
      release(slot, big, b);
      return file_error(slot, Error::os(EIO, "write", dst_name(f, false)));
    }
    s.put += uint64_t(res);
    if (s.put < s.len) return submit_write(slot, s, big, b);
    uint64_t len = s.len;
    release(slot, big, b);
    stripe_finished(slot, len);
  }

  void release(uint32_t slot, bool big, uint32_t b) {
    if (big) {
      free_big_.push_back(b);
      (void)slot;
    }
    if (error_) maybe_retire(slot);
  }

  void stripe_finished(uint32_t slot, uint64_t len) {
    FileState& f = files_[slot];
    ++f.stripes_done;
    job_.bytes_done_.fetch_add(len, std::memory_order_relaxed);
    if (!is_small(f) && f.active && f.next_stripe < f.nstripes &&
        std::find(want_big_.begin(), want_big_.end(), slot) == want_big_.end())
      want_big_.push_back(slot);
    maybe_finish_stripes(slot);
  }

  // All stripes read (and written): set metadata and close.
  void maybe_finish_stripes(uint32_t slot) {
    FileState& f = files_[slot];
    if (!f.active || f.closing || f.stripes_done < f.nstripes) return;
    if (opt_.write && !f.dst_open) return;  // an empty or all-hole file: wait for the open
    if (f.src_fd < 0) return;
    const FileTask& t = tasks_[f.task];
    if (opt_.write && !is_small(f)) {
      // A big file rewritten in place keeps its size; its mtime gives it away.
      struct stat st;
      if (::fstat(f.src_fd, &st) == 0) {
        int64_t m = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
        if (uint64_t(st.st_size) != t.size || m != t.mtime_ns)
          return file_error(slot, changed(f, "was modified while it was being copied"));
      }
    }
    if (opt_.write) {
      const timespec times[2] = {to_timespec(t.mtime_ns), to_timespec(t.mtime_ns)};
      if (f.chmod && ::fchmod(f.dst_fd, mode_t(t.mode & 07777)) != 0)
        return file_error(slot, Error::os(errno, "set mode of", dst_name(f, true)));
      if (::futimens(f.dst_fd, times) != 0)
        return file_error(slot, Error::os(errno, "set times of", dst_name(f, true)));
      if (f.anon) {
        int err = link_into_place(f, t.dst);
        if (err == EEXIST) {
          // A file of that name (an older copy) stays until replaced whole: the link
          // goes to the temporary name, renamed over it once closed, as a named one.
          ::unlinkat(dst_root_.get(), f.tmp_path.c_str(), 0);  // an earlier run's leftover
          err = link_into_place(f, f.tmp_path);
          f.anon = false;
        }
        if (err != 0)
          return file_error(slot, Error::os(err, "link into place", dst_name(f, false)));
      }
    }
    f.closing = true;
    close_fds(slot);
  }

  // Links the anonymous temporary f.dst_fd to rel: 0 or errno. AT_EMPTY_PATH where this
  // process may (CAP_DAC_READ_SEARCH on older kernels), else through /proc/self/fd.
  int link_into_place(const FileState& f, const std::string& rel) {
    if (empty_path_link_) {
      if (::linkat(f.dst_fd, "", dst_root_.get(), rel.c_str(), AT_EMPTY_PATH) == 0) return 0;
      if (errno != ENOENT && errno != EPERM) return errno;
      empty_path_link_ = false;
    }
    char proc[40];
    std::snprintf(proc, sizeof proc, "/proc/self/fd/%d", f.dst_fd);
    return ::linkat(AT_FDCWD, proc, dst_root_.get(), rel.c_str(), AT_SYMLINK_FOLLOW) == 0 ? 0
                                                                                          : errno;
  }

  // Both closes are counted before either is issued: a direct one completes at once.
  void close_fds(uint32_t slot) {
    FileState& f = files_[slot];
    const int src = f.src_fd, dst = f.dst_fd;
    f.src_fd = f.dst_fd = -1;
    f.closes = unsigned(src >= 0) + unsigned(dst >= 0);
    if (f.closes == 0) return finish_file(slot);
    if (src >= 0)
      issue({.code = io::OpCode::kClose, .fd = src}, slot, tag(slot, kCloseSrc),
            direct_src_close_);
    if (dst >= 0)
      issue({.code = io::OpCode::kClose, .fd = dst}, slot, tag(slot, kCloseDst), direct_dst_);
  }

  // Called once both descriptors are closed. A file completed before another file's
  // error is still renamed into place: it is whole, and the resume need not redo it.
  void finish_file(uint32_t slot) {
    FileState& f = files_[slot];
    if (f.failed) return maybe_retire(slot);
    const FileTask& t = tasks_[f.task];
    if (opt_.write && !f.anon &&
        ::renameat(dst_root_.get(), f.tmp_path.c_str(), dst_root_.get(), t.dst.c_str()) != 0)
      return file_error(slot, Error::os(errno, "rename into place", dst_name(f, false)));
    bool wake = false;
    {
      std::lock_guard lk(job_.mu_);
      job_.done_.push_back(FileDone{f.task, std::move(f.digests)});
      wake = job_.done_waiters_ > 0;
    }
    if (wake) job_.cv_.notify_all();
    job_.files_done_.fetch_add(1, std::memory_order_relaxed);
    f.active = false;
    --active_;
    free_files_.push_back(slot);
  }

  // ---- errors ------------------------------------------------------------------------

  Error changed(const FileState& f, const std::string& what) {
    return Error(ErrorKind::kSourceChanged, 0, "source file changed", src_name(f),
                 "it " + what + "; stage again to pick up the new content");
  }

  std::string src_name(const FileState& f) const {
    return join(job_.src_root_, tasks_[f.task].src);
  }
  std::string dst_name(const FileState& f, bool temporary) const {
    return join(job_.dst_root_, temporary ? f.tmp_path : tasks_[f.task].dst);
  }

  void file_error(uint32_t slot, Error e) {
    files_[slot].failed = true;
    fail(std::move(e));
    maybe_retire(slot);
  }

  void fail(Error e) {
    if (error_) return;
    if (e.kind() != ErrorKind::kCancelled) job_.halt_.store(true, std::memory_order_relaxed);
    error_ = std::move(e);
  }

  // After an error: once a file has nothing in flight, close its descriptors and remove
  // its temporary, so the destination holds only complete files.
  void maybe_retire(uint32_t slot) {
    FileState& f = files_[slot];
    if (!f.active || f.ops > 0) return;
    if (f.src_fd >= 0) ::close(f.src_fd);
    if (f.dst_fd >= 0) ::close(f.dst_fd);
    f.src_fd = f.dst_fd = -1;
    if (opt_.write && !f.tmp_path.empty()) ::unlinkat(dst_root_.get(), f.tmp_path.c_str(), 0);
    f.active = false;
    --active_;
  }

  void cleanup_after_error() {
    for (uint32_t i = 0; i < files_.size(); ++i) {
      files_[i].ops = 0;  // the engine has drained: nothing is in flight any more
      maybe_retire(i);
    }
  }

  uint32_t busy_open_[kBusyKinds] = {};
  uint64_t busy_since_[kBusyKinds] = {};
  uint64_t busy_ns_[kBusyKinds] = {};
  CopyJob& job_;
  const CopyOptions opt_;
  std::vector<FileTask>& tasks_;  // a task is its submitter's alone (stat_at_open)
  io::Engine* eng_ = nullptr;
  UniqueFd src_root_;
  UniqueFd dst_root_;
  void* region_ = MAP_FAILED;
  size_t region_size_ = 0;
  char* small_base_ = nullptr;
  char* big_base_ = nullptr;
  size_t small_size_ = 0, big_size_ = 0, small_stride_ = 0, big_stride_ = 0;
  bool fixed_ = false;
  bool direct_dst_ = false;        // the destination is local: its operations run now
  bool direct_src_close_ = false;  // the source is local: closing it runs now
  // Small files of a FUSE source are read O_DIRECT (till the server refuses it): FUSE
  // reads ahead through at most max_background requests of the whole mount (12 by
  // default), so with many files in flight the kernel falls back to reads of a page or
  // a few: netsim at 2 ms saw 2.3 to 3.8 READ requests per 60 KB file, each a round
  // trip, against one with O_DIRECT (which also skips the page cache of a file read once).
  bool direct_src_ = false;
  int umask_ = -1;                 // the process's, or -1: unknown (always fchmod)
  bool tmpfile_ = true;            // O_TMPFILE works on the destination (till it fails)
  bool empty_path_link_ = true;    // linkat(AT_EMPTY_PATH) is allowed (till refused)
  std::vector<FileState> files_;
  std::deque<uint32_t> free_files_;
  std::vector<Stripe> big_;
  std::deque<uint32_t> free_big_;
  std::deque<uint32_t> want_big_;
  bool exhausted_ = false;  // the job's task list is used up
  size_t active_ = 0;
  std::optional<Error> error_;
};

CopyJob::CopyJob(std::string src_root, std::string dst_root, std::vector<FileTask> tasks,
                 CopyOptions options)
    : src_root_(std::move(src_root)),
      dst_root_(std::move(dst_root)),
      tasks_(std::move(tasks)),
      opt_(options) {
  uint64_t total = 0;
  for (const auto& t : tasks_) total += t.size;
  bytes_total_.store(total, std::memory_order_relaxed);
}

CopyJob::~CopyJob() {
  if (thread_.joinable()) {
    cancel();
    thread_.join();
  }
}

unsigned default_submitters() {
  // One per core up to 8: each submitter keeps one thread busy issuing, completing and
  // setting metadata; past 8 the files in flight per submitter get too few to hide the
  // storage's latency (RESULTS.md, issue 33).
  // The cores this process may run on (taskset, a cgroup's cpuset), not the machine's.
  cpu_set_t set;
  CPU_ZERO(&set);
  unsigned cores = ::sched_getaffinity(0, sizeof set, &set) == 0
                       ? unsigned(CPU_COUNT(&set))
                       : std::thread::hardware_concurrency();
  return std::clamp(cores, 1u, 8u);
}

namespace {

// Submitter i's share of the job's options: the files in flight, big buffers, queue depth
// and pool threads divided between n submitters (each at least what one file needs).
CopyOptions share_of(const CopyOptions& opt, unsigned n) {
  CopyOptions o = opt;
  auto div = [n](unsigned v, unsigned least) { return std::max(least, (v + n - 1) / n); };
  o.files_in_flight = div(opt.files_in_flight, 1);
  o.big_buffers = div(opt.big_buffers, 2);
  o.engine.depth = div(opt.engine.depth, 8);
  o.engine.threads = div(opt.engine.threads, 2);
  return o;
}

}  // namespace

void CopyJob::run() {
  // The first error a submitter met wins over the cancellations it caused in the others.
  auto keep = [this](const Error& e) {
    std::lock_guard lk(mu_);
    if (!error_ || (error_->kind() == ErrorKind::kCancelled && e.kind() != ErrorKind::kCancelled))
      error_ = e;
  };
  auto run_one = [&](Runner& r, io::Engine& engine) {
    try {
      r.run(engine);
    } catch (const Error& e) {
      // An error before the loop (the roots, the buffers) stops the others too.
      if (e.kind() != ErrorKind::kCancelled) halt_.store(true, std::memory_order_relaxed);
      keep(e);
    } catch (const std::exception& e) {
      halt_.store(true, std::memory_order_relaxed);
      keep(Error(ErrorKind::kOs, EIO, "internal error", dst_root_, e.what()));
    }
  };
  try {
    unsigned n = opt_.submitters ? opt_.submitters : default_submitters();
    // A short list is not split: a submitter needs files enough to keep its share in
    // flight, and a few big files keep their stripes in one submitter's buffers.
    n = unsigned(std::clamp<size_t>(tasks_.size() / kFilesPerSubmitter, 1, n));
    const CopyOptions each = share_of(opt_, n);
    std::vector<std::unique_ptr<io::Engine>> engines;
    for (unsigned i = 0; i < n; ++i) {
      int err = 0;
      auto engine = io::make_engine(each.engine, &err);
      if (!engine) throw Error::os(-err, "start the I/O engine", "");
      engines.push_back(std::move(engine));
    }
    {
      std::lock_guard lk(mu_);
      engine_name_ = engines[0]->name();
      submitters_ = n;
      started_ = true;
    }
    cv_.notify_all();
    std::vector<std::unique_ptr<Runner>> runners;
    for (unsigned i = 0; i < n; ++i) runners.push_back(std::make_unique<Runner>(*this, each));
    std::vector<std::thread> others;
    for (unsigned i = 1; i < n; ++i)
      others.emplace_back([&, i] { run_one(*runners[i], *engines[i]); });
    run_one(*runners[0], *engines[0]);
    for (auto& t : others) t.join();
  } catch (const Error& e) {
    keep(e);
  } catch (const std::exception& e) {
    keep(Error(ErrorKind::kOs, EIO, "internal error", dst_root_, e.what()));
  }
  {
    std::lock_guard lk(mu_);
    started_ = finished_ = true;
  }
  cv_.notify_all();
}

void CopyJob::start() {
  thread_ = std::thread([this] {
    if (opt_.lowest_priority)  // this thread only (Linux), and the threads it starts
      ::setpriority(PRIO_PROCESS, 0, 19);
    run();
  });
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return started_; });
}

bool CopyJob::wait(int timeout_ms, bool any_done) {
  std::unique_lock lk(mu_);
  done_waiters_ += any_done;
  cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms),
               [&] { return finished_ || (any_done && !done_.empty()); });
  done_waiters_ -= any_done;
  if (!finished_) return false;
  lk.unlock();
  if (thread_.joinable()) thread_.join();
  return true;
}

void CopyJob::rethrow() const {
  std::lock_guard lk(mu_);
  if (error_) throw *error_;
}

std::vector<FileDone> CopyJob::take_done() {
  std::lock_guard lk(mu_);
  return std::exchange(done_, {});
}

std::string CopyJob::engine_name() const {
  std::lock_guard lk(mu_);
  return engine_name_;
}

}  // namespace fastload::copy
