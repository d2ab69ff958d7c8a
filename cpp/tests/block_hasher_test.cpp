// copy::BlockHasher (issue 33): blocks pushed in order are hashed in that order on the
// hasher's thread, each reported once hashed (not before: the caller may then reuse
// it); what the hash function throws is rethrown to the caller and nothing more is
// hashed; the destructor stops with blocks still queued, and joins.
#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "copy/block_hasher.hpp"
#include "tests/check.hpp"

namespace {

using namespace fastload;
using copy::BlockHasher;
using namespace std::chrono_literals;

// Pushes `n` blocks of 4 bytes, each with its own content, and waits until every one is
// hashed; checks what the hash function saw and what came back.
void in_order() {
  constexpr int n = 50;
  std::vector<std::string> blocks(n);
  // (appended, not "b" + to_string(): GCC 12 at -O3 warns of an overlap there, -Wrestrict)
  for (int b = 0; b < n; ++b) blocks[size_t(b)].append("b").append(std::to_string(1000 + b));
  std::string seen;  // written by the hasher's thread only, read after it is joined
  std::vector<int> back;
  {
    BlockHasher h([&](const char* p, size_t len) {
      std::this_thread::sleep_for(100us);  // the hasher lags behind the pushes
      seen.append(p, len);
    });
    for (int b = 0; b < n; ++b) h.push(b, blocks[size_t(b)].data(), blocks[size_t(b)].size());
    CHECK(h.pending() <= size_t(n));
    // wait() returns at once while hashed blocks are not taken: take them each time.
    for (int spins = 0; h.pending() > 0 && spins < 1000; ++spins) {
      h.wait(100ms);
      h.take_hashed(&back);
    }
    CHECK_EQ(h.pending(), size_t(0));
    h.take_hashed(&back);
  }
  std::string want;
  for (const auto& b : blocks) want += b;
  CHECK(seen == want);
  CHECK_EQ(back.size(), size_t(n));
  for (int b = 0; b < int(back.size()); ++b) CHECK_EQ(back[size_t(b)], b);
}

// The third block's hash fails: take_hashed() rethrows it, the blocks after it are not
// hashed, and the failed one is never reported hashed.
void failure() {
  int calls = 0;
  const char data[8] = "abcdefg";
  BlockHasher h([&](const char*, size_t) {
    if (++calls == 3) throw std::runtime_error("hash failed");
  });
  for (int b = 0; b < 6; ++b) h.push(b, data, sizeof data);
  std::vector<int> back;
  bool thrown = false;
  for (int spins = 0; spins < 100 && !thrown; ++spins) {
    h.wait(100ms);
    try {
      h.take_hashed(&back);
    } catch (const std::runtime_error& e) {
      thrown = std::string(e.what()) == "hash failed";
    }
  }
  CHECK(thrown);
  CHECK_EQ(back.size(), size_t(2));
  std::this_thread::sleep_for(20ms);
  CHECK_EQ(calls, 3);
}

// Destroyed with blocks queued behind a slow one: returns once that one is done. The
// destructor runs once the first block's hash has begun (its hash function says so),
// not after a sleep the hasher's thread may not have started within (under ASan, on a
// busy machine).
void stop_early() {
  std::atomic<int> calls = 0;
  std::promise<void> started;
  const char data[4] = "xyz";
  {
    BlockHasher h([&](const char*, size_t) {
      if (++calls == 1) started.set_value();
      std::this_thread::sleep_for(30ms);  // slow blocks: the rest stay queued
    });
    for (int b = 0; b < 20; ++b) h.push(b, data, sizeof data);
    started.get_future().wait();
  }
  CHECK(calls >= 1 && calls < 20);
}

}  // namespace

int main() {
  in_order();
  failure();
  stop_early();
  return test::exit_code();
}
