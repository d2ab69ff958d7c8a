// Fuzz target for the tar parser.
//
// LLVMFuzzerTestOneInput runs one input through StreamParser (feed splits, read/skip
// choices and seeks drawn from the input's first byte), through scan_file (via a memfd),
// and its name-sized pieces through the path safety checks. It asserts that nothing
// crashes, that only fastload::Error escapes, that the sink sees a well-formed event
// sequence whose data matches the member sizes, that both readers agree (same members,
// or the same error), and that accepted paths are normalised and contain no "..".
//
// Built with libFuzzer: clang++ -fsanitize=fuzzer,address,undefined -DFASTLOAD_LIBFUZZER.
// Otherwise main() runs a seeded mutation loop for FUZZ_SECONDS (default 10) over a
// built-in corpus of valid archives, so ctest runs it under the sanitizers in CI.
// FUZZ_SEED picks the seed (default 1); a failing input is written to fuzz-tar-crash.bin.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "tar/reader.hpp"
#include "tar_builder.hpp"

namespace {

using fastload::tar::Action;
using fastload::tar::Member;
using fastload::tar::MemberType;

// Outcome counts by the start of the error's reason ("ok" for none), printed by main()
// to show which paths the mutants reach.
std::map<std::string, uint64_t> g_outcomes;

const uint8_t* g_input = nullptr;  // the input being run, saved when an assertion fails
size_t g_input_size = 0;

[[noreturn]] void die(const char* what, int line) {
  std::fprintf(stderr, "fuzz_tar: assertion failed at line %d: %s\n", line, what);
  if (FILE* f = std::fopen("fuzz-tar-crash.bin", "wb")) {
    std::fwrite(g_input, 1, g_input_size, f);
    std::fclose(f);
    std::fprintf(stderr, "fuzz_tar: input written to fuzz-tar-crash.bin\n");
  }
  std::abort();
}
#define FUZZ_ASSERT(cond) \
  do {                    \
    if (!(cond)) die(#cond, __LINE__); \
  } while (0)

// A small deterministic generator for the choices an input makes about itself.
struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
};

std::string describe(const Member& m) {
  return m.path + '\0' + m.link + '\0' + std::to_string(static_cast<int>(m.type)) + ' ' +
         std::to_string(m.size) + ' ' + std::to_string(m.mode) + ' ' + std::to_string(m.mtime_ns) +
         ' ' + std::to_string(m.uid) + ' ' + std::to_string(m.gid) + ' ' +
         std::to_string(m.header_offset) + ' ' + std::to_string(m.data_offset);
}

void check_path_safety(const Member& m) {
  std::string out, why;
  if (fastload::tar::safe_relative_path(m.path, &out, &why)) {
    FUZZ_ASSERT(out.empty() || (out.front() != '/' && out.back() != '/'));
    FUZZ_ASSERT(out.find("//") == std::string::npos);
    FUZZ_ASSERT(out != "." && out.find("/./") == std::string::npos && !out.starts_with("./") &&
                !out.ends_with("/."));
    FUZZ_ASSERT(out != ".." && !out.starts_with("../") && out.find("/../") == std::string::npos &&
                !out.ends_with("/.."));
    std::string again;
    if (!out.empty())
      FUZZ_ASSERT(fastload::tar::safe_relative_path(out, &again, &why) && again == out);
  } else {
    FUZZ_ASSERT(!why.empty());
  }
  if (m.type == MemberType::kHardlink || m.type == MemberType::kSymlink) {
    why.clear();
    const bool hard = m.type == MemberType::kHardlink;
    if (!fastload::tar::safe_link_target(m.path, m.link, hard, &why)) FUZZ_ASSERT(!why.empty());
    else FUZZ_ASSERT(!m.link.empty() && m.link.front() != '/');
  }
}

struct FuzzSink : fastload::tar::Sink {
  Rng* rng;
  std::vector<std::string> members;
  bool open = false, reading = false;
  uint64_t expect = 0, got = 0;

