// Streaming decompression in front of the tar parser: gzip through zlib, zstd through
// libzstd loaded at run time (dlopen of libzstd.so.1: present on most systems, while its
// headers often are not; without it the Python layer decompresses with `zstandard`).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace fastload::copy {

enum class Compression { kNone, kGzip, kZstd };

// Receives decompressed bytes; the pointer is valid only during the call.
using Output = std::function<void(const char*, size_t)>;

class Decompressor {
 public:
  virtual ~Decompressor() = default;
  // Decompresses n input bytes, passing output to out as it is produced. Throws
  // fastload::Error (kFormat) naming the archive on corrupt input.
  virtual void feed(const char* in, size_t n, const Output& out) = 0;
  // The input ended: throws Error(kFormat) if it ended inside a compressed frame.
  virtual void finish(const Output& out) = 0;
};

// Throws Error(kUnsupported) when zstd is asked for and libzstd cannot be loaded.
std::unique_ptr<Decompressor> make_decompressor(Compression c, const std::string& name);

// True when libzstd.so.1 can be loaded here.
bool zstd_available();

}  // namespace fastload::copy
