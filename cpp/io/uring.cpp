#include "io/uring.hpp"

#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "io/sys.hpp"

namespace fastload::io {

namespace {

// The kernel side of every head/tail is written concurrently by the kernel, so each
// access goes through atomic_ref; the orderings are spelled out at each use.
inline unsigned load_acquire(const unsigned* p) noexcept {
  return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load(std::memory_order_acquire);
}
inline unsigned load_relaxed(const unsigned* p) noexcept {
  return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load(std::memory_order_relaxed);
}
inline void store_release(unsigned* p, unsigned v) noexcept {
  std::atomic_ref<unsigned>(*p).store(v, std::memory_order_release);
}

template <typename T>
T* at_offset(void* base, uint32_t off) noexcept {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}

// Setup flags, most wanted first. COOP_TASKRUN (5.19) stops the kernel from
// interrupting us with an IPI for every completion; TASKRUN_FLAG then tells us when
// to enter the kernel to run the deferred work. SUBMIT_ALL (5.18) keeps a batch going
// past an SQE that fails early, so one bad path does not stall the others. CLAMP
// (5.6) turns a too-large depth into the kernel maximum instead of EINVAL. Older
// kernels answer EINVAL to flags they do not know, and we try the next set.
// SINGLE_ISSUER/DEFER_TASKRUN are left out on purpose: they bind the ring to the
// thread that creates it, and fastload creates engines on the Python thread and drives
// them on worker threads; the gain for file I/O does not pay for that trap.
constexpr unsigned kSetupAttempts[] = {
    IORING_SETUP_CLAMP | IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN |
        IORING_SETUP_TASKRUN_FLAG,
    IORING_SETUP_CLAMP | IORING_SETUP_SUBMIT_ALL,
    IORING_SETUP_CLAMP,
};

// Every opcode push() may emit; a kernel lacking one is treated as lacking io_uring.
constexpr uint8_t kRequiredOps[] = {
    IORING_OP_NOP,   IORING_OP_OPENAT,     IORING_OP_CLOSE,       IORING_OP_READ,
    IORING_OP_WRITE, IORING_OP_READ_FIXED, IORING_OP_WRITE_FIXED, IORING_OP_STATX,
    IORING_OP_FSYNC,
};

// Returns 0 when the kernel supports every required opcode, else -EOPNOTSUPP.
// IORING_REGISTER_PROBE itself appeared in 5.6, with OPENAT/STATX/READ, so a kernel
// refusing the probe is too old anyway.
int probe_ops(int ring_fd) noexcept {
  constexpr unsigned kOps = 256;
  std::vector<unsigned char> mem;
  try {
    mem.assign(sizeof(io_uring_probe) + kOps * sizeof(io_uring_probe_op), 0);
  } catch (...) {
    return -ENOMEM;
  }
  auto* probe = reinterpret_cast<io_uring_probe*>(mem.data());
  int r = sys::io_uring_register(ring_fd, IORING_REGISTER_PROBE, probe, kOps);
  if (r < 0) return -EOPNOTSUPP;
  for (uint8_t op : kRequiredOps) {
    if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED))
      return -EOPNOTSUPP;
  }
  return 0;
}

int64_t remaining_ms(std::chrono::steady_clock::time_point deadline) noexcept {
  auto left = deadline - std::chrono::steady_clock::now();
  return std::max<int64_t>(
      0, std::chrono::ceil<std::chrono::milliseconds>(left).count());
}

}  // namespace

// ---------------------------------------------------------------------------------
// Ring: setup, mappings, head/tail protocol.

Ring::~Ring() { release(); }

Ring::Ring(Ring&& o) noexcept { *this = std::move(o); }

Ring& Ring::operator=(Ring&& o) noexcept {
  if (this == &o) return *this;
  release();
  fd_ = std::exchange(o.fd_, -1);
  features_ = o.features_;
  setup_flags_ = o.setup_flags_;
  sq_map_ = std::exchange(o.sq_map_, nullptr);
  sq_map_len_ = o.sq_map_len_;
  cq_map_ = std::exchange(o.cq_map_, nullptr);
  cq_map_len_ = o.cq_map_len_;
  sqes_ = std::exchange(o.sqes_, nullptr);
  sqes_len_ = o.sqes_len_;
  sq_khead_ = o.sq_khead_;
  sq_ktail_ = o.sq_ktail_;
  sq_kflags_ = o.sq_kflags_;
  sq_mask_ = o.sq_mask_;
  sq_entries_ = o.sq_entries_;
  sqe_tail_ = o.sqe_tail_;
  cq_khead_ = o.cq_khead_;
  cq_ktail_ = o.cq_ktail_;
  cqes_ = o.cqes_;
  cq_mask_ = o.cq_mask_;
  return *this;
}

