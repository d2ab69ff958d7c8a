// The fallback backend: a fixed pool of threads running the blocking system calls.
//
// Used where io_uring is missing or refused (old kernels, seccomp profiles in
// containers). It keeps the Engine contract exactly: push() never blocks, every
// operation completes once with a result or -errno, and at most capacity() operations
// are pushed and not yet reaped, so both internal queues are fixed rings sized at
// construction and the hot path never allocates.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "io/engine.hpp"

namespace fastload::io {

class PreadPool final : public Engine {
 public:
  // Starts `threads` workers (clamped to [1, depth]). Returns nullptr and -errno in
  // *err when depth is 0 (-EINVAL) or a thread cannot be started (-EAGAIN, ...).
  static std::unique_ptr<PreadPool> create(unsigned depth, unsigned threads, int* err);

  // Operations not yet picked up by a worker are dropped without completing; the ones
  // already running are waited for, so no worker touches a caller buffer afterwards.
  ~PreadPool() override;

  PreadPool(const PreadPool&) = delete;
  PreadPool& operator=(const PreadPool&) = delete;

  int push(const Op& op) override;
  int reap(Completion* out, unsigned max, unsigned min_complete, int timeout_ms) override;
  unsigned in_flight() const override { return in_flight_; }
  unsigned capacity() const override { return depth_; }
  const char* name() const override { return "pread"; }

  // Runs one operation with blocking system calls and returns its result or -errno:
  // what a worker does. Public for callers that want a synchronous path with exactly
  // the pool's semantics (UINT64_MAX offset = file position, close never -EINTR).
  static int64_t execute(const Op& op) noexcept;

 private:
  explicit PreadPool(unsigned depth);
  void worker_loop() noexcept;
  void stop_workers() noexcept;

  // A fixed-size FIFO; the caller guarantees it never holds more than its size.
  template <typename T>
  struct Fifo {
    std::vector<T> slots;
    size_t head = 0;  // next to pop
    size_t count = 0;
    void push(const T& v) { slots[(head + count++) % slots.size()] = v; }
    T pop() {
      T v = slots[head];
      head = (head + 1) % slots.size();
      --count;
      return v;
    }
  };

  const unsigned depth_;
  // Touched only by the caller's thread (push/reap): no lock needed.
  unsigned in_flight_ = 0;

  // mu_ guards everything below it.
  std::mutex mu_;
  std::condition_variable work_cv_;  // workers: queue_ non-empty or stopping_
  std::condition_variable done_cv_;  // caller: done_ reached wait_for_
  Fifo<Op> queue_;
  Fifo<Completion> done_;
  size_t wait_for_ = 0;  // completions the caller is blocked on; 0 when not waiting
  bool stopping_ = false;

  std::vector<std::thread> workers_;
};

}  // namespace fastload::io
