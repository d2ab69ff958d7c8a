#include "io/mapped.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>

#include "common/error.hpp"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

namespace fastload::io {

namespace {

// The thread's innermost guard. Initial-exec TLS: the signal handler reads it without a
// TLS lookup that might allocate.
__attribute__((tls_model("initial-exec"))) thread_local detail::MapGuard* t_guard = nullptr;

struct sigaction g_previous;  // the SIGBUS action before ours, for faults not ours
std::mutex g_install;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (info->si_code == BUS_ADRERR) {  // a fault past the end of a mapped file
    const char* addr = static_cast<const char*>(info->si_addr);
    for (detail::MapGuard* g = t_guard; g != nullptr; g = g->outer) {
      if (addr >= g->lo && addr < g->hi) {
        t_guard = g->outer;  // inner guards (other mappings) are abandoned too
        siglongjmp(g->jump, 1);
      }
    }
  }
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler == SIG_DFL || g_previous.sa_handler == SIG_IGN) {
    // The faulting access runs again on return and takes the default action (a fault
    // cannot be ignored).
    ::signal(sig, SIG_DFL);
  } else {
    g_previous.sa_handler(sig);
  }
}

// Installs on_sigbus, chaining to the action in place. Asked again for every mapping:
// a handler installed over ours since (faulthandler.enable(), say) is chained to in turn.
void install_handler() {
  std::lock_guard<std::mutex> lock(g_install);
  struct sigaction current;
  if (::sigaction(SIGBUS, nullptr, &current) != 0) throw Error::os(errno, "sigaction", "SIGBUS");
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return;
  struct sigaction ours {};
  ours.sa_sigaction = on_sigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  g_previous = current;
  if (::sigaction(SIGBUS, &ours, nullptr) != 0) throw Error::os(errno, "sigaction", "SIGBUS");
}

const uint64_t kPage = uint64_t(::sysconf(_SC_PAGESIZE));

}  // namespace

namespace detail {
void enter(MapGuard* g) noexcept {
  g->outer = t_guard;
  t_guard = g;
}
void leave(MapGuard* g) noexcept { t_guard = g->outer; }
}  // namespace detail

MappedFile::MappedFile(int fd, uint64_t size, std::string name)
    : size_(size), span_(std::max<uint64_t>((size + kPage - 1) / kPage * kPage, kPage)),
      name_(std::move(name)) {
  install_handler();
  void* p = ::mmap(nullptr, span_, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw Error::os(errno, "map", name_);
  data_ = static_cast<const char*>(p);
}

MappedFile::~MappedFile() { ::munmap(const_cast<char*>(data_), span_); }

void MappedFile::populate(uint64_t offset, uint64_t n) const {
  uint64_t end = std::min(offset + n, size_);
  if (offset >= end) return;
  uint64_t start = offset - offset % kPage;
  while (::madvise(const_cast<char*>(data_) + start, end - start, MADV_POPULATE_READ) != 0) {
    if (errno == EINTR) continue;
    if (errno == EFAULT) throw truncated();  // would have been SIGBUS: past the end now
    if (errno == EINVAL) return;  // an older kernel: the pages fault in as they are used
    throw Error::os(errno, "read", name_);
  }
}

void MappedFile::release(uint64_t offset, uint64_t n) const noexcept {
  uint64_t start = (offset + kPage - 1) / kPage * kPage;
  uint64_t end = std::min(offset + n, span_);
  end -= end % kPage;
  if (start < end) ::madvise(const_cast<char*>(data_) + start, end - start, MADV_DONTNEED);
}

Error MappedFile::truncated() const {
  return Error(ErrorKind::kSourceChanged, 0, "source file changed", name_,
              "it is shorter than when staging began; stage again to pick up the new content");
}

}  // namespace fastload::io
