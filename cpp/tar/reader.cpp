// StreamParser (push) and scan_file (pull) over the one HeaderDecoder.
//
// End-of-archive rules, the same in both (GNU tar's, minus its silent stop):
//  - two zero blocks end the archive; anything after them is ignored;
//  - one zero block followed by the end of input (or by a partial all-zero block) ends it;
//  - one zero block followed by a non-zero block is an error: GNU tar stops there with a
//    warning and tarfile silently, either way dropping the members after it;
//  - the end of input at a header boundary ends it, unless extension headers are waiting
//    for their member; anywhere else (inside a header, data, or the padding after data)
//    it is an error naming what was cut, as for GNU tar and tarfile.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "tar/header.hpp"
#include "tar/reader.hpp"

namespace fastload::tar {

using detail::HeaderDecoder;
using detail::kBlockSize;
using detail::padded;

// ---------------------------------------------------------------------------------------
// StreamParser

struct StreamParser::Impl {
  explicit Impl(std::string name) : dec(std::move(name)) {}

  enum class State : uint8_t {
    kHeader,     // collecting a header block
    kZero,       // collecting the block after a zero block
    kExtension,  // collecting an extension header's data
    kData,       // passing on (or discarding) a member's data
    kPadding,    // discarding the padding after data
    kEnd,        // end-of-archive seen: input is ignored
    kFailed,     // an error was thrown: every later call throws it again
  };

  HeaderDecoder dec;
  State state = State::kHeader;
  uint64_t offset = 0;  // bytes consumed
  // A header block split across feeds is assembled here; a whole block in the caller's
  // buffer is decoded in place.
  char block[kBlockSize];
  size_t fill = 0;
  std::string ext;       // extension data collected so far
  uint64_t ext_left = 0;
  Member member;         // the current member (for on_data errors and skippable())
  bool deliver = false;  // the sink asked for the current member's data
  bool silent = false;   // the current data belongs to an ignored entry (volume label)
  bool ext_pad = false;  // the current padding follows an extension header's data
  uint64_t data_left = 0;
  uint64_t pad_left = 0;
  std::optional<Error> error;

  void consume(const char* p, size_t n, Sink& sink);
  void on_block(const char* b, Sink& sink);
  void end_data(Sink& sink);
  void finish();
  [[noreturn]] void rethrow() const {
    if (error) throw *error;
    throw Error(ErrorKind::kFormat, 0, "malformed tar", dec.name(),
                "parser used after an earlier error");
  }
};

void StreamParser::Impl::end_data(Sink& sink) {
  state = pad_left ? State::kPadding : State::kHeader;
  if (!silent) sink.on_member_end();
}

void StreamParser::Impl::on_block(const char* b, Sink& sink) {
  const uint64_t at = offset - kBlockSize;  // the block was already counted as consumed
  if (state == State::kZero) {
    if (!detail::all_zero(b, kBlockSize))
      dec.fail(at, {}, "a lone zero block is followed by a header (data after the end marker?)");
    state = State::kEnd;
    return;
  }
  const HeaderDecoder::Step step = dec.decode(b, at, &member);
  switch (step.kind) {
    case HeaderDecoder::Kind::kZero:
      state = State::kZero;
      return;
    case HeaderDecoder::Kind::kExtension:
      ext.clear();
      ext_pad = true;
      ext_left = step.data_size;
      pad_left = padded(step.data_size) - step.data_size;
      state = State::kExtension;
      if (ext_left == 0) {
        dec.apply_extension(ext);
        state = State::kHeader;
      }
      return;
    case HeaderDecoder::Kind::kIgnored:
    case HeaderDecoder::Kind::kMember:
      silent = step.kind == HeaderDecoder::Kind::kIgnored;
      ext_pad = false;
      data_left = step.data_size;
      pad_left = padded(step.data_size) - step.data_size;
      deliver = false;
      state = State::kData;
      // The state is set before calling out, so a sink that throws leaves it consistent
      // (feed() then marks the parser failed anyway).
      if (!silent) deliver = sink.on_member(member) == Action::kRead;
      if (data_left == 0) end_data(sink);
      return;
  }
}

// Each step consumes a prefix of the input in the current state and may move to the
// next state; `offset` is advanced before any sink call, so errors and skippable() see
// the position after the bytes already taken.
void StreamParser::Impl::consume(const char* p, size_t n, Sink& sink) {
  while (n > 0) {
    switch (state) {
      case State::kHeader:
      case State::kZero: {
        if (fill == 0 && n >= kBlockSize) {
          offset += kBlockSize;
          const char* b = p;
          p += kBlockSize;
          n -= kBlockSize;
          on_block(b, sink);
        } else {
          const size_t k = std::min(n, kBlockSize - fill);
          std::memcpy(block + fill, p, k);
          fill += k;
          offset += k;
          p += k;
          n -= k;
          if (fill < kBlockSize) return;
          fill = 0;
          on_block(block, sink);
        }
        break;
      }
      case State::kExtension: {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(n, ext_left));
        ext.append(p, k);
        ext_left -= k;
        offset += k;
        p += k;
        n -= k;
        if (ext_left == 0) {
          dec.apply_extension(ext);
          state = pad_left ? State::kPadding : State::kHeader;
        }
        break;
      }
      case State::kData: {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(n, data_left));
        data_left -= k;
        offset += k;
        // Zero-copy: the sink sees the caller's buffer, in pieces that follow the feed
        // boundaries (possibly 1 byte), never past the member's end.
        if (deliver) sink.on_data(p, k);
        p += k;
        n -= k;
        if (data_left == 0) end_data(sink);
        break;
      }
      case State::kPadding: {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(n, pad_left));
        pad_left -= k;
        offset += k;
        p += k;
        n -= k;
        if (pad_left == 0) state = State::kHeader;
        break;
      }
      case State::kEnd:
        offset += n;
        return;
      case State::kFailed:
        rethrow();
    }
  }
}

