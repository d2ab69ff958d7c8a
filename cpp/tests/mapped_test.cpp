// MappedFile: the bytes read through the mapping are the file's; populate() and guard()
// turn a file truncated under the mapping into Error(kSourceChanged) naming it instead
// of a SIGBUS, again and again (the signal mask is restored after each), from nested
// guards and on other threads; a fault outside any guard's mapping is not swallowed.
#include "io/mapped.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "tests/check.hpp"

namespace {

using fastload::Error;
using fastload::ErrorKind;
using fastload::io::MappedFile;

const size_t kPage = size_t(::sysconf(_SC_PAGESIZE));

std::string make_file(const char* tag, size_t size) {
  char path[] = "/tmp/fastload-mapped-XXXXXX";
  int fd = ::mkstemp(path);
  if (fd < 0) std::abort();
  std::vector<char> data(size);
  for (size_t i = 0; i < size; ++i) data[i] = char((i * 7 + size_t(tag[0])) & 0xff);
  if (::write(fd, data.data(), size) != ssize_t(size)) std::abort();
  ::close(fd);
  return path;
}

// Reads every byte of [off, off + n) of the mapping under its guard; returns the error
// kind thrown, or -1.
int guarded_sum(const MappedFile& m, size_t off, size_t n, uint64_t* sum) {
  try {
    m.guard([&] {
      uint64_t s = 0;
      const volatile char* p = m.data() + off;
      for (size_t i = 0; i < n; ++i) s += uint8_t(p[i]);
      *sum = s;
    });
    return -1;
  } catch (const Error& e) {
    CHECK(std::strstr(e.what(), "shorter than when staging began") != nullptr);
    return int(e.kind());
  }
}

void test_reads_and_truncation() {
  const size_t size = 3 * kPage + 100;
  std::string path = make_file("a", size);
  int fd = ::open(path.c_str(), O_RDONLY);
  MappedFile m(fd, size, path);
  ::close(fd);  // the mapping outlives the descriptor
  CHECK(m.size() == size);
  m.populate(0, size);
  uint64_t sum = 0, want = 0;
  for (size_t i = 0; i < size; ++i) want += uint8_t((i * 7 + 'a') & 0xff);
  CHECK(guarded_sum(m, 0, size, &sum) == -1 && sum == want);
  m.release(0, size);  // out of the process, still readable
  CHECK(guarded_sum(m, 0, size, &sum) == -1 && sum == want);

  CHECK(::truncate(path.c_str(), off_t(kPage)) == 0);
  bool threw = false;
  try {
    m.populate(0, size);
  } catch (const Error& e) {
    threw = e.kind() == ErrorKind::kSourceChanged &&
            std::strstr(e.what(), path.c_str()) != nullptr;
  }
  CHECK(threw);
  for (int round = 0; round < 3; ++round) {  // SIGBUS is unblocked again each time
    CHECK(guarded_sum(m, 2 * kPage, 10, &sum) == int(ErrorKind::kSourceChanged));
    CHECK(guarded_sum(m, 0, kPage, &sum) == -1);
  }
  std::thread t([&] {  // the guard is per thread
    uint64_t s = 0;
    CHECK(guarded_sum(m, 3 * kPage, 1, &s) == int(ErrorKind::kSourceChanged));
  });
  t.join();
  ::unlink(path.c_str());
}

void test_nested_guards() {
  std::string pa = make_file("b", 2 * kPage), pb = make_file("c", 2 * kPage);
  int fa = ::open(pa.c_str(), O_RDONLY), fb = ::open(pb.c_str(), O_RDONLY);
  MappedFile a(fa, 2 * kPage, pa), b(fb, 2 * kPage, pb);
  ::close(fa);
  ::close(fb);
  CHECK(::truncate(pa.c_str(), 0) == 0);
  std::string named;
  try {
    a.guard([&] {
      b.guard([&] { (void)*(const volatile char*)(a.data() + kPage); });  // a's page
    });
  } catch (const Error& e) {
    named = e.what();
  }
  CHECK(named.find(pa) != std::string::npos);  // the outer guard (a's) caught it
  uint64_t sum = 0;
  CHECK(guarded_sum(b, 0, 2 * kPage, &sum) == -1);  // b's guard still works after
  CHECK(::truncate(pb.c_str(), 0) == 0);
  CHECK(guarded_sum(b, 0, 1, &sum) == int(ErrorKind::kSourceChanged));
  ::unlink(pa.c_str());
  ::unlink(pb.c_str());
}

// A SIGBUS from a mapping no guard covers goes on to the action there before (the
// default: death by SIGBUS; a sanitizer's report under one), in a child.
void test_foreign_fault_is_not_swallowed() {
  std::string mine = make_file("d", kPage), other = make_file("e", kPage);
  pid_t pid = ::fork();
  if (pid == 0) {
    int fd = ::open(mine.c_str(), O_RDONLY);
    MappedFile m(fd, kPage, mine);  // installs the handler
    ::close(fd);
    int fo = ::open(other.c_str(), O_RDONLY);
    MappedFile o(fo, kPage, other);
    ::close(fo);
    if (::truncate(other.c_str(), 0) != 0) ::_exit(3);
    // Under m's guard, but the fault is in o's mapping: not ours to catch.
    m.guard([&] { (void)*(const volatile char*)o.data(); });
    ::_exit(0);
  }
  int status = 0;
  CHECK(::waitpid(pid, &status, 0) == pid);
  CHECK(!WIFEXITED(status) || WEXITSTATUS(status) != 0);  // not swallowed
#if !defined(__SANITIZE_ADDRESS__)
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS);
#endif
  ::unlink(mine.c_str());
  ::unlink(other.c_str());
}

}  // namespace

int main() {
  test_reads_and_truncation();
  test_nested_guards();
  test_foreign_fault_is_not_swallowed();
  return fastload::test::exit_code();
}
