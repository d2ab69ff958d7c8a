// The tar writer (tar/writer.hpp): header sizes (ustar, pax for long names and sizes
// past 11 octal digits), deterministic headers parsed back by tar::StreamParser, shards
// written through ShardFile (from memory, from a file, members larger than the buffer)
// and parsed back whole, the temporary file removed on abort, and a source file that
// changed size refused.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "check.hpp"
#include "files.hpp"
#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "tar/reader.hpp"
#include "tar/writer.hpp"

using namespace fastload;
using test::read_file;
using test::write_file;

namespace {

std::string g_dir;

struct Got {
  std::string path;
  uint64_t size;
  std::string data;
};

class Collect final : public tar::Sink {
 public:
  std::vector<Got> members;
  tar::Action on_member(const tar::Member& m) override {
    members.push_back({m.path, m.size, {}});
    return tar::Action::kRead;
  }
  void on_data(const char* d, size_t n) override { members.back().data.append(d, n); }
  void on_member_end() override {}
};

std::vector<Got> parse(const std::string& bytes, bool finish = true) {
  tar::StreamParser p("test");
  Collect c;
  p.feed(bytes.data(), bytes.size(), c);
  if (finish) {
    p.finish(c);
    CHECK(p.at_end());
  }
  return c.members;
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// The kind of the Error fn throws, -1 if none.
int error_kind(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return int(e.kind());
  }
  return -1;
}

std::string header(const std::string& name, uint64_t size) {
  std::string h(size_t(tar::header_bytes(name.size(), size)), '\0');
  CHECK_EQ(tar::write_header(name, size, h.data()), h.size());
  return h;
}

void test_header_sizes() {
  CHECK_EQ(tar::header_bytes(100, 0), uint64_t(512));
  CHECK_EQ(tar::header_bytes(100, tar::kOctalSizeMax), uint64_t(512));
  CHECK(tar::header_bytes(101, 0) > 512);                      // pax path
  CHECK(tar::header_bytes(1, tar::kOctalSizeMax + 1) > 512);   // pax size
  CHECK_EQ(tar::header_bytes(101, 0) % 512, uint64_t(0));
  CHECK_EQ(tar::member_bytes(5, 0), uint64_t(512));
  CHECK_EQ(tar::member_bytes(5, 1), uint64_t(1024));
  CHECK_EQ(tar::member_bytes(5, 512), uint64_t(1024));
  CHECK_EQ(tar::member_bytes(5, 513), uint64_t(1536));
}

void test_headers_parse_back() {
  CHECK(header("a/b.txt", 3) == header("a/b.txt", 3));  // deterministic
  const std::string long_name = std::string(150, 'n') + "/" + std::string(120, 'm') + ".jpg";
  std::string bytes = header(long_name, 3) + "abc";
  bytes.append(509 + 1024, '\0');
  const auto got = parse(bytes);
  CHECK_EQ(got.size(), size_t(1));
  if (!got.empty()) {
    CHECK(got[0].path == long_name);
    CHECK(got[0].data == "abc");
  }
  // A size past 11 octal digits: the parser reads it from the pax header.
  const uint64_t huge = tar::kOctalSizeMax + 12345;
  const auto big = parse(header("big.bin", huge), /*finish=*/false);
  CHECK_EQ(big.size(), size_t(1));
  if (!big.empty()) CHECK_EQ(big[0].size, huge);
}

void test_shard_file() {
  const std::string src = g_dir + "/src.bin";
  std::string payload(300000, '\0');  // larger than the 64 KiB buffer below
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = char('a' + i % 23);
  write_file(src, payload);
  const std::string final_path = g_dir + "/s.tar", tmp = g_dir + "/s.tar.tmp";
  {
    tar::ShardFile f(final_path, tmp, 64 * 1024);
    CHECK(exists(tmp));
    f.add("k0.txt", "hello", 5);
    f.add("k0.big", payload.data(), payload.size());  // through the buffer in pieces
    UniqueFd fd(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
    f.add_from("k1.bin", payload.size(), fd.get(), 0, /*whole_file=*/true, src);
    f.add_from("k1.part", 10, fd.get(), 7, /*whole_file=*/false, src);
    f.add("k2.empty", "", 0);
    CHECK_EQ(f.members(), uint64_t(5));
    CHECK_EQ(f.bytes(), tar::member_bytes(6, 5) + 2 * tar::member_bytes(6, payload.size()) +
                            tar::member_bytes(7, 10) + tar::member_bytes(8, 0));
    f.commit(/*sync=*/false);
    CHECK(!exists(tmp));
  }
  const std::string bytes = read_file(final_path);
  CHECK_EQ(bytes.size() % 512, size_t(0));
  const auto got = parse(bytes);
  CHECK_EQ(got.size(), size_t(5));
  if (got.size() == 5) {
    CHECK(got[0].path == "k0.txt" && got[0].data == "hello");
    CHECK(got[1].path == "k0.big" && got[1].data == payload);
    CHECK(got[2].path == "k1.bin" && got[2].data == payload);
    CHECK(got[3].path == "k1.part" && got[3].data == payload.substr(7, 10));
    CHECK(got[4].path == "k2.empty" && got[4].data.empty());
  }
  ::unlink(final_path.c_str());

  {
    tar::ShardFile f(final_path, tmp);
    f.add("x.txt", "x", 1);
  }  // no commit: the temporary file goes, nothing is renamed
  CHECK(!exists(tmp));
  CHECK(!exists(final_path));

  // A whole file that is now longer or shorter than planned.
  UniqueFd fd(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
  const int changed = int(ErrorKind::kSourceChanged);
  for (uint64_t planned : {payload.size() - 1, payload.size() + 1, uint64_t(10)}) {
    tar::ShardFile f(final_path, tmp, 64 * 1024);
    CHECK_EQ(error_kind([&] { f.add_from("k.bin", planned, fd.get(), 0, true, src); }), changed);
  }
  CHECK(!exists(tmp));
  std::string buf(16, '\0');
  CHECK_EQ(error_kind([&] { tar::read_source(fd.get(), buf.data(), 8, payload.size() - 4, false, src); }),
           changed);
  CHECK_EQ(error_kind([&] { tar::read_source(fd.get(), buf.data(), 8, 0, false, src); }), -1);
  CHECK(buf.substr(0, 8) == payload.substr(0, 8));
  CHECK_EQ(error_kind([] { tar::ShardFile f("/nonexistent-dir/x.tar", "/nonexistent-dir/x.tmp"); }),
           int(ErrorKind::kOs));
  ::unlink(src.c_str());
}

}  // namespace

int main() {
  g_dir = test::make_temp_dir("tarw-test");
  if (g_dir.empty()) return 1;
  test_header_sizes();
  test_headers_parse_back();
  test_shard_file();
  ::rmdir(g_dir.c_str());
  return test::exit_code();
}
