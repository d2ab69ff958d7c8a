// The shared-memory batch blocks: sizes, the lease count through lease/retain/adopt and
// back to zero, the payload seen by a second mapping and by another process, counts
// kept exact under concurrent leases, the refusals of View (short file, no payload,
// not a block), a forked child's copies of leases giving nothing back, the counts
// of a held mapping retired, then given back by Retired, and an exited owner's block
// claimed by one of two children.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "check.hpp"
#include "common/error.hpp"
#include "shm/block.hpp"

using namespace fastload;

namespace {

// Whether View(fd, length) is refused with EINVAL.
bool refused(int fd, size_t length) {
  try {
    shm::View v(fd, length);
  } catch (const Error& e) {
    return e.kind() == ErrorKind::kOs && e.err() == EINVAL;
  }
  return false;
}

void test_sizes() {
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  shm::Block b(1000);
  CHECK(b.capacity() >= 1000);
  CHECK_EQ(b.length() % page, size_t(0));
  CHECK_EQ(b.length(), b.capacity() + shm::kHeaderBytes);
  CHECK_EQ(b.address() % 64, uintptr_t(0));
  CHECK_EQ(b.users(), 0u);
  CHECK(b.fd() >= 0);
  CHECK(b.inode() != 0);
  shm::Block exact(page - shm::kHeaderBytes);  // header + payload fill one page exactly
  CHECK_EQ(exact.length(), page);
}

void test_counts_in_one_process() {
  shm::Block b(4096);
  {
    auto l1 = b.lease();
    CHECK_EQ(b.users(), 1u);
    CHECK_EQ(l1->capacity(), b.capacity());
    CHECK_EQ(reinterpret_cast<uintptr_t>(l1->data()), b.address());
    {
      auto l2 = b.lease();
      CHECK_EQ(b.users(), 2u);
    }
    CHECK_EQ(b.users(), 1u);
  }
  CHECK_EQ(b.users(), 0u);
}

void test_handover_to_a_view() {
  shm::Block b(1 << 16);
  auto mine = b.lease();
  std::memcpy(mine->data(), "batch one", 9);
  b.retain();  // for the receiver, while `mine` is alive
  CHECK_EQ(b.users(), 2u);
  mine.reset();  // the sender drops its own lease before the receiver adopts
  CHECK_EQ(b.users(), 1u);

  shm::View v(::dup(b.fd()), b.length());
  CHECK_EQ(v.length(), b.length());
  CHECK_EQ(v.users(), 1u);
  {
    auto theirs = v.adopt();  // takes over the retained count, adds none
    CHECK_EQ(b.users(), 1u);
    CHECK(std::memcmp(theirs->data(), "batch one", 9) == 0);
    CHECK(theirs->data() != reinterpret_cast<char*>(b.address()));  // another mapping
    std::memcpy(theirs->data(), "seen", 4);
  }
  CHECK_EQ(b.users(), 0u);  // free for the next batch
  auto next = b.lease();
  CHECK(std::memcmp(next->data(), "seen", 4) == 0);  // one physical block
}

void test_another_process() {
  shm::Block b(1 << 16);
  auto mine = b.lease();
  std::memcpy(mine->data(), "across", 6);
  b.retain();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // The child: a receiver adopting the count and letting it go.
    int code = 0;
    try {
      shm::View v(::dup(b.fd()), b.length());
      auto l = v.adopt();
      if (std::memcmp(l->data(), "across", 6) != 0) code = 2;
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  CHECK(pid > 0);
  int status = 0;
  CHECK_EQ(::waitpid(pid, &status, 0), pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_EQ(b.users(), 1u);  // the child's adopted count is back; our lease remains
  mine.reset();
  CHECK_EQ(b.users(), 0u);
}

void test_concurrent_leases() {
  // Senders leasing and retaining, a receiver adopting: every count given back.
  shm::Block b(4096);
  shm::View v(::dup(b.fd()), b.length());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        auto l = b.lease();
        b.retain();
        l.reset();
        v.adopt().reset();
      }
    });
  for (auto& t : threads) t.join();
  CHECK_EQ(b.users(), 0u);
}

void test_refusals() {
  shm::Block b(4096);
  CHECK(refused(::dup(b.fd()), b.length() + 4096));   // longer than the file
  CHECK(refused(::dup(b.fd()), shm::kHeaderBytes));   // no payload
  const int other = ::memfd_create("not-a-block", MFD_CLOEXEC);
  CHECK(other >= 0);
  CHECK_EQ(::ftruncate(other, 8192), 0);
  CHECK(refused(other, 8192));                        // zeros: no magic
  CHECK_EQ(b.users(), 0u);
}

