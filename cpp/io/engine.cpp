// Backend selection: the one place that knows both backends, the environment
// switches and the fault wrapper. Everything returns -errno through *err; nothing
// here throws (allocation failures inside the backends are caught there).
#include "io/engine.hpp"

#include <cerrno>
#include <cstdlib>

#include "io/faults.hpp"
#include "io/pread_pool.hpp"
#include "io/uring.hpp"

namespace fastload::io {

namespace {

bool iequals(const std::string& a, const char* b) {
  size_t i = 0;
  for (; i < a.size() && b[i]; ++i) {
    char c = a[i];
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    if (c != b[i]) return false;
  }
  return i == a.size() && b[i] == '\0';
}

const char* env_value(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// io_uring with as many kernel workers as the pool would have threads, so blocking
// work (network-file-system opens and reads) keeps the same number of requests in flight.
std::unique_ptr<Engine> make_uring(const EngineOptions& options, int* err) {
  auto ring = UringEngine::create(options.depth, err);
  if (ring && options.threads > 0) (void)ring->set_max_workers(options.threads, options.threads);
  return ring;
}

}  // namespace

// Case-insensitive: FASTLOAD_ENGINE=PREAD is a plain typo-class difference, not an
// error worth failing a job for.
bool parse_kind(const std::string& text, Kind* kind) {
  if (iequals(text, "auto")) *kind = Kind::kAuto;
  else if (iequals(text, "uring") || iequals(text, "io_uring")) *kind = Kind::kUring;
  else if (iequals(text, "pread")) *kind = Kind::kPread;
  else return false;
  return true;
}

bool uring_available() {
  // A function-local static is initialised once, thread-safely; the answer cannot
  // change during the life of the process (seccomp filters are never relaxed).
  static const bool available = [] {
    int err = 0;
    return UringEngine::create(4, &err) != nullptr;
  }();
  return available;
}

std::unique_ptr<Engine> make_engine(const EngineOptions& options, int* err) {
  int dummy;
  if (!err) err = &dummy;
  Kind kind = options.kind;
  FaultSpec faults;
  bool inject = false;
  if (options.honour_env) {
    // A malformed variable is an error, not silently "auto": a test that asked for
    // faults or a backend must not pass by running something else.
    if (const char* e = env_value("FASTLOAD_ENGINE"); e && kind == Kind::kAuto) {
      if (!parse_kind(e, &kind)) {
        *err = -EINVAL;
        return nullptr;
      }
    }
    if (const char* f = env_value("FASTLOAD_FAULTS")) {
      if (!parse_fault_spec(f, &faults)) {
        *err = -EINVAL;
        return nullptr;
      }
      inject = true;
    }
  }

  std::unique_ptr<Engine> engine;
  switch (kind) {
    case Kind::kUring:
      engine = make_uring(options, err);
      break;
    case Kind::kPread:
      engine = PreadPool::create(options.depth, options.threads, err);
      break;
    case Kind::kAuto:
      // Any io_uring failure (ENOSYS, EPERM/EACCES from seccomp or
      // kernel.io_uring_disabled, ENOMEM from memlock accounting...) means the pool.
      if (uring_available()) engine = make_uring(options, err);
      if (!engine) engine = PreadPool::create(options.depth, options.threads, err);
      break;
  }
  if (!engine) return nullptr;  // *err set by the backend
  // The wrapper goes outermost, so faults hit the caller exactly as the backend's own
  // completions would, whichever backend was chosen.
  if (inject) engine = wrap_with_faults(std::move(engine), faults);
  *err = 0;
  return engine;
}

}  // namespace fastload::io
