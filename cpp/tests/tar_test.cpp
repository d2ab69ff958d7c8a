// Tar parsing: archives written by GNU tar (gnu, posix, ustar) and Python's tarfile
// (USTAR, GNU, PAX) read the same as tarfile lists them, through StreamParser under
// every feed split and through scan_file; crafted headers for what tools do not write
// (sizes past 8 GiB, bad fields, unknown types); every error is kFormat and names the
// member; path safety against PEP 706's data filter.
// GCC 12 at -O3 reports a false -Wrestrict inside std::string concatenation inlined
// from check.hpp's show() (GCC bug 105329); nothing here writes through overlapping
// pointers.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wrestrict"
#endif
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "check.hpp"
#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "tar/reader.hpp"
#include "tar_builder.hpp"

namespace {

using fastload::Error;
using fastload::ErrorKind;
using fastload::UniqueFd;
using fastload::tar::Action;
using fastload::tar::Member;
using fastload::tar::MemberType;
using fastload::tar::scan_file;
using fastload::tar::Sink;
using fastload::tar::StreamParser;
namespace tb = fastload::tar::testing;

std::string g_tmp;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

bool sh(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  if (rc != 0) std::fprintf(stderr, "command failed (%d): %s\n", rc, cmd.c_str());
  return rc == 0;
}

bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

char type_char(MemberType t) {
  switch (t) {
    case MemberType::kFile: return 'f';
    case MemberType::kHardlink: return 'h';
    case MemberType::kSymlink: return 's';
    case MemberType::kCharDev: return 'c';
    case MemberType::kBlockDev: return 'b';
    case MemberType::kDir: return 'd';
    case MemberType::kFifo: return 'p';
  }
  return '?';
}

// One member as a sink saw it.
struct Rec {
  Member m;
  std::string data;
  bool ended = false;
};

std::string describe(const Member& m) {
  return m.path + "|" + m.link + "|" + type_char(m.type) + "|" + std::to_string(m.size) + "|" +
         std::to_string(m.mode) + "|" + std::to_string(m.mtime_ns) + "|" + std::to_string(m.uid) +
         "|" + std::to_string(m.gid) + "|" + std::to_string(m.header_offset) + "|" +
         std::to_string(m.data_offset);
}

std::string describe(const std::vector<Rec>& recs) {
  std::string s;
  for (const Rec& r : recs)
    s += describe(r.m) + "|" + std::to_string(r.data.size()) + ":" + r.data + (r.ended ? "|E\n" : "|-\n");
  return s;
}

// Records events and checks their order; reads members unless `skip` says otherwise.
struct Collector : Sink {
  std::vector<Rec> recs;
  std::function<bool(const Member&)> skip;
  const char* buf_lo = nullptr;  // when set, on_data must point into [buf_lo, buf_hi)
  const char* buf_hi = nullptr;
  bool zero_copy_ok = true;

  Action on_member(const Member& m) override {
    CHECK(recs.empty() || recs.back().ended);
    recs.push_back(Rec{m, {}, false});
    return skip && skip(m) ? Action::kSkip : Action::kRead;
  }
  void on_data(const char* d, size_t n) override {
    CHECK(!recs.empty() && !recs.back().ended);
    CHECK(n > 0);
    if (buf_lo && (d < buf_lo || d + n > buf_hi)) zero_copy_ok = false;
    recs.back().data.append(d, n);
  }
  void on_member_end() override {
    CHECK(!recs.empty() && !recs.back().ended);
    recs.back().ended = true;
  }
  void on_warning(const std::string& w) override { warnings.push_back(w); }
  std::vector<std::string> warnings;
};

// Feeds `a` in pieces chosen by next_len (called with the bytes left), then finish().
struct Parsed {
  std::vector<Rec> recs;
  std::optional<Error> error;
  bool at_end = false;
  std::vector<std::string> warnings;
};

Parsed parse(const std::string& a, const std::function<size_t(size_t)>& next_len,
             std::function<bool(const Member&)> skip = {}) {
  Parsed out;
  Collector c;
  c.skip = std::move(skip);
  StreamParser p("test.tar");
  size_t pos = 0;
  try {
    while (pos < a.size()) {
      const size_t n = std::min(next_len(a.size() - pos), a.size() - pos);
      p.feed(a.data() + pos, n, c);
      pos += n;
      CHECK_EQ(p.offset(), static_cast<uint64_t>(pos));
    }
    p.finish(c);
    out.at_end = p.at_end();
  } catch (const Error& e) {
    out.error = e;
  }
  out.recs = std::move(c.recs);
  out.warnings = std::move(c.warnings);
  return out;
}

Parsed parse_whole(const std::string& a) {
  return parse(a, [](size_t left) { return left; });
}

Parsed parse_chunks(const std::string& a, size_t chunk,
                    std::function<bool(const Member&)> skip = {}) {
  return parse(a, [chunk](size_t) { return chunk; }, std::move(skip));
}

// scan_file over the bytes of a temporary file.
struct Scanned {
  std::vector<Member> members;
  std::optional<Error> error;
  std::vector<std::string> warnings;
};

Scanned scan_bytes(const std::string& a, size_t stop_after = SIZE_MAX) {
  const std::string path = g_tmp + "/scan.tar";
  write_file(path, a);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  CHECK(bool(fd));
  Scanned out;
  try {
    scan_file(fd.get(), a.size(), "test.tar", [&](const Member& m) {
      out.members.push_back(m);
      return out.members.size() < stop_after;
    }, [&](const std::string& w) { out.warnings.push_back(w); });
  } catch (const Error& e) {
    out.error = e;
  }
  return out;
}

// The error for a, checked to be the same through the stream (whole and 1-byte feeds)
// and through scan_file; returns its message.
std::string format_error(const std::string& a, const char* where_expected) {
  const Parsed whole = parse_whole(a);
  const Parsed bytes = parse_chunks(a, 1);
  const Scanned scanned = scan_bytes(a);
  CHECK(whole.error.has_value());
  CHECK(bytes.error.has_value());
  CHECK(scanned.error.has_value());
  if (!whole.error || !bytes.error || !scanned.error) {
    std::fprintf(stderr, "  (expected an error mentioning %s)\n", where_expected);
    return {};
  }
  CHECK_EQ(whole.error->kind(), ErrorKind::kFormat);
  CHECK_EQ(std::string(whole.error->what()), std::string(bytes.error->what()));
  CHECK_EQ(std::string(whole.error->what()), std::string(scanned.error->what()));
  CHECK_EQ(whole.error->path(), std::string("test.tar"));
  const std::string msg = whole.error->what();
  if (!contains(msg, where_expected)) {
    std::fprintf(stderr, "  message '%s' lacks '%s'\n", msg.c_str(), where_expected);
    CHECK(contains(msg, where_expected));
  }
  return msg;
}

// An archive GNU tar reads (with a warning when `warning` is not empty): accepted alike
// through the stream (whole and 1-byte feeds) and scan_file, the warning given by each.
Parsed accepted(const std::string& a, const char* warning) {
  const Parsed whole = parse_whole(a);
  const Parsed bytes = parse_chunks(a, 1);
  const Scanned scanned = scan_bytes(a);
  CHECK(!whole.error && !bytes.error && !scanned.error);
  if (whole.error) std::fprintf(stderr, "  unexpected error: %s\n", whole.error->what());
  CHECK_EQ(describe(whole.recs), describe(bytes.recs));
  CHECK_EQ(whole.recs.size(), scanned.members.size());
  CHECK_EQ(whole.warnings, bytes.warnings);
  CHECK_EQ(whole.warnings, scanned.warnings);
  if (*warning) {
    bool found = false;
    for (const std::string& w : whole.warnings) found = found || contains(w, warning);
    if (!found) std::fprintf(stderr, "  no warning mentions '%s'\n", warning);
    CHECK(found);
  }
  return whole;
}

// ---------------------------------------------------------------------------------------
// Fixtures from real tools

// Creates the source trees and Python's archives; GNU tar's are made below.
const char* kMakeTrees = R"PY(
import os, sys, tarfile
root = sys.argv[1]
def mk(path, data=b""):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f: f.write(data)
b = os.path.join(root, "basic")
mk(f"{b}/short.txt", b"hello\n")
mk(f"{b}/empty")
os.makedirs(f"{b}/emptydir")
for n in (1, 511, 512, 513, 5000):
    mk(f"{b}/sizes/f{n}", bytes((i * 7 + n) % 251 for i in range(n)))
mk(f"{b}/" + "o" * 50 + "/" + "p" * 70 + "/" + "q" * 90, b"prefixed\n")
mk(f"{b}/donn\u00e9es/na\u00efve_\u6587\u4ef6.txt", "unicode \u2713\n".encode())
os.link(f"{b}/short.txt", f"{b}/zhard")
os.symlink("short.txt", f"{b}/zsym")
os.symlink("emptydir", f"{b}/zdirlink")
os.mkfifo(f"{b}/zfifo")
l = os.path.join(root, "long")
mk(f"{l}/" + "n" * 150 + ".txt", b"long name\n")
mk(f"{l}/" + "d" * 100 + "/" + "e" * 100 + "/" + "f" * 100 + ".bin", b"x" * 700)
os.symlink("t" * 150, f"{l}/longsym")
os.link(f"{l}/" + "n" * 150 + ".txt", f"{l}/zz_hard_to_long")
os.link(f"{l}/" + "d" * 100 + "/" + "e" * 100 + "/" + "f" * 100 + ".bin", f"{l}/zz_hard_to_deep")
formats = {"USTAR": tarfile.USTAR_FORMAT, "GNU": tarfile.GNU_FORMAT, "PAX": tarfile.PAX_FORMAT}
for tree in ("basic", "long"):
    for fname, fmt in formats.items():
        if tree == "long" and fname == "USTAR":
            continue
        os.chdir(os.path.join(root, tree))
        names = []
        for dp, dns, fns in os.walk("."):
            dns.sort()
            for n in sorted(dns + fns):
                names.append(os.path.normpath(os.path.join(dp, n)))
        with tarfile.open(os.path.join(root, f"py-{fname}-{tree}.tar"), "w", format=fmt) as tf:
            for n in sorted(names):
                tf.add(n, recursive=False)
        if fname == "PAX":  # with a global header first
            with tarfile.open(os.path.join(root, f"py-PAXG-{tree}.tar"), "w", format=fmt,
                              pax_headers={"comment": "global"}) as tf:
                for n in sorted(names):
                    tf.add(n, recursive=False)
)PY";

