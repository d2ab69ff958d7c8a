// StreamParser (push) and scan_file (pull) over the one HeaderDecoder.
//
// End-of-archive rules, the same in both (GNU tar's):
//  - two zero blocks end the archive; anything after them is ignored;
//  - one zero block followed by the end of input, or by a partial all-zero block, ends it;
//  - one zero block followed by anything else ends it with a warning ("a lone zero
//    block"): GNU tar stops there too (only --ignore-zeros reads on);
//  - the end of input at a header boundary ends it (extension headers waiting for their
//    member are dropped, as GNU tar drops them); a partial all-zero block there too;
//  - anywhere else (inside a header, a sparse map, data, or the padding after data) it
//    is an error naming what was cut.
// A member whose type carries no data but whose size field is not 0 (a hard link with a
// body) is followed by a header, or by its body when the next block is no header
// (header_like()): the body is skipped with a warning.
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
    kHeader,     // collecting a header block (or a sparse map block, or a link's body)
    kZero,       // collecting the block after a zero block
    kExtension,  // collecting an extension header's data
    kData,       // passing on (or discarding) a member's data
    kPadding,    // discarding bytes of an entry's area that are not data
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
  bool silent = false;   // the current area belongs to no member (volume label)
  bool ext_pad = false;  // the current padding follows an extension header's data
  bool in_body = false;  // the current padding is a link's body
  bool more = false;     // the decoder waits for the member's next block (kMore)
  uint64_t body = 0;     // the last member's body size, if the next block is no header
  // The current member's data in segments: data_left bytes delivered, then pad_left
  // skipped. A sparse member has one segment per extent; `seg` is the current one.
  size_t seg = 0;
  uint64_t tail = 0;     // sparse: area bytes after the last extent's padding
  uint64_t area = 0;     // the current member's area (data and padding after its header)
  uint64_t data_left = 0;
  uint64_t pad_left = 0;
  std::optional<Error> error;

  void consume(const char* p, size_t n, Sink& sink);
  void on_block(const char* b, Sink& sink);
  void start_member(const HeaderDecoder::Step& step, Sink& sink);
  void set_segment();
  void end_data(Sink& sink);
  void end_padding();
  void warnings(Sink& sink) {
    if (dec.has_warnings())
      for (const std::string& w : dec.take_warnings()) sink.on_warning(w);
  }
  void finish(Sink& sink);
  [[noreturn]] void rethrow() const {
    if (error) throw *error;
    throw Error(ErrorKind::kFormat, 0, "malformed tar", dec.name(),
                "parser used after an earlier error");
  }
};

void StreamParser::Impl::set_segment() {
  if (!member.sparse) {
    data_left = member.data_size;
    return;  // pad_left was set from the area
  }
  if (member.extents.empty()) {
    data_left = 0;
    return;
  }
  const SparseExtent& e = member.extents[seg];
  data_left = e.size;
  pad_left = padded(e.size) - e.size + (seg + 1 == member.extents.size() ? tail : 0);
}

void StreamParser::Impl::start_member(const HeaderDecoder::Step& step, Sink& sink) {
  silent = step.kind == HeaderDecoder::Kind::kIgnored;
  ext_pad = false;
  in_body = false;
  deliver = false;
  seg = 0;
  tail = 0;
  data_left = 0;
  pad_left = step.area;
  area = step.area;
  body = 0;
  if (silent) {
    state = pad_left ? State::kPadding : State::kHeader;
    return;
  }
  if (member.sparse) {
    uint64_t used = 0;
    for (const SparseExtent& e : member.extents) used += padded(e.size);
    tail = step.area - used;
    if (member.extents.empty()) pad_left = step.area;
  } else {
    pad_left = step.area - member.data_size;
  }
  if (step.area == 0) body = step.body;
  // The state is set before calling out, so a sink that throws leaves it consistent
  // (feed() then marks the parser failed anyway).
  state = State::kData;
  deliver = sink.on_member(member) == Action::kRead;
  if (!deliver) {
    // Nothing is delivered: the whole area is discarded in one run.
    pad_left = step.area;
    data_left = 0;
    sink.on_member_end();
    state = pad_left ? State::kPadding : State::kHeader;
    return;
  }
  set_segment();
  if (data_left == 0) end_data(sink);
}

