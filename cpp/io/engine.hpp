// The I/O engine: one asynchronous interface, two backends.
//
// A caller (one thread: the engine is not thread-safe) pushes operations and reaps
// their completions. Every operation completes exactly once, with res >= 0 on success
// or -errno on failure; the engine never throws and never sets errno.
//
//   io_uring  (uring.cpp): raw syscalls over <linux/io_uring.h>, no liburing.
//   pread     (pread_pool.cpp): a pool of threads doing the blocking system calls.
//
// Which backend runs is decided in one place, resolve_kind() (issue 31): Python's
// staging, `fastload probe` and every native job ask it. FASTLOAD_FAULTS (see faults.hpp)
// wraps the chosen backend in a fault-injecting engine, for tests.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace fastload::io {

enum class OpCode : uint8_t {
  kNop,
  kOpenAt,  // dir_fd, path, flags, mode          -> res = new fd
  kClose,   // fd                                  -> res = 0
  kRead,    // fd, buf, len, offset (buf_index)    -> res = bytes read (may be short; 0 at EOF)
  kWrite,   // fd, buf, len, offset (buf_index)    -> res = bytes written (may be short)
  kStatx,   // dir_fd, path, flags, mask, statx_buf -> res = 0
  kFsync,   // fd                                  -> res = 0
};

struct Op {
  OpCode code = OpCode::kNop;
  int fd = -1;                       // kClose/kRead/kWrite/kFsync: the file
  int dir_fd = AT_FDCWD;             // kOpenAt/kStatx: relative paths resolve here
  const char* path = nullptr;        // kOpenAt/kStatx: must stay valid until completion
  void* buf = nullptr;               // kRead/kWrite: must stay valid until completion
  uint32_t len = 0;
  uint64_t offset = 0;
  int flags = 0;                     // open(2) flags, or statx(2) AT_* flags
  uint32_t mode = 0;                 // open(2) mode, or statx(2) mask
  struct statx* statx_buf = nullptr; // kStatx: must stay valid until completion
  int buf_index = -1;                // kRead/kWrite: registered buffer, or -1 for none
  uint64_t user_data = 0;            // returned untouched in the completion
};

struct Completion {
  uint64_t user_data;
  int64_t res;  // >= 0, or -errno
};

class Engine {
 public:
  virtual ~Engine() = default;

  // Queues an operation. It is handed to the kernel (or the pool) no later than the
  // next reap(). Returns 0, or -EBUSY when capacity() operations are already pushed
  // and not yet reaped: the caller must reap first.
  virtual int push(const Op& op) = 0;

  // Submits what was pushed, then waits until at least min_complete completions are
  // ready (0: do not wait) or timeout_ms passes (-1: no limit). Copies at most max
  // completions to out and returns how many, or -errno (-ETIME is never returned:
  // a timeout returns whatever is ready, possibly 0).
  virtual int reap(Completion* out, unsigned max, unsigned min_complete, int timeout_ms) = 0;

  // Operations pushed and not yet reaped.
  virtual unsigned in_flight() const = 0;

  // The most operations that may be in flight at once.
  virtual unsigned capacity() const = 0;

  // Registers buffers for fixed-buffer reads and writes (Op::buf_index indexes this
  // list; Op::buf must still point inside the registered buffer). Returns 0, or
  // -errno when the backend cannot (then the caller passes buf_index = -1). May be
  // called once, before any operation is pushed.
  virtual int register_buffers(std::span<const iovec> buffers) {
    (void)buffers;
    return -95;  // EOPNOTSUPP
  }

  // Runs op on the calling thread with blocking system calls, outside the queue, and
  // returns its result (>= 0 or -errno; the pool's semantics, PreadPool::execute). For
  // operations cheaper done at once than handed to the kernel's workers or the pool: a
  // node-local destination's creates, buffered writes and closes (the copier). A
  // wrapping engine (faults) sees these operations too.
  virtual int64_t run_now(const Op& op) noexcept;

  // "uring" or "pread" (a fault-injecting wrapper reports the backend it wraps).
  virtual const char* name() const = 0;
};

enum class Kind { kAuto, kUring, kPread };

struct EngineOptions {
  Kind kind = Kind::kAuto;
  // A path whose file system the kAuto rule looks at (the source of a tree copy, the
  // destination of an extraction); empty: none.
  std::string where;
  unsigned depth = 64;    // operations in flight (ring size, or queue bound of the pool)
  unsigned threads = 16;  // pread backend: worker threads
  bool honour_env = true; // read FASTLOAD_ENGINE and FASTLOAD_FAULTS
};

// Builds an engine. On failure returns nullptr and stores -errno in *err (for kUring,
// the io_uring_setup error; kAuto only fails if the pool cannot start).
std::unique_ptr<Engine> make_engine(const EngineOptions& options, int* err);

// Parses "auto" | "uring" | "io_uring" | "pread". Returns false on anything else.
bool parse_kind(const std::string& text, Kind* kind);

// "auto", "uring" or "pread".
const char* kind_name(Kind kind);

// The one rule that turns a requested kind into the backend a job runs:
//   - an explicit kUring or kPread is kept;
//   - kAuto takes FASTLOAD_ENGINE when set (honour_env), else
//   - kPread when `where` is on a network or FUSE file system (io_uring punts every open
//     and uncached read there to its kernel workers anyway; the pool keeps as many
//     requests in flight for less CPU: RESULTS.md, issue 24),
//   - kPread when io_uring cannot be set up here,
//   - else kUring.
// Returns 0 with *out set (never kAuto), or -EINVAL when FASTLOAD_ENGINE is malformed.
int resolve_kind(Kind requested, const std::string& where, bool honour_env, Kind* out);

// True when io_uring_setup works here (cached after the first call).
bool uring_available();

}  // namespace fastload::io
