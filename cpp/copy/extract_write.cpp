// A member's file: created unnamed (or under a temporary name), written with many
// writes in flight (data copied into slots, or written from where it lies: a lent read
// block or the mapped archive; O_DIRECT where the destination allows), digested per
// chunk, named once whole. Then the engine: queueing, completions, and abort.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "copy/copier.hpp"
#include "copy/extract_impl.hpp"

namespace fastload::copy {

// ---- members -------------------------------------------------------------------------

void ExtractJob::Impl::start_file(const std::string& out, const tar::Member& m, uint32_t* index) {
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
  f.sparse = m.sparse;
  f.size = m.size;
  f.direct = direct_writes && !m.sparse && m.size >= opt.direct_write_min;
  f.direct_end = m.size - m.size % page_size;
  push_open(i);
  *index = i;
}

// Chunk digests, the same as the copier's: one per chunk_size bytes of content.
void ExtractJob::Impl::digest(File& f, const char* p, size_t n) {
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
}

void ExtractJob::Impl::hole_to(uint32_t i, uint64_t to) {
  File& f = files[i];
  if (to <= f.pos) return;
  if (f.slot != kNone) submit_slot(i);  // a slot holds one contiguous run
  static const char kZeros[64 * 1024] = {};
  for (uint64_t left = to - f.pos; left > 0;) {
    const size_t k = size_t(std::min<uint64_t>(left, sizeof kZeros));
    digest(f, kZeros, k);
    left -= k;
  }
  f.pos = to;
}

void ExtractJob::Impl::append(uint32_t i, const char* p, size_t n) {
  File& f = files[i];
  digest(f, p, n);
  if (lent_lo != nullptr && p >= lent_lo && p + n <= lent_hi) {
    // In the lent range (a read block, or the mapped archive): written from where it
    // lies, a read block pinned till then.
    if (f.slot != kNone) submit_slot(i);
    uint32_t k = new_piece();
    pieces[k] = Piece{i, p, n, 0, f.pos, kNone, lent_block};
    if (lent_block != kNone) ++block_pins[lent_block];
    f.appended += n;
    f.pos += n;
    queue_piece(i, k);
    return;
  }
  while (n > 0) {
    if (f.slot == kNone) {
      while (free_slots.empty()) pump(true);
      f.slot = free_slots.back();
      free_slots.pop_back();
      f.fill = 0;
      f.slot_offset = f.pos;
    }
    size_t take = std::min(n, opt.slot_size - f.fill);
    std::memcpy(slot_data(f.slot) + f.fill, p, take);
    f.fill += take;
    f.appended += take;
    f.pos += take;
    p += take;
    n -= take;
    if (f.fill == opt.slot_size) submit_slot(i);
  }
}

// A member's file is created unnamed (O_TMPFILE) where the filesystem can, and given
// its name once whole: the inode is allocated without the directory's lock, which
// creates and renames in one directory otherwise hold in turn, and a killed run leaves
// no temporaries. Elsewhere it is written under a temporary name and renamed.
void ExtractJob::Impl::push_open(uint32_t i) {
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
char* ExtractJob::Impl::slot_data(uint32_t s) {
  if (!arena) arena = aligned_buffer(size_t(opt.slots) * opt.slot_size);
  return arena.get() + size_t(s) * opt.slot_size;
}

uint32_t ExtractJob::Impl::new_piece() {
  while (free_pieces.empty()) pump(true);
  uint32_t k = free_pieces.back();
  free_pieces.pop_back();
  return k;
}

void ExtractJob::Impl::submit_slot(uint32_t i) {
  File& f = files[i];
  uint32_t s = f.slot;
  f.slot = kNone;
  uint32_t k = new_piece();
  pieces[k] = Piece{i, slot_data(s), f.fill, 0, f.slot_offset, s, kNone};
  queue_piece(i, k);
}

void ExtractJob::Impl::queue_piece(uint32_t i, uint32_t k) {
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
bool ExtractJob::Impl::direct_ok(const Piece& pc) const {
  return pc.offset + pc.len <= files[pc.file].direct_end &&
         reinterpret_cast<uintptr_t>(pc.buf) % dio_mem_align == 0 &&
         pc.offset % dio_offset_align == 0 && pc.len % dio_offset_align == 0;
}

// Pushes the file's waiting pieces, in order, once it is open. A piece O_DIRECT
// cannot write (the tail below a page, a misaligned buffer) waits until the file's
// direct writes are done: then O_DIRECT is cleared and the rest is written buffered.
// A buffered write must never share a page with a direct write in flight.
void ExtractJob::Impl::flush(uint32_t i) {
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

void ExtractJob::Impl::push_write(uint32_t k) {
  const Piece& pc = pieces[k];
  // Writes only read .buf (it is not const because reads share io::Op).
  push({.code = io::OpCode::kWrite, .fd = files[pc.file].fd,
        .buf = const_cast<char*>(pc.buf + pc.put),
        .len = uint32_t(pc.len - pc.put), .offset = pc.offset + pc.put},
       tag(pc.file, kWrite, k));
}

void ExtractJob::Impl::end_file(uint32_t i) {
  File& f = files[i];
  if (f.sparse) hole_to(i, f.size);  // a hole at the end is digested too
  if (f.slot != kNone) submit_slot(i);
  if (f.chunk_fill > 0 || f.digests.empty()) f.digests.push_back(f.stream.digest());
  f.data_done = true;
  maybe_close(i);
}

void ExtractJob::Impl::maybe_close(uint32_t i) {
  File& f = files[i];
  if (!f.data_done || !f.opened || f.writes > 0 || f.closing) return;
  timespec t[2] = {to_timespec(f.mtime_ns), to_timespec(f.mtime_ns)};
  // A sparse file's holes were never written: its size comes from here.
  if (f.sparse && ::ftruncate(f.fd, off_t(f.size)) != 0)
    throw Error::os(errno, "set the size of", full(f.path));
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
void ExtractJob::Impl::link_into_place(File& f) {
  if (link_anon(f, f.base.c_str())) return;
  if (errno != EEXIST) throw Error::os(errno, "link into place", full(f.path));
  if (::unlinkat(f.dir_fd, f.tmp.c_str(), 0) != 0 && errno != ENOENT)
    throw Error::os(errno, "remove stale temporary of", full(f.path));
  if (!link_anon(f, f.tmp.c_str())) throw Error::os(errno, "link into place", full(f.path));
  f.anon = false;  // now named: renamed once closed, removed on abort
}

// linkat(2) of the open file: by descriptor where allowed (CAP_DAC_READ_SEARCH),
// else through /proc/self/fd. Sets errno on failure.
bool ExtractJob::Impl::link_anon(const File& f, const char* as) {
  if (link_by_fd && ::linkat(f.fd, "", f.dir_fd, as, AT_EMPTY_PATH) == 0) return true;
  if (link_by_fd && errno != EPERM && errno != ENOENT && errno != EINVAL) return false;
  link_by_fd = false;
  char proc[40];
  std::snprintf(proc, sizeof proc, "/proc/self/fd/%d", f.fd);
  return ::linkat(AT_FDCWD, proc, f.dir_fd, as, AT_SYMLINK_FOLLOW) == 0;
}

void ExtractJob::Impl::file_closed(uint32_t i) {
  File& f = files[i];
  if (!f.anon && ::renameat(f.dir_fd, f.tmp.c_str(), f.dir_fd, f.base.c_str()) != 0) {
    // An empty directory an earlier run left at the name (a re-run over a tree where a
    // later directory member replaced this file) is removed, as GNU tar removes it; one
    // this run made, or one holding anything, is not.
    int e = errno;
    if (e == EISDIR && !dirs_made.count(f.path) &&
        ::unlinkat(f.dir_fd, f.base.c_str(), AT_REMOVEDIR) == 0)
      e = ::renameat(f.dir_fd, f.tmp.c_str(), f.dir_fd, f.base.c_str()) == 0 ? 0 : errno;
    if (e != 0) throw Error::os(e, "rename into place", full(f.path));
  }
  f.dir.reset();
  f.dir_fd = -1;
  done.push_back(
      ExtractedFile{f.path, f.sparse ? f.size : f.appended, f.mode, f.mtime_ns, std::move(f.digests), false});
  active_paths.erase(f.path);
  f.active = false;
  --active;
  free_files.push_back(i);
  job.files_done_.fetch_add(1, std::memory_order_relaxed);
}

// ---- the engine ----------------------------------------------------------------------

void ExtractJob::Impl::push(io::Op op, uint64_t user_data) {
  while (eng->in_flight() >= eng->capacity()) pump(true);
  op.user_data = user_data;
  int r = eng->push(op);
  if (r != 0) throw Error::os(-r, "queue I/O", full(""));
}

// Handles completions: with block, waits (in slices, so cancel is seen) for at least
// one when anything is in flight. Throws the first error.
void ExtractJob::Impl::pump(bool block) {
  if (job.cancelled_.load(std::memory_order_acquire))
    throw Error(ErrorKind::kCancelled, 0, "extraction cancelled", name);
  io::Completion cq[256];
  int n = eng->reap(cq, 256, block && eng->in_flight() > 0 ? 1 : 0, 100);
  if (n < 0) throw Error::os(-n, "wait for I/O", full(""));
  for (int k = 0; k < n; ++k) complete(cq[k]);
}

void ExtractJob::Impl::complete(const io::Completion& c) {
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

// After an error or cancel, and at the end of a finish: let the kernel finish what it
// holds, then remove the temporaries, so the destination keeps only whole files.
void ExtractJob::Impl::abort() noexcept {
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
  // Nothing more is written: the destination's folder is let go now, not when the job
  // is freed (a caller keeping the exception keeps the job; a mount under it stays busy).
  if (root) root->reset();
  eng.reset();
}

}  // namespace fastload::copy