// Lists an archive as tarfile reads it, one member a line.
const char* kList = R"PY(
import os, sys, tarfile
kinds = {tarfile.REGTYPE: "f", tarfile.AREGTYPE: "f", tarfile.CONTTYPE: "f", tarfile.LNKTYPE: "h",
         tarfile.SYMTYPE: "s", tarfile.DIRTYPE: "d", tarfile.CHRTYPE: "c", tarfile.BLKTYPE: "b",
         tarfile.FIFOTYPE: "p"}
with tarfile.open(sys.argv[1]) as tf:
    for m in tf:
        print("x" + os.fsencode(m.name).hex(), kinds[m.type], m.size, "x" + os.fsencode(m.linkname).hex(),
              int(m.mtime), m.uid, m.gid, m.offset, m.offset_data, m.mode)
)PY";

std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out = "x";
  for (unsigned char c : s) {
    out += d[c >> 4];
    out += d[c & 15];
  }
  return out;
}

// Our reading in tarfile's listing format (tarfile strips a directory's trailing '/').
std::string as_listing(const Member& m) {
  std::string name = m.path;
  if (m.type == MemberType::kDir)
    while (name.size() > 1 && name.back() == '/') name.pop_back();
  int64_t sec = m.mtime_ns / 1000000000;
  if (m.mtime_ns % 1000000000 < 0) --sec;
  return hex(name) + " " + type_char(m.type) + " " + std::to_string(m.size) + " " + hex(m.link) +
         " " + std::to_string(sec) + " " + std::to_string(m.uid) + " " + std::to_string(m.gid) +
         " " + std::to_string(m.header_offset) + " " + std::to_string(m.data_offset) + " " +
         std::to_string(m.mode);
}

// Everything there is to check about one well-formed archive.
void check_archive(const std::string& path, const std::string& tree) {
  std::fprintf(stderr, "checking %s\n", path.c_str());
  const std::string a = read_file(path);
  CHECK(a.size() % 512 == 0 && !a.empty());
  const std::string listing_path = path + ".list";
  if (!sh("python3 " + g_tmp + "/list.py '" + path + "' > '" + listing_path + "'")) {
    CHECK(false);
    return;
  }
  std::vector<std::string> expected;
  {
    std::istringstream in(read_file(listing_path));
    for (std::string line; std::getline(in, line);) expected.push_back(line);
  }

  // Whole buffer: zero-copy data, same members as tarfile, data equal to the sources.
  Collector c;
  c.buf_lo = a.data();
  c.buf_hi = a.data() + a.size();
  StreamParser p(path);
  try {
    p.feed(a.data(), a.size(), c);
    p.finish(c);
  } catch (const Error& e) {
    std::fprintf(stderr, "  unexpected error: %s\n", e.what());
    CHECK(false);
    return;
  }
  CHECK(p.at_end());
  CHECK(c.zero_copy_ok);
  CHECK_EQ(c.recs.size(), expected.size());
  for (size_t i = 0; i < c.recs.size() && i < expected.size(); ++i) {
    CHECK_EQ(as_listing(c.recs[i].m), expected[i]);
    CHECK(c.recs[i].ended);
    if (c.recs[i].m.type == MemberType::kFile) {
      const std::string src = read_file(g_tmp + "/" + tree + "/" + c.recs[i].m.path);
      CHECK_EQ(c.recs[i].data.size(), src.size());
      CHECK(c.recs[i].data == src);
    } else {
      CHECK(c.recs[i].data.empty());
    }
  }
  const std::string want = describe(c.recs);

  // Other splits, and skipping every other member (discarded, still ended).
  for (size_t chunk : {size_t{1}, size_t{7}, size_t{511}, size_t{512}, size_t{513}, size_t{4096}}) {
    const Parsed r = parse_chunks(a, chunk);
    CHECK(!r.error);
    CHECK_EQ(describe(r.recs), want);
  }
  size_t k = 0;
  const Parsed skipped = parse_chunks(a, 100, [&](const Member&) { return k++ % 2 == 1; });
  CHECK(!skipped.error);
  CHECK_EQ(skipped.recs.size(), c.recs.size());
  for (size_t i = 0; i < skipped.recs.size() && i < c.recs.size(); ++i) {
    CHECK_EQ(describe(skipped.recs[i].m), describe(c.recs[i].m));
    CHECK(skipped.recs[i].ended);
    CHECK(i % 2 == 1 ? skipped.recs[i].data.empty() : skipped.recs[i].data == c.recs[i].data);
  }

  // scan_file: the same members and offsets.
  const Scanned s = scan_bytes(a);
  CHECK(!s.error);
  CHECK_EQ(s.members.size(), c.recs.size());
  for (size_t i = 0; i < s.members.size() && i < c.recs.size(); ++i)
    CHECK_EQ(describe(s.members[i]), describe(c.recs[i].m));
  if (c.recs.size() > 2) CHECK_EQ(scan_bytes(a, 2).members.size(), size_t{2});  // early stop
}

const Member* find(const std::vector<Rec>& recs, const std::string& path) {
  for (const Rec& r : recs)
    if (r.m.path == path) return &r.m;
  return nullptr;
}