void Ring::release() noexcept {
  if (sqes_) munmap(sqes_, sqes_len_);
  if (cq_map_ && cq_map_ != sq_map_) munmap(cq_map_, cq_map_len_);
  if (sq_map_) munmap(sq_map_, sq_map_len_);
  sqes_ = nullptr;
  cq_map_ = sq_map_ = nullptr;
  // Unmapping first, then closing, lets the kernel free the rings at close.
  if (fd_ >= 0) sys::close(fd_);
  fd_ = -1;
}

int Ring::init(unsigned entries, bool legacy) {
  release();
  io_uring_params p;
  int fd = -EINVAL;
  for (unsigned flags : kSetupAttempts) {
    if (legacy && flags != IORING_SETUP_CLAMP) continue;
    std::memset(&p, 0, sizeof p);
    p.flags = flags;
    fd = sys::io_uring_setup(entries, &p);
    if (fd != -EINVAL) break;
  }
  if (fd < 0) return fd;
  fd_ = fd;
  features_ = legacy ? p.features & ~IORING_FEAT_EXT_ARG : p.features;
  setup_flags_ = p.flags;

  // The SQ ring ends with the index array, the CQ ring with the CQEs. With
  // SINGLE_MMAP (5.4+) both live in one mapping at IORING_OFF_SQ_RING, which must then
  // be large enough for either layout.
  sq_map_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  cq_map_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
  if (single) sq_map_len_ = cq_map_len_ = std::max(sq_map_len_, cq_map_len_);

  // MAP_POPULATE: the rings are touched on every operation; fault them in now.
  void* sq = mmap(nullptr, sq_map_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                  fd_, IORING_OFF_SQ_RING);
  if (sq == MAP_FAILED) {
    int err = -errno;
    release();
    return err;
  }
  sq_map_ = sq;
  if (single) {
    cq_map_ = sq_map_;
  } else {
    void* cq = mmap(nullptr, cq_map_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                    fd_, IORING_OFF_CQ_RING);
    if (cq == MAP_FAILED) {
      int err = -errno;
      release();
      return err;
    }
    cq_map_ = cq;
  }
  sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
  void* sqes = mmap(nullptr, sqes_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                    fd_, IORING_OFF_SQES);
  if (sqes == MAP_FAILED) {
    int err = -errno;
    release();
    return err;
  }
  sqes_ = static_cast<io_uring_sqe*>(sqes);

  sq_khead_ = at_offset<unsigned>(sq_map_, p.sq_off.head);
  sq_ktail_ = at_offset<unsigned>(sq_map_, p.sq_off.tail);
  sq_kflags_ = at_offset<unsigned>(sq_map_, p.sq_off.flags);
  sq_mask_ = *at_offset<unsigned>(sq_map_, p.sq_off.ring_mask);
  sq_entries_ = p.sq_entries;
  cq_khead_ = at_offset<unsigned>(cq_map_, p.cq_off.head);
  cq_ktail_ = at_offset<unsigned>(cq_map_, p.cq_off.tail);
  cq_mask_ = *at_offset<unsigned>(cq_map_, p.cq_off.ring_mask);
  cqes_ = at_offset<io_uring_cqe>(cq_map_, p.cq_off.cqes);

  // SQEs are always filled in ring order, so the indirection array is the identity
  // and is written once here, before the first tail store publishes any entry.
  unsigned* array = at_offset<unsigned>(sq_map_, p.sq_off.array);
  for (unsigned i = 0; i < p.sq_entries; ++i) array[i] = i;
  sqe_tail_ = load_relaxed(sq_ktail_);
  return 0;
}

unsigned Ring::flush_sq() noexcept {
  // Release: the SQE stores above must be visible before the kernel sees the new tail.
  if (load_relaxed(sq_ktail_) != sqe_tail_) store_release(sq_ktail_, sqe_tail_);
  return sq_unconsumed();
}

unsigned Ring::sq_unconsumed() const noexcept {
  // Acquire pairs with the kernel's release of the head after it copied the SQEs.
  return sqe_tail_ - load_acquire(sq_khead_);
}

unsigned Ring::cq_ready() const noexcept {
  // Only we write the CQ head, so a relaxed read of our own value is enough.
  return load_acquire(cq_ktail_) - load_relaxed(cq_khead_);
}

const io_uring_cqe& Ring::cqe(unsigned i) const noexcept {
  return cqes_[(load_relaxed(cq_khead_) + i) & cq_mask_];
}

void Ring::cq_advance(unsigned n) noexcept {
  store_release(cq_khead_, load_relaxed(cq_khead_) + n);
}

bool Ring::needs_enter() const noexcept {
  // Relaxed: a stale flag only costs one extra or one later io_uring_enter.
  return (load_relaxed(sq_kflags_) & (IORING_SQ_TASKRUN | IORING_SQ_CQ_OVERFLOW)) != 0;
}

