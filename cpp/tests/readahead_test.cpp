// io::ReadAhead (issue 33) on both backends: a file read in lent blocks comes back
// whole and in order, buffered and O_DIRECT (where the temporary directory's file system
// takes it), after seeks to unaligned offsets, through injected EINTR and short reads;
// a file cut short is kSourceChanged naming it; an injected EIO is kOs naming it; the
// destructor gives every block back with reads still in flight. All of it again with
// buffered blocks read in stripes (several reads in flight per block).
//
// Exits 77 (skipped) when io_uring is unavailable and everything else passed.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/engine.hpp"
#include "io/readahead.hpp"
#include "tests/check.hpp"
#include "tests/files.hpp"

namespace {

using namespace fastload;
using namespace fastload::io;

constexpr size_t kBlock = 64 << 10;
constexpr unsigned kBlocks = 12;

uint8_t pattern(uint64_t i) { return static_cast<uint8_t>((i * 131) ^ (i >> 11)); }

// Page-aligned blocks lent out like an ExtractJob's: counts what is lent.
struct Lender {
  char* mem;
  std::vector<bool> lent = std::vector<bool>(kBlocks, false);
  int out = 0;
  int bad_releases = 0;
  Lender() : mem(static_cast<char*>(::operator new[](kBlocks * kBlock, std::align_val_t{4096}))) {}
  ~Lender() { ::operator delete[](mem, std::align_val_t{4096}); }
  BlockLender make() {
    return BlockLender{
        [this](bool) {
          for (unsigned b = 0; b < kBlocks; ++b)
            if (!lent[b]) {
              lent[b] = true;
              ++out;
              return int(b);
            }
          return -1;
        },
        [this](int b) { return mem + size_t(b) * kBlock; },
        [this](int b) {
          if (!lent[size_t(b)]) ++bad_releases;
          lent[size_t(b)] = false;
          --out;
        },
    };
  }
};

struct Case {
  Kind kind;
  bool direct;
  std::string faults;  // FASTLOAD_FAULTS for the engine, "" for none
  size_t stripe = 0;   // ReadAheadOptions::stripe
};

std::unique_ptr<Engine> engine_for(const Case& c) {
  if (c.faults.empty()) ::unsetenv("FASTLOAD_FAULTS");
  else ::setenv("FASTLOAD_FAULTS", c.faults.c_str(), 1);
  EngineOptions eo;
  eo.kind = c.kind;
  eo.depth = 18;
  eo.threads = 8;
  int err = 0;
  auto eng = make_engine(eo, &err);
  ::unsetenv("FASTLOAD_FAULTS");
  return eng;
}

// Reads [from, size) with seeks over `skip` bytes after every `every`-th block; checks
// each block's bytes against the pattern. Returns the bytes checked.
uint64_t read_all(const Case& c, const std::string& path, uint64_t size, uint64_t from,
                  uint64_t skip, uint64_t* direct_blocks) {
  auto eng = engine_for(c);
  CHECK(eng != nullptr);
  if (!eng) return 0;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  int dfd = c.direct ? ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC) : -1;
  Lender lender;
  uint64_t checked = 0;
  {
    ReadAheadOptions o;
    o.fd = fd;
    o.direct_fd = dfd;
    o.size = size;
    o.block_size = kBlock;
    o.depth = 6;
    o.stripe = c.stripe;
    o.name = path;
    ReadAhead ra(*eng, lender.make(), o, nullptr);
    if (from) ra.seek(from);
    uint64_t expect = from;
    ReadAhead::Block b;
    unsigned k = 0;
    while (ra.next(&b)) {
      CHECK_EQ(b.offset, expect);
      bool same = true;
      for (size_t i = 0; i < b.n; ++i) same = same && uint8_t(b.data[i]) == pattern(b.offset + i);
      CHECK(same);
      checked += b.n;
      expect = b.offset + b.n;
      if (skip && ++k % 3 == 0) {
        expect += skip;
        ra.seek(expect);
      }
      CHECK(lender.out <= 7);  // depth in flight + the one the caller holds
    }
    CHECK(expect >= size);
    *direct_blocks = ra.direct_blocks();
  }
  CHECK_EQ(lender.out, 0);
  CHECK_EQ(lender.bad_releases, 0);
  ::close(fd);
  if (dfd >= 0) ::close(dfd);
  return checked;
}

