#include "copy/decompress.hpp"

#include <dlfcn.h>
#include <pthread.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "common/error.hpp"
#include "common/write.hpp"

namespace fastload::copy {
namespace {

// zlib counts in uInt: one call takes at most this much input and output.
constexpr size_t kMaxCall = size_t(1) << 30;
// How long the caller waits for the decoder before polling again.
constexpr auto kPollSlice = std::chrono::milliseconds(2);

Error corrupt(const std::string& name, const std::string& what) {
  return Error(ErrorKind::kFormat, 0, "decompress", name, what);
}

// gzip, including several concatenated members (what `cat a.gz b.gz` and some parallel
// compressors produce): after each member's end, inflate is reset for the next.
class Gzip final : public Decompressor {
 public:
  explicit Gzip(std::string name) : name_(std::move(name)) {
    zs_ = {};
    if (inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK) throw Error::os(ENOMEM, "inflateInit", name_);
  }
  ~Gzip() override { inflateEnd(&zs_); }

  Step step(const char* in, size_t n, char* out, size_t cap) override {
    Step s;
    if (ended_) {
      // Bytes after a member: another member, or trailing zero padding (tolerated).
      while (s.used < n && in[s.used] == 0) ++s.used;
      if (s.used == n) return s;
      inflateReset(&zs_);
      ended_ = false;
    }
    uInt avail_in = uInt(std::min(n - s.used, kMaxCall));
    uInt avail_out = uInt(std::min(cap, kMaxCall));
    zs_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in ? in + s.used : nullptr));
    zs_.avail_in = avail_in;
    zs_.next_out = reinterpret_cast<Bytef*>(out);
    zs_.avail_out = avail_out;
    int r = inflate(&zs_, Z_NO_FLUSH);
    s.used += avail_in - zs_.avail_in;
    s.made = avail_out - zs_.avail_out;
    if (r == Z_STREAM_END) {
      ended_ = true;
      any_ = true;
    } else if (r != Z_OK && !(r == Z_BUF_ERROR && (avail_in == 0 || avail_out == 0))) {
      // Z_BUF_ERROR with both input and room: no progress possible, which would spin.
      throw corrupt(name_, std::string("corrupt gzip data (") + (zs_.msg ? zs_.msg : "error") +
                               ")");
    }
    return s;
  }

  void finish() override {
    if (!ended_) throw corrupt(name_, any_ ? "gzip member truncated" : "truncated gzip stream");
  }

 private:
  std::string name_;
  z_stream zs_;
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
  size_t (*compress)(void*, size_t, const void*, size_t, int) = nullptr;
  size_t (*compress_bound)(size_t) = nullptr;
  bool ok = false;           // decoding
  bool can_compress = false;
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
    api.compress = reinterpret_cast<size_t (*)(void*, size_t, const void*, size_t, int)>(
        dlsym(h, "ZSTD_compress"));
    api.compress_bound = reinterpret_cast<size_t (*)(size_t)>(dlsym(h, "ZSTD_compressBound"));
    api.can_compress = api.ok && api.compress && api.compress_bound;
  });
  return api;
}

class Zstd final : public Decompressor {
 public:
  explicit Zstd(std::string name) : name_(std::move(name)), api_(zstd()) {
    if (!api_.ok)
      throw Error(ErrorKind::kUnsupported, 0, "decompress", name_, "libzstd.so.1 is not available");
    ds_ = api_.create();
    if (!ds_) throw Error::os(ENOMEM, "ZSTD_createDStream", name_);
  }
  ~Zstd() override { api_.free(ds_); }

  Step step(const char* in, size_t n, char* out, size_t cap) override {
    ZstdApi::InBuf ib{in, n, 0};
    ZstdApi::OutBuf ob{out, cap, 0};
    size_t r = api_.decompress(ds_, &ob, &ib);
    if (api_.is_error(r))
      throw corrupt(name_, std::string("corrupt zstd data (") + api_.error_name(r) + ")");
    // r == 0 means a frame ended with everything flushed; a call that neither reads nor
    // writes says nothing about frames (it may return the next frame's header-size hint).
    if (ib.pos != 0 || ob.pos != 0)
      frame_done_ = r == 0;
    else if (n != 0 && cap != 0)
      throw corrupt(name_, "the zstd decoder made no progress");
    return {ib.pos, ob.pos};
  }

  void finish() override {
    if (!frame_done_) throw corrupt(name_, "truncated zstd stream");
  }

 private:
  std::string name_;
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
  return nullptr;
}

bool zstd_available() { return zstd().ok; }

std::string zstd_compress(const char* data, size_t n, int level, const std::string& name) {
  const ZstdApi& api = zstd();
  if (!api.can_compress)
    throw Error(ErrorKind::kUnsupported, 0, "compress", name, "libzstd.so.1 is not available");
  std::string out(api.compress_bound(n), '\0');
  size_t r = api.compress(out.data(), out.size(), data, n, level);
  if (api.is_error(r))
    throw std::runtime_error(name + ": zstd compression failed (" + api.error_name(r) + ")");
  out.resize(r);
  return out;
}

