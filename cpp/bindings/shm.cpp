// Shared-memory blocks that a DataLoader worker reuses from batch to batch.
//
// A fresh shared-memory segment per batch (what torch allocates for a tensor in a
// worker) costs a page fault, a page of zeroes and a page-cache insertion for every
// 4 KiB of it, and a truncation when it is freed: on a batch of 25 MB that is most of
// the time it takes to fill. A worker instead keeps a few memfd blocks and writes each
// batch into one that the main process has finished with.
//
// Who has finished is counted in the block itself: a 64-byte header at the start of the
// mapping holds a magic and a count of the leases on the block, updated atomically by
// both processes (the same physical page is mapped in each).
//  - ShmBlock (worker): owns the memfd and a mapping. lease() returns a ShmLease (+1);
//    retain() adds one count for a lease that another process will take over
//    (ShmLease.attach there), called while the worker's own lease is still alive, so the
//    count cannot drop to zero while a batch is on its way.
//  - ShmLease: a writable buffer over the block's payload (what torch.frombuffer wraps;
//    the tensor's storage keeps the lease alive); its destruction gives the count back.
//  - ShmView (main process): its mapping of a block received from a worker, kept from
//    batch to batch; adopt() is the lease taking over the count the worker retained.
// A block is free for the next batch when its count is zero: every tensor over the last
// batch written into it is gone, in both processes.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "bindings/common.hpp"
#include "common/error.hpp"
#include "common/unique_fd.hpp"

namespace fastload::bindings {
namespace {

constexpr uint64_t kMagic = 0x4b4c424d48534c46ull;  // "FLSHMBLK" little-endian
constexpr size_t kHeader = 64;                      // payload starts on a cache line
constexpr const char* kName = "fastload batch block";

struct Header {
  uint64_t magic;
  uint32_t users;
};

// One mapping of a block (header + payload), unmapped when the last holder goes.
class Mapping {
 public:
  Mapping(char* base, size_t length) : base_(base), length_(length) {}
  ~Mapping() { ::munmap(base_, length_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  static std::shared_ptr<Mapping> map(int fd, size_t length) {
    void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw Error::os(errno, "map", kName);
    return std::make_shared<Mapping>(static_cast<char*>(p), length);
  }

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  std::atomic_ref<uint32_t> users() const { return std::atomic_ref<uint32_t>(header()->users); }
  char* payload() const { return base_ + kHeader; }
  size_t capacity() const { return length_ - kHeader; }
  size_t length() const { return length_; }

 private:
  char* base_;
  size_t length_;
};

class ShmLease {
 public:
  // Takes over one count already on the block (ShmBlock::lease() or the sender's
  // retain()).
  explicit ShmLease(std::shared_ptr<Mapping> map) : map_(std::move(map)) {}
  ~ShmLease() {
    if (map_) map_->users().fetch_sub(1, std::memory_order_release);
  }
  ShmLease(const ShmLease&) = delete;
  ShmLease& operator=(const ShmLease&) = delete;

  py::buffer_info buffer() const {
    return py::buffer_info(map_->payload(), 1, "B", 1, {py::ssize_t(map_->capacity())}, {1},
                           /*readonly=*/false);
  }
  size_t capacity() const { return map_->capacity(); }

 private:
  std::shared_ptr<Mapping> map_;
};

// The receiving side's mapping of a block that arrived from another process. It stays
// mapped while the receiver keeps it, so the next batch written into the same block
// costs no new mapping and no page faults here.
class ShmView {
 public:
  // Maps the block behind fd (a descriptor received from the sender; closed here).
  ShmView(int raw_fd, size_t length) {
    UniqueFd fd(raw_fd);
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) throw Error::os(errno, "stat", kName);
    if (length <= kHeader || uint64_t(st.st_size) < length)
      throw Error(ErrorKind::kOs, EINVAL, "attach", kName,
                  "the block has " + std::to_string(st.st_size) + " bytes, " +
                      std::to_string(length) + " were announced");
    map_ = Mapping::map(fd.get(), length);
    if (map_->header()->magic != kMagic)
      throw Error(ErrorKind::kOs, EINVAL, "attach", kName, "not a fastload batch block");
  }
  // A lease taking over the count the sender retained for this batch.
  std::unique_ptr<ShmLease> adopt() { return std::make_unique<ShmLease>(map_); }
  size_t length() const { return map_->length(); }

 private:
  std::shared_ptr<Mapping> map_;
};

class ShmBlock {
 public:
  explicit ShmBlock(size_t capacity) {
    const long page = ::sysconf(_SC_PAGESIZE);
    const size_t length = (kHeader + capacity + size_t(page) - 1) / size_t(page) * size_t(page);
    fd_.reset(::memfd_create("fastload-batch", MFD_CLOEXEC));
    if (!fd_) throw Error::os(errno, "create", kName);
    if (::ftruncate(fd_.get(), off_t(length)) != 0) throw Error::os(errno, "size", kName);
    map_ = Mapping::map(fd_.get(), length);
    map_->header()->magic = kMagic;
    map_->users().store(0, std::memory_order_release);
    struct stat st;
    if (::fstat(fd_.get(), &st) != 0) throw Error::os(errno, "stat", kName);
    inode_ = uint64_t(st.st_ino);
  }

  uint32_t users() const { return map_->users().load(std::memory_order_acquire); }
  std::unique_ptr<ShmLease> lease() {
    map_->users().fetch_add(1, std::memory_order_acq_rel);
    return std::make_unique<ShmLease>(map_);
  }
  void retain() { map_->users().fetch_add(1, std::memory_order_acq_rel); }
  int fd() const { return fd_.get(); }
  size_t length() const { return map_->length(); }
  size_t capacity() const { return map_->capacity(); }
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(map_->payload()); }
  uint64_t inode() const { return inode_; }

 private:
  UniqueFd fd_;
  uint64_t inode_ = 0;
  std::shared_ptr<Mapping> map_;
};

}  // namespace

void register_shm(py::module_& m) {
  py::class_<ShmLease>(m, "ShmLease", py::buffer_protocol(),
                       "A writable buffer over a shared-memory batch block; the block is free "
                       "for reuse once every lease on it is gone.")
      .def_buffer(&ShmLease::buffer)
      .def_property_readonly("capacity", &ShmLease::capacity);

  py::class_<ShmView>(m, "ShmView", "A block received from another process, mapped here.")
      .def(py::init<int, size_t>(), py::arg("fd"), py::arg("length"),
           "Maps the block behind fd (closed here); OSError if it is not a block of that "
           "length.")
      .def("adopt", &ShmView::adopt,
           "A lease taking over the count the sending process retained for it.")
      .def_property_readonly("length", &ShmView::length);

  py::class_<ShmBlock>(m, "ShmBlock",
                       "A reusable shared-memory (memfd) block for packed batches.")
      .def(py::init<size_t>(), py::arg("capacity"))
      .def_property_readonly("users", &ShmBlock::users)
      .def_property_readonly("fd", &ShmBlock::fd)
      .def_property_readonly("inode", &ShmBlock::inode)
      .def_property_readonly("length", &ShmBlock::length)
      .def_property_readonly("capacity", &ShmBlock::capacity)
      .def_property_readonly("address", &ShmBlock::address)
      .def("lease", &ShmBlock::lease)
      .def("retain", &ShmBlock::retain);
}

}  // namespace fastload::bindings