// The end of input: accepted exactly where scan_file accepts the end of the file (see
// the rules at the top), else an error naming what was cut.
void StreamParser::Impl::finish() {
  switch (state) {
    case State::kEnd:
      return;
    case State::kHeader:
      if (fill != 0)
        dec.fail(offset - fill, {},
                 "archive ends inside a header block (" + std::to_string(fill) + " of 512 bytes)");
      dec.check_can_end(offset);
      break;
    case State::kZero:
      if (!detail::all_zero(block, fill))
        dec.fail(offset - fill, {},
                 "archive ends inside a header block (" + std::to_string(fill) + " of 512 bytes)");
      break;
    case State::kExtension:
      dec.fail(offset, {},
               "archive ends inside an extension header's data (" + std::to_string(ext_left) +
                   " bytes missing)");
    case State::kData:
      if (silent) dec.fail(offset, {}, "archive ends inside a volume label's data");
      dec.fail(member.header_offset, member.path,
               "archive ends inside the member's data (" + std::to_string(data_left) + " of " +
                   std::to_string(member.size) + " bytes missing)");
    case State::kPadding:
      if (ext_pad) dec.fail(offset, {}, "archive ends inside the padding after an extension header's data");
      if (silent) dec.fail(offset, {}, "archive ends inside a volume label's data");
      dec.fail(member.header_offset, member.path,
               "archive ends inside the padding after the member's data");
    case State::kFailed:
      rethrow();
  }
  state = State::kEnd;
}

StreamParser::StreamParser(std::string name) : impl_(new Impl(std::move(name))) {}

StreamParser::~StreamParser() { delete impl_; }

void StreamParser::feed(const char* data, size_t n, Sink& sink) {
  Impl& s = *impl_;
  if (s.state == Impl::State::kFailed) s.rethrow();
  try {
    s.consume(data, n, sink);
  } catch (const Error& e) {
    s.state = Impl::State::kFailed;
    s.error = e;
    throw;
  } catch (...) {
    s.state = Impl::State::kFailed;
    throw;
  }
}

void StreamParser::finish(Sink& sink) {
  (void)sink;  // nothing is reported at the end; kept for symmetry with feed()
  Impl& s = *impl_;
  try {
    s.finish();
  } catch (const Error& e) {
    s.state = Impl::State::kFailed;
    s.error = e;
    throw;
  }
}

bool StreamParser::at_end() const { return impl_->state == Impl::State::kEnd; }

// Skippable bytes are those the parser would discard anyway: a skipped member's data and
// any padding. Header and extension bytes never are, so a seek cannot desynchronise it.
uint64_t StreamParser::skippable() const {
  const Impl& s = *impl_;
  switch (s.state) {
    case Impl::State::kData:
      return s.deliver ? 0 : s.data_left + s.pad_left;
    case Impl::State::kPadding:
      return s.pad_left;
    default:
      return 0;
  }
}

void StreamParser::skipped(uint64_t n, Sink& sink) {
  Impl& s = *impl_;
  if (s.state == Impl::State::kFailed) s.rethrow();
  if (n > skippable())
    throw std::invalid_argument("tar::StreamParser::skipped: " + std::to_string(n) +
                                " bytes is more than skippable()");
  if (n == 0) return;
  try {
    if (s.state == Impl::State::kData) {
      const uint64_t k = std::min(n, s.data_left);
      s.data_left -= k;
      s.offset += k;
      n -= k;
      if (s.data_left == 0) s.end_data(sink);
    }
    if (n > 0) {  // state is kPadding here
      s.pad_left -= n;
      s.offset += n;
      if (s.pad_left == 0) s.state = Impl::State::kHeader;
    }
  } catch (...) {
    s.state = Impl::State::kFailed;
    throw;
  }
}