void test_tool_archives() {
  write_file(g_tmp + "/trees.py", kMakeTrees);
  write_file(g_tmp + "/list.py", kList);
  if (!sh("python3 " + g_tmp + "/trees.py " + g_tmp)) {
    CHECK(false);
    return;
  }
  for (const char* fmt : {"gnu", "posix", "ustar"}) {
    for (const char* tree : {"basic", "long"}) {
      if (std::string(fmt) == "ustar" && std::string(tree) == "long") continue;  // > 255 bytes
      const std::string out = g_tmp + "/gnu-" + fmt + "-" + tree + ".tar";
      CHECK(sh("cd " + g_tmp + "/" + tree + " && tar --sort=name --format=" + fmt + " -cf " +
               out + " *"));
    }
  }
  // v7 (no magic, names up to 99 bytes, directories marked by a trailing '/') and oldgnu.
  CHECK(sh("cd " + g_tmp + "/basic && tar --sort=name --format=v7 -cf " + g_tmp +
           "/gnu-v7-basic.tar short.txt empty emptydir sizes zhard zsym zdirlink"));
  CHECK(sh("cd " + g_tmp + "/long && tar --sort=name --format=oldgnu -cf " + g_tmp +
           "/gnu-oldgnu-long.tar *"));
  for (const char* name :
       {"gnu-gnu-basic", "gnu-gnu-long", "gnu-posix-basic", "gnu-posix-long", "gnu-ustar-basic",
        "gnu-v7-basic", "gnu-oldgnu-long",
        "py-USTAR-basic", "py-GNU-basic", "py-GNU-long", "py-PAX-basic", "py-PAX-long",
        "py-PAXG-basic", "py-PAXG-long"}) {
    const std::string n = name;
    check_archive(g_tmp + "/" + n + ".tar", contains(n, "long") ? "long" : "basic");
  }

  // Spot checks of what matters most: exact long names and link targets.
  const std::string n150 = std::string(150, 'n') + ".txt";
  const std::string deep =
      std::string(100, 'd') + "/" + std::string(100, 'e') + "/" + std::string(100, 'f') + ".bin";
  const std::string prefixed =
      std::string(50, 'o') + "/" + std::string(70, 'p') + "/" + std::string(90, 'q');
  for (const char* name : {"gnu-gnu-long", "gnu-posix-long", "py-GNU-long", "py-PAX-long"}) {
    const Parsed r = parse_whole(read_file(g_tmp + "/" + name + ".tar"));
    const Member* m = find(r.recs, n150);
    CHECK(m && m->type == MemberType::kFile && m->size == 10);
    m = find(r.recs, deep);
    CHECK(m && m->type == MemberType::kFile && m->size == 700);
    m = find(r.recs, "longsym");
    CHECK(m && m->type == MemberType::kSymlink && m->link == std::string(150, 't'));
    m = find(r.recs, "zz_hard_to_long");
    CHECK(m && m->type == MemberType::kHardlink && m->link == n150 && m->size == 0);
    m = find(r.recs, "zz_hard_to_deep");
    CHECK(m && m->type == MemberType::kHardlink && m->link == deep);
  }
  for (const char* name : {"gnu-gnu-basic", "gnu-posix-basic", "gnu-ustar-basic", "py-USTAR-basic",
                           "py-GNU-basic", "py-PAX-basic"}) {
    const Parsed r = parse_whole(read_file(g_tmp + "/" + name + ".tar"));
    CHECK(find(r.recs, prefixed) != nullptr);
    CHECK(find(r.recs, "donn\u00e9es/na\u00efve_\u6587\u4ef6.txt") != nullptr);
    const Member* m = find(r.recs, "zsym");
    CHECK(m && m->link == "short.txt" && m->type == MemberType::kSymlink);
    m = find(r.recs, "emptydir/");
    if (!m) m = find(r.recs, "emptydir");
    CHECK(m && m->type == MemberType::kDir && m->size == 0);
    m = find(r.recs, "empty");
    CHECK(m && m->type == MemberType::kFile && m->size == 0);
    // One of the two names of the hard-linked file is a hard link to the other.
    const Member* h = find(r.recs, "zhard");
    CHECK(h && h->type == MemberType::kHardlink && h->link == "short.txt");
  }
}

// The sparse files GNU tar writes: type 'S' (gnu) and pax GNU.sparse.* (posix).
void test_sparse_members() {
  const std::string dir = g_tmp + "/sparse";
  if (!sh("mkdir -p " + dir + " && cd " + dir +
          " && truncate -s 2M sparse.bin && printf data | dd of=sparse.bin bs=1 seek=1048576 "
          "conv=notrunc 2>/dev/null && printf hi > before.txt"
          " && tar --sparse --format=gnu -cf ../sparse-gnu.tar before.txt sparse.bin"
          " && tar --sparse --format=posix -cf ../sparse-posix.tar before.txt sparse.bin")) {
    CHECK(false);
    return;
  }
  for (const char* f : {"sparse-gnu.tar", "sparse-posix.tar"}) {
    const std::string a = read_file(g_tmp + "/" + f);
    const Parsed r = accepted(a, "");
    CHECK_EQ(r.recs.size(), size_t{2});
    if (r.recs.size() != 2) continue;
    const Member& m = r.recs[1].m;
    CHECK_EQ(m.path, std::string("sparse.bin"));
    CHECK(m.sparse);
    CHECK_EQ(m.size, uint64_t{2} << 20);
    // GNU tar stores whole blocks of data (the rest of the block is zeros).
    CHECK(m.data_size >= 4 && m.data_size <= 8192);
    CHECK(r.recs[1].data.starts_with("data"));
    CHECK_EQ(r.recs[1].data.size(), m.data_size);
    CHECK(!m.extents.empty() && m.extents[0].offset == 1048576);
    // Read in small feeds and with the member skipped, the framing is the same.
    const Parsed skipped = parse_chunks(a, 7, [](const Member& x) { return x.sparse; });
    CHECK(!skipped.error);
    CHECK_EQ(skipped.recs.size(), size_t{2});
  }
}

// An old GNU sparse header ('S', magic "ustar  \0"): the first four extents in the header,
// the rest in extension blocks of 21 each, every block flagged when another follows.
std::string old_gnu_sparse(std::string_view name, uint64_t real, uint64_t size,
                           const std::vector<std::pair<uint64_t, uint64_t>>& extents) {
  std::string h = tb::header(name, 'S', size);
  tb::put(h, 257, std::string_view("ustar  \0", 8));
  tb::put(h, 483, tb::octal(real, 12));
  std::string ext;
  for (size_t i = 0; i < extents.size(); ++i) {
    std::string* b = &h;
    size_t at = 386 + 24 * i;
    if (i >= 4) {
      const size_t k = (i - 4) % 21;
      if (k == 0) {
        if (i == 4) h[482] = 1;
        else ext[ext.size() - tb::kBlock + 504] = 1;
        ext.append(tb::kBlock, '\0');
      }
      b = &ext;
      at = ext.size() - tb::kBlock + 24 * k;
    }
    tb::put(*b, at, tb::octal(extents[i].first, 12));
    tb::put(*b, at + 12, tb::octal(extents[i].second, 12));
  }
  tb::fix_checksum(h);
  return h + ext;
}

