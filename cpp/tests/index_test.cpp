// The shard index: key splitting, build + open round trip over tars written here (ustar
// headers, a member past 4 GiB in a sparse file), lookups, mmap and engine reads, and
// every refusal: corrupt, truncated, foreign-version and stale indexes, duplicate keys,
// members without a key, compressed shards.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "check.hpp"
#include "files.hpp"
#include "common/error.hpp"
#include "index/builder.hpp"
#include "index/reader.hpp"

using namespace fastload;
using fastload::index::ShardInput;
using fastload::test::read_file;
using fastload::test::write_file;

// Strings are compared here, not with CHECK_EQ: GCC 12 raises a false -Wrestrict in
// check.hpp's show() for std::string.
#define CHECK_STREQ(a, b)                                                              \
  do {                                                                                 \
    const std::string streq_a_{a}, streq_b_{b};                                        \
    if (streq_a_ != streq_b_) {                                                        \
      std::string what(#a " == " #b " (");                                             \
      what.append(streq_a_.substr(0, 80)).append(" vs ").append(streq_b_.substr(0, 80)); \
      ::fastload::test::fail(__FILE__, __LINE__, what + ")");                          \
    }                                                                                  \
  } while (0)

namespace {

std::string g_dir;

std::string path_of(const std::string& name) { return g_dir + "/" + name; }

// A ustar header block for a regular file (or a directory with type '5').
std::string ustar_header(const std::string& name, uint64_t size, char type = '0') {
  std::string h(512, '\0');
  std::memcpy(h.data(), name.data(), std::min<size_t>(name.size(), 100));
  std::snprintf(h.data() + 100, 8, "%07o", 0644);
  std::snprintf(h.data() + 108, 8, "%07o", 0);
  std::snprintf(h.data() + 116, 8, "%07o", 0);
  std::snprintf(h.data() + 124, 12, "%011llo", static_cast<unsigned long long>(size));
  std::snprintf(h.data() + 136, 12, "%011o", 1700000000);
  h[156] = type;
  std::memcpy(h.data() + 257, "ustar\0" "00", 8);
  std::memset(h.data() + 148, ' ', 8);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  std::snprintf(h.data() + 148, 8, "%06o", sum);
  h[155] = ' ';
  return h;
}

struct Entry {
  std::string name;
  std::string data;
  char type = '0';
};

// Writes a tar of the entries; returns each entry's data offset.
std::vector<uint64_t> write_tar(const std::string& path, const std::vector<Entry>& entries) {
  std::string out;
  std::vector<uint64_t> offsets;
  for (const auto& e : entries) {
    out += ustar_header(e.name, e.data.size(), e.type);
    offsets.push_back(out.size());
    out += e.data;
    out.append((512 - out.size() % 512) % 512, '\0');
  }
  out.append(1024, '\0');
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(out.data(), 1, out.size(), f);
  std::fclose(f);
  return offsets;
}

// Runs fn, returning the kind of the Error it threw (or -1 if none, -2 if another).
int error_kind(const std::function<void()>& fn, std::string* message = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return int(e.kind());
  } catch (...) {
    return -2;
  }
  return -1;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

void test_split_key() {
  std::string_view k, f;
  CHECK(index::split_key("a/b/x.seg.png", &k, &f));
  CHECK_STREQ(std::string(k), std::string("a/b/x"));
  CHECK_STREQ(std::string(f), std::string("seg.png"));
  CHECK(index::split_key("dir.v2/x.jpg", &k, &f));
  CHECK_STREQ(std::string(k), std::string("dir.v2/x"));
  CHECK_STREQ(std::string(f), std::string("jpg"));
  CHECK(!index::split_key("noext", &k, &f));
  CHECK(!index::split_key("a/.hidden", &k, &f));
  CHECK(!index::split_key("a/x.", &k, &f));
  CHECK(!index::split_key("dir.v2/noext", &k, &f));
}

void test_round_trip() {
  std::vector<Entry> a = {{"a/", "", '5'},
                          {"./a/s0.jpg", "JPEGDATA0"},
                          {"./a/s0.cls", "3"},
                          {"__meta__", "ignored"},
                          {"a/s1.jpg", ""},
                          {"a/s1.seg.png", std::string(5000, 'p')},
                          {"dots.in.dir/s2.txt", "hello"}};
  auto offs = write_tar(path_of("a.tar"), a);
  write_tar(path_of("b.tar"), {{"b0.cls", "7"}, {"b0.jpg", "B0"}});
  std::vector<ShardInput> in = {{path_of("a.tar"), "a.tar"}, {path_of("b.tar"), "b.tar"}};
  index::BuildOptions opt;
  opt.threads = 2;
  index::BuildResult r = index::build(in, path_of("ab.fidx"), opt);
  CHECK_EQ(r.shards, uint64_t(2));
  CHECK_EQ(r.samples, uint64_t(4));
  CHECK_EQ(r.members, uint64_t(7));

  auto ix = index::IndexFile::open(path_of("ab.fidx"));
  ix->check_shards();
  CHECK_EQ(ix->sample_count(), uint64_t(4));
  CHECK_STREQ(std::string(ix->key(0)), std::string("a/s0"));
  CHECK_STREQ(std::string(ix->key(1)), std::string("a/s1"));
  CHECK_STREQ(std::string(ix->key(2)), std::string("dots.in.dir/s2"));
  CHECK_STREQ(std::string(ix->key(3)), std::string("b0"));
  CHECK_STREQ(std::string(ix->shard_path(1)), std::string("b.tar"));
  CHECK_STREQ(ix->shard_open_path(1), path_of("b.tar"));
  CHECK(ix->find("a/s1") == std::optional<uint64_t>(1));
  CHECK(ix->find("b0") == std::optional<uint64_t>(3));
  CHECK(!ix->find("nope").has_value());
  CHECK(!ix->find("a/s").has_value());
  index::SampleRecord s1 = ix->sample(1);
  CHECK_EQ(s1.member_count, uint32_t(2));
  index::MemberRecord m = ix->member(s1.first_member + 1);
  CHECK_STREQ(std::string(ix->field_name(m.field)), std::string("seg.png"));
  CHECK_EQ(m.offset, offs[5]);
  CHECK_EQ(m.size, uint64_t(5000));

  // Fetch through both paths: mmap and the engine.
  index::Shards shards(ix);
  std::vector<uint64_t> want_samples = {3, 0, 1, 2};
  std::vector<index::Piece> pieces;
  shards.plan(want_samples, nullptr, pieces);
  CHECK_EQ(pieces.size(), size_t(7));
  std::vector<std::string> got(pieces.size());
  std::vector<char*> dst(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    got[i].resize(pieces[i].size);
    dst[i] = got[i].data();
  }
  shards.read(pieces, dst);
  shards.prefault(pieces);
  for (size_t i = 0; i < pieces.size(); ++i) {
    auto map = shards.mapping(pieces[i].shard);
    CHECK_STREQ(std::string(map->data() + pieces[i].offset, pieces[i].size), got[i]);
  }
  CHECK_STREQ(got[0], std::string("7"));
  CHECK_STREQ(got[1], std::string("B0"));
  CHECK_STREQ(got[2], std::string("JPEGDATA0"));
  CHECK_STREQ(got[5], std::string(5000, 'p'));
  CHECK_STREQ(got[6], std::string("hello"));
  CHECK(!shards.engine_name().empty());

  // Only some fields.
  std::vector<bool> want(ix->field_count(), false);
  for (uint64_t f = 0; f < ix->field_count(); ++f) want[f] = ix->field_name(f) == "cls";
  pieces.clear();
  shards.plan(want_samples, &want, pieces);
  CHECK_EQ(pieces.size(), size_t(2));
}

void test_refusals() {
  std::string msg;
  index::BuildOptions opt;
  // Duplicate keys across shards.
  write_tar(path_of("d1.tar"), {{"k.jpg", "1"}, {"j.jpg", "j"}});
  write_tar(path_of("d2.tar"), {{"k.jpg", "2"}, {"k2.jpg", "x"}});
  std::vector<ShardInput> dup = {{path_of("d1.tar"), "d1.tar"}, {path_of("d2.tar"), "d2.tar"}};
  CHECK_EQ(error_kind([&] { index::build_bytes(dup, opt, nullptr); }, &msg),
           int(ErrorKind::kFormat));
  CHECK(contains(msg, "duplicate sample key 'k'"));
  opt.on_duplicate = index::OnDuplicate::kFirst;
  index::BuildResult r;
  index::build_bytes(dup, opt, &r);
  CHECK_EQ(r.samples, uint64_t(3));
  CHECK_EQ(r.duplicates_skipped, uint64_t(1));
  opt.on_duplicate = index::OnDuplicate::kError;

  // A key seen twice apart in one shard; a field twice in one sample.
  write_tar(path_of("d3.tar"), {{"k.jpg", "1"}, {"j.jpg", "j"}, {"k.cls", "2"}});
  CHECK_EQ(error_kind([&] { index::build_bytes({{path_of("d3.tar"), "d3"}}, opt, nullptr); }),
           int(ErrorKind::kFormat));
  write_tar(path_of("d4.tar"), {{"k.jpg", "1"}, {"k.jpg", "2"}});
  CHECK_EQ(error_kind([&] { index::build_bytes({{path_of("d4.tar"), "d4"}}, opt, &r); }, &msg),
           int(ErrorKind::kFormat));
  CHECK(contains(msg, "twice"));

  // A member without a key.
  write_tar(path_of("nokey.tar"), {{"a/README", "x"}});
  CHECK_EQ(error_kind([&] { index::build_bytes({{path_of("nokey.tar"), "n"}}, opt, &r); }, &msg),
           int(ErrorKind::kFormat));
  CHECK(contains(msg, "a/README") && contains(msg, "no sample key"));

  // Compressed.
  write_file(path_of("c.tar.gz"), std::string("\x1f\x8b\x08\x00", 4) + std::string(600, 'z'));
  CHECK_EQ(error_kind([&] { index::build_bytes({{path_of("c.tar.gz"), "c"}}, opt, &r); }, &msg),
           int(ErrorKind::kFormat));
  CHECK(contains(msg, "gzip") && contains(msg, "fastload stage"));

  // Missing shard.
  CHECK_EQ(error_kind([&] { index::build_bytes({{path_of("missing.tar"), "m"}}, opt, &r); }),
           int(ErrorKind::kOs));

  // A truncated shard (data runs past the end).
  std::string t = read_file(path_of("d1.tar"));
  write_file(path_of("trunc.tar"), t.substr(0, 512 + 100));
  write_file(path_of("trunc.tar"), t.substr(0, 512) + std::string(1, '1'));
  int kind = error_kind([&] { index::build_bytes({{path_of("trunc.tar"), "t"}}, opt, &r); });
  CHECK(kind == int(ErrorKind::kFormat) || kind == -1);
}

void test_corrupt_index() {
  write_tar(path_of("c1.tar"), {{"x.a", "1"}, {"y.a", "22"}, {"z.a", "333"}});
  index::BuildOptions opt;
  index::build({{path_of("c1.tar"), "c1.tar"}}, path_of("c.fidx"), opt);
  const std::string good = read_file(path_of("c.fidx"));
  const std::string bad = path_of("bad.fidx");
  std::string msg;
  auto open_bad = [&](const std::string& bytes) {
    write_file(bad, bytes);
    return error_kind([&] { index::IndexFile::open(bad); }, &msg);
  };
  CHECK_EQ(open_bad(good), -1);
  // Every single-byte flip is caught.
  for (size_t i = 0; i < good.size(); ++i) {
    std::string b = good;
    b[i] = char(b[i] ^ 0x40);
    if (open_bad(b) != int(ErrorKind::kIndexFormat)) {
      CHECK(false);
      std::fprintf(stderr, "  flip at byte %zu not detected\n", i);
      break;
    }
  }
  // Every truncation is caught.
  for (size_t n = 0; n < good.size(); n += 7)
    CHECK_EQ(open_bad(good.substr(0, n)), int(ErrorKind::kIndexFormat));
  CHECK_EQ(open_bad(good + "x"), int(ErrorKind::kIndexFormat));
  CHECK_EQ(open_bad("hello world, not an index at all"), int(ErrorKind::kIndexFormat));
  CHECK(contains(msg, "not a fastload index"));
  // Another version, with a valid header checksum: refused by version, not checksum.
  std::string v2 = good;
  index::Header h;
  std::memcpy(&h, v2.data(), sizeof h);
  h.version = 2;
  h.header_checksum =
      hash::fl64(&h, offsetof(index::Header, header_checksum), index::kChecksumSeed);
  std::memcpy(v2.data(), &h, sizeof h);
  CHECK_EQ(open_bad(v2), int(ErrorKind::kIndexFormat));
  CHECK(contains(msg, "version 2"));
  CHECK_EQ(error_kind([&] { index::IndexFile::open(path_of("absent.fidx")); }),
           int(ErrorKind::kOs));

  // Stale: a shard whose mtime or size changed, or that is gone.
  auto ix = index::IndexFile::open(path_of("c.fidx"));
  ix->check_shards();
  struct timespec ts[2] = {{1000, 5}, {1000, 5}};
  ::utimensat(AT_FDCWD, path_of("c1.tar").c_str(), ts, 0);
  CHECK_EQ(error_kind([&] { ix->check_shards(); }, &msg), int(ErrorKind::kIndexFormat));
  CHECK(contains(msg, "c1.tar") && contains(msg, "modified 1970-01-01 00:16:40.000000005 UTC"));
  write_tar(path_of("c1.tar"), {{"x.a", "1"}, {"y.a", "22"}, {"z.a", std::string(2000, 'z')}});
  CHECK_EQ(error_kind([&] { ix->check_shards(); }, &msg), int(ErrorKind::kIndexFormat));
  CHECK(contains(msg, "size"));
  index::Shards shards(ix);
  CHECK_EQ(error_kind([&] { shards.mapping(0); }), int(ErrorKind::kIndexFormat));
  ::unlink(path_of("c1.tar").c_str());
  CHECK_EQ(error_kind([&] { ix->check_shards(); }, &msg), int(ErrorKind::kIndexFormat));
}

// A member whose data starts past 4 GiB: a sparse file (the hole costs no disk).
void test_past_4gib() {
  const std::string p = path_of("big.tar");
  const uint64_t big = (uint64_t(5) << 30) + 123;
  int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  CHECK(fd >= 0);
  std::string h1 = ustar_header("hole.bin", big);
  CHECK_EQ(::pwrite(fd, h1.data(), 512, 0), ssize_t(512));
  uint64_t next = 512 + ((big + 511) / 512) * 512;
  std::string h2 = ustar_header("hole.txt", 11) + "past 4 GiB!";
  h2.append(512 - 11, '\0');
  h2.append(1024, '\0');
  if (::pwrite(fd, h2.data(), h2.size(), off_t(next)) != ssize_t(h2.size())) {
    std::fprintf(stderr, "cannot write a sparse file past 4 GiB here; skipping that part\n");
    ::close(fd);
    ::unlink(p.c_str());
    return;
  }
  ::close(fd);
  index::BuildOptions opt;
  index::build({{p, "big.tar"}}, path_of("big.fidx"), opt);
  auto ix = index::IndexFile::open(path_of("big.fidx"));
  CHECK_EQ(ix->sample_count(), uint64_t(1));
  index::SampleRecord s = ix->sample(0);
  CHECK_EQ(s.member_count, uint32_t(2));
  index::MemberRecord m0 = ix->member(s.first_member);
  index::MemberRecord m1 = ix->member(s.first_member + 1);
  CHECK_EQ(m0.size, big);
  CHECK_EQ(m1.offset, next + 512);
  CHECK(m1.offset > (uint64_t(1) << 32));
  index::Shards shards(ix);
  std::vector<index::Piece> pieces = {{0, m1.field, 0, m1.offset, m1.size}};
  std::string got(11, '\0');
  std::vector<char*> dst = {got.data()};
  shards.read(pieces, dst);
  CHECK_STREQ(got, std::string("past 4 GiB!"));
  auto map = shards.mapping(0);
  CHECK_STREQ(std::string(map->data() + m1.offset, 11), std::string("past 4 GiB!"));
  ::unlink(p.c_str());
}

}  // namespace

int main() {
  char tmpl[] = "/tmp/fastload-index-test-XXXXXX";
  if (!::mkdtemp(tmpl)) return 1;
  g_dir = tmpl;
  test_split_key();
  test_round_trip();
  test_refusals();
  test_corrupt_index();
  test_past_4gib();
  std::string rm = "rm -rf '" + g_dir + "'";
  if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", g_dir.c_str());
  return fastload::test::exit_code();
}
