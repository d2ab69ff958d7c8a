// Backend selection: the one place that knows both backends, the environment
// switches and the fault wrapper. Everything returns -errno through *err; nothing
// here throws (allocation failures inside the backends are caught there).
#include "io/engine.hpp"

#include <cerrno>
#include <cstdlib>

#include "io/faults.hpp"
#include "io/fs.hpp"
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

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kUring: return "uring";
    case Kind::kPread: return "pread";
    case Kind::kAuto: break;
  }
  return "auto";
}

int64_t Engine::run_now(const Op& op) noexcept { return PreadPool::execute(op); }

int resolve_kind(Kind requested, const std::string& where, bool honour_env, Kind* out) {
  Kind kind = requested;
  // A malformed variable is an error, not silently "auto": a test that asked for a
  // backend must not pass by running something else.
  if (const char* e = env_value("FASTLOAD_ENGINE"); honour_env && e && kind == Kind::kAuto)
    if (!parse_kind(e, &kind)) return -EINVAL;
  if (kind == Kind::kAuto && !where.empty()) {
    uint32_t magic = 0;
    const FsKind* fs = fs_magic(where, &magic) == 0 ? find_fs(magic) : nullptr;
    if (fs && fs->network) kind = Kind::kPread;
  }
  if (kind == Kind::kAuto) kind = uring_available() ? Kind::kUring : Kind::kPread;
  *out = kind;
  return 0;
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
  Kind kind = Kind::kAuto;
  if (int r = resolve_kind(options.kind, options.where, options.honour_env, &kind); r != 0) {
    *err = r;
    return nullptr;
  }
  // Only a choice the rule made may fall back: an io_uring that was asked for and fails
  // to start is an error, one the rule picked becomes the pool.
  const bool may_fall_back = options.kind == Kind::kAuto;
  FaultSpec faults;
  bool inject = false;
  if (options.honour_env) {
    if (const char* f = env_value("FASTLOAD_FAULTS")) {
      if (!parse_fault_spec(f, &faults)) {
        *err = -EINVAL;
        return nullptr;
      }
      inject = true;
    }
  }

  std::unique_ptr<Engine> engine;
  if (kind == Kind::kUring) engine = make_uring(options, err);
  // Any io_uring failure of a ring the rule chose (ENOMEM from memlock accounting when
  // many rings are up, ...) means the pool.
  if (!engine && (kind == Kind::kPread || may_fall_back))
    engine = PreadPool::create(options.depth, options.threads, err);
  if (!engine) return nullptr;  // *err set by the backend
  // The wrapper goes outermost, so faults hit the caller exactly as the backend's own
  // completions would, whichever backend was chosen.
  if (inject) engine = wrap_with_faults(std::move(engine), faults);
  *err = 0;
  return engine;
}

}  // namespace fastload::io
