#include "tar/writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "common/error.hpp"
#include "common/write.hpp"

namespace fastload::tar {
namespace {

// ---- headers -------------------------------------------------------------------------

constexpr char kPaxName[] = "././@PaxHeader";  // what Python's tarfile names them

size_t digits(uint64_t v) {
  size_t n = 1;
  while (v >= 10) {
    v /= 10;
    ++n;
  }
  return n;
}

// Length of the pax record "LEN KEY=VALUE\n", LEN counting itself.
uint64_t pax_record_len(size_t key_len, uint64_t value_len) {
  const uint64_t base = 1 + key_len + 1 + value_len + 1;  // ' ', '=', '\n'
  uint64_t n = base + digits(base);
  while (base + digits(n) != n) n = base + digits(n);
  return n;
}

uint64_t pax_bytes(size_t name_len, uint64_t size) {
  uint64_t n = 0;
  if (name_len > kUstarName) n += pax_record_len(4, name_len);
  if (size > kOctalSizeMax) n += pax_record_len(4, digits(size));
  return n;
}

char* put_record(char* p, std::string_view key, std::string_view value) {
  const uint64_t n = pax_record_len(key.size(), value.size());
  const std::string len = std::to_string(n);
  std::memcpy(p, len.data(), len.size());
  p += len.size();
  *p++ = ' ';
  std::memcpy(p, key.data(), key.size());
  p += key.size();
  *p++ = '=';
  std::memcpy(p, value.data(), value.size());
  p += value.size();
  *p++ = '\n';
  return p;
}

// width-1 octal digits, zero-padded, then a NUL (what GNU tar and tarfile write).
void put_octal(char* field, size_t width, uint64_t v) {
  field[width - 1] = '\0';
  for (size_t i = width - 1; i-- > 0;) {
    field[i] = static_cast<char>('0' + (v & 7));
    v >>= 3;
  }
}

// One POSIX ustar block. The name is cut at 100 bytes: a longer one is in a pax header.
void put_ustar(char* b, std::string_view name, uint64_t size, char type) {
  std::memset(b, 0, kBlock);
  std::memcpy(b, name.data(), std::min(name.size(), kUstarName));
  put_octal(b + 100, 8, 0644);
  put_octal(b + 108, 8, 0);
  put_octal(b + 116, 8, 0);
  put_octal(b + 124, 12, size <= kOctalSizeMax ? size : 0);  // else pax "size"
  put_octal(b + 136, 12, uint64_t(kMtime));
  b[156] = type;
  std::memcpy(b + 257, "ustar", 6);  // magic with its NUL, then version "00"
  b[263] = '0';
  b[264] = '0';
  put_octal(b + 329, 8, 0);
  put_octal(b + 337, 8, 0);
  std::memset(b + 148, ' ', 8);
  unsigned sum = 0;
  for (size_t i = 0; i < kBlock; ++i) sum += static_cast<unsigned char>(b[i]);
  put_octal(b + 148, 7, sum);  // "%06o\0" then the space left in place
}

// ---- small I/O helpers ---------------------------------------------------------------

Error changed(const std::string& what, const std::string& detail) {
  return Error(ErrorKind::kSourceChanged, 0, "read", what, detail);
}

}  // namespace

// ---- reading sources -----------------------------------------------------------------

void read_source(int fd, char* dst, uint64_t n, uint64_t off, bool check_eof,
                const std::string& what) {
  uint64_t done = 0;
  const auto longer = [&] {
    return changed(what, "file is longer than when the pack was planned (" + std::to_string(n) +
                             " bytes); pack again");
  };
  while (done < n) {
    const uint64_t want = n - done + (check_eof ? 1 : 0);
    const ssize_t r = ::pread(fd, dst + done, size_t(want), off_t(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error::os(errno, "read", what);
    }
    if (r == 0)
      throw changed(what, "file is shorter than when the pack was planned (" +
                              std::to_string(n) + " bytes, got " + std::to_string(done) +
                              "); pack again");
    done += uint64_t(r);
    if (done > n) throw longer();
  }
  if (check_eof && n == 0) {
    char c;
    ssize_t r;
    do r = ::pread(fd, &c, 1, off_t(off));
    while (r < 0 && errno == EINTR);
    if (r < 0) throw Error::os(errno, "read", what);
    if (r > 0) throw longer();
  }
}


// ---- headers -------------------------------------------------------------------------

uint64_t header_bytes(size_t name_len, uint64_t size) {
  const uint64_t pax = pax_bytes(name_len, size);
  return pax == 0 ? kBlock : kBlock + padded(pax) + kBlock;
}

size_t write_header(std::string_view name, uint64_t size, char* out) {
  const uint64_t pax = pax_bytes(name.size(), size);
  if (pax == 0) {
    put_ustar(out, name, size, '0');
    return kBlock;
  }
  put_ustar(out, kPaxName, pax, 'x');
  char* p = out + kBlock;
  std::memset(p, 0, size_t(padded(pax)));
  if (name.size() > kUstarName) p = put_record(p, "path", name);
  if (size > kOctalSizeMax) p = put_record(p, "size", std::to_string(size));
  char* member = out + kBlock + padded(pax);
  put_ustar(member, name, size, '0');
  return size_t(member + kBlock - out);
}

// ---- ShardFile -----------------------------------------------------------------------

ShardFile::ShardFile(std::string final_path, std::string tmp_path, size_t buffer_bytes)
    : final_path_(std::move(final_path)), tmp_path_(std::move(tmp_path)) {
  buf_.resize(std::max<size_t>(buffer_bytes, 64 * 1024));
  fd_.reset(::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd_) throw Error::os(errno, "create", tmp_path_);
}

ShardFile::~ShardFile() { abort(); }

void ShardFile::write_all(const char* p, size_t n) { write_all_at(fd_.get(), p, n, -1, final_path_); }

void ShardFile::flush() {
  if (fill_ > 0) write_all(buf_.data(), fill_);
  fill_ = 0;
}

char* ShardFile::room(size_t n) {
  if (fill_ + n > buf_.size()) flush();
  return buf_.data() + fill_;
}

void ShardFile::add(std::string_view name, const char* data, uint64_t size) {
  if (done_) throw std::logic_error("ShardFile::add after commit");
  const uint64_t hb = header_bytes(name.size(), size);
  const uint64_t total = hb + padded(size);
  if (total <= buf_.size()) {
    char* p = room(size_t(total));
    write_header(name, size, p);
    if (size) std::memcpy(p + hb, data, size_t(size));
    std::memset(p + hb + size, 0, size_t(padded(size) - size));
    fill_ += size_t(total);
  } else {
    std::string head(size_t(hb), '\0');
    write_header(name, size, head.data());
    flush();
    write_all(head.data(), head.size());
    write_all(data, size_t(size));
    char* pad = room(size_t(padded(size) - size));
    std::memset(pad, 0, size_t(padded(size) - size));
    fill_ += size_t(padded(size) - size);
  }
  bytes_ += total;
  ++members_;
}

void ShardFile::add_from(std::string_view name, uint64_t size, int fd, uint64_t offset,
                         bool whole_file, const std::string& what) {
  if (done_) throw std::logic_error("ShardFile::add_from after commit");
  const uint64_t hb = header_bytes(name.size(), size);
  const uint64_t total = hb + padded(size);
  const uint64_t pad = padded(size) - size;
  if (total + 1 <= buf_.size()) {
    // Read straight into the buffer; the byte after the data is scratch for check_eof.
    char* p = room(size_t(total + 1));
    write_header(name, size, p);
    read_source(fd, p + hb, size, offset, whole_file, what);
    std::memset(p + hb + size, 0, size_t(pad));
    fill_ += size_t(total);
  } else {
    write_header(name, size, room(size_t(hb)));
    fill_ += size_t(hb);
    uint64_t done = 0;
    while (done < size) {
      if (fill_ == buf_.size()) flush();
      const uint64_t take = std::min<uint64_t>(size - done, buf_.size() - fill_);
      read_source(fd, buf_.data() + fill_, take, offset + done, false, what);
      fill_ += size_t(take);
      done += take;
    }
    if (whole_file) {
      char c;
      ssize_t r;
      do r = ::pread(fd, &c, 1, off_t(offset + size));
      while (r < 0 && errno == EINTR);
      if (r < 0) throw Error::os(errno, "read", what);
      if (r > 0)
        throw changed(what, "file is longer than when the pack was planned (" +
                                std::to_string(size) + " bytes); pack again");
    }
    std::memset(room(size_t(pad)), 0, size_t(pad));
    fill_ += size_t(pad);
  }
  bytes_ += total;
  ++members_;
}

void ShardFile::commit(bool sync) {
  if (done_) throw std::logic_error("ShardFile::commit twice");
  try {
    std::memset(room(kEndBytes), 0, kEndBytes);
    fill_ += kEndBytes;
    flush();
    if (sync && ::fdatasync(fd_.get()) != 0) throw Error::os(errno, "sync", final_path_);
    if (::close(fd_.release()) != 0) throw Error::os(errno, "close", final_path_);
    if (::rename(tmp_path_.c_str(), final_path_.c_str()) != 0)
      throw Error::os(errno, "rename into place", final_path_);
  } catch (...) {
    abort();
    throw;
  }
  done_ = true;
}

void ShardFile::abort() noexcept {
  if (done_) return;
  fd_.reset();
  ::unlink(tmp_path_.c_str());
  done_ = true;
}

}  // namespace fastload::tar