// ---------------------------------------------------------------------------------
// UringEngine: Engine operations on top of the ring.

std::unique_ptr<UringEngine> UringEngine::create(unsigned depth, int* err) {
  return create(depth, err, false);
}

std::unique_ptr<UringEngine> UringEngine::create_legacy(unsigned depth, int* err) {
  return create(depth, err, true);
}

std::unique_ptr<UringEngine> UringEngine::create(unsigned depth, int* err, bool legacy) {
  int dummy;
  if (!err) err = &dummy;
  if (depth == 0) {
    *err = -EINVAL;
    return nullptr;
  }
  Ring ring;
  int r = ring.init(depth, legacy);
  if (r == 0) r = probe_ops(ring.fd());
  if (r < 0) {
    *err = r;
    return nullptr;
  }
  const unsigned capacity = std::min(depth, ring.sq_entries());
  std::unique_ptr<UringEngine> engine(new (std::nothrow) UringEngine(std::move(ring), capacity));
  *err = engine ? 0 : -ENOMEM;
  return engine;
}

UringEngine::~UringEngine() {
  if (ring_.fd() < 0) return;
  // SQEs the kernel has not consumed are simply never submitted (we pass to_submit = 0
  // below and closing the ring discards them). Everything else the kernel owns and
  // may still be writing into a caller's buffer: wait for it before unmapping.
  unsigned owned = in_flight_ - ring_.sq_unconsumed();
  while (owned > 0) {
    unsigned n = std::min(ring_.cq_ready(), owned);
    if (n > 0) {
      ring_.cq_advance(n);
      owned -= n;
      continue;
    }
    int r = sys::io_uring_enter(ring_.fd(), 0, 1, IORING_ENTER_GETEVENTS, nullptr, _NSIG / 8);
    if (r < 0 && r != -EINTR && r != -EAGAIN) break;  // nothing sensible left to do
  }
}

int UringEngine::push(const Op& op) {
  if (in_flight_ >= capacity_) return -EBUSY;
  if (op.code > OpCode::kFsync) return -EINVAL;

  io_uring_sqe* sqe = ring_.next_sqe();
  // The slot still holds an old request's fields; every field the kernel reads for
  // these opcodes must start at zero (ioprio, rw_flags, personality, splice_fd_in...).
  std::memset(sqe, 0, sizeof *sqe);
  sqe->user_data = op.user_data;
  switch (op.code) {
    case OpCode::kNop:
      sqe->opcode = IORING_OP_NOP;
      break;
    case OpCode::kOpenAt:
      sqe->opcode = IORING_OP_OPENAT;
      sqe->fd = op.dir_fd;
      sqe->addr = reinterpret_cast<uintptr_t>(op.path);
      sqe->len = op.mode;
      sqe->open_flags = static_cast<uint32_t>(op.flags);
      break;
    case OpCode::kClose:
      sqe->opcode = IORING_OP_CLOSE;
      sqe->fd = op.fd;
      break;
    case OpCode::kRead:
    case OpCode::kWrite: {
      const bool read = op.code == OpCode::kRead;
      const bool fixed = op.buf_index >= 0;
      sqe->opcode = fixed ? (read ? IORING_OP_READ_FIXED : IORING_OP_WRITE_FIXED)
                          : (read ? IORING_OP_READ : IORING_OP_WRITE);
      sqe->fd = op.fd;
      sqe->addr = reinterpret_cast<uintptr_t>(op.buf);
      sqe->len = op.len;
      sqe->off = op.offset;  // UINT64_MAX (-1): the file position
      if (fixed) sqe->buf_index = static_cast<uint16_t>(op.buf_index);
      break;
    }
    case OpCode::kStatx:
      sqe->opcode = IORING_OP_STATX;
      sqe->fd = op.dir_fd;
      sqe->addr = reinterpret_cast<uintptr_t>(op.path);
      sqe->len = op.mode;  // the statx mask
      sqe->addr2 = reinterpret_cast<uintptr_t>(op.statx_buf);
      sqe->statx_flags = static_cast<uint32_t>(op.flags);
      break;
    case OpCode::kFsync:
      sqe->opcode = IORING_OP_FSYNC;
      sqe->fd = op.fd;
      break;
  }
  ++in_flight_;
  return 0;
}

