#include "shm/block.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <string>
#include <utility>

#include "common/error.hpp"

namespace fastload::shm {
namespace {

constexpr uint64_t kMagic = 0x4b4c424d48534c46ull;  // "FLSHMBLK" little-endian
constexpr const char* kName = "fastload batch block";

struct Header {
  uint64_t magic;
  uint32_t users;
  uint32_t owner;  // the pid writing batches into the block; 0: free to claim
};
static_assert(sizeof(Header) <= kHeaderBytes);

}  // namespace

class Mapping {
 public:
  Mapping(char* base, size_t length) noexcept : base_(base), length_(length) {}
  ~Mapping() { ::munmap(base_, length_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  // Maps [0, length) of fd shared and writable. Throws Error(kOs).
  static std::shared_ptr<Mapping> map(int fd, size_t length) {
    void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw Error::os(errno, "map", kName);
    return std::make_shared<Mapping>(static_cast<char*>(p), length);
  }

  Header* header() const noexcept { return reinterpret_cast<Header*>(base_); }
  std::atomic_ref<uint32_t> users() const noexcept {
    return std::atomic_ref<uint32_t>(header()->users);
  }
  std::atomic_ref<uint32_t> owner() const noexcept {
    return std::atomic_ref<uint32_t>(header()->owner);
  }
  // Set by the receiver before it lets a copy read the block (registration); read by
  // each lease as it is destroyed.
  bool held() const noexcept { return hold_.load(std::memory_order_acquire); }
  void hold(bool on) noexcept { hold_.store(on, std::memory_order_release); }
  char* payload() const noexcept { return base_ + kHeaderBytes; }
  size_t capacity() const noexcept { return length_ - kHeaderBytes; }
  size_t length() const noexcept { return length_; }

 private:
  char* base_;
  size_t length_;
  std::atomic<bool> hold_{false};
};

namespace {

// The counts retired by leases destroyed on held mappings, in this process (a forked
// child never adds to its copy of the list: its leases give nothing back).
struct RetiredList {
  std::mutex mu;
  std::vector<std::pair<std::shared_ptr<Mapping>, pid_t>> maps;  // with the retiring process
};

RetiredList& retired_list() {
  static RetiredList* list = new RetiredList();  // never destroyed: leases may outlive statics
  return *list;
}

}  // namespace

// ---- Lease ---------------------------------------------------------------------------

Lease::Lease(std::shared_ptr<Mapping> map) noexcept : map_(std::move(map)), pid_(::getpid()) {}

Lease::~Lease() {
  // Another process's count: a forked child dropping the lease it inherited must not
  // give back a block the parent still reads.
  if (!map_ || ::getpid() != pid_) return;
  if (map_->held()) {
    RetiredList& list = retired_list();
    try {
      std::lock_guard<std::mutex> lock(list.mu);
      list.maps.emplace_back(std::move(map_), pid_);
    } catch (...) {
      // No memory to retire it: the count stays (the block is never reused), which
      // is safe; giving it back now is not.
    }
    return;
  }
  map_->users().fetch_sub(1, std::memory_order_release);
}

char* Lease::data() const noexcept { return map_->payload(); }
size_t Lease::capacity() const noexcept { return map_->capacity(); }

// ---- Retired -------------------------------------------------------------------------

Retired::Retired() noexcept = default;

Retired Retired::take() {
  Retired out;
  RetiredList& list = retired_list();
  std::lock_guard<std::mutex> lock(list.mu);
  out.maps_.swap(list.maps);
  return out;
}

Retired::~Retired() { release(); }

void Retired::release() noexcept {
  // A count retired in another process (the list a forked child inherited) is not ours.
  const pid_t self = ::getpid();
  for (auto& [m, pid] : maps_) {
    if (pid == self) m->users().fetch_sub(1, std::memory_order_release);
  }
  maps_.clear();
}

// ---- Block ---------------------------------------------------------------------------

Block::Block(size_t capacity) {
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  const size_t length = (kHeaderBytes + capacity + page - 1) / page * page;
  fd_.reset(::memfd_create("fastload-batch", MFD_CLOEXEC));
  if (!fd_) throw Error::os(errno, "create", kName);
  if (::ftruncate(fd_.get(), off_t(length)) != 0) throw Error::os(errno, "size", kName);
  map_ = Mapping::map(fd_.get(), length);
  map_->header()->magic = kMagic;
  map_->owner().store(uint32_t(::getpid()), std::memory_order_relaxed);
  map_->users().store(0, std::memory_order_release);
  struct stat st;
  if (::fstat(fd_.get(), &st) != 0) throw Error::os(errno, "stat", kName);
  inode_ = uint64_t(st.st_ino);
}

std::unique_ptr<Block> Block::claim(int fd) {
  std::unique_ptr<Block> b(new Block());
  b->fd_.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!b->fd_) throw Error::os(errno, "claim", kName);
  struct stat st;
  if (::fstat(b->fd_.get(), &st) != 0) throw Error::os(errno, "stat", kName);
  if (size_t(st.st_size) <= kHeaderBytes)
    throw Error(ErrorKind::kOs, EINVAL, "claim", kName, "not a fastload batch block");
  b->map_ = Mapping::map(b->fd_.get(), size_t(st.st_size));
  if (b->map_->header()->magic != kMagic)
    throw Error(ErrorKind::kOs, EINVAL, "claim", kName, "not a fastload batch block");
  uint32_t unowned = 0;
  // acq_rel: the claim orders after the previous owner's last writes and the count's
  // last release, both published before the block was disowned.
  if (!b->map_->owner().compare_exchange_strong(unowned, uint32_t(::getpid()),
                                                std::memory_order_acq_rel))
    return nullptr;
  b->inode_ = uint64_t(st.st_ino);
  return b;
}

Block::~Block() = default;

uint32_t Block::users() const noexcept { return map_->users().load(std::memory_order_acquire); }

std::unique_ptr<Lease> Block::lease() {
  map_->users().fetch_add(1, std::memory_order_acq_rel);
  return std::make_unique<Lease>(map_);
}

void Block::retain() noexcept { map_->users().fetch_add(1, std::memory_order_acq_rel); }

size_t Block::length() const noexcept { return map_->length(); }
size_t Block::capacity() const noexcept { return map_->capacity(); }
uintptr_t Block::address() const noexcept { return reinterpret_cast<uintptr_t>(map_->payload()); }

// ---- View ----------------------------------------------------------------------------

View::View(int raw_fd, size_t length) {
  UniqueFd fd(raw_fd);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) throw Error::os(errno, "stat", kName);
  if (length <= kHeaderBytes || uint64_t(st.st_size) < length)
    throw Error(ErrorKind::kOs, EINVAL, "attach", kName,
                "the block has " + std::to_string(st.st_size) + " bytes, " +
                    std::to_string(length) + " were announced");
  map_ = Mapping::map(fd.get(), length);
  if (map_->header()->magic != kMagic)
    throw Error(ErrorKind::kOs, EINVAL, "attach", kName, "not a fastload batch block");
}

View::~View() = default;

std::unique_ptr<Lease> View::adopt() { return std::make_unique<Lease>(map_); }
size_t View::length() const noexcept { return map_->length(); }
void View::hold(bool on) noexcept { map_->hold(on); }
bool View::held() const noexcept { return map_->held(); }
uint32_t View::users() const noexcept { return map_->users().load(std::memory_order_acquire); }
uint32_t View::owner() const noexcept { return map_->owner().load(std::memory_order_acquire); }
void View::disown() noexcept { map_->owner().store(0, std::memory_order_release); }

}  // namespace fastload::shm
