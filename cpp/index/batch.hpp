// A batch of samples brought in from the shards, the two ways Index.fetch and
// Index.fetch_packed hand it out (the bindings only convert):
//
//   select_fields()   the fields a batch asks for, as a mask over field ids
//   locate()          every member's bytes in place, zero-copy: in the shards' mappings
//                     (mmap; pages faulted in here when asked), or in one block read
//                     through the I/O engine (read); each with the owner that keeps it
//   copy_pieces()     every member's bytes copied into buffers the caller provides
//   Columns           the batch laid out one column per field, one row per sample
//                     (common/columns.hpp's layout); fill_columns() copies each payload
//                     once, from the mapping or by the engine's reads, into the buffers
//
// Nothing here takes a lock beyond Shards' own, and nothing needs the caller's (Python's)
// lock: callers release it around every call. Errors: Error(kIndexFormat) for a member
// outside its shard (from Shards::plan), Error(kOs) for I/O failures.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "index/reader.hpp"

namespace fastload::index {

enum class Access : uint8_t {
  kMmap,  // through the shards' mappings (page faults: local disks, the page cache)
  kRead,  // all at once through the I/O engine (network storage: each fault a round trip)
};

struct FieldSelection {
  std::vector<uint32_t> fields;           // the field ids named, in order (repeats kept)
  std::optional<std::vector<bool>> want;  // one entry per field id; nullopt: every field
  size_t wanted = 0;                      // distinct ids in fields
};

// The selection of exactly `fields` (ids below field_count), or of every field
// (nullopt). std::out_of_range for an id past field_count.
FieldSelection select_fields(uint64_t field_count, const std::optional<std::vector<uint32_t>>& fields);

// Where each piece's bytes are (data[i], pieces[i].size bytes; a valid pointer even for
// an empty piece), and what keeps them there (owner[i]: a shard's mapping, or the block
// every piece was read into).
struct Located {
  std::vector<const char*> data;
  std::vector<std::shared_ptr<const void>> owner;
};

// Brings every piece in. kMmap: points into the mappings, touching their pages first
// when prefault is set (so the faults happen in the calling thread); kRead: reads all
// pieces into one block through the engine.
Located locate(Shards& shards, std::span<const Piece> pieces, Access access, bool prefault);

// Copies every piece into dst[i] (pieces[i].size bytes each).
void copy_pieces(Shards& shards, std::span<const Piece> pieces, std::span<char* const> dst,
                 Access access);

// A batch of `rows` samples laid out as columns, one per field.
struct Columns {
  size_t rows = 0;
  std::vector<uint32_t> field;  // the field id of each column
  std::vector<size_t> piece;    // per (column c, row r) at c * rows + r: 1 + the index of
                                // its piece, 0 when sample r has no such field
  std::vector<uint64_t> size;   // per (column, row): the payload's bytes (0 when none)

  size_t count() const noexcept { return field.size(); }
  bool has(size_t c, size_t r) const noexcept { return piece[c * rows + r] != 0; }
  // The bytes of column c's payloads, all rows together.
  uint64_t data_bytes(size_t c) const noexcept;
  // The rows of column c without a payload, in order.
  std::vector<uint32_t> missing(size_t c) const;
};

// Lays out pieces planned for `rows` samples (Shards::plan, slot = row): the columns are
// `fields` in order (each once), or when fields is nullopt every field the pieces have,
// in order of first appearance. A field twice in one sample: the last piece wins (as a
// dict built from the pieces in order would have it).
Columns layout_columns(std::span<const Piece> pieces, size_t rows, uint64_t field_count,
                       const std::optional<std::vector<uint32_t>>& fields);

// Fills column c's payloads back to back into data[c] (data_bytes(c) bytes) and its
// offsets into offsets[c] (offsets_bytes(rows) bytes), each payload copied once.
void fill_columns(Shards& shards, const Columns& columns, std::span<const Piece> pieces,
                  std::span<char* const> data, std::span<char* const> offsets, Access access);

}  // namespace fastload::index