void StreamParser::Impl::end_data(Sink& sink) {
  if (member.sparse && seg + 1 < member.extents.size()) {
    state = State::kPadding;  // the padding after one extent, then the next
    if (pad_left == 0) end_padding();
    return;
  }
  state = pad_left ? State::kPadding : State::kHeader;
  sink.on_member_end();
}

void StreamParser::Impl::end_padding() {
  if (!ext_pad && !in_body && !silent && deliver && member.sparse &&
      seg + 1 < member.extents.size()) {
    ++seg;
    set_segment();
    state = State::kData;
    return;
  }
  in_body = false;
  state = State::kHeader;
}

void StreamParser::Impl::on_block(const char* b, Sink& sink) {
  const uint64_t at = offset - kBlockSize;  // the block was already counted as consumed
  if (state == State::kZero) {
    if (!detail::all_zero(b, kBlockSize)) {
      dec.lone_zero_block(at - kBlockSize);
      warnings(sink);
    }
    state = State::kEnd;
    return;
  }
  if (more) {
    const HeaderDecoder::Step step = dec.more(b, at, &member);
    warnings(sink);
    if (step.kind == HeaderDecoder::Kind::kMore) return;
    more = false;
    start_member(step, sink);
    return;
  }
  if (body > 0) {
    const uint64_t n = std::exchange(body, 0);
    if (!detail::header_like(b)) {
      // The block is the first of the last member's body: skipped with the rest of it.
      dec.body_skipped(member, at, n);
      warnings(sink);
      ext_pad = false;
      silent = false;
      in_body = true;
      pad_left = padded(n) - kBlockSize;
      state = pad_left ? State::kPadding : State::kHeader;
      if (!pad_left) in_body = false;
      return;
    }
  }
  const HeaderDecoder::Step step = dec.decode(b, at, &member);
  warnings(sink);
  switch (step.kind) {
    case HeaderDecoder::Kind::kZero:
      state = State::kZero;
      return;
    case HeaderDecoder::Kind::kMore:
      more = true;
      return;
    case HeaderDecoder::Kind::kExtension:
      ext.clear();
      ext_pad = true;
      in_body = false;
      ext_left = step.data_size;
      pad_left = padded(step.data_size) - step.data_size;
      state = State::kExtension;
      if (ext_left == 0) {
        dec.apply_extension(ext);
        warnings(sink);
        state = State::kHeader;
      }
      return;
    case HeaderDecoder::Kind::kIgnored:
    case HeaderDecoder::Kind::kMember:
      start_member(step, sink);
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
          warnings(sink);
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
        if (pad_left == 0) end_padding();
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
void StreamParser::Impl::finish(Sink& sink) {
  const auto cut_header = [&] {
    dec.fail(offset - fill, {},
             "archive ends inside a header block (" + std::to_string(fill) + " of 512 bytes)");
  };
  switch (state) {
    case State::kEnd:
      return;
    case State::kHeader:
      if (more) dec.fail_more_cut(offset - fill);
      if (fill != 0 && !detail::all_zero(block, fill)) cut_header();
      break;
    case State::kZero:
      if (!detail::all_zero(block, fill)) {
        dec.partial_block(offset - fill, fill);
        warnings(sink);
      }
      break;
    case State::kExtension:
      dec.fail(offset, {},
               "archive ends inside an extension header's data (" + std::to_string(ext_left) +
                   " bytes missing)");
    case State::kData:
    case State::kPadding: {
      if (ext_pad) dec.fail(offset, {}, "archive ends inside the padding after an extension header's data");
      if (silent) dec.fail(offset, {}, "archive ends inside a volume label's data");
      if (in_body)
        dec.fail(member.header_offset, member.path,
                 "archive ends inside the body after the member's header (" +
                     std::to_string(pad_left) + " bytes missing)");
      // What is missing of the member's area.
      const uint64_t missing = member.data_offset + area - offset;
      dec.fail_cut(member, area, missing);

    }
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
  Impl& s = *impl_;
  if (s.state == Impl::State::kFailed) s.rethrow();
  try {
    s.finish(sink);
  } catch (const Error& e) {
    s.state = Impl::State::kFailed;
    s.error = e;
    throw;
  } catch (...) {
    s.state = Impl::State::kFailed;
    throw;
  }
}

bool StreamParser::at_end() const { return impl_->state == Impl::State::kEnd; }

// Skippable bytes are those the parser would discard anyway: a skipped member's area and
// any padding. Header, extension, map and delivered data bytes never are, so a seek
// cannot desynchronise it.
uint64_t StreamParser::skippable() const {
  const Impl& s = *impl_;
  return s.state == Impl::State::kPadding ? s.pad_left : 0;
}

void StreamParser::skipped(uint64_t n, Sink& sink) {
  (void)sink;
  Impl& s = *impl_;
  if (s.state == Impl::State::kFailed) s.rethrow();
  if (n > skippable())
    throw std::invalid_argument("tar::StreamParser::skipped: " + std::to_string(n) +
                                " bytes is more than skippable()");
  if (n == 0) return;
  s.pad_left -= n;
  s.offset += n;
  if (s.pad_left == 0) s.end_padding();
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
               const std::function<bool(const Member&)>& fn,
               const std::function<void(const std::string&)>& warn) {
  HeaderDecoder dec(name);
  FileBlocks file(fd, size, dec);
  const auto warnings = [&] {
    if (!dec.has_warnings()) return;
    std::vector<std::string> w = dec.take_warnings();
    if (warn)
      for (const std::string& s : w) warn(s);
  };
  // Members below this size are read through, not seeked over, with the next header.
  constexpr uint64_t kSmall = 16 * 1024;
  bool ahead = true;
  uint64_t off = 0;
  uint64_t body = 0;  // the last member's body size, if the next block is no header
  Member m;
  std::string ext;
  for (;;) {
    if (off == size) return;
    if (size - off < kBlockSize) {
      const size_t n = static_cast<size_t>(size - off);
      if (detail::all_zero(file.get(off, n, false), n)) return;
      dec.fail(off, {}, "archive ends inside a header block (" + std::to_string(n) + " of 512 bytes)");
    }
    const char* b = file.get(off, kBlockSize, ahead);
    if (body > 0) {
      const uint64_t n = std::exchange(body, 0);
      if (!detail::header_like(b)) {
        dec.body_skipped(m, off, n);
        warnings();
        if (padded(n) > size - off)
          dec.fail(m.header_offset, m.path,
                   "archive ends inside the body after the member's header (" +
                       std::to_string(padded(n) - (size - off)) + " bytes missing)");
        off += padded(n);
        continue;
      }
    }
    HeaderDecoder::Step step = dec.decode(b, off, &m);
    warnings();
    uint64_t data_off = off + kBlockSize;
    while (step.kind == HeaderDecoder::Kind::kMore) {
      if (size - data_off < kBlockSize) dec.fail_more_cut(data_off);
      step = dec.more(file.get(data_off, kBlockSize, true), data_off, &m);
      warnings();
      data_off += kBlockSize;
    }
    const uint64_t avail = size - data_off;
    switch (step.kind) {
      case HeaderDecoder::Kind::kMore:
        break;  // not reached: read above
      case HeaderDecoder::Kind::kZero: {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(avail, kBlockSize));
        if (n == 0) return;
        if (!detail::all_zero(file.get(data_off, n, false), n)) {
          if (n < kBlockSize) dec.partial_block(data_off, n);
          else dec.lone_zero_block(off);
          warnings();
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
        warnings();
        if (padded(step.data_size) > avail)
          dec.fail(size, {}, "archive ends inside the padding after an extension header's data");
        off = data_off + padded(step.data_size);
        continue;
      case HeaderDecoder::Kind::kIgnored:
        if (step.area > avail) dec.fail(size, {}, "archive ends inside a volume label's data");
        break;
      case HeaderDecoder::Kind::kMember:
        if (step.area > avail) dec.fail_cut(m, step.area, step.area - avail);
        if (!fn(m)) return;
        ahead = m.data_size < kSmall;
        if (step.area == 0) body = step.body;
        break;
    }
    off = data_off + step.area;
  }
}

}  // namespace fastload::tar
