// The shard index file format, version 1 (docs/index-format.md is the reference).
//
// One file describes every sample of a set of webdataset-style tar shards:
//
//   Header   144 bytes at offset 0
//   shards   ShardRecord[shard_count]
//   samples  SampleRecord[sample_count]      in shard order, then tar order
//   members  MemberRecord[member_count]      each sample's members are contiguous
//   fields   FieldRecord[field_count]        distinct field names ("jpg", "seg.png")
//   hash     uint64_t[hash_slots]            open addressing, key -> sample + 1 (0: empty)
//   strings  bytes[string_size]              shard paths, field names, keys (no NULs)
//
// Every integer is little-endian; every table starts at a multiple of 8; records have
// fixed sizes and natural alignment, so a reader over an mmap needs no parsing. Offsets
// and sizes are 64-bit: shards over 4 GiB and indexes over 4 GiB work.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "hash/digest.hpp"

namespace fastload::index {

static_assert(std::endian::native == std::endian::little,
              "the index is read by casting mmapped records: a big-endian host needs byte swaps");

// "\x89FLIDX\r\n": the high byte catches 7-bit transports, CR LF catches newline
// translation (the PNG trick).
inline constexpr char kMagic[8] = {'\x89', 'F', 'L', 'I', 'D', 'X', '\r', '\n'};
inline constexpr uint32_t kVersion = 1;

// Header.flags bits. A reader refuses bits it does not know.
inline constexpr uint64_t kFlagFirstOnDuplicate = 1;  // built with on_duplicate="first"
inline constexpr uint64_t kKnownFlags = kFlagFirstOnDuplicate;

// Seeds of fl64 for the hash table and the checksums (fixed by the format).
inline constexpr uint64_t kKeyHashSeed = 0x6b65792d68617368ULL;  // "key-hash"
inline constexpr uint64_t kChecksumSeed = 0x666c2d6964782d31ULL;  // "fl-idx-1"

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t header_size;  // sizeof(Header): lets a later minor change append fields
  uint64_t flags;
  uint64_t file_size;  // the whole file; a shorter file is truncated
  uint64_t shard_count;
  uint64_t sample_count;
  uint64_t member_count;
  uint64_t field_count;
  uint64_t hash_slots;  // a power of two, > sample_count
  uint64_t shard_offset;
  uint64_t sample_offset;
  uint64_t member_offset;
  uint64_t field_offset;
  uint64_t hash_offset;
  uint64_t string_offset;
  uint64_t string_size;
  uint64_t tables_checksum;  // fl64(kChecksumSeed) of bytes [header_size, file_size)
  uint64_t header_checksum;  // fl64(kChecksumSeed) of the header bytes before this field
};
static_assert(sizeof(Header) == 144);
static_assert(offsetof(Header, header_checksum) == 136);

struct ShardRecord {
  uint64_t path_offset;  // into the string table: the path relative to the index's folder
  uint32_t path_length;
  uint32_t reserved;     // 0
  uint64_t size;         // bytes, as seen when indexed
  int64_t mtime_ns;      // st_mtim, as seen when indexed
  uint64_t first_sample;
  uint64_t sample_count;
};
static_assert(sizeof(ShardRecord) == 48);

struct SampleRecord {
  uint64_t key_offset;  // into the string table
  uint32_t key_length;
  uint32_t shard;
  uint64_t first_member;
  uint32_t member_count;  // >= 1
  uint32_t reserved;      // 0
};
static_assert(sizeof(SampleRecord) == 32);

struct MemberRecord {
  uint32_t field;     // index into the field table
  uint32_t reserved;  // 0
  uint64_t offset;    // of the member's data in its shard
  uint64_t size;      // bytes of data
};
static_assert(sizeof(MemberRecord) == 24);

struct FieldRecord {
  uint64_t name_offset;  // into the string table
  uint32_t name_length;
  uint32_t reserved;  // 0
};
static_assert(sizeof(FieldRecord) == 16);

inline uint64_t key_hash(std::string_view key) noexcept {
  return hash::fl64(key.data(), key.size(), kKeyHashSeed);
}

// The smallest power of two holding n keys at a load factor of at most one half.
inline uint64_t hash_slots_for(uint64_t n) noexcept {
  uint64_t slots = 8;
  while (slots < 2 * n) slots <<= 1;
  return slots;
}

inline constexpr uint64_t align8(uint64_t n) noexcept { return (n + 7) & ~uint64_t(7); }

// Reads a T from possibly unaligned bytes (the compiler turns this into one load).
template <typename T>
inline T load(const char* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace fastload::index
