#include "io/faults.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace fastload::io {

namespace {

constexpr uint32_t bit(OpCode c) { return 1u << static_cast<unsigned>(c); }
constexpr uint32_t kDefaultOps = bit(OpCode::kRead) | bit(OpCode::kWrite);

// splitmix64 (Steele, Lea, Flood 2014): tiny, fast and fully determined by the seed,
// which is all fault injection needs; statistical quality is more than enough.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() noexcept {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1), from the top 53 bits.
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

// Wraps another engine. Decisions are made at push() time, one PRNG draw per eligible
// operation, so the fault sequence depends only on the seed and the order of pushes,
// never on completion timing or the backend.
class FaultEngine final : public Engine {
 public:
  FaultEngine(std::unique_ptr<Engine> inner, const FaultSpec& spec)
      : inner_(std::move(inner)), spec_(spec), rng_(spec.seed) {
    fake_.resize(inner_->capacity());
  }

  int push(const Op& op) override {
    // Synthetic completions count against capacity too: the caller's bound on
    // outstanding operations must hold whichever way an operation completes.
    if (in_flight() >= capacity()) return -EBUSY;
    Op fwd = op;
    if (int64_t r = decide(op, &fwd); r < 0) return fake(op.user_data, r);
    return inner_->push(fwd);
  }

  int64_t run_now(const Op& op) noexcept override {
    Op fwd = op;
    if (int64_t r = decide(op, &fwd); r < 0) return r;
    return inner_->run_now(fwd);
  }

  // Synthetic completions are handed out first: they are ready by construction, so the
  // caller never waits on the inner engine for something it could already have.
  int reap(Completion* out, unsigned max, unsigned min_complete, int timeout_ms) override {
    unsigned n = 0;
    while (n < max && fake_count_ > 0) {
      out[n++] = fake_[fake_head_];
      fake_head_ = (fake_head_ + 1) % fake_.size();
      --fake_count_;
    }
    // Always call through, even when the synthetic ones filled `out`: the inner engine
    // must still submit what was pushed (the push() contract), just without waiting.
    const unsigned inner_min = min_complete > n ? min_complete - n : 0;
    const int r = inner_->reap(out + n, max - n, inner_min, inner_min ? timeout_ms : 0);
    // Completions already moved to `out` must not be lost behind an inner error; the
    // error will come again on the next reap if it persists.
    if (r < 0) return n > 0 ? static_cast<int>(n) : r;
    return static_cast<int>(n) + r;
  }

  unsigned in_flight() const override { return inner_->in_flight() + fake_count_; }
  unsigned capacity() const override { return inner_->capacity(); }
  int register_buffers(std::span<const iovec> buffers) override {
    return inner_->register_buffers(buffers);
  }
  const char* name() const override { return inner_->name(); }

 private:
  // The fate of an operation: -EIO or -EINTR (not run), else 0 with *fwd the operation
  // to run (its length halved for a short read or write).
  int64_t decide(const Op& op, Op* fwd) {
    if (!(spec_.ops_mask & bit(op.code)) || seen_++ < spec_.after) return 0;
    const double u = rng_.uniform();
    if (u < spec_.eio) return -EIO;
    if (u < spec_.eio + spec_.eintr) return -EINTR;
    const bool rw = op.code == OpCode::kRead || op.code == OpCode::kWrite;
    if (u < spec_.eio + spec_.eintr + spec_.short_io && rw && op.len > 1)
      fwd->len = op.len / 2;  // >= 1 since len > 1
    return 0;
  }

  int fake(uint64_t user_data, int64_t res) {
    // Fits: fake_count_ <= in_flight() < capacity() == fake_.size().
    fake_[(fake_head_ + fake_count_) % fake_.size()] = Completion{user_data, res};
    ++fake_count_;
    return 0;
  }

  std::unique_ptr<Engine> inner_;
  FaultSpec spec_;
  SplitMix64 rng_;
  uint64_t seen_ = 0;  // eligible operations pushed so far
  std::vector<Completion> fake_;  // FIFO ring of synthetic completions
  size_t fake_head_ = 0;
  unsigned fake_count_ = 0;
};

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool parse_probability(std::string_view v, double* out) {
  std::string s(v);
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double d = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(d) || d < 0.0 || d > 1.0)
    return false;
  *out = d;
  return true;
}

bool parse_u64(std::string_view v, uint64_t* out) {
  std::string s(v);
  // strtoull accepts a sign and wraps negatives around; allow digits only up front.
  if (s.empty() || s[0] < '0' || s[0] > '9') return false;
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(s.c_str(), &end, 0);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = x;
  return true;
}

bool parse_ops(std::string_view v, uint32_t* mask) {
  uint32_t m = 0;
  while (true) {
    const size_t plus = v.find('+');
    const std::string_view name = trim(v.substr(0, plus));
    if (name == "read") m |= bit(OpCode::kRead);
    else if (name == "write") m |= bit(OpCode::kWrite);
    else if (name == "open") m |= bit(OpCode::kOpenAt);
    else if (name == "close") m |= bit(OpCode::kClose);
    else if (name == "statx") m |= bit(OpCode::kStatx);
    else if (name == "fsync") m |= bit(OpCode::kFsync);
    else if (name == "all")
      m |= bit(OpCode::kRead) | bit(OpCode::kWrite) | bit(OpCode::kOpenAt) |
           bit(OpCode::kClose) | bit(OpCode::kStatx) | bit(OpCode::kFsync);
    else return false;
    if (plus == std::string_view::npos) break;
    v.remove_prefix(plus + 1);
  }
  *mask = m;
  return true;
}

}  // namespace

// Grammar: items separated by ',', each `key=value`; blanks around either are ignored.
// Later items override earlier ones. Every key is optional; an empty spec injects
// nothing (ops still defaults to read+write).
bool parse_fault_spec(const std::string& text, FaultSpec* spec) {
  FaultSpec s;
  s.ops_mask = kDefaultOps;
  std::string_view rest = text;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    if (item.empty()) continue;  // tolerate "a=1,,b=2" and a trailing comma
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) return false;
    const std::string_view key = trim(item.substr(0, eq));
    const std::string_view value = trim(item.substr(eq + 1));
    bool ok;
    if (key == "eio") ok = parse_probability(value, &s.eio);
    else if (key == "eintr") ok = parse_probability(value, &s.eintr);
    else if (key == "short") ok = parse_probability(value, &s.short_io);
    else if (key == "seed") ok = parse_u64(value, &s.seed);
    else if (key == "after") ok = parse_u64(value, &s.after);
    else if (key == "ops") ok = parse_ops(value, &s.ops_mask);
    else ok = false;
    if (!ok) return false;
  }
  // One draw decides between the kinds, so their shares must fit in [0, 1].
  if (s.eio + s.eintr + s.short_io > 1.0 + 1e-9) return false;
  *spec = s;
  return true;
}

std::unique_ptr<Engine> wrap_with_faults(std::unique_ptr<Engine> inner, const FaultSpec& spec) {
  if (!inner) return nullptr;
  return std::make_unique<FaultEngine>(std::move(inner), spec);
}

}  // namespace fastload::io