void test_forked_child_gives_nothing_back() {
  // The parent holds a received lease; a child forked meanwhile drops its copy of it
  // (and of a retired list): the count is the parent's, and stays.
  shm::Block b(4096);
  b.retain();
  shm::View v(::dup(b.fd()), b.length());
  auto theirs = v.adopt();
  shm::View held(::dup(b.fd()), b.length());
  held.hold(true);
  b.retain();
  held.adopt().reset();  // retired, not given back
  CHECK_EQ(b.users(), 2u);
  const pid_t pid = ::fork();
  if (pid == 0) {
    theirs.reset();
    shm::Retired::take().release();
    ::_exit(b.users() == 2u ? 0 : 2);
  }
  CHECK(pid > 0);
  int status = 0;
  CHECK_EQ(::waitpid(pid, &status, 0), pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_EQ(b.users(), 2u);
  theirs.reset();
  CHECK_EQ(b.users(), 1u);
  shm::Retired::take().release();
  CHECK_EQ(b.users(), 0u);
}

void test_held_mapping_retires() {
  shm::Block b(4096);
  shm::View v(::dup(b.fd()), b.length());
  b.retain();
  auto early = v.adopt();  // taken before the hold: retires too, when destroyed after it
  b.retain();
  auto late = v.adopt();
  v.hold(true);
  CHECK(v.held());
  early.reset();
  late.reset();
  CHECK_EQ(b.users(), 2u);
  {
    shm::Retired r = shm::Retired::take();
    CHECK_EQ(r.size(), size_t(2));
    CHECK_EQ(shm::Retired::take().size(), size_t(0));  // taken once
    CHECK_EQ(b.users(), 2u);
  }  // destroyed: given back
  CHECK_EQ(b.users(), 0u);
  v.hold(false);
  b.retain();
  v.adopt().reset();
  CHECK_EQ(b.users(), 0u);  // not held: straight back
  CHECK_EQ(shm::Retired::take().size(), size_t(0));
}

void test_claim_an_exited_owners_block() {
  // A worker's block outlives it: the main process (the View) frees it once the worker
  // is gone; of two children forked with its descriptor, one claims it; the count stays.
  auto b = std::make_unique<shm::Block>(4096);
  shm::View v(::dup(b->fd()), b->length());
  CHECK_EQ(v.owner(), uint32_t(::getpid()));  // its creator
  CHECK(shm::Block::claim(b->fd()) == nullptr);  // owned
  b->retain();
  auto lease = v.adopt();  // a batch still read here
  const int fd = ::dup(b->fd());
  b.reset();  // the worker is gone
  v.disown();
  CHECK_EQ(v.owner(), 0u);
  int wins = 0;
  for (int i = 0; i < 2; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      auto mine = shm::Block::claim(fd);
      // the claimed block keeps the count: the batch in it is still read elsewhere
      ::_exit(mine == nullptr ? 1 : (mine->users() == 1u && mine->inode() != 0) ? 0 : 3);
    }
    CHECK(pid > 0);
    int status = 0;
    CHECK_EQ(::waitpid(pid, &status, 0), pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) != 3);
    wins += WEXITSTATUS(status) == 0;
  }
  CHECK_EQ(wins, 1);  // the second child found it owned by the first
  CHECK(v.owner() != 0u);
  v.disown();
  auto again = shm::Block::claim(fd);
  CHECK(again != nullptr && again->users() == 1u && again->length() == v.length());
  CHECK_EQ(v.owner(), uint32_t(::getpid()));
  lease.reset();
  CHECK_EQ(again->users(), 0u);
  ::close(fd);
  const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  bool threw = false;
  try {
    shm::Block::claim(null);
  } catch (const Error& e) {
    threw = e.kind() == ErrorKind::kOs && e.err() == EINVAL;
  }
  CHECK(threw);  // not a block
  ::close(null);
}

}  // namespace

int main() {
  test_sizes();
  test_counts_in_one_process();
  test_handover_to_a_view();
  test_another_process();
  test_concurrent_leases();
  test_refusals();
  test_forked_child_gives_nothing_back();
  test_held_mapping_retires();
  test_claim_an_exited_owners_block();
  return test::exit_code();
}
