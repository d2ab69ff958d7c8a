#include "index/batch.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/columns.hpp"

namespace fastload::index {
namespace {

constexpr uint32_t kNone = UINT32_MAX;
const char kEmpty[1] = {0};  // where an empty piece points

}  // namespace

FieldSelection select_fields(uint64_t field_count,
                             const std::optional<std::vector<uint32_t>>& fields) {
  FieldSelection s;
  if (!fields) return s;
  s.fields = *fields;
  s.want.emplace(field_count, false);
  for (uint32_t f : s.fields) {
    if (f >= field_count)
      throw std::out_of_range("field id " + std::to_string(f) + " of " + std::to_string(field_count));
    if (!(*s.want)[f]) ++s.wanted;
    (*s.want)[f] = true;
  }
  return s;
}

Located locate(Shards& shards, std::span<const Piece> pieces, Access access, bool prefault) {
  Located out;
  out.data.resize(pieces.size());
  out.owner.resize(pieces.size());
  if (access == Access::kMmap) {
    std::shared_ptr<const Mapping> map;
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (!map || pieces[i].shard != pieces[i - 1].shard) map = shards.mapping(pieces[i].shard);
      out.data[i] = pieces[i].size ? map->data() + pieces[i].offset : kEmpty;
      out.owner[i] = map;
    }
    if (prefault) shards.prefault(pieces);
    return out;
  }
  uint64_t total = 0;
  for (const Piece& p : pieces) total += p.size;
  std::shared_ptr<char[]> block(new char[std::max<uint64_t>(total, 1)]);
  std::vector<char*> dst(pieces.size());
  uint64_t at = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    dst[i] = block.get() + at;
    out.data[i] = pieces[i].size ? dst[i] : kEmpty;
    out.owner[i] = block;
    at += pieces[i].size;
  }
  shards.read(pieces, dst);
  return out;
}

void copy_pieces(Shards& shards, std::span<const Piece> pieces, std::span<char* const> dst,
                 Access access) {
  if (access == Access::kRead) {
    shards.read(pieces, dst);
    return;
  }
  std::shared_ptr<const Mapping> map;
  uint32_t shard = kNone;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!pieces[i].size) continue;
    if (pieces[i].shard != shard) {
      shard = pieces[i].shard;
      map = shards.mapping(shard);
    }
    std::memcpy(dst[i], map->data() + pieces[i].offset, pieces[i].size);
  }
}

uint64_t Columns::data_bytes(size_t c) const noexcept {
  uint64_t n = 0;
  for (size_t r = 0; r < rows; ++r) n += size[c * rows + r];
  return n;
}

std::vector<uint32_t> Columns::missing(size_t c) const {
  std::vector<uint32_t> out;
  for (size_t r = 0; r < rows; ++r)
    if (!has(c, r)) out.push_back(uint32_t(r));
  return out;
}

Columns layout_columns(std::span<const Piece> pieces, size_t rows, uint64_t field_count,
                       const std::optional<std::vector<uint32_t>>& fields) {
  Columns out;
  out.rows = rows;
  std::vector<uint32_t> column_of(field_count, kNone);
  const auto add = [&](uint32_t f) {
    if (column_of[f] != kNone) return;
    column_of[f] = uint32_t(out.field.size());
    out.field.push_back(f);
  };
  if (fields) {
    for (uint32_t f : *fields) add(f);
  } else {
    for (const Piece& p : pieces) add(p.field);
  }
  out.piece.assign(out.field.size() * rows, 0);
  out.size.assign(out.field.size() * rows, 0);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const uint32_t c = column_of[pieces[i].field];
    if (c == kNone) continue;  // a field not asked for (plan() was given another mask)
    const size_t at = c * rows + pieces[i].slot;
    out.piece[at] = i + 1;
    out.size[at] = pieces[i].size;
  }
  return out;
}

void fill_columns(Shards& shards, const Columns& columns, std::span<const Piece> pieces,
                  std::span<char* const> data, std::span<char* const> offsets, Access access) {
  const size_t rows = columns.rows;
  std::vector<Piece> todo;  // the pieces to bring in, and where each goes
  std::vector<char*> dst;
  todo.reserve(pieces.size());
  dst.reserve(pieces.size());
  for (size_t c = 0; c < columns.count(); ++c) {
    write_offsets(offsets[c], columns.size.data() + c * rows, rows);
    char* at = data[c];
    for (size_t r = 0; r < rows; ++r) {
      const size_t k = columns.piece[c * rows + r];
      if (k && pieces[k - 1].size) {
        todo.push_back(pieces[k - 1]);
        dst.push_back(at);
      }
      at += columns.size[c * rows + r];
    }
  }
  if (!todo.empty()) copy_pieces(shards, todo, dst, access);
}

}  // namespace fastload::index