void drop(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void run_case(const Case& c, const std::string& path, uint64_t size) {
  uint64_t direct = 0;
  drop(path);  // uncached: direct reads where the case has a direct descriptor
  CHECK_EQ(read_all(c, path, size, 0, 0, &direct), size);
  if (c.direct) CHECK(direct > 0);
  // An unaligned start and seeks past whole blocks: every byte read is the file's.
  drop(path);
  read_all(c, path, size, 1234, 3 * kBlock + 513, &direct);
}

void expect_error(const Case& c, const std::string& path, uint64_t claimed, ErrorKind kind) {
  auto eng = engine_for(c);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  Lender lender;
  bool thrown = false;
  try {
    ReadAheadOptions o;
    o.fd = fd;
    o.size = claimed;
    o.block_size = kBlock;
    o.stripe = c.stripe;
    o.name = path;
    ReadAhead ra(*eng, lender.make(), o, nullptr);
    ReadAhead::Block b;
    while (ra.next(&b)) {
    }
  } catch (const Error& e) {
    thrown = true;
    CHECK_EQ(int(e.kind()), int(kind));
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
  CHECK(thrown);
  CHECK_EQ(lender.out, 0);
  ::close(fd);
}

}  // namespace

int main() {
  std::string dir = test::make_temp_dir("readahead");
  if (dir.empty()) return 1;
  std::string path = dir + "/data.bin";
  const uint64_t size = 40 * kBlock + 777;  // ends mid-block, off a page
  std::string bytes(size, '\0');
  for (uint64_t i = 0; i < size; ++i) bytes[i] = char(pattern(i));
  test::write_file(path, bytes);
  {
    int fd = ::open(path.c_str(), O_RDONLY);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // uncached: direct reads happen
    ::close(fd);
  }
  int probe = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  bool direct_ok = probe >= 0;
  if (probe >= 0) ::close(probe);
  bool have_uring = uring_available();

  for (Kind kind : {Kind::kPread, Kind::kUring}) {
    if (kind == Kind::kUring && !have_uring) continue;
    for (bool direct : {false, true}) {
      if (direct && !direct_ok) continue;
      run_case({kind, direct, ""}, path, size);
    }
    // EINTR and short reads are retried, invisibly; a direct read cut short off a page
    // goes on buffered.
    run_case({kind, false, "eintr=0.3,short=0.4,seed=5,ops=read"}, path, size);
    if (direct_ok) run_case({kind, true, "eintr=0.2,short=0.5,seed=6,ops=read"}, path, size);
    // A file shorter than claimed: source changed; a failing read: the errno, named.
    expect_error({kind, false, ""}, path, size + 3 * kBlock, ErrorKind::kSourceChanged);
    expect_error({kind, false, "eio=1,seed=1,ops=read,after=4"}, path, size, ErrorKind::kOs);
    // Striped: 16 KiB reads (4 a block), and 5000 bytes (rounded to a page); a direct
    // descriptor too (uncached blocks are one direct read, cached ones striped).
    for (size_t stripe : {size_t(16) << 10, size_t(5000)}) {
      run_case({kind, false, "", stripe}, path, size);
      if (direct_ok) run_case({kind, true, "", stripe}, path, size);
      run_case({kind, false, "eintr=0.3,short=0.4,seed=7,ops=read", stripe}, path, size);
      expect_error({kind, false, "", stripe}, path, size + 3 * kBlock + 100,
                   ErrorKind::kSourceChanged);
      expect_error({kind, false, "eio=1,seed=3,ops=read,after=9", stripe}, path, size,
                   ErrorKind::kOs);
    }
  }
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
  int rc = test::exit_code();
  if (rc == 0 && !have_uring) return test::kSkip;
  return rc;
}
