// DecompressThread: output identical to the input for gzip (one member, several, zero
// padding) and zstd (when libzstd.so.1 is here), whatever the block and chunk sizes;
// corrupt and truncated streams throw naming the archive; an exception from the output
// callback or from poll (a cancel) stops the thread, which no longer touches the
// lent input (ASan checks); a thread abandoned mid-stream ends. zstd_compress and
// decompress_to_fd (the index object's copy) round-trip, stop at their limit, and refuse
// truncated input.
#include "copy/decompress.hpp"

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/error.hpp"
#include "tests/check.hpp"

namespace {

using fastload::Error;
using fastload::ErrorKind;
using fastload::copy::Compression;
using fastload::copy::Decompressor;
using fastload::copy::DecompressThread;
using fastload::copy::make_decompressor;

const std::string kName = "/data/archive.tar.x";

// Half random, half repetitive: both stored-like and well-compressed stretches.
std::string sample(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i)
    s[i] = (i / 65536) % 2 ? char('a' + (i % 7)) : char(rng());
  return s;
}

std::string gzip(const std::string& data, int level = 6) {
  z_stream zs{};
  CHECK(deflateInit2(&zs, level, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::string out(deflateBound(&zs, uLong(data.size())), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  zs.avail_in = uInt(data.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = uInt(out.size());
  CHECK(deflate(&zs, Z_FINISH) == Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

// One zstd frame with a content checksum (as the zstd CLI writes), made by libzstd's
// stable one-shot API, if the library is here.
std::string zstd(const std::string& data) {
  void* h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return {};
  auto bound = reinterpret_cast<size_t (*)(size_t)>(dlsym(h, "ZSTD_compressBound"));
  auto create = reinterpret_cast<void* (*)()>(dlsym(h, "ZSTD_createCCtx"));
  auto free_cctx = reinterpret_cast<size_t (*)(void*)>(dlsym(h, "ZSTD_freeCCtx"));
  auto set = reinterpret_cast<size_t (*)(void*, int, int)>(dlsym(h, "ZSTD_CCtx_setParameter"));
  auto compress = reinterpret_cast<size_t (*)(void*, void*, size_t, const void*, size_t)>(
      dlsym(h, "ZSTD_compress2"));
  auto is_error = reinterpret_cast<unsigned (*)(size_t)>(dlsym(h, "ZSTD_isError"));
  if (!bound || !create || !free_cctx || !set || !compress || !is_error) return {};
  constexpr int kChecksumFlag = 201;  // ZSTD_c_checksumFlag
  void* cctx = create();
  CHECK(!is_error(set(cctx, kChecksumFlag, 1)));
  std::string out(bound(data.size()), '\0');
  size_t n = compress(cctx, out.data(), out.size(), data.data(), data.size());
  free_cctx(cctx);
  CHECK(!is_error(n));
  out.resize(is_error(n) ? 0 : n);
  return out;
}

struct Run {
  std::string out;
  std::string error;  // what() of the fastload::Error thrown, if any
  ErrorKind kind = ErrorKind::kOs;
};

// Feeds `in` in blocks of `block` bytes (the last may be shorter) and finishes.
Run decode(Compression c, const std::string& in, size_t block, size_t chunk, unsigned chunks) {
  Run r;
  DecompressThread t(make_decompressor(c, kName), chunk, chunks);
  auto out = [&](const char* p, size_t n) { r.out.append(p, n); };
  auto poll = [] {};
  try {
    for (size_t off = 0; off < in.size(); off += block) {
      // A copy per block, freed after feed returns: ASan sees any later use.
      size_t k = std::min(block, in.size() - off);
      std::vector<char> lent(in.begin() + off, in.begin() + off + k);
      t.feed(lent.data(), lent.size(), out, poll);
    }
    t.finish(out, poll);
  } catch (const Error& e) {
    r.error = e.what();
    r.kind = e.kind();
  }
  return r;
}

void check_roundtrip(Compression c, const std::string& data, const std::string& packed) {
  for (size_t block : {size_t(1) << 20, size_t(65536), size_t(4097), size_t(7)}) {
    if (block < 4096 && packed.size() > (1u << 20)) continue;  // too slow to be worth it
    for (auto [chunk, chunks] : {std::pair<size_t, unsigned>{4096, 2}, {65536, 3}, {1 << 20, 8}}) {
      Run r = decode(c, packed, block, chunk, chunks);
      CHECK_EQ(r.error, std::string());
      CHECK(r.out == data);
    }
  }
}

void test_gzip() {
  std::string data = sample(3 << 20, 1);
  check_roundtrip(Compression::kGzip, data, gzip(data));
  check_roundtrip(Compression::kGzip, data, gzip(data, 0));  // stored blocks
  // Members one after another (pigz -i, cat a.gz b.gz), then zero padding.
  std::string a = data.substr(0, 1000000), b = data.substr(1000000);
  check_roundtrip(Compression::kGzip, data, gzip(a) + gzip(b) + std::string(1024, '\0'));
  check_roundtrip(Compression::kGzip, "", gzip(""));
}

void test_zstd() {
  std::string data = sample(3 << 20, 2);
  std::string packed = zstd(data);
  if (packed.empty() || !fastload::copy::zstd_available()) {
    std::fprintf(stderr, "libzstd.so.1 is not here: zstd cases skipped\n");
    return;
  }
  check_roundtrip(Compression::kZstd, data, packed);
  std::string a = data.substr(0, 1000000), b = data.substr(1000000);
  check_roundtrip(Compression::kZstd, data, zstd(a) + zstd(b));  // two frames
}

void check_fails(Compression c, const std::string& packed, const char* says) {
  for (auto [chunk, chunks] : {std::pair<size_t, unsigned>{4096, 2}, {1 << 20, 8}}) {
    Run r = decode(c, packed, 65536, chunk, chunks);
    if (r.error.empty()) std::fprintf(stderr, "  expected an error saying: %s\n", says);
    CHECK(!r.error.empty());
    CHECK_EQ(r.kind, ErrorKind::kFormat);
    CHECK(r.error.find(kName) != std::string::npos);
    CHECK(r.error.find(says) != std::string::npos);
    if (r.error.find(says) == std::string::npos)
      std::fprintf(stderr, "  got: %s\n", r.error.c_str());
  }
}

void test_corrupt_and_truncated() {
  std::string data = sample(2 << 20, 3);
  std::string gz = gzip(data);
  std::string bad = gz;
  for (size_t i = bad.size() / 2; i < bad.size() / 2 + 64; ++i) bad[i] = char(bad[i] ^ 0x5a);
  check_fails(Compression::kGzip, bad, "corrupt gzip data");
  check_fails(Compression::kGzip, gz.substr(0, gz.size() / 2), "truncated");
  check_fails(Compression::kGzip, "", "truncated gzip stream");
  check_fails(Compression::kGzip, gz + "garbage", "corrupt gzip data");

  std::string zs = zstd(data);
  if (zs.empty() || !fastload::copy::zstd_available()) return;
  std::string zbad = zs;
  // Past the frame header: flipped bytes inside a block or the content checksum.
  for (size_t i = zbad.size() / 2; i < zbad.size() / 2 + 64; ++i) zbad[i] = char(zbad[i] ^ 0x5a);
  check_fails(Compression::kZstd, zbad, "corrupt zstd data");
  check_fails(Compression::kZstd, zs.substr(0, zs.size() / 2), "truncated zstd stream");
  check_fails(Compression::kZstd, "", "truncated zstd stream");
}

// Copies input to output a little at a time, slowly: the caller has to wait (and poll).
class Slow final : public Decompressor {
 public:
  Step step(const char*, size_t n, char*, size_t cap) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    size_t k = std::min({n, cap, size_t(1000)});
    return {k, k};
  }
  void finish() override {}
};

struct Stop : std::runtime_error {
  Stop() : std::runtime_error("stop") {}
};

void test_stops() {
  std::string data = sample(1 << 20, 4);
  std::string gz = gzip(data);
  // The output callback throws (a parse error, a write error): feed rethrows it, the
  // thread stops; the lent block is freed right after (ASan: never read again).
  for (size_t after : {size_t(0), size_t(1), size_t(200000)}) {
    DecompressThread t(make_decompressor(Compression::kGzip, kName), 4096, 2);
    size_t seen = 0;
    bool caught = false;
    auto out = [&](const char*, size_t n) {
      if (seen >= after) throw Stop();
      seen += n;
    };
    try {
      for (size_t off = 0; off < gz.size(); off += 65536) {
        size_t k = std::min<size_t>(65536, gz.size() - off);
        std::vector<char> lent(gz.begin() + off, gz.begin() + off + k);
        t.feed(lent.data(), lent.size(), out, [] {});
      }
      t.finish(out, [] {});
    } catch (const Stop&) {
      caught = true;
    }
    CHECK(caught);
    // Used after a stop: refused, not a hang.
    bool refused = false;
    try {
      t.feed(gz.data(), 1, out, [] {});
    } catch (const std::logic_error&) {
      refused = true;
    }
    CHECK(refused);
  }
  // poll throws (the job was cancelled) while the caller waits for a slow decoder.
  {
    DecompressThread t(std::make_unique<Slow>(), 4096, 2);
    std::vector<char> lent(1 << 20, 'x');
    int polls = 0;
    bool caught = false;
    try {
      t.feed(lent.data(), lent.size(), [](const char*, size_t) {}, [&] {
        if (++polls == 3) throw Stop();
      });
    } catch (const Stop&) {
      caught = true;
    }
    CHECK(caught);
    lent.clear();
    lent.shrink_to_fit();
  }
  // Abandoned mid-stream, with the ring full and nobody draining it: the destructor ends it.
  {
    DecompressThread t(make_decompressor(Compression::kGzip, kName), 4096, 2);
    std::string first;
    t.feed(gz.data(), gz.size() / 2, [&](const char* p, size_t n) { first.append(p, n); }, [] {});
    CHECK(first.size() <= data.size());
  }
  // Never fed at all.
  { DecompressThread t(make_decompressor(Compression::kGzip, kName), 4096, 2); }
}

// The whole of fd's contents.
std::string contents(int fd) {
  std::string out(size_t(lseek(fd, 0, SEEK_END)), '\0');
  CHECK_EQ(pread(fd, out.data(), out.size(), 0), ssize_t(out.size()));
  return out;
}

void test_to_fd() {
  using fastload::copy::decompress_to_fd;
  std::string data = sample(5 << 20, 3);
  // gzip always (zlib is linked); zstd through zstd_compress where libzstd is here.
  std::vector<std::pair<Compression, std::string>> cases = {{Compression::kGzip, gzip(data)}};
  if (fastload::copy::zstd_available())
    cases.emplace_back(Compression::kZstd,
                       fastload::copy::zstd_compress(data.data(), data.size(), 3, kName));
  for (auto& [c, packed] : cases) {
    int fd = memfd_create("decoded", MFD_CLOEXEC);
    CHECK(fd >= 0);
    CHECK_EQ(decompress_to_fd(c, packed.data(), packed.size(), fd, data.size(), kName),
             uint64_t(data.size()));
    CHECK(contents(fd) == data);
    using Case = std::tuple<size_t, uint64_t, const char*>;  // bytes cut off, limit, error
    for (auto [cut, limit, says] : {Case{0, data.size() - 1, "more than"},
                                    Case{packed.size() / 2, data.size(), "truncated"}}) {
      CHECK(ftruncate(fd, 0) == 0);
      std::string what;
      try {
        decompress_to_fd(c, packed.data(), packed.size() - cut, fd, limit, kName);
      } catch (const Error& e) {
        what = e.what();
        CHECK_EQ(e.kind(), ErrorKind::kFormat);
      }
      CHECK(what.find(kName) != std::string::npos);
      CHECK(what.find(says) != std::string::npos);
    }
    close(fd);
  }
}

}  // namespace

int main() {
  test_gzip();
  test_zstd();
  test_to_fd();
  test_corrupt_and_truncated();
  test_stops();
  return fastload::test::exit_code();
}
