// A file mapped read-only, so its bytes can be written to other files straight from the
// page cache: a write(2) copies from the cached page once, an O_DIRECT write hands the
// page itself to the device. Read into a buffer first, the same bytes would be copied
// out of the cache one more time (on a small node, CPU the extraction needs).
//
// A mapping has one hazard a read(2) has not: touching a page past the file's end (the
// file was truncated while mapped) raises SIGBUS, which would kill the process. Code
// that reads the mapping runs under guard(): a SIGBUS from inside this mapping, on that
// thread, ends the guarded call early and throws Error(kSourceChanged) naming the file.
// Any other SIGBUS goes to the handler that was there before (Python's faulthandler,
// a sanitizer, the default action).
#pragma once

#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <string>

#include "common/error.hpp"

namespace fastload::io {

namespace detail {
// A guard()ed call in progress: the range it reads and where a SIGBUS in it lands.
struct MapGuard {
  sigjmp_buf jump;
  const char* lo;
  const char* hi;
  MapGuard* outer;  // the thread's enclosing guard, if any
};
void enter(MapGuard* g) noexcept;
void leave(MapGuard* g) noexcept;
}  // namespace detail

class MappedFile {
 public:
  // Maps the first size bytes of fd (which may be closed afterwards); name: how errors
  // name the file. Throws Error(kOs).
  MappedFile(int fd, uint64_t size, std::string name);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const char* data() const { return data_; }
  uint64_t size() const { return size_; }

  // Maps the pages of [offset, offset + n) into the process ahead of use
  // (MADV_POPULATE_READ), reading from the disk those not cached, so the thread that
  // uses them takes no page faults. Thread-safe. Throws Error(kSourceChanged) when the
  // file no longer reaches that far, Error(kOs) on a read error.
  void populate(uint64_t offset, uint64_t n) const;
  // Unmaps the pages wholly inside [offset, offset + n) from the process (the page
  // cache keeps them; a later touch maps them again): bounds what the mapping adds to
  // the process's resident size. Writes in flight from them are not disturbed.
  void release(uint64_t offset, uint64_t n) const noexcept;

  // Runs fn(); a SIGBUS raised by reading this mapping on this thread abandons fn's
  // frames (they are not unwound: their destructors do not run) and throws
  // Error(kSourceChanged). So fn must leave nothing its caller relies on half-done when
  // it faults: after a throw from here the caller treats fn's state as lost.
  template <class F>
  void guard(F&& fn) const {
    detail::MapGuard g;
    g.lo = data_;
    g.hi = data_ + span_;
    // The signal mask is saved: the handler runs with SIGBUS blocked, and the jump out
    // of it must unblock it again.
    if (sigsetjmp(g.jump, 1) != 0) throw truncated();  // the handler left the guard
    detail::enter(&g);
    struct Leave {
      detail::MapGuard* g;
      ~Leave() { detail::leave(g); }
    } leave{&g};
    fn();
  }

  // The error for a file found shorter than mapped (kSourceChanged, naming it).
  Error truncated() const;

 private:

  const char* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t span_ = 0;  // bytes mapped (size rounded up to pages; at least one page)
  std::string name_;
};

}  // namespace fastload::io
