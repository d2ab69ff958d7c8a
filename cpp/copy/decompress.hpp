// Streaming decompression in front of the tar parser: gzip through zlib, zstd through
// libzstd loaded at run time (dlopen of libzstd.so.1: present on most systems, while its
// headers often are not; without it the Python layer decompresses with `zstandard`).
//
// Decoding runs on a thread of its own (DecompressThread), so that on two cores it
// overlaps with parsing and writing the members, as `zstd -dc | tar -x` overlaps its two
// processes: the caller lends each compressed block to the thread and meanwhile takes
// the decompressed output, in large chunks, from a small ring.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fastload::copy {

enum class Compression { kNone, kGzip, kZstd };

// Receives decompressed bytes; the pointer is valid only during the call.
using Output = std::function<void(const char*, size_t)>;

// One compressed stream, decoded piecewise into buffers the caller provides.
class Decompressor {
 public:
  struct Step {
    size_t used = 0;  // input consumed
    size_t made = 0;  // output produced
  };
  virtual ~Decompressor() = default;
  // Decodes from in[0, n) into out[0, cap). When all input is used and some of out is
  // left unfilled, everything decodable from the input so far has been produced;
  // otherwise call again (with the rest of the input, or none). Throws fastload::Error
  // (kFormat) naming the archive on corrupt input.
  virtual Step step(const char* in, size_t n, char* out, size_t cap) = 0;
  // The input ended: throws Error(kFormat) if it ended inside a compressed frame.
  virtual void finish() = 0;
};

// Throws Error(kUnsupported) when zstd is asked for and libzstd cannot be loaded.
// Compression::kNone has no decompressor: returns nullptr.
std::unique_ptr<Decompressor> make_decompressor(Compression c, const std::string& name);

// True when libzstd.so.1 can be loaded here.
bool zstd_available();

// data[0, n) as one zstd frame at `level` (the content size recorded in it). Throws
// Error(kUnsupported) when libzstd.so.1 cannot be loaded; `name` is what errors name.
std::string zstd_compress(const char* data, size_t n, int level, const std::string& name);

// Decodes the whole compressed stream in[0, n) and writes it to fd from offset 0.
// Returns the bytes written. Throws Error(kFormat) naming `name` on corrupt or truncated
// data, or when it would write more than `limit` bytes (a hostile stream cannot fill
// the disk); Error with the errno when writing fails.
uint64_t decompress_to_fd(Compression c, const char* in, size_t n, int fd, uint64_t limit,
                          const std::string& name);

// Runs a Decompressor on its own thread. Memory is bounded by the ring: `chunks`
// buffers of `chunk` bytes of output. Used from one thread (the one that parses).
class DecompressThread {
 public:
  // Called while waiting for the decoder, at least every few milliseconds: the caller's
  // chance to do other work (reap write completions) or to stop by throwing (cancel).
  using Poll = std::function<void()>;

  DecompressThread(std::unique_ptr<Decompressor> dec, size_t chunk, unsigned chunks);
  ~DecompressThread() { stop(); }
  DecompressThread(const DecompressThread&) = delete;
  DecompressThread& operator=(const DecompressThread&) = delete;

  // Lends in[0, n) to the decoder and passes the output ready meanwhile to out, in
  // order; returns once the decoder has consumed all of in (output still on its way is
  // passed by later calls). Throws the decoder's error (corrupt data), or what out or
  // poll threw; the thread is then stopped. Either way, in is no longer used.
  void feed(const char* in, size_t n, const Output& out, const Poll& poll);
  // The input ended: passes the rest of the output, checks that the stream ended
  // cleanly and ends the thread. Throws like feed().
  void finish(const Output& out, const Poll& poll);
  // Stops and joins the thread (idempotent; noexcept: for error paths and destructors).
  void stop() noexcept;

 private:
  struct Chunk {
    std::unique_ptr<char[]> data;
    size_t len = 0;
  };
  void run();
  // Producer side: the chunk to decode into, once the ring has room; nullptr if stopped.
  char* fill_chunk();
  void publish(size_t len);
  // Consumer side: passes ready chunks to out until done() (called under the lock).
  template <class Done>
  void drain(const Output& out, const Poll& poll, Done done);

  std::unique_ptr<Decompressor> dec_;
  const size_t chunk_;
  std::vector<Chunk> ring_;

  std::mutex mu_;
  std::condition_variable work_cv_;   // decoder: input lent, end of input, room, stop
  std::condition_variable ready_cv_;  // caller: a chunk ready, input consumed, done, error
  // Ring: ring_[head_ .. head_ + ready_) (mod size) are ready for the caller; the decoder
  // fills ring_[(head_ + ready_) % size] while ready_ < size.
  size_t head_ = 0;
  size_t ready_ = 0;
  const char* in_ = nullptr;  // lent input, while lent_
  size_t in_n_ = 0;
  bool lent_ = false;
  bool end_ = false;       // no more input
  bool finished_ = false;  // decoder done, every chunk published
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace fastload::copy
