// The pool: the caller thread pushes into queue_ and pops from done_; workers do the
// opposite. One mutex guards both FIFOs. That is one uncontended lock per push, pop
// and completion, small next to the system call each operation costs; the pool is the
// fallback, and io_uring is the fast path.
#include "io/pread_pool.hpp"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <limits>
#include <new>
#include <system_error>

#include "io/sys.hpp"

namespace fastload::io {

namespace {

// Retries a call interrupted by a signal. Safe for everything but close(2): the pool
// owns the thread, so there is no caller to hand a partial wait back to.
template <typename F>
auto retry_eintr(F&& f) noexcept {
  for (;;) {
    auto r = f();
    if (r != -EINTR) return r;
  }
}

// Blocks every asynchronous signal for as long as it lives. Threads started inside
// inherit the mask, so SIGINT and friends land on the caller's threads (where Python
// handles them) and never interrupt a worker's system call.
class ScopedSignalBlock {
 public:
  ScopedSignalBlock() noexcept {
    sigset_t all;
    sigfillset(&all);
    ok_ = pthread_sigmask(SIG_BLOCK, &all, &old_) == 0;
  }
  ~ScopedSignalBlock() {
    if (ok_) pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  ScopedSignalBlock(const ScopedSignalBlock&) = delete;
  ScopedSignalBlock& operator=(const ScopedSignalBlock&) = delete;

 private:
  sigset_t old_;
  bool ok_ = false;
};

// Op::offset == UINT64_MAX means "the file position", as for io_uring's READ/WRITE.
constexpr uint64_t kCurrentPosition = std::numeric_limits<uint64_t>::max();

}  // namespace

int64_t PreadPool::execute(const Op& op) noexcept {
  switch (op.code) {
    case OpCode::kNop:
      return 0;
    case OpCode::kOpenAt:
      return retry_eintr([&] { return sys::openat(op.dir_fd, op.path, op.flags, op.mode); });
    case OpCode::kClose: {
      // Linux releases the descriptor even when close(2) reports EINTR; retrying
      // could close a descriptor another thread has just been given. Report success.
      int r = sys::close(op.fd);
      return r == -EINTR ? 0 : r;
    }
    case OpCode::kRead:
      if (op.offset == kCurrentPosition)
        return retry_eintr([&] { return sys::ret_or_errno(::read(op.fd, op.buf, op.len)); });
      return retry_eintr([&] { return sys::pread(op.fd, op.buf, op.len, op.offset); });
    case OpCode::kWrite:
      if (op.offset == kCurrentPosition)
        return retry_eintr([&] { return sys::ret_or_errno(::write(op.fd, op.buf, op.len)); });
      return retry_eintr([&] { return sys::pwrite(op.fd, op.buf, op.len, op.offset); });
    case OpCode::kStatx:
      return retry_eintr(
          [&] { return sys::statx(op.dir_fd, op.path, op.flags, op.mode, op.statx_buf); });
    case OpCode::kFsync:
      return retry_eintr([&] { return sys::fsync(op.fd); });
  }
  return -EINVAL;
}

PreadPool::PreadPool(unsigned depth) : depth_(depth) {
  queue_.slots.resize(depth);
  done_.slots.resize(depth);
}

std::unique_ptr<PreadPool> PreadPool::create(unsigned depth, unsigned threads, int* err) {
  int dummy;
  if (!err) err = &dummy;
  if (depth == 0) {
    *err = -EINVAL;
    return nullptr;
  }
  threads = std::clamp(threads, 1u, depth);
  std::unique_ptr<PreadPool> pool;
  try {
    pool.reset(new PreadPool(depth));
    pool->workers_.reserve(threads);
    ScopedSignalBlock block;
    for (unsigned i = 0; i < threads; ++i)
      pool->workers_.emplace_back([p = pool.get()] { p->worker_loop(); });
  } catch (const std::system_error& e) {
    // The destructor joins whichever workers did start.
    *err = e.code().value() > 0 ? -e.code().value() : -EAGAIN;
    return nullptr;
  } catch (const std::bad_alloc&) {
    *err = -ENOMEM;
    return nullptr;
  }
  *err = 0;
  return pool;
}

PreadPool::~PreadPool() { stop_workers(); }

void PreadPool::stop_workers() noexcept {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
}

int PreadPool::push(const Op& op) {
  if (in_flight_ >= depth_) return -EBUSY;
  {
    std::lock_guard lk(mu_);
    // Cannot overflow: queue_ holds a subset of the in_flight_ < depth_ operations.
    queue_.push(op);
  }
  // Notified after unlocking, so the woken worker does not block on mu_ at once.
  work_cv_.notify_one();
  ++in_flight_;
  return 0;
}

int PreadPool::reap(Completion* out, unsigned max, unsigned min_complete, int timeout_ms) {
  // Waiting for more than can ever arrive would only sleep until the timeout.
  const size_t need = std::min(min_complete, in_flight_);
  std::unique_lock lk(mu_);
  if (done_.count < need && timeout_ms != 0) {
    wait_for_ = need;
    auto ready = [&] { return done_.count >= need; };
    if (timeout_ms < 0)
      done_cv_.wait(lk, ready);
    else
      done_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready);
    wait_for_ = 0;
  }
  // Hand out what is ready even after a timeout: a timeout is not an error.
  const unsigned n = static_cast<unsigned>(std::min<size_t>(max, done_.count));
  for (unsigned i = 0; i < n; ++i) out[i] = done_.pop();
  lk.unlock();
  in_flight_ -= n;
  return static_cast<int>(n);
}

void PreadPool::worker_loop() noexcept {
  for (;;) {
    Op op;
    {
      std::unique_lock lk(mu_);
      work_cv_.wait(lk, [&] { return stopping_ || queue_.count > 0; });
      // Stopping wins over queued work: those operations were never started, and
      // their buffers may be gone once the destructor returns.
      if (stopping_) return;
      op = queue_.pop();
    }
    const int64_t res = execute(op);
    bool wake;
    {
      std::lock_guard lk(mu_);
      done_.push(Completion{op.user_data, res});
      // Wake the caller only once its whole batch is there, not on every completion.
      wake = wait_for_ != 0 && done_.count >= wait_for_;
    }
    if (wake) done_cv_.notify_one();
  }
}

}  // namespace fastload::io