uint64_t decompress_to_fd(Compression c, const char* in, size_t n, int fd, uint64_t limit,
                          const std::string& name) {
  std::unique_ptr<Decompressor> dec = make_decompressor(c, name);
  if (!dec) throw std::invalid_argument("decompress_to_fd: no compression given");
  constexpr size_t kOut = size_t(1) << 20;
  std::unique_ptr<char[]> buf(new char[kOut]);
  uint64_t written = 0;
  size_t pos = 0;
  for (;;) {
    Decompressor::Step s = dec->step(in + pos, n - pos, buf.get(), kOut);
    pos += s.used;
    if (s.made > limit - written)
      throw corrupt(name, "decompresses to more than " + std::to_string(limit) + " bytes");
    write_all_at(fd, buf.get(), s.made, int64_t(written), name);
    written += s.made;
    // Everything decodable so far is out once the input is used up and the output was
    // not filled.
    if (pos == n && s.made < kOut) break;
  }
  dec->finish();
  return written;
}

// ---- DecompressThread ---------------------------------------------------------------

DecompressThread::DecompressThread(std::unique_ptr<Decompressor> dec, size_t chunk,
                                   unsigned chunks)
    : dec_(std::move(dec)), chunk_(std::max<size_t>(chunk, 4096)), ring_(std::max(2u, chunks)) {
  for (auto& c : ring_) c.data.reset(new char[chunk_]);
  thread_ = std::thread([this] { run(); });
}

void DecompressThread::run() {
  pthread_setname_np(pthread_self(), "fastload-decode");
  try {
    size_t fill = 0;  // bytes decoded into the chunk being filled
    for (;;) {
      const char* in = nullptr;
      size_t n = 0;
      bool end = false;
      {
        std::unique_lock lk(mu_);
        work_cv_.wait(lk, [&] { return stop_ || lent_ || end_; });
        if (stop_) return;
        if (lent_) {
          in = in_;
          n = in_n_;
        } else {
          end = true;
        }
      }
      // Until the input is used up and the decoder has nothing more to give: it may hold
      // output back while the chunk is full. The input is handed back as soon as it is
      // used up, so the caller can lend the next block while the output is drained.
      size_t pos = 0;
      for (;;) {
        char* out = fill_chunk();
        if (!out) return;
        const char* rest = in ? in + pos : nullptr;
        Decompressor::Step s = dec_->step(rest, n - pos, out + fill, chunk_ - fill);
        pos += s.used;
        fill += s.made;
        bool full = fill == chunk_;
        if (full) {
          publish(fill);
          fill = 0;
        }
        if (in && pos == n) {
          {
            std::lock_guard lk(mu_);
            lent_ = false;
          }
          ready_cv_.notify_one();
          in = nullptr;
          n = pos = 0;
        }
        if (!in && !full) break;
      }
      if (end) {
        dec_->finish();
        if (fill > 0) publish(fill);
        {
          std::lock_guard lk(mu_);
          finished_ = true;
        }
        ready_cv_.notify_one();
        return;
      }
    }
  } catch (...) {
    {
      std::lock_guard lk(mu_);
      error_ = std::current_exception();
    }
    ready_cv_.notify_one();
  }
}

char* DecompressThread::fill_chunk() {
  std::unique_lock lk(mu_);
  work_cv_.wait(lk, [&] { return stop_ || ready_ < ring_.size(); });
  if (stop_) return nullptr;
  return ring_[(head_ + ready_) % ring_.size()].data.get();
}

void DecompressThread::publish(size_t len) {
  {
    std::lock_guard lk(mu_);
    ring_[(head_ + ready_) % ring_.size()].len = len;
    ++ready_;
  }
  ready_cv_.notify_one();
}

template <class Done>
void DecompressThread::drain(const Output& out, const Poll& poll, Done done) {
  std::unique_lock lk(mu_);
  for (;;) {
    if (error_) std::rethrow_exception(error_);
    if (done()) return;
    if (ready_ > 0) {
      // The decoder does not touch ready chunks: this one is read without the lock.
      const Chunk& c = ring_[head_];
      lk.unlock();
      out(c.data.get(), c.len);
      lk.lock();
      head_ = (head_ + 1) % ring_.size();
      --ready_;
      work_cv_.notify_one();
      continue;
    }
    lk.unlock();
    poll();
    lk.lock();
    ready_cv_.wait_for(lk, kPollSlice, [&] { return error_ || ready_ > 0 || done(); });
  }
}

void DecompressThread::feed(const char* in, size_t n, const Output& out, const Poll& poll) {
  if (n == 0) return;
  {
    std::lock_guard lk(mu_);
    if (stop_ || end_) throw std::logic_error("DecompressThread::feed after stop or finish");
    in_ = in;
    in_n_ = n;
    lent_ = true;
  }
  work_cv_.notify_one();
  try {
    drain(out, poll, [&] { return !lent_; });
  } catch (...) {
    stop();
    throw;
  }
}

void DecompressThread::finish(const Output& out, const Poll& poll) {
  {
    std::lock_guard lk(mu_);
    if (stop_ || end_) throw std::logic_error("DecompressThread::finish after stop or finish");
    end_ = true;
  }
  work_cv_.notify_one();
  try {
    drain(out, poll, [&] { return finished_ && ready_ == 0; });
  } catch (...) {
    stop();
    throw;
  }
  stop();
}

void DecompressThread::stop() noexcept {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace fastload::copy