uint64_t StreamParser::offset() const { return impl_->offset; }

// ---------------------------------------------------------------------------------------
// scan_file

namespace {

// Serves header blocks and extension data from a file with pread. To keep archives of
// many small members from costing one system call per header, a block is read together
// with up to `ahead` bytes after it; the caller asks for read-ahead only when the
// previous member was small, so large members' data is still seeked over, not read.
class FileBlocks {
 public:
  static constexpr size_t kWindow = 64 * 1024;

  FileBlocks(int fd, uint64_t size, const HeaderDecoder& dec) : fd_(fd), size_(size), dec_(dec) {
    buf_.resize(kWindow);
  }

  // n bytes at off (off + n <= size, n <= kWindow); valid until the next call.
  const char* get(uint64_t off, size_t n, bool ahead) {
    if (off >= buf_off_ && off + n <= buf_off_ + buf_len_) return buf_.data() + (off - buf_off_);
    const size_t want = static_cast<size_t>(std::min<uint64_t>(ahead ? kWindow : n, size_ - off));
    read_at(off, buf_.data(), want);
    buf_off_ = off;
    buf_len_ = want;
    return buf_.data();
  }

  // Reads exactly n bytes at off (off + n <= size) into dst, bypassing the window.
  void read_at(uint64_t off, char* dst, size_t n) {
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd_, dst + done, n - done, static_cast<off_t>(off + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        throw Error(ErrorKind::kOs, err, "read", dec_.name(),
                    std::string(std::strerror(err)) + " (at offset " +
                        std::to_string(off + done) + ")");
      }
      if (r == 0)
        dec_.fail(off + done, {}, "file is shorter than its stated size of " +
                                      std::to_string(size_) + " bytes (changed while read?)");
      done += static_cast<size_t>(r);
    }
  }

 private:
  int fd_;
  uint64_t size_;
  const HeaderDecoder& dec_;
  std::vector<char> buf_;
  uint64_t buf_off_ = 0;
  size_t buf_len_ = 0;
};

}  // namespace

void scan_file(int fd, uint64_t size, const std::string& name,
               const std::function<bool(const Member&)>& fn) {
  HeaderDecoder dec(name);
  FileBlocks file(fd, size, dec);
  // Members below this size are read through, not seeked over, with the next header.
  constexpr uint64_t kSmall = 16 * 1024;
  bool ahead = true;
  uint64_t off = 0;
  Member m;
  std::string ext;
  for (;;) {
    if (off == size) {
      dec.check_can_end(size);
      return;
    }
    if (size - off < kBlockSize)
      dec.fail(off, {},
               "archive ends inside a header block (" + std::to_string(size - off) +
                   " of 512 bytes)");
    const HeaderDecoder::Step step = dec.decode(file.get(off, kBlockSize, ahead), off, &m);
    const uint64_t data_off = off + kBlockSize;
    const uint64_t avail = size - data_off;
    switch (step.kind) {
      case HeaderDecoder::Kind::kZero: {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(avail, kBlockSize));
        if (n == 0) return;
        if (!detail::all_zero(file.get(data_off, n, false), n)) {
          if (n < kBlockSize)
            dec.fail(data_off, {},
                     "archive ends inside a header block (" + std::to_string(n) + " of 512 bytes)");
          dec.fail(data_off, {},
                   "a lone zero block is followed by a header (data after the end marker?)");
        }
        return;
      }
      case HeaderDecoder::Kind::kExtension:
        if (step.data_size > avail)
          dec.fail(size, {},
                   "archive ends inside an extension header's data (" +
                       std::to_string(step.data_size - avail) + " bytes missing)");
        ext.resize(static_cast<size_t>(step.data_size));
        if (step.data_size <= FileBlocks::kWindow)
          std::memcpy(ext.data(), file.get(data_off, ext.size(), true), ext.size());
        else
          file.read_at(data_off, ext.data(), ext.size());
        dec.apply_extension(ext);  // before the padding check, as the stream does
        if (padded(step.data_size) > avail)
          dec.fail(size, {}, "archive ends inside the padding after an extension header's data");
        break;
      case HeaderDecoder::Kind::kIgnored:
        if (padded(step.data_size) > avail)
          dec.fail(size, {}, "archive ends inside a volume label's data");
        break;
      case HeaderDecoder::Kind::kMember:
        if (m.size > avail)
          dec.fail(m.header_offset, m.path,
                   "archive ends inside the member's data (" + std::to_string(m.size - avail) +
                       " of " + std::to_string(m.size) + " bytes missing)");
        if (padded(m.size) > avail)
          dec.fail(m.header_offset, m.path, "archive ends inside the padding after the member's data");
        if (!fn(m)) return;
        ahead = m.size < kSmall;
        break;
    }
    off = data_off + padded(step.data_size);
  }
}

}  // namespace fastload::tar