// A sparse member's size may count its extents' padding (GNU tar reads each extent as
// whole blocks and skips only what the size counts past them) or not (what GNU tar
// writes); both frame the member the same, read or skipped. What the size counts beyond
// the extents' blocks is skipped to a block: the next member's header follows. (libarchive
// test_read_format_gtar_sparse_skip_entry: its 4-byte extent is counted as a whole block.)
void test_sparse_size_counts_padding() {
  std::vector<std::pair<uint64_t, uint64_t>> ext;
  std::string data;
  for (uint64_t i = 0; i < 30; ++i) {  // two extension blocks
    ext.push_back({i * 8192, 100 + i});
    data += tb::pad(std::string(100 + i, static_cast<char>('a' + i % 26)));
  }
  const uint64_t sum = 30 * 100 + 29 * 30 / 2, blocks = data.size();
  const uint64_t real = ext.back().first + ext.back().second;
  // size: the data (GNU tar), the data's blocks (the padding counted), and 700 bytes more
  // than the blocks (two more blocks to skip).
  for (const uint64_t size : {sum, blocks, blocks + 700}) {
    const std::string tail = size > blocks ? tb::pad(std::string(size - blocks, '\0')) : "";
    const std::string old_gnu = old_gnu_sparse("s", real, size, ext) + data + tail +
                                tb::file("b", "bbbb") + tb::end_marker();
    // pax 1.0: the map in the data's first block, counted in the size.
    std::string map = std::to_string(ext.size()) + "\n";
    for (const auto& [o, n] : ext) map += std::to_string(o) + "\n" + std::to_string(n) + "\n";
    const std::string pax = tb::extension('x', tb::pax_record("GNU.sparse.major", "1") +
                                                   tb::pax_record("GNU.sparse.minor", "0") +
                                                   tb::pax_record("GNU.sparse.name", "s") +
                                                   tb::pax_record("GNU.sparse.realsize", std::to_string(real))) +
                            tb::header("GNUSparseFile.1/s", '0', tb::kBlock + size) +
                            tb::pad(map) + data + tail + tb::file("b", "bbbb") + tb::end_marker();
    for (const std::string& a : {old_gnu, pax}) {
      const Parsed r = accepted(a, "");
      CHECK_EQ(r.recs.size(), size_t{2});
      if (r.recs.size() != 2) continue;
      CHECK(r.recs[0].m.sparse);
      CHECK_EQ(r.recs[0].m.size, real);
      CHECK_EQ(r.recs[0].m.data_size, sum);
      CHECK_EQ(r.recs[0].data.size(), size_t{sum});
      CHECK_EQ(r.recs[1].m.path, std::string("b"));
      CHECK_EQ(r.recs[1].data, std::string("bbbb"));
      // "b": its header, its data block and the end marker close the archive.
      CHECK_EQ(r.recs[1].m.header_offset, static_cast<uint64_t>(a.size() - 4 * tb::kBlock));
      const Parsed skipped = parse_chunks(a, 7, [](const Member& x) { return x.sparse; });
      CHECK(!skipped.error);
      CHECK_EQ(describe(skipped.recs.back().m), describe(r.recs[1].m));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Splits, seeking, end of archive

std::string small_archive() {
  std::string a;
  a += tb::extension('g', tb::pax_record("mtime", "1600000000.5") + tb::pax_record("comment", "x"));
  a += tb::file("a.txt", "alpha");
  a += tb::extension('L', std::string(130, 'L') + '\0');
  a += tb::file("short-name-ignored", std::string(700, 'z'));
  a += tb::extension('x', tb::pax_record("path", "pax/\u00e9t\u00e9.bin") +
                              tb::pax_record("mtime", "1700000000.123456789") +
                              tb::pax_record("uid", "4000000000"));
  a += tb::file("ignored", std::string(512, 'q'));
  a += tb::header("dir/", '5', 0);
  a += tb::extension('K', std::string(120, 'K') + '\0');
  a += tb::header("lnk", '2', 0, "short");
  a += tb::file("empty", "");
  a += tb::file("last", "end");
  a += tb::end_marker();
  return a;
}

void test_small_archive_fields() {
  const Parsed r = parse_whole(small_archive());
  CHECK(!r.error);
  CHECK(r.at_end);
  CHECK_EQ(r.recs.size(), size_t{7});
  if (r.recs.size() != 7) return;
  CHECK_EQ(r.recs[0].m.path, std::string("a.txt"));
  CHECK_EQ(r.recs[0].m.mtime_ns, int64_t{1600000000500000000});  // from the 'g' header
  CHECK_EQ(r.recs[0].m.header_offset, uint64_t{2 * 512});  // the 'g' header is no member's
  CHECK_EQ(r.recs[0].m.data_offset, uint64_t{3 * 512});
  CHECK_EQ(r.recs[0].data, std::string("alpha"));
  CHECK_EQ(r.recs[1].m.path, std::string(130, 'L'));
  CHECK_EQ(r.recs[1].m.header_offset, uint64_t{4 * 512});
  CHECK_EQ(r.recs[1].m.size, uint64_t{700});
  CHECK_EQ(r.recs[2].m.path, std::string("pax/\u00e9t\u00e9.bin"));
  CHECK_EQ(r.recs[2].m.mtime_ns, int64_t{1700000000123456789});
  CHECK_EQ(r.recs[2].m.uid, uint32_t{4000000000u});
  CHECK_EQ(r.recs[2].m.gid, uint32_t{1000});
  CHECK_EQ(r.recs[3].m.type, MemberType::kDir);
  CHECK_EQ(r.recs[3].m.mtime_ns, int64_t{1600000000500000000});
  CHECK_EQ(r.recs[4].m.link, std::string(120, 'K'));
  CHECK_EQ(r.recs[4].m.path, std::string("lnk"));
  CHECK_EQ(r.recs[5].m.size, uint64_t{0});
  CHECK(r.recs[5].ended);
  CHECK_EQ(r.recs[6].data, std::string("end"));
}

// Every split into fixed-size feeds of 1..N bytes, and random splits, give the same
// events; so do seeking callers that jump over skipped data.
void test_every_split() {
  const std::string a = small_archive();
  const std::string want = describe(parse_whole(a).recs);
  for (size_t chunk = 1; chunk <= 1100; ++chunk) {
    const Parsed r = parse_chunks(a, chunk);
    if (describe(r.recs) != want || r.error) {
      std::fprintf(stderr, "split into %zu-byte feeds differs\n", chunk);
      CHECK(false);
      break;
    }
  }
  std::mt19937_64 rng(42);
  for (int i = 0; i < 300; ++i) {
    const Parsed r = parse(a, [&](size_t left) { return 1 + rng() % std::min<size_t>(left, 1500); });
    CHECK(!r.error);
    CHECK_EQ(describe(r.recs), want);
  }
  // All two-piece splits.
  for (size_t cut = 0; cut <= a.size(); ++cut) {
    bool first = true;
    const Parsed r = parse(a, [&](size_t left) {
      if (!first) return left;
      first = false;
      return cut == 0 ? left : cut;
    });
    if (describe(r.recs) != want) {
      std::fprintf(stderr, "two-piece split at %zu differs\n", cut);
      CHECK(false);
      break;
    }
  }
}

// A seeking caller: after kSkip, jump skippable() bytes (or part of it) and call skipped().
void test_skippable() {
  const std::string a = small_archive();
  for (uint64_t part : {uint64_t{0}, uint64_t{1}, uint64_t{3}, ~uint64_t{0}}) {
    Collector c;
    c.skip = [](const Member& m) { return m.size > 100; };
    StreamParser p("test.tar");
    size_t pos = 0;
    while (pos < a.size()) {
      const uint64_t can = p.skippable();
      if (can > 0 && part > 0) {
        const uint64_t n = std::min(can, part);
        p.skipped(n, c);
        pos += n;
        CHECK_EQ(p.offset(), static_cast<uint64_t>(pos));
        continue;
      }
      const size_t n = std::min<size_t>(37, a.size() - pos);
      p.feed(a.data() + pos, n, c);
      pos += n;
    }
    p.finish(c);
    CHECK(p.at_end());
    CHECK_EQ(c.recs.size(), size_t{7});
    for (const Rec& r : c.recs) {
      CHECK(r.ended);
      CHECK(r.m.size > 100 ? r.data.empty() : r.data.size() == r.m.size);
    }
  }
  // Skipping more than skippable() is a caller bug.
  Collector c;
  StreamParser p("test.tar");
  bool threw = false;
  try {
    p.skipped(1, c);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

void test_end_of_archive() {
  const std::string body = tb::file("a", "1") + tb::file("b", "22");
  // Two zero blocks, then anything (record padding, garbage): ignored.
  for (const std::string& tail : {std::string(), std::string(10240, '\0'), std::string("garbage")}) {
    const std::string a = body + tb::end_marker() + tail;
    const Parsed r = parse_chunks(a, 3);
    CHECK(!r.error);
    CHECK(r.at_end);
    CHECK_EQ(r.recs.size(), size_t{2});
    const Scanned s = scan_bytes(a);
    CHECK(!s.error);
    CHECK_EQ(s.members.size(), size_t{2});
  }
  // Accepted: no marker; one zero block; one and a partial zero block.
  for (const std::string& a : {body, body + std::string(512, '\0'), body + std::string(700, '\0')}) {
    const Parsed r = parse_chunks(a, 5);
    CHECK(!r.error);
    CHECK_EQ(r.recs.size(), size_t{2});
    const Scanned s = scan_bytes(a);
    CHECK(!s.error);
    CHECK_EQ(s.members.size(), size_t{2});
  }
  CHECK(parse_whole("").recs.empty() && !parse_whole("").error);  // an empty archive
  // Refused: padding cut short (GNU tar and tarfile refuse it too).
  format_error(tb::file("a", "1") + tb::header("b", '0', 2) + "22", "member 'b'");
  format_error(tb::file("a", "1") + tb::header("b", '0', 2) + "22" + std::string(100, '\0'), "padding");
  format_error(tb::extension('L', std::string("n") + '\0').substr(0, 520), "padding after an extension");
  format_error(tb::header("LABEL", 'V', 3) + "abc", "volume label");
  // A lone zero block ends the archive, with a warning (GNU tar stops there too).
  CHECK_EQ(accepted(body + std::string(512, '\0') + tb::file("c", "3"), "lone zero block").recs.size(),
           size_t{2});
  // A partial block after one zero block: ignored, with a warning.
  accepted(body + std::string(512, '\0') + "x", "ignored");
  // Extension headers with no member after them are dropped (GNU tar).
  CHECK_EQ(accepted(body + tb::extension('L', std::string("name") + '\0') + tb::end_marker(), "").recs.size(),
           size_t{2});
  CHECK_EQ(accepted(body + tb::extension('x', tb::pax_record("path", "p")), "").recs.size(), size_t{2});
}

// ---------------------------------------------------------------------------------------
// Crafted headers

void test_big_sizes() {
  const uint64_t big = (uint64_t{10} << 30) + 123;  // 10 GiB: past the 11-digit octal range
  // base-256 in the size field (GNU).
  {
    const std::string h = tb::header("huge.bin", '0', big);
    CHECK_EQ(static_cast<unsigned char>(h[124]), 0x80u);
    Collector c;
    StreamParser p("test.tar");
    p.feed(h.data(), h.size(), c);
    CHECK_EQ(c.recs.size(), size_t{1});
    if (!c.recs.empty()) CHECK_EQ(c.recs[0].m.size, big);
    // Feed a little data, then the archive ends: truncated member named.
    p.feed("abc", 3, c);
    bool threw = false;
    try {
      p.finish(c);
    } catch (const Error& e) {
      threw = true;
      CHECK_EQ(e.kind(), ErrorKind::kFormat);
      CHECK(contains(e.what(), "member 'huge.bin'"));
      CHECK(contains(e.what(), std::to_string(big - 3) + " of " + std::to_string(big)));
    }
    CHECK(threw);
    // A seeking caller can jump over it.
    const std::string more = h + tb::file("after", "x") + tb::end_marker();
    Collector c2;
    c2.skip = [](const Member&) { return true; };
    StreamParser p2("test.tar");
    p2.feed(more.data(), 512, c2);
    CHECK_EQ(p2.skippable(), (big + 511) / 512 * 512);
    p2.skipped(p2.skippable(), c2);
    CHECK_EQ(p2.offset(), 512 + (big + 511) / 512 * 512);
    p2.feed(more.data() + 512, more.size() - 512, c2);
    p2.finish(c2);
    CHECK_EQ(c2.recs.size(), size_t{2});
    CHECK(p2.at_end());
    // scan_file: the data runs past the end of the file.
    const std::string msg = format_error(h + "abc", "member 'huge.bin'");
    CHECK(contains(msg, "ends inside the member's data"));
  }
  // pax size.
  {
    std::string a = tb::extension('x', tb::pax_record("size", std::to_string(big)) +
                                           tb::pax_record("path", "pax-huge.bin"));
    a += tb::header("x", '0', 0);
    Collector c;
    StreamParser p("test.tar");
    p.feed(a.data(), a.size(), c);
    CHECK_EQ(c.recs.size(), size_t{1});
    if (!c.recs.empty()) {
      CHECK_EQ(c.recs[0].m.size, big);
      CHECK_EQ(c.recs[0].m.path, std::string("pax-huge.bin"));
      CHECK_EQ(c.recs[0].m.header_offset, uint64_t{0});
    }
    CHECK_EQ(p.skippable(), uint64_t{0});  // read, not skipped
  }
  // Negative base-256 mtime (before 1970), and octal size of exactly 8 GiB - 1.
  {
    std::string h = tb::header("old", '0', 0);
    std::string f(12, '\xff');
    f[11] = static_cast<char>(0xfe);  // -2
    tb::put(h, 136, f);
    tb::fix_checksum(h);
    const Parsed r = parse_whole(h);
    CHECK(!r.error);
    if (!r.recs.empty()) CHECK_EQ(r.recs[0].m.mtime_ns, int64_t{-2000000000});
    std::string h2 = tb::header("max", '0', 0);
    tb::put(h2, 124, std::string("77777777777") + '\0');
    tb::fix_checksum(h2);
    Collector c;
    StreamParser p("test.tar");
    p.feed(h2.data(), h2.size(), c);
    CHECK(!c.recs.empty() && c.recs[0].m.size == (uint64_t{1} << 33) - 1);
  }
}

void test_pax_fields() {
  const auto one = [](const std::string& pax, const std::string& header_block) {
    return parse_whole(tb::extension('x', pax) + header_block + tb::end_marker());
  };
  // mtime fractions: more than 9 digits truncated, fewer padded, negative.
  const std::pair<const char*, int64_t> times[] = {
      {"1700000000.5", 1700000000500000000},         {"1700000000.1234567891", 1700000000123456789},
      {"1700000000", 1700000000000000000},           {"-1.5", -1500000000},
      {"0.000000001", 1},                            {"9223372036.9", INT64_MAX},
  };
  for (const auto& [v, ns] : times) {
    const Parsed r = one(tb::pax_record("mtime", v), tb::header("f", '0', 0));
    CHECK(!r.error);
    if (!r.recs.empty()) CHECK_EQ(r.recs[0].m.mtime_ns, ns);
  }
  // Unknown keys ignored; linkpath; values with '=' and newlines; hdrcharset.
  {
    const Parsed r = one(tb::pax_record("SCHILY.xattr.user.a", "b=c\nd") +
                             tb::pax_record("hdrcharset", "BINARY") +
                             tb::pax_record("linkpath", "target with = sign") +
                             tb::pax_record("gid", "7"),
                         tb::header("l", '2', 0, "short"));
    CHECK(!r.error);
    if (!r.recs.empty()) {
      CHECK_EQ(r.recs[0].m.link, std::string("target with = sign"));
      CHECK_EQ(r.recs[0].m.gid, uint32_t{7});
    }
  }
  // An empty value falls back to the header's field, overriding a global value.
  {
    const std::string a = tb::extension('g', tb::pax_record("uid", "5")) +
                          tb::extension('x', tb::pax_record("uid", "")) + tb::header("f", '0', 0) +
                          tb::header("g", '0', 0) + tb::end_marker();
    const Parsed r = parse_whole(a);
    CHECK_EQ(r.recs.size(), size_t{2});
    if (r.recs.size() == 2) {
      CHECK_EQ(r.recs[0].m.uid, uint32_t{1000});
      CHECK_EQ(r.recs[1].m.uid, uint32_t{5});
    }
  }
  // Global path and size apply to every later member, as GNU tar applies them.
  {
    const Parsed r = accepted(tb::extension('g', tb::pax_record("path", "everyone")) +
                                  tb::header("mine", '0', 0) + tb::end_marker(), "");
    CHECK(!r.recs.empty() && r.recs[0].m.path == "everyone");
    const Parsed z = accepted(tb::extension('g', tb::pax_record("size", "3")) +
                                  tb::header("f", '0', 0) + tb::pad("abc") + tb::end_marker(), "");
    CHECK(!z.recs.empty() && z.recs[0].data == "abc");
  }
  // pax and a GNU long name for one member: fine when they agree, refused when not;
  // two headers of one kind for one member are refused (readers pick different ones).
  {
    const Parsed r = parse_whole(tb::extension('L', std::string("same-name") + '\0') +
                                 tb::extension('x', tb::pax_record("path", "same-name")) +
                                 tb::header("ustar-name", '0', 0) + tb::end_marker());
    CHECK(!r.recs.empty() && r.recs[0].m.path == "same-name");
    CHECK(!r.recs.empty() && r.recs[0].m.header_offset == 0);
    // pax over a GNU long name, as GNU tar reads them.
    const Parsed d = accepted(tb::extension('L', std::string("gnu-name") + '\0') +
                                  tb::extension('x', tb::pax_record("path", "pax-name")) +
                                  tb::header("ustar-name", '0', 0) + tb::end_marker(), "");
    CHECK(!d.recs.empty() && d.recs[0].m.path == "pax-name");
    const Parsed k = accepted(tb::extension('x', tb::pax_record("linkpath", "a")) +
                                  tb::extension('K', std::string("b") + '\0') + tb::header("l", '2', 0) +
                                  tb::end_marker(), "");
    CHECK(!k.recs.empty() && k.recs[0].m.link == "a");
    // Of two headers of one kind before one member, the last wins (GNU tar).
    for (char t : {'x', 'L', 'K'}) {
      const auto data = [t](const char* n) {
        return t == 'x' ? tb::pax_record("path", n) : std::string(n) + '\0';
      };
      const Parsed two = accepted(tb::extension(t, data("first")) + tb::extension(t, data("second")) +
                                      tb::header("f", '2', 0, "ln") + tb::end_marker(), "");
      if (two.recs.empty()) continue;
      CHECK_EQ(t == 'K' ? two.recs[0].m.link : two.recs[0].m.path, std::string("second"));
    }
    // Several global headers are fine: each updates the global values.
    const Parsed g = parse_whole(tb::extension('g', tb::pax_record("uid", "1")) +
                                 tb::extension('g', tb::pax_record("uid", "2")) +
                                 tb::header("f", '0', 0) + tb::end_marker());
    CHECK(!g.error && !g.recs.empty() && g.recs[0].m.uid == 2);
  }
  // Malformed records.
  for (const std::string& bad :
       {std::string("5 a=b\n"), std::string("7 a=b\n"), std::string("99 path=x\n"),
        std::string("x path=y\n"), std::string("6 abc\n"),
        std::string("7 path=y"), tb::pax_record("path", "x") + "junk"}) {
    format_error(tb::extension('x', bad) + tb::file("f", "") + tb::end_marker(), "pax");
  }
  // Malformed values: GNU tar warns and goes on without them.
  for (const std::string& bad :
       {tb::pax_record("size", "12x"), tb::pax_record("size", "-1"),
        tb::pax_record("uid", "4294967296"), tb::pax_record("mtime", "abc")}) {
    const Parsed r = accepted(tb::extension('x', bad) + tb::file("f", "") + tb::end_marker(), "ignored");
    CHECK(!r.recs.empty() && r.recs[0].m.size == 0);
  }
  // A pax time with trailing garbage: the number before it (GNU tar's reading).
  {
    const Parsed r = accepted(tb::extension('x', tb::pax_record("mtime", "1.2.3")) + tb::file("f", "") +
                                  tb::end_marker(), "");
    CHECK(!r.recs.empty() && r.recs[0].m.mtime_ns == 1200000000);
  }
  // Trailing NUL padding after the records is tolerated.
  {
    const Parsed r = one(tb::pax_record("path", "p") + std::string(20, '\0'), tb::header("f", '0', 0));
    CHECK(!r.error);
    CHECK(!r.recs.empty() && r.recs[0].m.path == "p");
  }
}

void test_format_errors() {
  const std::string good = tb::file("first.txt", "1") + tb::file("victim.txt", std::string(1000, 'v')) +
                           tb::end_marker();
  // Corrupt checksum: one byte of victim's header.
  {
    std::string a = good;
    a[1024 + 100] ^= 1;  // mode field
    const std::string msg = format_error(a, "member 'victim.txt'");
    CHECK(contains(msg, "checksum"));
    CHECK(contains(msg, "offset 1024"));
    CHECK_EQ(parse_whole(a).recs.size(), size_t{1});
  }
  // Signed checksums (historic writers) are accepted.
  {
    std::string h = tb::header("\xe9t\xe9", '0', 0);
    int sum = 0;
    tb::put(h, 148, "        ");
    for (char c : h) sum += static_cast<signed char>(c);
    char buf[8];
    std::snprintf(buf, sizeof buf, "%06o", sum);
    tb::put(h, 148, std::string_view(buf, 6));
    const Parsed r = parse_whole(h + tb::end_marker());
    CHECK(!r.error);
    CHECK_EQ(r.recs.size(), size_t{1});
  }
  // Truncated member data, anywhere inside it.
  for (size_t cut : {size_t{1024 + 512}, size_t{1024 + 513}, size_t{1024 + 999}}) {
    const std::string msg = format_error(good.substr(0, cut), "member 'victim.txt'");
    CHECK(contains(msg, "ends inside the member's data"));
  }
  // Truncated header.
  {
    const std::string msg = format_error(good.substr(0, 1024 + 100), "offset 1024");
    CHECK(contains(msg, "inside a header block"));
  }
  // The prefix field in a GNU-magic header (GNU keeps times there, tarfile prepends it).
  {
    std::string h = tb::header("name", '0', 0);
    tb::put(h, 257, std::string_view("ustar  \0", 8));
    tb::put(h, 345, "14524770400");
    tb::fix_checksum(h);
    const Parsed r = accepted(h + tb::end_marker(), "");  // GNU tar ignores it
    CHECK(!r.recs.empty() && r.recs[0].m.path == "name");
  }
  // A GNU long name without its NUL: the whole data is the name (GNU tar).
  {
    const Parsed r = accepted(tb::extension('L', "no-nul") + tb::file("f", "") + tb::end_marker(), "");
    CHECK(!r.recs.empty() && r.recs[0].m.path == "no-nul");
  }
  // Truncated extension data.
  format_error(tb::extension('L', std::string(600, 'a')).substr(0, 700), "extension header's data");
  // Bad octal in a numeric field.
  for (size_t field : {size_t{100}, size_t{124}, size_t{136}}) {
    std::string h = tb::header("bad-octal.bin", '0', 0);
    h[field + 2] = '9';
    tb::fix_checksum(h);
    const std::string msg = format_error(tb::file("ok", "") + h + tb::end_marker(), "member 'bad-octal.bin'");
    CHECK(contains(msg, "malformed numeric field"));
  }
  // Owners are not applied: a malformed one is a warning.
  for (size_t field : {size_t{108}, size_t{116}}) {
    std::string h = tb::header("bad-owner.bin", '0', 0);
    h[field + 2] = '9';
    tb::fix_checksum(h);
    accepted(tb::file("ok", "") + h + tb::end_marker(), "ignored");
  }
  {  // a leading NUL before digits: GNU tar reads the digits
    std::string h = tb::header("lead-nul.bin", '0', 0);
    tb::put(h, 124, std::string("\0" "0000001000\0", 12));
    tb::fix_checksum(h);
    const Parsed r = accepted(h + tb::pad("x") + tb::end_marker(), "");
    CHECK(!r.recs.empty() && r.recs[0].m.size == 512);
  }
  {  // digits, a space, then anything: GNU tar reads the digits
    std::string h = tb::header("octal-space.bin", '0', 0);
    tb::put(h, 124, std::string("0000001 7\0\0\0", 12));
    tb::fix_checksum(h);
    const Parsed r = accepted(h + tb::pad("y") + tb::end_marker(), "");
    CHECK(!r.recs.empty() && r.recs[0].data == "y");
  }
  {  // octal filling the whole field, no terminator; leading spaces
    std::string h = tb::header("full.bin", '0', 0);
    tb::put(h, 124, "000000000003");
    tb::put(h, 136, "   1234567  ");
    tb::fix_checksum(h);
    const Parsed r = accepted(h + tb::pad("abc") + tb::end_marker(), "");
    CHECK(!r.recs.empty() && r.recs[0].data == "abc" && r.recs[0].m.mtime_ns == int64_t{01234567} * 1000000000);
  }
  // GNU multi-volume continuations are refused (GNU tar refuses them out of their volume).
  {
    const std::string msg = format_error(tb::header("odd-type", 'M', 0) + tb::end_marker(), "member 'odd-type'");
    CHECK(contains(msg, "multi-volume"));
  }
  // Unknown types are regular files, with a warning; 'D' is a directory.
  for (char t : {'N', 'Z', '8', 'A'}) {
    const Parsed r = accepted(tb::header("odd-type", t, 2) + tb::pad("ab") + tb::end_marker(), "unknown type");
    CHECK(!r.recs.empty() && r.recs[0].m.type == MemberType::kFile && r.recs[0].data == "ab");
  }
  {
    const Parsed r = accepted(tb::header("dumpdir", 'D', 3) + tb::pad("a\0b") + tb::end_marker(), "");
    CHECK(!r.recs.empty() && r.recs[0].m.type == MemberType::kDir);
  }
  // An empty name is ".", with a warning.
  {
    const Parsed r = accepted(tb::header("", '5', 0) + tb::end_marker(), "empty member name");
    CHECK(!r.recs.empty() && r.recs[0].m.path == ".");
  }
  {
    const std::string a = tb::header("LABEL", 'V', 0) + tb::file("f", "x") + tb::end_marker();
    const Parsed r = parse_chunks(a, 1);
    CHECK(!r.error);
    CHECK_EQ(r.recs.size(), size_t{1});
    CHECK(!r.recs.empty() && r.recs[0].m.header_offset == 512);
    CHECK_EQ(scan_bytes(a).members.size(), size_t{1});
  }
  // Links, devices and fifos with data are ambiguous; directories' sizes are ignored.
  // A hard link with a body: the body is skipped, with a warning; without one the next
  // block is a header.
  {
    const Parsed r = accepted(tb::header("hl", '1', 5, "t") + tb::pad("abcde") + tb::file("n", "x") +
                                  tb::end_marker(), "hard link");
    CHECK_EQ(r.recs.size(), size_t{2});
    const Parsed q = accepted(tb::header("hl", '1', 5, "t") + tb::file("n", "x") + tb::end_marker(), "");
    CHECK_EQ(q.recs.size(), size_t{2});
    CHECK(q.warnings.empty());
  }
  {
    const Parsed r = parse_whole(tb::header("d/", '5', 5000) + tb::file("f", "x") + tb::end_marker());
    CHECK(!r.error);
    CHECK_EQ(r.recs.size(), size_t{2});
  }
  // A regular file named like a directory: a directory when empty, refused with data.
  {
    const Parsed r = parse_whole(tb::header("v7dir/", '\0', 0) + tb::end_marker());
    CHECK(!r.recs.empty() && r.recs[0].m.type == MemberType::kDir);
    const Parsed b = accepted(tb::header("v7dir/", '0', 3) + tb::pad("abc") + tb::end_marker(), "directory");
    CHECK(!b.recs.empty() && b.recs[0].m.type == MemberType::kDir);
  }
  // Long-name cap.
  format_error(tb::header("././@LongLink", 'L', (uint64_t{1} << 20) + 1) + tb::end_marker(),
               "exceeds the limit");
  // A hostile name cannot inject control characters into the message.
  {
    std::string h = tb::header("evil\n\x1b[31mname", 'M', 0);
    const std::string msg = format_error(h + tb::end_marker(), "evil\\x0a\\x1b[31mname");
    CHECK(!contains(msg, "\n"));
    const Parsed r = accepted(tb::header("evil\n\x1b[31mname", 'Z', 0) + tb::end_marker(),
                              "evil\\x0a\\x1b[31mname");
    for (const std::string& w : r.warnings) CHECK(!contains(w, "\n"));
  }
  // Errors are sticky: later calls throw the same error.
  {
    std::string a = good;
    a[1024 + 100] ^= 1;
    Collector c;
    StreamParser p("test.tar");
    std::string first, again;
    try {
      p.feed(a.data(), a.size(), c);
    } catch (const Error& e) {
      first = e.what();
    }
    try {
      p.feed("x", 1, c);
    } catch (const Error& e) {
      again = e.what();
    }
    CHECK(!first.empty());
    CHECK_EQ(again, first);
  }
}

void test_scan_os_error() {
  bool threw = false;
  try {
    scan_file(-1, 4096, "nofd.tar", [](const Member&) { return true; });
  } catch (const Error& e) {
    threw = true;
    CHECK_EQ(e.kind(), ErrorKind::kOs);
    CHECK_EQ(e.err(), EBADF);
    CHECK_EQ(e.path(), std::string("nofd.tar"));
  }
  CHECK(threw);
  // A file shorter than the size it is said to have.
  write_file(g_tmp + "/short.tar", tb::file("a", "1"));
  UniqueFd fd(::open((g_tmp + "/short.tar").c_str(), O_RDONLY | O_CLOEXEC));
  threw = false;
  try {
    scan_file(fd.get(), 1 << 20, "short.tar", [](const Member&) { return true; });
  } catch (const Error& e) {
    threw = true;
    CHECK_EQ(e.kind(), ErrorKind::kFormat);
  }
  CHECK(threw);
}

// ---------------------------------------------------------------------------------------
// Path safety

void test_safe_paths() {
  using fastload::tar::safe_link_target;
  using fastload::tar::safe_relative_path;
  struct P {
    std::string in;
    const char* out;  // nullptr: refused
  };
  const P paths[] = {
      {"a/b", "a/b"},        {"./a//b/", "a/b"},   {"./a", "a"},       {"a", "a"},
      {".", ""},             {"./", ""},            {"././/", ""},          {"..foo/b..", "..foo/b.."},
      {"/etc/passwd", nullptr}, {"//x", nullptr},  {"../x", nullptr},  {"a/../../b", nullptr},
      {"a/../b", nullptr},   {"a/..", nullptr},    {"..", nullptr},    {"", nullptr},
      {std::string("a\0b", 3), nullptr},
  };
  for (const P& p : paths) {
    std::string out, why;
    const bool ok = safe_relative_path(p.in, &out, &why);
    CHECK_EQ(ok, p.out != nullptr);
    if (ok && p.out) CHECK_EQ(out, std::string(p.out));
    if (!ok) CHECK(!why.empty());
    if (ok != (p.out != nullptr)) std::fprintf(stderr, "  path '%s'\n", p.in.c_str());
  }
  struct L {
    const char* path;
    std::string target;
    bool hard;
    bool ok;
  };
  const L links[] = {
      {"a/l", "../x", false, true},         {"l", "../x", false, false},
      {"a/b/l", "../../x", false, true},    {"a/b/l", "../../../x", false, false},
      {"l", "/etc/passwd", false, false},   {"l", "/", false, false},
      {"l", "x/../../y", false, false},     {"l", "d/../x", false, false},
      {"l", ".", false, true},              {"a/l", "..", false, true},
      {"l", "sub/file", false, true},       {"./a/./l", "./../x", false, true},
      {"../l", "x", false, false},          {"/l", "x", false, false},
      {"l", "", false, false},              {"l", std::string("a\0b", 3), false, false},
      {"a/b/l", "short.txt", true, true},   {"l", "./a/b", true, true},
      {"l", "../x", true, false},           {"l", "/x", true, false},
      {"l", "a/../b", true, false},         {"l", ".", true, false},
      {"deep/er/l", "../../x", true, false},
  };
  for (const L& l : links) {
    std::string why;
    const bool ok = safe_link_target(l.path, l.target, l.hard, &why);
    if (ok != l.ok) {
      std::fprintf(stderr, "  link '%s' -> '%s' (%s): got %d\n", l.path, l.target.c_str(),
                   l.hard ? "hard" : "sym", ok);
      CHECK(false);
    }
    if (!ok) CHECK(!why.empty());
  }
  CHECK(!safe_relative_path("/a", nullptr, nullptr));  // out and why may be null
}

// At least as strict as PEP 706's data filter: whatever it refuses, we refuse.
void test_against_pep706() {
  std::mt19937_64 rng(7);
  const char* parts[] = {"a", "b", "..", ".", "", "c d", "\xc3\xa9"};
  const auto random_path = [&] {
    std::string s = rng() % 6 == 0 ? "/" : "";
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < n; ++i) {
      if (i) s += '/';
      s += parts[rng() % 7];
    }
    return s;
  };
  struct Case {
    std::string name, target;
    char kind;  // f, s, h
  };
  std::vector<Case> cases;
  for (int i = 0; i < 600; ++i) {
    const char kind = "fsh"[rng() % 3];
    cases.push_back({random_path(), kind == 'f' ? "" : random_path(), kind});
  }
  std::string in;
  for (const Case& c : cases) in += hex(c.name) + " " + hex(c.target) + " " + c.kind + "\n";
  write_file(g_tmp + "/pep706.in", in);
  write_file(g_tmp + "/pep706.py", R"PY(
import os, sys, tarfile
dest = sys.argv[1]
os.makedirs(dest, exist_ok=True)
out = []
for line in open(sys.argv[2]):
    n, t, k = line.split()
    m = tarfile.TarInfo(os.fsdecode(bytes.fromhex(n[1:])))
    m.linkname = os.fsdecode(bytes.fromhex(t[1:]))
    m.type = {"f": tarfile.REGTYPE, "s": tarfile.SYMTYPE, "h": tarfile.LNKTYPE}[k]
    try:
        tarfile.data_filter(m, dest)
        out.append("ok")
    except tarfile.FilterError:
        out.append("refused")
    except Exception as e:
        out.append("refused")
print("\n".join(out))
)PY");
  if (!sh("python3 " + g_tmp + "/pep706.py " + g_tmp + "/pep706-dest " + g_tmp +
          "/pep706.in > " + g_tmp + "/pep706.out")) {
    CHECK(false);
    return;
  }
  std::istringstream verdicts(read_file(g_tmp + "/pep706.out"));
  size_t refused_by_both = 0, refused_only_by_us = 0;
  for (const Case& c : cases) {
    std::string v;
    std::getline(verdicts, v);
    std::string out, why;
    bool ours = fastload::tar::safe_relative_path(c.name, &out, &why);
    if (ours && c.kind != 'f') ours = fastload::tar::safe_link_target(c.name, c.target, c.kind == 'h', &why);
    if (v == "refused") {
      if (ours)
        std::fprintf(stderr, "  PEP 706 refuses, we accept: '%s' -> '%s' (%c)\n", c.name.c_str(),
                     c.target.c_str(), c.kind);
      CHECK(!ours);
      ++refused_by_both;
    } else {
      CHECK_EQ(v, std::string("ok"));
      if (!ours) ++refused_only_by_us;
    }
  }
  std::fprintf(stderr, "pep706: %zu cases, %zu refused by the filter, %zu more by us\n",
               cases.size(), refused_by_both, refused_only_by_us);
}

// Framing agreement with GNU tar, the reference: random mutants of valid archives that
// we accept must list, in GNU tar (`tar -tR`, which names each member's header block),
// the same members with their headers at the same blocks, where GNU tar accepts them.
// TAR_DIFF_MUTANTS (default 400) and TAR_DIFF_SEED (default 2024) widen the search.
void test_differential_gnu_tar() {
  const char* count_env = std::getenv("TAR_DIFF_MUTANTS");
  const char* seed_env = std::getenv("TAR_DIFF_SEED");
  const size_t want = count_env ? std::strtoull(count_env, nullptr, 10) : 400;
  std::mt19937_64 rng(seed_env ? std::strtoull(seed_env, nullptr, 10) : 2024);
  const std::vector<std::string> base = tb::sample_archives();
  std::vector<std::string> pool = base;
  const std::string dir = g_tmp + "/diff";
  CHECK(sh("mkdir -p " + dir));
  std::vector<std::string> ours;
  for (size_t tries = 0; ours.size() < want && tries < 500 * want; ++tries) {
    std::string m = tb::mutate(pool[rng() % pool.size()], pool, rng);
    if (rng() % 8 == 0 && pool.size() < 128) pool.push_back(m);
    const Parsed r = parse_whole(m);
    if (r.error || r.recs.empty()) continue;
    write_file(dir + "/" + std::to_string(ours.size()) + ".tar", m);
    std::string blocks;
    for (const Rec& rec : r.recs) {
      // GNU tar names one of the member's header blocks (which one of a chain of
      // extension headers depends on their kinds): any from the first to the last.
      blocks += std::to_string(rec.m.header_offset / 512) + "-" +
                std::to_string(rec.m.data_offset / 512 - 1) + "\n";
    }
    ours.push_back(blocks);
  }
  CHECK(ours.size() >= want / 4);
  write_file(g_tmp + "/diff.py", R"PY(
import os, re, subprocess, sys
d, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    print("FILE", i)
    p = subprocess.run(["tar", "-tvRf", os.path.join(d, f"{i}.tar")], capture_output=True)
    if p.returncode != 0:
        print("ERROR")
        continue
    for line in p.stdout.decode("utf-8", "replace").splitlines():
        m = re.match(r"block (\d+): (.*)", line)
        if m and not m.group(2).startswith(("**", "V")):  # not the end, not a volume label
            print(m.group(1))
)PY");
  if (!sh("python3 " + g_tmp + "/diff.py " + dir + " " + std::to_string(ours.size()) + " > " + g_tmp +
          "/diff.out")) {
    CHECK(false);
    return;
  }
  std::vector<std::string> theirs;
  {
    std::istringstream in(read_file(g_tmp + "/diff.out"));
    for (std::string line; std::getline(in, line);) {
      if (line.starts_with("FILE ")) theirs.emplace_back();
      else if (!line.empty() && !theirs.empty()) theirs.back() += line + "\n";
    }
  }
  CHECK_EQ(ours.size(), theirs.size());
  size_t agreed = 0, refused = 0;
  for (size_t i = 0; i < ours.size() && i < theirs.size(); ++i) {
    if (theirs[i].starts_with("ERROR")) {
      ++refused;
      continue;
    }
    const auto agree = [](const std::string& mine, const std::string& gnu) {
      std::istringstream a(mine), b(gnu);
      std::string x, y;
      for (;;) {
        const bool more_a = bool(std::getline(a, x)), more_b = bool(std::getline(b, y));
        if (!more_a || !more_b) return more_a == more_b;
        const size_t dash = x.find('-');
        const uint64_t lo = std::stoull(x.substr(0, dash)), hi = std::stoull(x.substr(dash + 1));
        const uint64_t block = std::stoull(y);
        if (block < lo || block > hi) return false;
      }
    };
    if (!agree(ours[i], theirs[i])) {
      std::fprintf(stderr, "GNU tar reads %s/%zu.tar differently:\nours:\n%sGNU tar:\n%s", dir.c_str(),
                   i, ours[i].c_str(), theirs[i].c_str());
      CHECK(false);
    } else {
      ++agreed;
    }
  }
  std::fprintf(stderr, "differential: %zu mutants we accept, %zu read alike by GNU tar, %zu refused by it\n",
               ours.size(), agreed, refused);
}

}  // namespace

int main() {
  char tmpl[] = "/tmp/fastload-tar-test-XXXXXX";
  if (!::mkdtemp(tmpl)) {
    std::perror("mkdtemp");
    return 1;
  }
  g_tmp = tmpl;
  test_small_archive_fields();
  test_every_split();
  test_skippable();
  test_end_of_archive();
  test_big_sizes();
  test_pax_fields();
  test_format_errors();
  test_scan_os_error();
  test_safe_paths();
  test_tool_archives();
  test_sparse_members();
  test_sparse_size_counts_padding();
  test_against_pep706();
  test_differential_gnu_tar();
  if (fastload::test::failures() == 0) sh("rm -rf '" + g_tmp + "'");
  else std::fprintf(stderr, "fixtures kept in %s\n", g_tmp.c_str());
  return fastload::test::exit_code();
}
