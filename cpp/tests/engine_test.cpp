// The I/O engine: one conformance suite run against both backends (the pread pool
// always, io_uring when the kernel allows it), then make_engine()'s choices and the
// environment, then the fault-injecting wrapper.
//
// Exits 77 (skipped) when io_uring is unavailable and everything else passed, so a
// kernel or seccomp profile without io_uring shows up as a skip, not a green run that
// never touched the ring.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/engine.hpp"
#include "io/faults.hpp"
#include "io/pread_pool.hpp"
#include "io/residency.hpp"
#include "io/uring.hpp"
#include "tests/check.hpp"

namespace {

using namespace fastload::io;
using Clock = std::chrono::steady_clock;
using Factory = std::function<std::unique_ptr<Engine>(unsigned depth)>;

constexpr size_t kFileSize = 1 << 20;  // 1 MiB: many chunks, quick on any disk

uint8_t pattern(size_t i) { return static_cast<uint8_t>((i * 131) ^ (i >> 9)); }

// Pushes every op (their user_data must be their index), reaping whenever the engine
// is full, and returns each result by index. Fails the test if the engine ever holds
// more than capacity(), loses an operation, or completes one twice.
std::vector<int64_t> run_ops(Engine& e, const std::vector<Op>& ops) {
  std::vector<int64_t> res(ops.size(), INT64_MIN);
  std::vector<Completion> cqes(e.capacity());
  size_t next = 0, done = 0;
  const auto give_up = Clock::now() + std::chrono::seconds(30);
  while (done < ops.size()) {
    while (next < ops.size()) {
      int r = e.push(ops[next]);
      if (r == -EBUSY) break;
      CHECK_EQ(r, 0);
      if (r != 0) return res;
      ++next;
    }
    CHECK(e.in_flight() <= e.capacity());
    int n = e.reap(cqes.data(), static_cast<unsigned>(cqes.size()), 1, 1000);
    CHECK(n >= 0);
    if (n < 0) return res;
    for (int i = 0; i < n; ++i) {
      const uint64_t id = cqes[i].user_data;
      CHECK(id < ops.size());
      if (id >= ops.size()) continue;
      CHECK_EQ(res[id], INT64_MIN);  // exactly once
      res[id] = cqes[i].res;
      ++done;
    }
    if (Clock::now() > give_up) {
      CHECK(!"run_ops: operations did not complete in 30 s");
      break;
    }
  }
  CHECK_EQ(e.in_flight(), 0u);
  return res;
}

int64_t run_one(Engine& e, const Op& op) {
  Op o = op;
  o.user_data = 0;
  return run_ops(e, {o})[0];
}

Op open_op(int dir_fd, const char* path, int flags, unsigned mode = 0) {
  Op o;
  o.code = OpCode::kOpenAt;
  o.dir_fd = dir_fd;
  o.path = path;
  o.flags = flags;
  o.mode = mode;
  return o;
}

Op rw_op(OpCode code, int fd, void* buf, uint32_t len, uint64_t off, uint64_t id = 0) {
  Op o;
  o.code = code;
  o.fd = fd;
  o.buf = buf;
  o.len = len;
  o.offset = off;
  o.user_data = id;
  return o;
}

Op fd_op(OpCode code, int fd) {
  Op o;
  o.code = code;
  o.fd = fd;
  return o;
}

// ---------------------------------------------------------------------------------
// Conformance: the same expectations for every backend.

// Writes the data file with many writes in flight (resubmitting short ones), fsyncs,
// closes, and checks its size through the engine's statx.
void write_file(Engine& e, int dir_fd, const char* name, const std::vector<uint8_t>& data) {
  const int fd = static_cast<int>(
      run_one(e, open_op(dir_fd, name, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644)));
  CHECK(fd >= 0);
  if (fd < 0) return;
  constexpr uint32_t kChunk = 16 << 10;
  // Loop until every byte is written: a backend may complete a write short.
  std::vector<std::pair<uint64_t, uint32_t>> todo;
  for (uint64_t off = 0; off < data.size(); off += kChunk)
    todo.emplace_back(off, static_cast<uint32_t>(std::min<size_t>(kChunk, data.size() - off)));
  for (int round = 0; !todo.empty() && round < 64; ++round) {
    std::vector<Op> ops;
    for (size_t i = 0; i < todo.size(); ++i)
      ops.push_back(rw_op(OpCode::kWrite, fd, const_cast<uint8_t*>(data.data()) + todo[i].first,
                          todo[i].second, todo[i].first, i));
    auto res = run_ops(e, ops);
    std::vector<std::pair<uint64_t, uint32_t>> left;
    for (size_t i = 0; i < todo.size(); ++i) {
      CHECK(res[i] > 0);
      if (res[i] <= 0) return;
      if (res[i] < todo[i].second)
        left.emplace_back(todo[i].first + res[i], todo[i].second - static_cast<uint32_t>(res[i]));
    }
    todo.swap(left);
  }
  CHECK(todo.empty());
  CHECK_EQ(run_one(e, fd_op(OpCode::kFsync, fd)), 0);
  CHECK_EQ(run_one(e, fd_op(OpCode::kClose, fd)), 0);

  struct statx stx;
  std::memset(&stx, 0, sizeof stx);
  Op st;
  st.code = OpCode::kStatx;
  st.dir_fd = dir_fd;
  st.path = name;
  st.mode = STATX_SIZE;
  st.statx_buf = &stx;
  CHECK_EQ(run_one(e, st), 0);
  CHECK(stx.stx_mask & STATX_SIZE);
  CHECK_EQ(stx.stx_size, static_cast<uint64_t>(data.size()));
}

// Reads the whole file back in uneven chunks, all in flight together up to capacity,
// then the bytes at and past EOF.
void read_back(Engine& e, int dir_fd, const char* name, const std::vector<uint8_t>& data) {
  const int fd = static_cast<int>(run_one(e, open_op(dir_fd, name, O_RDONLY | O_CLOEXEC)));
  CHECK(fd >= 0);
  if (fd < 0) return;
  std::vector<uint8_t> got(data.size(), 0);
  std::vector<std::pair<uint64_t, uint32_t>> todo;
  uint32_t chunk = 1000;
  for (uint64_t off = 0; off < data.size(); off += chunk) {
    chunk = 1000 + static_cast<uint32_t>((off * 7919) % 20000);  // uneven, unaligned
    todo.emplace_back(off, static_cast<uint32_t>(std::min<size_t>(chunk, data.size() - off)));
  }
  for (int round = 0; !todo.empty() && round < 64; ++round) {
    std::vector<Op> ops;
    for (size_t i = 0; i < todo.size(); ++i)
      ops.push_back(rw_op(OpCode::kRead, fd, got.data() + todo[i].first, todo[i].second,
                          todo[i].first, i));
    auto res = run_ops(e, ops);
    std::vector<std::pair<uint64_t, uint32_t>> left;
    for (size_t i = 0; i < todo.size(); ++i) {
      CHECK(res[i] > 0);
      if (res[i] <= 0) return;
      if (res[i] < todo[i].second)
        left.emplace_back(todo[i].first + res[i], todo[i].second - static_cast<uint32_t>(res[i]));
    }
    todo.swap(left);
  }
  CHECK(todo.empty());
  CHECK(got == data);

  // Short at EOF, then 0 at and past it.
  std::vector<uint8_t> tail(4096);
  CHECK_EQ(run_one(e, rw_op(OpCode::kRead, fd, tail.data(), 4096, data.size() - 100)), 100);
  CHECK(std::memcmp(tail.data(), data.data() + data.size() - 100, 100) == 0);
  CHECK_EQ(run_one(e, rw_op(OpCode::kRead, fd, tail.data(), 4096, data.size())), 0);
  CHECK_EQ(run_one(e, rw_op(OpCode::kRead, fd, tail.data(), 4096, data.size() + 12345)), 0);

  // A write to a read-only descriptor fails with EBADF.
  CHECK_EQ(run_one(e, rw_op(OpCode::kWrite, fd, tail.data(), 10, 0)), -EBADF);
  CHECK_EQ(run_one(e, fd_op(OpCode::kClose, fd)), 0);
}

void errors_are_negative_errno(Engine& e, int dir_fd) {
  CHECK_EQ(run_one(e, open_op(dir_fd, "no/such/file", O_RDONLY)), -ENOENT);
  CHECK_EQ(run_one(e, open_op(dir_fd, "data.bin", O_CREAT | O_EXCL | O_WRONLY, 0644)), -EEXIST);
  char buf[16];
  // A descriptor number far above anything open: EBADF from read, write, fsync, close.
  constexpr int kBad = 1 << 20;
  CHECK_EQ(run_one(e, rw_op(OpCode::kRead, kBad, buf, sizeof buf, 0)), -EBADF);
  CHECK_EQ(run_one(e, rw_op(OpCode::kWrite, kBad, buf, sizeof buf, 0)), -EBADF);
  CHECK_EQ(run_one(e, fd_op(OpCode::kFsync, kBad)), -EBADF);
  CHECK_EQ(run_one(e, fd_op(OpCode::kClose, kBad)), -EBADF);
  struct statx stx;
  Op st;
  st.code = OpCode::kStatx;
  st.dir_fd = dir_fd;
  st.path = "missing";
  st.mode = STATX_SIZE;
  st.statx_buf = &stx;
  CHECK_EQ(run_one(e, st), -ENOENT);
  // statx flags reach the kernel: AT_EMPTY_PATH stats dir_fd itself, and without it
  // the empty path is ENOENT.
  st.path = "";
  st.mode = STATX_TYPE;
  CHECK_EQ(run_one(e, st), -ENOENT);
  std::memset(&stx, 0, sizeof stx);
  st.flags = AT_EMPTY_PATH;
  CHECK_EQ(run_one(e, st), 0);
  CHECK(S_ISDIR(stx.stx_mode));
  CHECK_EQ(run_one(e, Op{}), 0);  // kNop
}

// push() refuses the capacity()+1-th un-reaped operation, reap() hands out at most
// `max`, and everything comes back exactly once.
void capacity_and_busy(const Factory& make) {
  auto e = make(8);
  CHECK(e != nullptr);
  if (!e) return;
  const unsigned cap = e->capacity();
  CHECK(cap >= 1 && cap <= 8);
  for (unsigned i = 0; i < cap; ++i) {
    Op nop;
    nop.user_data = 100 + i;
    CHECK_EQ(e->push(nop), 0);
  }
  CHECK_EQ(e->in_flight(), cap);
  CHECK_EQ(e->push(Op{}), -EBUSY);
  CHECK_EQ(e->in_flight(), cap);

  std::vector<Completion> out(cap);
  std::vector<int> seen(cap, 0);
  int n = e->reap(out.data(), 3, cap, 2000);  // waits for all, hands out 3
  CHECK_EQ(n, static_cast<int>(std::min(3u, cap)));
  unsigned got = 0;
  for (int i = 0; i < n; ++i) ++seen[out[i].user_data - 100], ++got;
  CHECK_EQ(e->in_flight(), cap - got);
  CHECK_EQ(e->push(Op{}), 0);  // room again
  // The extra nop has user_data 0; collect everything.
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (e->in_flight() > 0 && Clock::now() < give_up) {
    n = e->reap(out.data(), cap, 1, 1000);
    CHECK(n >= 0);
    for (int i = 0; i < n; ++i)
      if (out[i].user_data != 0) ++seen[out[i].user_data - 100];
  }
  for (unsigned i = 0; i < cap; ++i) CHECK_EQ(seen[i], 1);
  CHECK_EQ(e->in_flight(), 0u);
}

// A read from an empty pipe cannot complete: reap() must return 0 after its timeout
// (not before), and at once with timeout 0; writing into the pipe completes it. No bound
// here depends on how fast the machine is: "at once" is checked against a timeout of a
// minute (only a reap that waits for it fails), or as "returns at all" (timeout 0 with
// a read that never completes in flight: a reap that waited would hang, and ctest's
// TIMEOUT fails it).
void timeouts(const Factory& make) {
  auto e = make(4);
  CHECK(e != nullptr);
  if (!e) return;
  Completion out[4];
  auto t0 = Clock::now();
  CHECK_EQ(e->reap(out, 4, 1, 60'000), 0);  // nothing in flight: no waiting at all
  CHECK(Clock::now() - t0 < std::chrono::seconds(60));

  int p[2];
  CHECK_EQ(pipe2(p, O_CLOEXEC), 0);
  char buf[64];
  // Pipes cannot pread: UINT64_MAX asks for the file position on both backends.
  CHECK_EQ(e->push(rw_op(OpCode::kRead, p[0], buf, sizeof buf, UINT64_MAX, 7)), 0);
  CHECK_EQ(e->reap(out, 4, 1, 0), 0);  // returns, the read still in flight
  CHECK_EQ(e->in_flight(), 1u);
  t0 = Clock::now();
  CHECK_EQ(e->reap(out, 4, 1, 150), 0);
  const auto waited = Clock::now() - t0;
  CHECK(waited >= std::chrono::milliseconds(140));  // a lower bound: not early
  CHECK(waited < std::chrono::seconds(60));         // not without a limit
  CHECK_EQ(e->in_flight(), 1u);

  CHECK_EQ(write(p[1], "hello", 5), 5);
  int n = e->reap(out, 4, 1, 5000);
  CHECK_EQ(n, 1);
  if (n == 1) {
    CHECK_EQ(out[0].user_data, 7u);
    CHECK_EQ(out[0].res, 5);
    CHECK(std::memcmp(buf, "hello", 5) == 0);
  }
  if (e->in_flight() > 0) {
    // Unblock a stuck read before the engine waits for it in its destructor.
    close(p[1]);
    p[1] = -1;
    e->reap(out, 4, 1, 5000);
  }
  close(p[0]);
  if (p[1] >= 0) close(p[1]);
}

// Fixed buffers: io_uring registers and uses them; the pool declines with -EOPNOTSUPP.
void fixed_buffers(const Factory& make, int dir_fd, const std::vector<uint8_t>& data,
                   bool expect_support) {
  auto e = make(16);
  CHECK(e != nullptr);
  if (!e) return;
  constexpr size_t kLen = 64 << 10;
  void* mem = nullptr;
  CHECK_EQ(posix_memalign(&mem, 4096, kLen), 0);
  std::unique_ptr<void, decltype(&free)> hold(mem, &free);
  auto* bytes = static_cast<uint8_t*>(mem);
  std::memset(bytes, 0, kLen);
  iovec iov{mem, kLen};
  const int r = e->register_buffers({&iov, 1});
  if (!expect_support) {
    CHECK_EQ(r, -EOPNOTSUPP);
    return;
  }
  if (r == -ENOMEM) {
    std::fprintf(stderr, "note: register_buffers: ENOMEM (memlock limit), fixed I/O untested\n");
    return;
  }
  CHECK_EQ(r, 0);
  CHECK_EQ(e->register_buffers({&iov, 1}), -EBUSY);  // only once

  const int fd = static_cast<int>(run_one(*e, open_op(dir_fd, "data.bin", O_RDONLY)));
  CHECK(fd >= 0);
  if (fd < 0) return;
  // Sixteen 4 KiB fixed reads into different parts of the registered buffer.
  std::vector<Op> ops;
  for (uint32_t i = 0; i < 16; ++i) {
    Op o = rw_op(OpCode::kRead, fd, bytes + i * 4096, 4096, 8192 + i * 4096ull, i);
    o.buf_index = 0;
    ops.push_back(o);
  }
  auto res = run_ops(*e, ops);
  for (uint32_t i = 0; i < 16; ++i) CHECK_EQ(res[i], 4096);
  CHECK(std::memcmp(bytes, data.data() + 8192, 16 * 4096) == 0);
  // A buffer outside the registered range is refused by the kernel.
  char stray[16];
  Op bad = rw_op(OpCode::kRead, fd, stray, sizeof stray, 0);
  bad.buf_index = 0;
  CHECK_EQ(run_one(*e, bad), -EFAULT);
  CHECK_EQ(run_one(*e, fd_op(OpCode::kClose, fd)), 0);

  // A fixed write, read back with a plain read.
  const int wfd = static_cast<int>(
      run_one(*e, open_op(dir_fd, "fixed.bin", O_CREAT | O_TRUNC | O_RDWR, 0644)));
  CHECK(wfd >= 0);
  if (wfd < 0) return;
  Op w = rw_op(OpCode::kWrite, wfd, bytes, 4096, 0);
  w.buf_index = 0;
  CHECK_EQ(run_one(*e, w), 4096);
  std::vector<uint8_t> check(4096);
  CHECK_EQ(run_one(*e, rw_op(OpCode::kRead, wfd, check.data(), 4096, 0)), 4096);
  CHECK(std::memcmp(check.data(), bytes, 4096) == 0);
  CHECK_EQ(run_one(*e, fd_op(OpCode::kClose, wfd)), 0);
}

void conformance(const char* label, const Factory& make, int dir_fd,
                 const std::vector<uint8_t>& data, bool fixed_supported) {
  std::fprintf(stderr, "== conformance: %s\n", label);
  const int before = fastload::test::failures();
  {
    // A small depth forces many -EBUSY/reap cycles over 64+ chunks.
    auto e = make(8);
    CHECK(e != nullptr);
    if (!e) return;
    write_file(*e, dir_fd, "data.bin", data);
    read_back(*e, dir_fd, "data.bin", data);
    errors_are_negative_errno(*e, dir_fd);
  }
  {
    auto e = make(256);
    CHECK(e != nullptr);
    if (e) read_back(*e, dir_fd, "data.bin", data);
  }
  capacity_and_busy(make);
  timeouts(make);
  fixed_buffers(make, dir_fd, data, fixed_supported);
  std::fprintf(stderr, "   %s: %s\n", label,
               fastload::test::failures() == before ? "ok" : "FAILED");
}

// ---------------------------------------------------------------------------------
// make_engine, parse_kind, the environment.

void factory_and_env(bool have_uring) {
  std::fprintf(stderr, "== make_engine / environment\n");
  Kind k = Kind::kAuto;
  CHECK(parse_kind("pread", &k) && k == Kind::kPread);
  CHECK(parse_kind("uring", &k) && k == Kind::kUring);
  CHECK(parse_kind("io_uring", &k) && k == Kind::kUring);
  CHECK(parse_kind("auto", &k) && k == Kind::kAuto);
  CHECK(!parse_kind("", &k));
  CHECK(!parse_kind("aio", &k));
  CHECK_EQ(uring_available(), have_uring);

  unsetenv("FASTLOAD_ENGINE");
  unsetenv("FASTLOAD_FAULTS");
  int err = 1;
  EngineOptions o;
  o.depth = 16;
  o.threads = 2;
  auto e = make_engine(o, &err);
  CHECK(e != nullptr);
  CHECK_EQ(err, 0);
  if (e) CHECK_EQ(std::string(e->name()), std::string(have_uring ? "uring" : "pread"));
  if (e) CHECK_EQ(e->capacity(), 16u);

  o.kind = Kind::kPread;
  e = make_engine(o, &err);
  CHECK(e && std::string(e->name()) == "pread");

  o.kind = Kind::kUring;
  e = make_engine(o, &err);
  if (have_uring) CHECK(e && std::string(e->name()) == "uring");
  else CHECK(!e && err < 0);

  o.depth = 0;
  e = make_engine(o, &err);
  CHECK(!e);
  CHECK_EQ(err, -EINVAL);
  o.depth = 16;

  // FASTLOAD_ENGINE overrides kAuto only, and only with honour_env.
  setenv("FASTLOAD_ENGINE", "pread", 1);
  o.kind = Kind::kAuto;
  e = make_engine(o, &err);
  CHECK(e && std::string(e->name()) == "pread");
  if (have_uring) {
    o.kind = Kind::kUring;
    e = make_engine(o, &err);
    CHECK(e && std::string(e->name()) == "uring");
    o.kind = Kind::kAuto;
    o.honour_env = false;
    e = make_engine(o, &err);
    CHECK(e && std::string(e->name()) == "uring");
    o.honour_env = true;
  }
  setenv("FASTLOAD_ENGINE", "bogus", 1);
  e = make_engine(o, &err);
  CHECK(!e);
  CHECK_EQ(err, -EINVAL);
  Kind got = Kind::kAuto;
  CHECK_EQ(resolve_kind(Kind::kAuto, "", true, &got), -EINVAL);
  CHECK_EQ(resolve_kind(Kind::kPread, "", true, &got), 0);  // an explicit kind ignores it
  CHECK(got == Kind::kPread);
  unsetenv("FASTLOAD_ENGINE");

  // resolve_kind: the one rule. kAuto never comes out; a local path changes nothing.
  const Kind plain = have_uring ? Kind::kUring : Kind::kPread;
  CHECK_EQ(resolve_kind(Kind::kAuto, "", true, &got), 0);
  CHECK(got == plain);
  CHECK_EQ(resolve_kind(Kind::kAuto, "/", true, &got), 0);
  CHECK(got == plain);
  CHECK_EQ(resolve_kind(Kind::kAuto, "/no/such/path", true, &got), 0);  // cannot tell: plain
  CHECK(got == plain);
  setenv("FASTLOAD_ENGINE", "PREAD", 1);
  CHECK_EQ(resolve_kind(Kind::kAuto, "/", true, &got), 0);
  CHECK(got == Kind::kPread);
  CHECK_EQ(resolve_kind(Kind::kAuto, "/", false, &got), 0);
  CHECK(got == plain);
  unsetenv("FASTLOAD_ENGINE");
  CHECK(std::string(kind_name(Kind::kPread)) == "pread");
  CHECK(std::string(kind_name(Kind::kUring)) == "uring");

  // FASTLOAD_FAULTS wraps; the wrapper keeps the backend's name.
  setenv("FASTLOAD_FAULTS", "eio=1,ops=read", 1);
  o.kind = Kind::kPread;
  e = make_engine(o, &err);
  CHECK(e && std::string(e->name()) == "pread");
  if (e) {
    char b[8];
    CHECK_EQ(run_one(*e, rw_op(OpCode::kRead, 0, b, sizeof b, 0)), -EIO);
    CHECK_EQ(run_one(*e, Op{}), 0);  // nop is not in ops=read
  }
  setenv("FASTLOAD_FAULTS", "eio=2", 1);
  e = make_engine(o, &err);
  CHECK(!e);
  CHECK_EQ(err, -EINVAL);
  setenv("FASTLOAD_FAULTS", "", 1);  // empty: no wrapper
  e = make_engine(o, &err);
  CHECK(e != nullptr);
  unsetenv("FASTLOAD_FAULTS");
}

// ---------------------------------------------------------------------------------
// Fault injection.

void fault_spec_parsing() {
  std::fprintf(stderr, "== fault spec parsing\n");
  FaultSpec s;
  CHECK(parse_fault_spec("eio=0.01,eintr=0.1,short=0.2,seed=7,ops=read+write,after=100", &s));
  CHECK(s.eio == 0.01 && s.eintr == 0.1 && s.short_io == 0.2);
  CHECK_EQ(s.seed, 7u);
  CHECK_EQ(s.after, 100u);
  CHECK_EQ(s.ops_mask, (1u << int(OpCode::kRead)) | (1u << int(OpCode::kWrite)));
  CHECK(parse_fault_spec("", &s));
  CHECK(s.eio == 0 && s.eintr == 0 && s.short_io == 0 && s.after == 0);
  CHECK_EQ(s.ops_mask, (1u << int(OpCode::kRead)) | (1u << int(OpCode::kWrite)));  // default
  CHECK(parse_fault_spec(" eio = 1 , ops=open+close+statx ", &s));
  CHECK_EQ(s.ops_mask, (1u << int(OpCode::kOpenAt)) | (1u << int(OpCode::kClose)) |
                           (1u << int(OpCode::kStatx)));
  CHECK(parse_fault_spec("seed=0x10", &s) && s.seed == 16);
  CHECK(!parse_fault_spec("eio", &s));
  CHECK(!parse_fault_spec("eio=1.5", &s));
  CHECK(!parse_fault_spec("eio=-0.1", &s));
  CHECK(!parse_fault_spec("eio=nan", &s));
  CHECK(!parse_fault_spec("eio=0.6,eintr=0.6", &s));  // shares must sum to <= 1
  CHECK(!parse_fault_spec("seed=-1", &s));
  CHECK(!parse_fault_spec("seed=12x", &s));
  CHECK(!parse_fault_spec("ops=read+bogus", &s));
  CHECK(!parse_fault_spec("ops=", &s));
  CHECK(!parse_fault_spec("colour=blue", &s));
}

enum Outcome { kFull, kShort, kEio, kEintr, kOther };

// 400 reads of 4 KiB from inside the file (a real read is never short there), through
// the wrapper; returns the outcome of each, by index.
std::vector<Outcome> faulty_reads(const Factory& make, const FaultSpec& spec, int fd) {
  auto e = wrap_with_faults(make(32), spec);
  CHECK(e != nullptr);
  if (!e) return {};
  constexpr int kN = 400;
  std::vector<uint8_t> buf(kN * 4096);
  std::vector<Op> ops;
  for (int i = 0; i < kN; ++i)
    ops.push_back(rw_op(OpCode::kRead, fd, buf.data() + i * 4096, 4096, (i % 200) * 4096ull, i));
  auto res = run_ops(*e, ops);
  std::vector<Outcome> out;
  for (int64_t r : res) {
    if (r == 4096) out.push_back(kFull);
    else if (r == 2048) out.push_back(kShort);  // exactly halved
    else if (r == -EIO) out.push_back(kEio);
    else if (r == -EINTR) out.push_back(kEintr);
    else out.push_back(kOther);
  }
  return out;
}

void fault_injection(const char* label, const Factory& make, int dir_fd) {
  std::fprintf(stderr, "== fault injection: %s\n", label);
  const int fd = openat(dir_fd, "data.bin", O_RDONLY | O_CLOEXEC);
  CHECK(fd >= 0);
  if (fd < 0) return;

  FaultSpec spec;
  CHECK(parse_fault_spec("eio=0.1,eintr=0.15,short=0.25,seed=42", &spec));
  auto a = faulty_reads(make, spec, fd);
  auto b = faulty_reads(make, spec, fd);
  CHECK(a == b);  // same seed, same sequence
  std::map<Outcome, int> count;
  for (auto o : a) ++count[o];
  CHECK(count[kEio] > 10);
  CHECK(count[kEintr] > 20);
  CHECK(count[kShort] > 40);
  CHECK(count[kFull] > 100);
  CHECK_EQ(count[kOther], 0);

  spec.seed = 43;
  CHECK(faulty_reads(make, spec, fd) != a);  // another seed, another sequence

  // after=N spares the first N eligible operations.
  CHECK(parse_fault_spec("eio=1,after=50", &spec));
  auto c = faulty_reads(make, spec, fd);
  CHECK_EQ(c.size(), 400u);
  for (size_t i = 0; i < c.size(); ++i) CHECK_EQ(c[i], i < 50 ? kFull : kEio);

  // ops= restricts the hits: reads are untouched when only opens are eligible.
  CHECK(parse_fault_spec("eio=1,ops=open", &spec));
  auto d = faulty_reads(make, spec, fd);
  CHECK(std::all_of(d.begin(), d.end(), [](Outcome o) { return o == kFull; }));
  {
    auto e = wrap_with_faults(make(4), spec);
    CHECK_EQ(run_one(*e, open_op(dir_fd, "data.bin", O_RDONLY)), -EIO);
    CHECK_EQ(std::string(e->name()), std::string(make(4)->name()));
  }

  // Synthetic completions count against capacity.
  CHECK(parse_fault_spec("eintr=1", &spec));
  {
    auto e = wrap_with_faults(make(4), spec);
    const unsigned cap = e->capacity();
    char buf[8];
    for (unsigned i = 0; i < cap; ++i)
      CHECK_EQ(e->push(rw_op(OpCode::kRead, fd, buf, 8, 0, i)), 0);
    CHECK_EQ(e->in_flight(), cap);
    CHECK_EQ(e->push(rw_op(OpCode::kRead, fd, buf, 8, 0, 99)), -EBUSY);
    std::vector<Completion> out(cap);
    CHECK_EQ(e->reap(out.data(), cap, cap, 1000), static_cast<int>(cap));
    for (auto& c2 : out) CHECK_EQ(c2.res, -EINTR);
    CHECK_EQ(e->in_flight(), 0u);
  }

  // A 1-byte read cannot be halved: it goes through whole.
  CHECK(parse_fault_spec("short=1", &spec));
  {
    auto e = wrap_with_faults(make(4), spec);
    char buf[2];
    CHECK_EQ(run_one(*e, rw_op(OpCode::kRead, fd, buf, 1, 0)), 1);
    CHECK_EQ(run_one(*e, rw_op(OpCode::kRead, fd, buf, 2, 0)), 1);
  }

  // run_now: the operation done on the calling thread, outside the queue (nothing in
  // flight before or after), and a wrapping engine's faults apply to it as to push().
  {
    auto e = make(4);
    char buf[16];
    CHECK_EQ(e->run_now(rw_op(OpCode::kRead, fd, buf, 16, 0)), int64_t{16});
    CHECK_EQ(e->in_flight(), 0u);
    CHECK_EQ(e->run_now(rw_op(OpCode::kRead, -1, buf, 16, 0)), int64_t{-EBADF});
    Op open_op{.code = OpCode::kOpenAt, .dir_fd = dir_fd, .path = "data.bin",
               .flags = O_RDONLY | O_CLOEXEC};
    const int64_t opened = e->run_now(open_op);
    CHECK(opened >= 0);
    if (opened >= 0) CHECK_EQ(e->run_now(Op{.code = OpCode::kClose, .fd = int(opened)}), 0);
  }
  CHECK(parse_fault_spec("eio=1,ops=write", &spec));
  {
    auto e = wrap_with_faults(make(4), spec);
    char buf[16];
    CHECK_EQ(e->run_now(rw_op(OpCode::kRead, fd, buf, 16, 0)), int64_t{16});  // not a write
    CHECK_EQ(e->run_now(rw_op(OpCode::kWrite, fd, buf, 16, 0)), int64_t{-EIO});
    CHECK_EQ(e->in_flight(), 0u);
  }
  CHECK(parse_fault_spec("eintr=1,ops=read", &spec));
  {
    auto e = wrap_with_faults(make(4), spec);
    char buf[16];
    CHECK_EQ(e->run_now(rw_op(OpCode::kRead, fd, buf, 16, 0)), int64_t{-EINTR});
  }
  CHECK(parse_fault_spec("short=1,ops=read", &spec));
  {
    auto e = wrap_with_faults(make(4), spec);
    char buf[16];
    CHECK_EQ(e->run_now(rw_op(OpCode::kRead, fd, buf, 16, 0)), int64_t{8});
  }
  close(fd);
}

// cached_bytes(): all of a range just read, none of it once its pages are dropped
// (where the file system drops clean pages on request: not tmpfs), page by page, and
// asking reads nothing.
void page_residency(int dir_fd) {
  using fastload::io::cached_bytes;
  const int fd = openat(dir_fd, "resident.bin", O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CHECK(fd >= 0);
  if (fd < 0) return;
  const uint64_t size = 1 << 20;
  std::vector<char> buf(size, 'r');
  CHECK_EQ(pwrite(fd, buf.data(), size, 0), ssize_t(size));
  CHECK_EQ(fsync(fd), 0);
  int err = -1;
  CHECK_EQ(cached_bytes(fd, 0, 0, &err), uint64_t{0});  // an empty range
  CHECK_EQ(err, 0);
  CHECK_EQ(pread(fd, buf.data(), size, 0), ssize_t(size));
  CHECK_EQ(cached_bytes(fd, 0, size, &err), size);
  CHECK_EQ(cached_bytes(fd, 4097, 10000, &err), uint64_t{10000});  // not page-aligned
  CHECK_EQ(err, 0);
  CHECK_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  if (cached_bytes(fd, 0, size, &err) == 0) {
    // Reading 10 bytes at 8190 brings back two pages; asking about them reads nothing.
    for (int k = 0; k < 3; ++k) CHECK_EQ(cached_bytes(fd, 4096 * 5, 4096, &err), uint64_t{0});
    CHECK_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);  // no readahead
    CHECK_EQ(pread(fd, buf.data(), 10, 8190), ssize_t(10));
    CHECK_EQ(cached_bytes(fd, 0, size, &err), uint64_t{8192});
    CHECK_EQ(cached_bytes(fd, 8000, 4096 + 192 + 100, &err), uint64_t{4096 + 192});
    CHECK_EQ(err, 0);
  } else {
    std::fprintf(stderr, "page_residency: clean pages not dropped here (tmpfs?)\n");
  }
  close(fd);
  CHECK_EQ(cached_bytes(fd, 0, 4096, &err), uint64_t{0});  // closed: an error, not 0 bytes
  CHECK_EQ(err, -EBADF);
}

// Removes what the test wrote; the directory was made by mkdtemp.
void cleanup(const std::string& dir) {
  for (const char* f : {"data.bin", "fixed.bin", "resident.bin"})
    unlink((dir + "/" + f).c_str());
  rmdir(dir.c_str());
}

}  // namespace

int main() {
  const char* base = getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/fastload-engine-XXXXXX";
  if (!mkdtemp(tmpl.data())) {
    std::perror("mkdtemp");
    return 1;
  }
  const int dir_fd = open(tmpl.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    std::perror("open tmpdir");
    return 1;
  }
  std::vector<uint8_t> data(kFileSize);
  for (size_t i = 0; i < data.size(); ++i) data[i] = pattern(i);

  Factory pool = [](unsigned depth) -> std::unique_ptr<Engine> {
    int err = 0;
    return PreadPool::create(depth, 4, &err);
  };
  conformance("pread", pool, dir_fd, data, /*fixed_supported=*/false);
  fault_injection("pread", pool, dir_fd);
  page_residency(dir_fd);

  int err = 0;
  const bool have_uring = UringEngine::create(4, &err) != nullptr;
  if (have_uring) {
    Factory uring = [](unsigned depth) -> std::unique_ptr<Engine> {
      int e = 0;
      return UringEngine::create(depth, &e);
    };
    {
      auto probe = UringEngine::create(4, &err);
      std::fprintf(stderr, "io_uring: setup flags 0x%x, features 0x%x, sq entries %u\n",
                   probe->ring().setup_flags(), probe->ring().features(),
                   probe->ring().sq_entries());
    }
    unlink((tmpl + "/data.bin").c_str());  // the uring run writes its own copy
    conformance("uring", uring, dir_fd, data, /*fixed_supported=*/true);
    fault_injection("uring", uring, dir_fd);

    // The 5.10 paths: no optional setup flags, timed waits by polling the CQ.
    Factory legacy = [](unsigned depth) -> std::unique_ptr<Engine> {
      int e = 0;
      auto eng = UringEngine::create_legacy(depth, &e);
      if (eng) {
        CHECK_EQ(eng->ring().setup_flags(), unsigned{IORING_SETUP_CLAMP});
        CHECK(!(eng->ring().features() & IORING_FEAT_EXT_ARG));
      }
      return eng;
    };
    unlink((tmpl + "/data.bin").c_str());
    conformance("uring (5.10 paths)", legacy, dir_fd, data, /*fixed_supported=*/true);
  } else {
    std::fprintf(stderr, "io_uring unavailable here (%s): uring suite skipped\n",
                 std::strerror(-err));
  }
  factory_and_env(have_uring);
  fault_spec_parsing();

  close(dir_fd);
  cleanup(tmpl);
  const int rc = fastload::test::exit_code();
  if (rc == 0 && !have_uring) return fastload::test::kSkip;
  return rc;
}