int UringEngine::enter(unsigned to_submit, unsigned wait_nr, int timeout_ms) noexcept {
  const int fd = ring_.fd();
  const unsigned flags = IORING_ENTER_GETEVENTS;
  if (wait_nr == 0 || timeout_ms < 0)
    return sys::io_uring_enter(fd, to_submit, wait_nr, flags, nullptr, _NSIG / 8);

  if (ring_.features() & IORING_FEAT_EXT_ARG) {
    // 5.11+: the wait itself carries a relative timeout and ends with -ETIME.
    __kernel_timespec ts{};
    ts.tv_sec = timeout_ms / 1000;
    ts.tv_nsec = static_cast<long long>(timeout_ms % 1000) * 1000000;
    io_uring_getevents_arg arg{};
    arg.sigmask = 0;
    arg.sigmask_sz = _NSIG / 8;
    arg.ts = reinterpret_cast<uintptr_t>(&ts);
    return sys::io_uring_enter(fd, to_submit, wait_nr, flags | IORING_ENTER_EXT_ARG, &arg,
                               sizeof arg);
  }

  // 5.10: no timed wait without spending an SQE on IORING_OP_TIMEOUT, which would
  // break the capacity accounting. Submit, then poll the CQ with a short, growing
  // sleep; completions arrive through task work that runs on our own syscalls.
  int r = sys::io_uring_enter(fd, to_submit, 0, flags, nullptr, _NSIG / 8);
  if (r < 0 || static_cast<unsigned>(r) != to_submit) return r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  auto nap = std::chrono::microseconds(50);
  while (ring_.cq_ready() < wait_nr) {
    if (std::chrono::steady_clock::now() >= deadline) return -ETIME;
    std::this_thread::sleep_for(nap);
    nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(1));
    sys::io_uring_enter(fd, 0, 0, flags, nullptr, _NSIG / 8);
  }
  return r;
}

unsigned UringEngine::copy_out(Completion* out, unsigned max) noexcept {
  const unsigned n = std::min(ring_.cq_ready(), max);
  for (unsigned i = 0; i < n; ++i) {
    const io_uring_cqe& c = ring_.cqe(i);
    out[i] = Completion{c.user_data, c.res};
  }
  // Only after the copies: advancing the head lets the kernel reuse those slots.
  if (n > 0) ring_.cq_advance(n);
  in_flight_ -= n;
  return n;
}

// One pass is usually one io_uring_enter that both submits and waits. The loop exists
// for the rare cases where the kernel returns before the wait was satisfied: a partial
// submission (it skips the wait then) or a transient -EAGAIN; the deadline is
// recomputed each time so the caller's timeout bounds the whole call.
int UringEngine::reap(Completion* out, unsigned max, unsigned min_complete, int timeout_ms) {
  // Waiting for more than is in flight could only end by timeout.
  const unsigned wait_nr = std::min(min_complete, in_flight_);
  const bool timed = timeout_ms > 0;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timed ? timeout_ms : 0);
  bool interrupted = false;
  int error = 0;

  for (;;) {
    const unsigned to_submit = ring_.flush_sq();
    bool wait = timeout_ms != 0 && ring_.cq_ready() < wait_nr;
    int budget = timeout_ms;
    if (wait && timed) {
      budget = static_cast<int>(remaining_ms(deadline));
      if (budget == 0) wait = false;
    }
    // Nothing to submit, nothing to wait for, no deferred task work: the CQ as it is
    // now is the answer, and we save the system call.
    if (to_submit == 0 && !wait && !ring_.needs_enter()) break;

    const int r = enter(to_submit, wait ? wait_nr : 0, wait ? budget : 0);
    if (r == -ETIME) break;
    // A signal: return what is there so the caller can look at its cancel flag.
    if (r == -EINTR) {
      interrupted = true;
      break;
    }
    if (r == -EAGAIN || r == -EBUSY) {
      // The kernel is short of request memory; what stays in the SQ is retried on the
      // next pass or the next reap. Do not spin on it.
      if (!wait) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    if (r < 0) {
      error = r;
      break;
    }
    if (!wait || ring_.cq_ready() >= wait_nr) break;
    // A partial submission returns before waiting: go round to submit the rest (the
    // deadline, recomputed above, still bounds the whole call).
  }

  const unsigned n = copy_out(out, max);
  if (n == 0 && error) return error;
  if (n == 0 && interrupted) return -EINTR;
  return static_cast<int>(n);
}

int UringEngine::set_max_workers(unsigned bounded, unsigned unbounded) {
  unsigned counts[2] = {bounded, unbounded};
  return sys::io_uring_register(ring_.fd(), IORING_REGISTER_IOWQ_MAX_WORKERS, counts, 2);
}

int UringEngine::register_buffers(std::span<const iovec> buffers) {
  if (buffers_registered_ || in_flight_ > 0) return -EBUSY;
  if (buffers.empty()) return -EINVAL;
  int r;
  do {
    // Kernels before 5.13 quiesce the ring here and may be interrupted.
    r = sys::io_uring_register(ring_.fd(), IORING_REGISTER_BUFFERS, buffers.data(),
                               static_cast<unsigned>(buffers.size()));
  } while (r == -EINTR);
  if (r < 0) return r;  // -ENOMEM: RLIMIT_MEMLOCK on kernels before 5.12
  buffers_registered_ = true;
  return 0;
}

}  // namespace fastload::io
