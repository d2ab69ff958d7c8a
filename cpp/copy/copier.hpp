// The copier: many files in flight, big files in stripes, digests on the way.
//
// Several submitters (CopyOptions::submitters, by default one per core up to 8), each a
// thread driving an io::Engine of its own (a ring per thread, or a pool per thread),
// take files from the one task list in turn; the metadata work of a file (its opens,
// ftruncate, fchmod, futimens, closes and the rename) is done by the submitter that
// copies it, so no single thread carries it all. On a local destination its create, the
// write of a small file and its closes are done at once on the submitter (Engine::run_now):
// handing them to io_uring's workers or the pool cost more CPU than the work itself
// (RESULTS.md, issue 33: CPU per file); the source's opens and reads stay on the engine,
// where its latency is hidden. Each admitted file goes through
//   open src (+ open a hidden temporary in the destination) -> stripes of
//   read -> digest -> write at the same offset -> fchmod/futimens -> close -> rename
// and up to `files_in_flight` files advance at once, so on network storage the
// per-file round trips overlap. A file larger than the small-buffer size is split into
// stripes read in parallel (up to `big_buffers` stripes in flight across all files), so
// one large file on a striped file system is read at a high queue depth.
//
// A file appears at its final path only after every byte was written and its
// metadata set: on a local destination with O_TMPFILE, the anonymous temporary is linked
// there (linkat); else, or where an older copy holds the name, a named temporary is
// renamed over it. The last read of each file asks for one byte
// more than expected, so a file that grew is noticed without an extra round trip.
//
// With write == false the job only reads and digests (verify()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/cancel.hpp"
#include "common/error.hpp"
#include "io/engine.hpp"

namespace fastload::copy {

struct FileTask {
  std::string src;  // relative to the source root
  std::string dst;  // relative to the destination root (unused when !write)
  uint64_t size = 0;
  uint64_t blocks = 0;  // 512-byte blocks allocated in the source (sparse hint)
  uint32_t mode = 0644;
  int64_t mtime_ns = 0;
  // Size, blocks, mode and time not known yet (a listing of names alone): the job learns
  // them from fstat(2) of the opened source (on a network file system, from the open's
  // own reply: no round trip), before it creates the temporary. CopyJob::task_meta
  // tells them once the file is done.
  bool stat_at_open = false;
};

struct CopyOptions {
  io::EngineOptions engine;
  uint64_t stripe_size = 4u << 20;  // also the digest chunk size
  uint64_t small_size = 256u << 10; // files below this use one small buffer
  unsigned files_in_flight = 64;
  unsigned big_buffers = 16;
  // Threads each driving an engine of their own over a share of the files (0: from the
  // core count, default_submitters()).
  unsigned submitters = 0;
  // Whether the source is on a network or FUSE file system (1 or 0), and whether on
  // FUSE, where the caller knows it: else (-1) the job asks statfs(2), a round trip
  // there for every job.
  int src_network = -1;
  int src_fuse = -1;
  bool write = true;
  // The job's threads (its submitters, and the engine's threads they start) run at
  // nice 19, the lowest priority of ordinary threads: a stage in the background's own
  // order, beside a training loop, takes little CPU a thread of the loop wants, and a
  // thread of the loop that wakes preempts them. (Not SCHED_IDLE: that gets nothing at
  // all while any other thread of the node runs, so the stage would stall behind, say,
  // a compile, or the loop's own decoding workers.)
  bool lowest_priority = false;
};

struct FileDone {
  uint32_t index;                // into the task list
  std::vector<uint64_t> digests; // one per stripe_size chunk (one for an empty file)
};

// Kinds of operation whose busy time a job counts: reads, writes, metadata (open, close).
inline constexpr int kBusyKinds = 3;

// Submitters of a job whose options leave them at 0: one per core, at most 8.
unsigned default_submitters();

// Name of the hidden temporary a file is written to before it is renamed into place.
std::string temp_name(const std::string& rel_path);

class CopyJob {
 public:
  CopyJob(std::string src_root, std::string dst_root, std::vector<FileTask> tasks,
          CopyOptions options);
  ~CopyJob();
  CopyJob(const CopyJob&) = delete;
  CopyJob& operator=(const CopyJob&) = delete;

  // Runs on a background thread. Returns once the engine exists (or failed to start,
  // in which case the error is thrown by wait()/rethrow()).
  void start();
  // Waits up to timeout_ms; true once the job has finished (successfully or not). With
  // any_done, returns as well as soon as a finished file waits for take_done() (a
  // reader waiting for that file need not wait out the timeout).
  bool wait(int timeout_ms, bool any_done = false);
  // Asks the job to stop; it finishes the operations in flight and removes temporaries.
  void cancel() { cancel_.cancel(); }
  // Throws the job's error, if it failed.
  void rethrow() const;
  // Runs the whole job on the calling thread (tests, and start()'s thread).
  void run();

  std::vector<FileDone> take_done();
  uint64_t bytes_done() const { return bytes_done_.load(std::memory_order_relaxed); }
  uint64_t files_done() const { return files_done_.load(std::memory_order_relaxed); }
  uint64_t bytes_total() const { return bytes_total_.load(std::memory_order_relaxed); }
  // A task's size, blocks, mode and mtime: as given, or (stat_at_open) as its source was
  // found when opened. Read a task's once take_done() has returned it.
  const FileTask& task(size_t i) const { return tasks_.at(i); }
  uint64_t files_total() const { return tasks_.size(); }
  std::string engine_name() const;
  // Seconds during which at least one operation of kind k (0 reads, 1 writes, 2 opens
  // and closes) was in flight, summed over the submitters: where a copy waits.
  double busy_seconds(int k) const {
    return double(busy_ns_[k].load(std::memory_order_relaxed)) * 1e-9;
  }
  // Submitters the job runs (known once started).
  unsigned submitters() const {
    std::lock_guard lk(mu_);
    return submitters_;
  }

 private:
  friend class Runner;
  std::string src_root_;
  std::string dst_root_;
  std::vector<FileTask> tasks_;
  CopyOptions opt_;
  std::atomic<uint64_t> bytes_total_{0};  // grows as stat_at_open tasks are opened
  CancelToken cancel_;
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<uint64_t> files_done_{0};
  std::atomic<size_t> next_task_{0};  // the next task a submitter claims
  std::atomic<bool> halt_{false};     // a submitter failed: the others stop
  std::atomic<uint64_t> busy_ns_[kBusyKinds] = {};
  unsigned submitters_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool started_ = false;
  bool finished_ = false;
  std::string engine_name_;
  std::optional<Error> error_;
  std::vector<FileDone> done_;
  unsigned done_waiters_ = 0;  // wait(any_done) calls waiting: a finished file wakes them
  std::thread thread_;
};

}  // namespace fastload::copy
