// A batch brought in from the shards (index/batch.hpp), over shards written by
// tar::ShardFile and indexed here: field selection, locate() in both access modes
// (bytes in place, each with the owner that keeps it), copy_pieces(), and the packed
// columns (layout in both column orders, missing rows, offsets, payloads back to back).
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "check.hpp"
#include "files.hpp"
#include "common/columns.hpp"
#include "index/batch.hpp"
#include "index/builder.hpp"
#include "index/reader.hpp"
#include "tar/writer.hpp"

using namespace fastload;
using index::Access;
using index::Piece;

namespace {

std::string g_dir;

// Sample k of shard s: key "s<s>/k<k>", field "txt" always ("<s>:<k>" repeated k + 1
// times), field "cls" on even k (one byte), field "big" on k == 3 (70,000 bytes).
// (Strings are built with append: GCC 12 at -O3 warns falsely, -Wrestrict, on "x" + str.)
std::string txt(int s, int k) {
  std::string out;
  for (int i = 0; i <= k; ++i) out.append(std::to_string(s)).append(":").append(std::to_string(k));
  return out;
}

std::string key_of(int s, int k) {
  std::string out("s");
  return out.append(std::to_string(s)).append("/k").append(std::to_string(k));
}

void write_shards() {
  for (int s = 0; s < 2; ++s) {
    std::string name = g_dir;
    name.append("/shard").append(std::to_string(s)).append(".tar");
    tar::ShardFile f(name, std::string(name).append(".tmp"));
    for (int k = 0; k < 5; ++k) {
      const std::string key = key_of(s, k);
      const std::string t = txt(s, k);
      f.add(std::string(key).append(".txt"), t.data(), t.size());
      if (k % 2 == 0) f.add(std::string(key).append(".cls"), "c", 1);
      if (k == 3) {
        const std::string big(70000, char('a' + s));
        f.add(std::string(key).append(".big"), big.data(), big.size());
      }
    }
    f.commit(false);
  }
  std::vector<index::ShardInput> in = {{g_dir + "/shard0.tar", "shard0.tar"},
                                       {g_dir + "/shard1.tar", "shard1.tar"}};
  index::build(in, g_dir + "/i.fidx", {});
}

uint32_t id(const index::IndexFile& ix, const char* name) {
  const std::optional<uint32_t> f = ix.field_id(name);
  CHECK(f.has_value());
  return f.value_or(0);
}

std::string bytes_of(const char* p, uint64_t n) { return std::string(p, size_t(n)); }

void test_select_fields(const index::IndexFile& ix) {
  CHECK(!ix.field_id("nope").has_value());
  const auto every = index::select_fields(ix.field_count(), std::nullopt);
  CHECK(!every.want.has_value());
  CHECK(every.fields.empty());
  const uint32_t t = id(ix, "txt"), c = id(ix, "cls");
  const auto two = index::select_fields(ix.field_count(), std::vector<uint32_t>{c, t, c});
  CHECK(two.want.has_value() && (*two.want)[t] && (*two.want)[c]);
  CHECK_EQ(two.wanted, size_t(2));
  CHECK_EQ(two.fields.size(), size_t(3));
  bool threw = false;
  try {
    index::select_fields(ix.field_count(), std::vector<uint32_t>{uint32_t(ix.field_count())});
  } catch (const std::out_of_range&) {
    threw = true;
  }
  CHECK(threw);
}

// Every piece of the batch {s1/k3, s0/k0, s1/k3} (a sample twice) in both access modes.
void test_locate_and_copy(index::Shards& shards) {
  const index::IndexFile& ix = shards.index();
  const std::vector<uint64_t> samples = {*ix.find("s1/k3"), *ix.find("s0/k0"), *ix.find("s1/k3")};
  std::vector<Piece> pieces;
  shards.plan(samples, nullptr, pieces);
  CHECK_EQ(pieces.size(), size_t(2 + 2 + 2));  // txt+big, txt+cls, txt+big
  for (Access access : {Access::kMmap, Access::kRead}) {
    std::vector<std::string> seen;
    {
      index::Located got = index::locate(shards, pieces, access, /*prefault=*/true);
      CHECK_EQ(got.data.size(), pieces.size());
      CHECK_EQ(got.owner.size(), pieces.size());
      for (size_t i = 0; i < pieces.size(); ++i) {
        CHECK(got.owner[i] != nullptr);
        seen.push_back(bytes_of(got.data[i], pieces[i].size));
      }
      if (access == Access::kRead)  // one block holds the whole batch
        CHECK(got.owner.front() == got.owner.back());
    }
    CHECK(seen[0] == txt(1, 3));
    CHECK(seen[1] == std::string(70000, 'b'));
    CHECK(seen[2] == txt(0, 0));
    CHECK(seen[3] == "c");
    CHECK(seen[4] == seen[0] && seen[5] == seen[1]);

    std::vector<std::string> out(pieces.size());
    std::vector<char*> dst(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      out[i].assign(size_t(pieces[i].size), '\0');
      dst[i] = out[i].data();
    }
    index::copy_pieces(shards, pieces, dst, access);
    CHECK(out == seen);
  }
}

int64_t offset_at(const std::string& offsets, size_t r) {
  int64_t v;
  std::memcpy(&v, offsets.data() + 8 * r, 8);
  return v;
}

void test_columns(index::Shards& shards) {
  const index::IndexFile& ix = shards.index();
  const uint32_t t = id(ix, "txt"), c = id(ix, "cls"), b = id(ix, "big");
  // Rows: s0/k1 (txt), s0/k3 (txt, big), s1/k2 (txt, cls).
  const std::vector<uint64_t> samples = {*ix.find("s0/k1"), *ix.find("s0/k3"), *ix.find("s1/k2")};
  const size_t rows = samples.size();

  // Every field, in order of first appearance.
  std::vector<Piece> all;
  shards.plan(samples, nullptr, all);
  const index::Columns every = index::layout_columns(all, rows, ix.field_count(), std::nullopt);
  CHECK_EQ(every.count(), size_t(3));
  CHECK(every.field == (std::vector<uint32_t>{t, b, c}));
  CHECK(every.missing(0).empty());
  CHECK(every.missing(1) == (std::vector<uint32_t>{0, 2}));
  CHECK(every.missing(2) == (std::vector<uint32_t>{0, 1}));
  CHECK_EQ(every.data_bytes(1), uint64_t(70000));

  // Named fields, in the order named (a repeat once), filled in both access modes.
  const auto sel = index::select_fields(ix.field_count(), std::vector<uint32_t>{c, t, c});
  std::vector<Piece> pieces;
  shards.plan(samples, &*sel.want, pieces);
  const index::Columns cols = index::layout_columns(pieces, rows, ix.field_count(), sel.fields);
  CHECK(cols.field == (std::vector<uint32_t>{c, t}));
  CHECK(cols.missing(0) == (std::vector<uint32_t>{0, 1}));
  CHECK(!cols.has(0, 0) && cols.has(0, 2) && cols.has(1, 1));
  const std::string want_txt = txt(0, 1) + txt(0, 3) + txt(1, 2);
  CHECK_EQ(cols.data_bytes(0), uint64_t(1));
  CHECK_EQ(cols.data_bytes(1), uint64_t(want_txt.size()));
  for (Access access : {Access::kMmap, Access::kRead}) {
    std::vector<std::string> data(2), offsets(2, std::string(size_t(offsets_bytes(rows)), 'x'));
    std::vector<char*> dp(2), op(2);
    for (size_t k = 0; k < 2; ++k) {
      data[k].assign(size_t(cols.data_bytes(k)), '\0');
      dp[k] = data[k].data();
      op[k] = offsets[k].data();
    }
    index::fill_columns(shards, cols, pieces, dp, op, access);
    CHECK(data[0] == "c");
    CHECK(data[1] == want_txt);
    CHECK_EQ(offset_at(offsets[0], 0), int64_t(0));
    CHECK_EQ(offset_at(offsets[0], 2), int64_t(0));  // rows 0 and 1 are missing: empty
    CHECK_EQ(offset_at(offsets[0], 3), int64_t(1));
    CHECK_EQ(offset_at(offsets[1], 1), int64_t(txt(0, 1).size()));
    CHECK_EQ(offset_at(offsets[1], 2), int64_t(txt(0, 1).size() + txt(0, 3).size()));
    CHECK_EQ(offset_at(offsets[1], 3), int64_t(want_txt.size()));
  }

  // An empty batch: columns named, no rows.
  const index::Columns none = index::layout_columns({}, 0, ix.field_count(), sel.fields);
  CHECK_EQ(none.count(), size_t(2));
  CHECK_EQ(none.data_bytes(0), uint64_t(0));
}

}  // namespace

int main() {
  g_dir = test::make_temp_dir("batch-test");
  if (g_dir.empty()) return 1;
  write_shards();
  {
    auto ix = index::IndexFile::open(g_dir + "/i.fidx");
    index::Shards shards(ix);
    test_select_fields(*ix);
    test_locate_and_copy(shards);
    test_columns(shards);
  }
  for (const char* f : {"/shard0.tar", "/shard1.tar", "/i.fidx"}) ::unlink((g_dir + f).c_str());
  ::rmdir(g_dir.c_str());
  return test::exit_code();
}