  Action on_member(const Member& m) override {
    FUZZ_ASSERT(!open);
    FUZZ_ASSERT(m.data_offset >= m.header_offset + 512);
    FUZZ_ASSERT(m.header_offset % 512 == 0 && m.data_offset % 512 == 0);
    FUZZ_ASSERT(m.mode <= 07777);
    if (m.type != MemberType::kFile) FUZZ_ASSERT(m.size == 0);
    check_path_safety(m);
    members.push_back(describe(m));
    open = true;
    reading = rng->next() % 3 != 0;
    expect = m.size;
    got = 0;
    return reading ? Action::kRead : Action::kSkip;
  }
  void on_data(const char* d, size_t n) override {
    FUZZ_ASSERT(open && reading && n > 0 && d != nullptr);
    got += n;
    FUZZ_ASSERT(got <= expect);
  }
  void on_member_end() override {
    FUZZ_ASSERT(open);
    FUZZ_ASSERT(!reading || got == expect);
    open = false;
  }
};

struct Outcome {
  std::vector<std::string> members;
  std::string error;  // empty: no error
};

Outcome run_stream(const char* a, size_t n, uint64_t seed) {
  Rng rng{seed * 0x9e3779b97f4a7c15ull + n + 1};
  FuzzSink sink;
  sink.rng = &rng;
  fastload::tar::StreamParser p("fuzz.tar");
  Outcome out;
  try {
    size_t pos = 0;
    while (pos < n) {
      const uint64_t can = p.skippable();
      if (can > 0 && rng.next() % 2) {  // a seeking caller
        const uint64_t k = std::min<uint64_t>({can, n - pos, 1 + rng.next() % (can + 1)});
        p.skipped(k, sink);
        pos += static_cast<size_t>(k);
      } else {
        const uint64_t r = rng.next();
        size_t k = r % 4 == 0 ? 1 : (r % 4 == 1 ? 1 + (r >> 8) % 1100 : n - pos);
        k = std::min(k, n - pos);
        p.feed(a + pos, k, sink);
        pos += k;
      }
      FUZZ_ASSERT(p.offset() == pos);
    }
    p.finish(sink);
    FUZZ_ASSERT(!sink.open);
  } catch (const fastload::Error& e) {
    FUZZ_ASSERT(e.kind() == fastload::ErrorKind::kFormat);
    out.error = e.what();
    FUZZ_ASSERT(!out.error.empty());
  }
  out.members = std::move(sink.members);
  return out;
}

Outcome run_scan(const char* a, size_t n) {
  Outcome out;
  fastload::UniqueFd fd(::memfd_create("fuzz-tar", MFD_CLOEXEC));
  if (!fd) return {{}, "memfd"};
  for (size_t done = 0; done < n;) {
    const ssize_t w = ::write(fd.get(), a + done, n - done);
    FUZZ_ASSERT(w > 0);
    done += static_cast<size_t>(w);
  }
  try {
    fastload::tar::scan_file(fd.get(), n, "fuzz.tar", [&](const Member& m) {
      out.members.push_back(describe(m));
      return true;
    });
  } catch (const fastload::Error& e) {
    FUZZ_ASSERT(e.kind() == fastload::ErrorKind::kFormat);
    out.error = e.what();
  }
  return out;
}

void run_one(const uint8_t* data, size_t size) {
  g_input = data;
  g_input_size = size;
  if (size == 0) return;
  const uint64_t seed = data[0];
  const char* a = reinterpret_cast<const char*>(data + 1);
  const size_t n = size - 1;
  const Outcome s = run_stream(a, n, seed);
  const Outcome f = run_scan(a, n);
  {
    const size_t colon = s.error.find("): ");
    g_outcomes[s.error.empty() ? "ok" : colon == std::string::npos ? s.error.substr(0, 40)
                                                                   : s.error.substr(colon + 3, 40)]++;
  }
  if (f.error != "memfd") {
    FUZZ_ASSERT(s.error == f.error);
    // The stream reports a member before it can know that its data is cut short;
    // scan_file checks the data fits first. Otherwise both see the same members.
    FUZZ_ASSERT(s.members.size() == f.members.size() ||
                (!s.error.empty() && s.members.size() == f.members.size() + 1));
    FUZZ_ASSERT(std::equal(f.members.begin(), f.members.end(), s.members.begin()));
  }
  // The safety checks on raw bytes, as a link path and target pair.
  const std::string_view raw(a, n);
  const size_t cut = n ? seed % (n + 1) : 0;
  Member m;
  m.path = std::string(raw.substr(0, std::min<size_t>(cut, 300)));
  m.link = std::string(raw.substr(cut, 300));
  m.type = seed & 1 ? MemberType::kSymlink : MemberType::kHardlink;
  check_path_safety(m);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  run_one(data, size);
  return 0;
}

#ifndef FASTLOAD_LIBFUZZER

namespace {

namespace tb = fastload::tar::testing;

}  // namespace

int main() {
  const char* env = std::getenv("FUZZ_SECONDS");
  const double seconds = env ? std::atof(env) : 10.0;
  const char* seed_env = std::getenv("FUZZ_SEED");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : 1;
  std::mt19937_64 rng(seed);
  const std::vector<std::string> base = tb::sample_archives();
  std::vector<std::string> pool = base;  // grows with mutants, bounded
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration<double>(seconds);
  uint64_t runs = 0;
  for (const std::string& c : base) {  // every corpus entry once, as is
    std::string in = std::string(1, '\x01') + c;
    run_one(reinterpret_cast<const uint8_t*>(in.data()), in.size());
    ++runs;
  }
  while (std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < 64; ++i) {
      std::string m = tb::mutate(pool[rng() % pool.size()], pool, rng);
      std::string in = std::string(1, static_cast<char>(rng())) + m;
      run_one(reinterpret_cast<const uint8_t*>(in.data()), in.size());
      ++runs;
      if (rng() % 16 == 0) {
        if (pool.size() < 256) pool.push_back(std::move(m));
        else pool[base.size() + rng() % (pool.size() - base.size())] = std::move(m);
      }
    }
  }
  std::vector<std::pair<uint64_t, std::string>> top;
  for (const auto& [what, count] : g_outcomes) top.emplace_back(count, what);
  std::sort(top.rbegin(), top.rend());
  for (size_t i = 0; i < top.size() && i < 25; ++i)
    std::fprintf(stderr, "  %8llu  %s\n", static_cast<unsigned long long>(top[i].first),
                 top[i].second.c_str());
  std::fprintf(stderr, "fuzz_tar: %llu runs in %.1f s (seed %llu), %zu distinct outcomes, no failures\n",
               static_cast<unsigned long long>(runs), seconds, static_cast<unsigned long long>(seed),
               g_outcomes.size());
  return 0;
}

#endif  // FASTLOAD_LIBFUZZER
