#include "copy/decompress.hpp"

#include <dlfcn.h>
#include <zlib.h>

#include <mutex>
#include <vector>

#include "common/error.hpp"

namespace fastload::copy {
namespace {

constexpr size_t kOut = 1 << 20;

Error corrupt(const std::string& name, const std::string& what) {
  return Error(ErrorKind::kFormat, 0, "decompress", name, what);
}

class Passthrough final : public Decompressor {
 public:
  void feed(const char* in, size_t n, const Output& out) override {
    if (n) out(in, n);
  }
  void finish(const Output&) override {}
};

// gzip, including several concatenated members (what `cat a.gz b.gz` and some parallel
// compressors produce): after each member's end, inflate is reset for the next.
class Gzip final : public Decompressor {
 public:
  explicit Gzip(std::string name) : name_(std::move(name)), buf_(kOut) {
    zs_ = {};
    if (inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK) throw Error::os(ENOMEM, "inflateInit", name_);
  }
  ~Gzip() override { inflateEnd(&zs_); }

  void feed(const char* in, size_t n, const Output& out) override {
    zs_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in));
    while (n > 0) {
      uInt chunk = uInt(std::min<size_t>(n, 1u << 30));
      zs_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in));
      zs_.avail_in = chunk;
      while (zs_.avail_in > 0) {
        if (ended_) {
          // Bytes after a member: another member, or trailing zero padding (tolerated).
          if (*zs_.next_in == 0) {
            ++zs_.next_in;
            --zs_.avail_in;
            continue;
          }
          inflateReset(&zs_);
          ended_ = false;
        }
        zs_.next_out = reinterpret_cast<Bytef*>(buf_.data());
        zs_.avail_out = uInt(buf_.size());
        int r = inflate(&zs_, Z_NO_FLUSH);
        size_t produced = buf_.size() - zs_.avail_out;
        if (produced) out(buf_.data(), produced);
        if (r == Z_STREAM_END) {
          ended_ = true;
          any_ = true;
        } else if (r == Z_BUF_ERROR && produced == 0) {
          break;  // needs more input
        } else if (r != Z_OK) {
          throw corrupt(name_, std::string("corrupt gzip data (") + (zs_.msg ? zs_.msg : "error") +
                                   ")");
        }
      }
      in += chunk;
      n -= chunk;
    }
  }

  void finish(const Output&) override {
    if (!ended_) throw corrupt(name_, any_ ? "gzip member truncated" : "truncated gzip stream");
  }

 private:
  std::string name_;
  z_stream zs_;
  std::vector<char> buf_;
  bool ended_ = false;
  bool any_ = false;
};

// The handful of libzstd's stable streaming API, declared here because the headers may
// be missing where the library is present.
struct ZstdApi {
  struct InBuf {
    const void* src;
    size_t size;
    size_t pos;
  };
  struct OutBuf {
    void* dst;
    size_t size;
    size_t pos;
  };
  void* (*create)() = nullptr;
  size_t (*free)(void*) = nullptr;
  size_t (*decompress)(void*, OutBuf*, InBuf*) = nullptr;
  unsigned (*is_error)(size_t) = nullptr;
  const char* (*error_name)(size_t) = nullptr;
  bool ok = false;
};

const ZstdApi& zstd() {
  static ZstdApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    api.create = reinterpret_cast<void* (*)()>(dlsym(h, "ZSTD_createDStream"));
    api.free = reinterpret_cast<size_t (*)(void*)>(dlsym(h, "ZSTD_freeDStream"));
    api.decompress = reinterpret_cast<size_t (*)(void*, ZstdApi::OutBuf*, ZstdApi::InBuf*)>(
        dlsym(h, "ZSTD_decompressStream"));
    api.is_error = reinterpret_cast<unsigned (*)(size_t)>(dlsym(h, "ZSTD_isError"));
    api.error_name = reinterpret_cast<const char* (*)(size_t)>(dlsym(h, "ZSTD_getErrorName"));
    api.ok = api.create && api.free && api.decompress && api.is_error && api.error_name;
  });
  return api;
}

class Zstd final : public Decompressor {
 public:
  explicit Zstd(std::string name) : name_(std::move(name)), buf_(kOut), api_(zstd()) {
    if (!api_.ok)
      throw Error(ErrorKind::kUnsupported, 0, "decompress", name_, "libzstd.so.1 is not available");
    ds_ = api_.create();
    if (!ds_) throw Error::os(ENOMEM, "ZSTD_createDStream", name_);
  }
  ~Zstd() override { api_.free(ds_); }

  void feed(const char* in, size_t n, const Output& out) override {
    ZstdApi::InBuf ib{in, n, 0};
    // Until the input is used up and the decoder has nothing more to flush. r == 0 means
    // a frame ended with everything flushed; a call that neither reads nor writes says
    // nothing about frames (it may return the next frame's header-size hint).
    for (;;) {
      ZstdApi::OutBuf ob{buf_.data(), buf_.size(), 0};
      size_t before = ib.pos;
      size_t r = api_.decompress(ds_, &ob, &ib);
      if (api_.is_error(r))
        throw corrupt(name_, std::string("corrupt zstd data (") + api_.error_name(r) + ")");
      if (ob.pos) out(buf_.data(), ob.pos);
      if (ib.pos != before || ob.pos) frame_done_ = r == 0;
      if (ib.pos == ib.size && ob.pos < ob.size) break;
    }
  }

  void finish(const Output&) override {
    if (!frame_done_) throw corrupt(name_, "truncated zstd stream");
  }

 private:
  std::string name_;
  std::vector<char> buf_;
  const ZstdApi& api_;
  void* ds_ = nullptr;
  bool frame_done_ = false;
};

}  // namespace

std::unique_ptr<Decompressor> make_decompressor(Compression c, const std::string& name) {
  switch (c) {
    case Compression::kGzip:
      return std::make_unique<Gzip>(name);
    case Compression::kZstd:
      return std::make_unique<Zstd>(name);
    case Compression::kNone:
      break;
  }
  return std::make_unique<Passthrough>();
}

bool zstd_available() { return zstd().ok; }

}  // namespace fastload::copy
