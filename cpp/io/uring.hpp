// The io_uring backend, over raw system calls and <linux/io_uring.h> (no liburing).
//
// Layers, bottom up: sys.hpp wraps io_uring_setup/enter/register; Ring (below) owns the
// ring descriptor and the three shared mappings (SQ ring, CQ ring, SQE array) and knows
// the head/tail protocol; UringEngine maps Engine operations onto SQEs.
//
// Sizing: the SQ has at least capacity() entries and the CQ twice as many (the kernel's
// default), and push() refuses a capacity()+1-th un-reaped operation, so the CQ can
// never overflow and an SQE slot is never reused before the kernel has consumed it.
#pragma once

#include <linux/io_uring.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "io/engine.hpp"

namespace fastload::io {

// Owns one io_uring instance: the descriptor and its mappings. Move-only; the
// destructor unmaps and closes. Does no waiting of its own.
class Ring {
 public:
  Ring() = default;
  ~Ring();
  Ring(Ring&& o) noexcept;
  Ring& operator=(Ring&& o) noexcept;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Creates a ring with at least `entries` SQ entries (clamped to the kernel maximum).
  // Tries the cheapest task-running mode first and falls back when the kernel refuses
  // a setup flag. Returns 0 or -errno (io_uring_setup's, or mmap's).
  // `legacy`: only the flags a 5.10 kernel knows, and IORING_FEAT_EXT_ARG masked off.
  int init(unsigned entries, bool legacy = false);

  int fd() const noexcept { return fd_; }
  unsigned sq_entries() const noexcept { return sq_entries_; }
  unsigned features() const noexcept { return features_; }
  unsigned setup_flags() const noexcept { return setup_flags_; }

  // Next free SQE. The caller guarantees (by counting in-flight operations) that it
  // has been consumed by the kernel; no SQPOLL thread exists, so the kernel reads SQEs
  // only inside our own io_uring_enter and the slot is free once that call returned.
  io_uring_sqe* next_sqe() noexcept { return &sqes_[sqe_tail_++ & sq_mask_]; }

  // Publishes every SQE written since the last call (a release store of the SQ tail,
  // so the kernel's acquire load of the tail sees their contents). Returns how many
  // SQEs are published and not yet consumed by the kernel.
  unsigned flush_sq() noexcept;

  // SQEs taken from next_sqe() that the kernel has not consumed (published or not).
  unsigned sq_unconsumed() const noexcept;

  // Completions ready in the CQ (acquire load of the tail: CQE contents written by the
  // kernel before its release store of the tail are visible afterwards).
  unsigned cq_ready() const noexcept;
  // The i-th ready CQE; valid until cq_advance() is called past it.
  const io_uring_cqe& cqe(unsigned i) const noexcept;
  // Hands n CQE slots back to the kernel (release store of the CQ head, so our reads of
  // those CQEs happen before the kernel may overwrite them).
  void cq_advance(unsigned n) noexcept;

  // True when the kernel asks us to enter it to run deferred completion work
  // (IORING_SQ_TASKRUN) or to flush an overflowed CQ.
  bool needs_enter() const noexcept;

 private:
  void release() noexcept;

  int fd_ = -1;
  unsigned features_ = 0;
  unsigned setup_flags_ = 0;

  // Mappings; cq_map_ == sq_map_ with IORING_FEAT_SINGLE_MMAP.
  void* sq_map_ = nullptr;
  size_t sq_map_len_ = 0;
  void* cq_map_ = nullptr;
  size_t cq_map_len_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  size_t sqes_len_ = 0;

  // Pointers into the SQ ring.
  unsigned* sq_khead_ = nullptr;
  unsigned* sq_ktail_ = nullptr;
  unsigned* sq_kflags_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned sq_entries_ = 0;
  // Local SQ tail: SQEs handed out by next_sqe(); *sq_ktail_ catches up in flush_sq().
  unsigned sqe_tail_ = 0;

  // Pointers into the CQ ring.
  unsigned* cq_khead_ = nullptr;
  unsigned* cq_ktail_ = nullptr;
  io_uring_cqe* cqes_ = nullptr;
  unsigned cq_mask_ = 0;
};

class UringEngine final : public Engine {
 public:
  // Sets up a ring for `depth` operations in flight and checks that the kernel knows
  // every opcode the Engine uses (IORING_REGISTER_PROBE, 5.6+). Returns nullptr and
  // -errno in *err when io_uring_setup fails (ENOSYS, EPERM under seccomp, ENOMEM...),
  // or -EINVAL for depth 0, or -EOPNOTSUPP when an opcode is missing.
  static std::unique_ptr<UringEngine> create(unsigned depth, int* err);

  // For tests: behave as on a 5.10 kernel, with no optional setup flags (no
  // COOP_TASKRUN, SUBMIT_ALL) and IORING_FEAT_EXT_ARG ignored, so timed waits take the
  // polling path. Same contract as create().
  static std::unique_ptr<UringEngine> create_legacy(unsigned depth, int* err);

  // Operations pushed but never handed to the kernel are dropped; the ones the kernel
  // owns are waited for, because it may still write into the caller's buffers.
  ~UringEngine() override;

  int push(const Op& op) override;
  int reap(Completion* out, unsigned max, unsigned min_complete, int timeout_ms) override;
  unsigned in_flight() const override { return in_flight_; }
  unsigned capacity() const override { return capacity_; }
  int register_buffers(std::span<const iovec> buffers) override;
  const char* name() const override { return "uring"; }

  // Caps the kernel's io-wq worker threads for this ring (5.15+), which run the
  // operations that cannot complete inline: opens, and reads of files whose data is not
  // cached. Reads of regular files count as "bounded" work, by default capped at
  // 4 x CPUs, so on a 2-core node only 8 network reads would be in flight. Returns 0 or
  // -errno (older kernels: -EINVAL; the caller then keeps the default).
  int set_max_workers(unsigned bounded, unsigned unbounded);

  // For tests and diagnostics.
  const Ring& ring() const noexcept { return ring_; }

 private:
  UringEngine(Ring ring, unsigned capacity) : ring_(std::move(ring)), capacity_(capacity) {}
  static std::unique_ptr<UringEngine> create(unsigned depth, int* err, bool legacy);

  // One io_uring_enter: submits what is published, waits for `wait_nr` completions up
  // to timeout_ms (-1: none). Returns 0 or -errno; -ETIME and -EINTR mean "go on".
  int enter(unsigned to_submit, unsigned wait_nr, int timeout_ms) noexcept;
  unsigned copy_out(Completion* out, unsigned max) noexcept;

  Ring ring_;
  const unsigned capacity_;
  unsigned in_flight_ = 0;
  bool buffers_registered_ = false;
};

}  // namespace fastload::io
