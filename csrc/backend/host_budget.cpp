#include "backend/host_budget.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "common/errors.h"
#include "common/process.h"

namespace kvcached {

namespace {
constexpr std::uint64_t kMagic = 0x4b5643484f535442ULL;  // "KVCHOSTB"
constexpr std::uint32_t kVersion = 1;
constexpr std::uint32_t kSlots = 256;

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

class FileLock {
 public:
  explicit FileLock(int fd) : fd_(fd) {
    while (flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  ~FileLock() { flock(fd_, LOCK_UN); }

 private:
  int fd_;
};
}  // namespace

struct HostBudget::Slot {
  std::atomic<std::int32_t> pid;
  std::uint32_t pad;
  std::atomic<std::uint64_t> start_time;
  std::atomic<std::uint64_t> bytes;
};

struct HostBudget::Ledger {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t num_slots;
  Slot slots[kSlots];
};

HostBudget::HostBudget(const std::string& path, std::size_t capacity_bytes) : path_(path), capacity_(capacity_bytes) {
  fd_ = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd_ < 0) throw BackendError(errno_text("cannot open host budget ledger " + path), errno);
  struct stat st{};
  // Only a file kvcached made is trusted: a link planted here (hard links pass O_NOFOLLOW) would have the
  // ledger written into another file of this user.
  if (fstat(fd_, &st) != 0 || st.st_uid != geteuid() || !S_ISREG(st.st_mode) || st.st_nlink != 1 ||
      (st.st_mode & 077) != 0) {
    close(fd_);
    throw BackendError("host budget ledger " + path +
                           " is not a private file of this user (a link, another user's file or open to others); "
                           "remove it or set KVCACHED_RUNTIME_DIR",
                       EPERM);
  }
  FileLock lock(fd_);
  bool fresh = static_cast<std::size_t>(st.st_size) < sizeof(Ledger);
  if (fresh && ftruncate(fd_, sizeof(Ledger)) != 0) {
    int err = errno;
    close(fd_);
    throw BackendError("cannot size host budget ledger " + path + ": " + std::strerror(err), err);
  }
  void* mem = mmap(nullptr, sizeof(Ledger), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (mem == MAP_FAILED) {
    int err = errno;
    close(fd_);
    throw BackendError("cannot map host budget ledger " + path + ": " + std::strerror(err), err);
  }
  ledger_ = static_cast<Ledger*>(mem);
  guard_ = std::make_unique<SigbusGuard>(mem, sizeof(Ledger));
  if (fresh || ledger_->magic != kMagic || ledger_->version != kVersion || ledger_->num_slots != kSlots) {
    if (!fresh && ledger_->magic != 0) {
      // Foreign or older file: start over rather than trust its contents.
      std::memset(static_cast<void*>(ledger_), 0, sizeof(Ledger));
    }
    ledger_->version = kVersion;
    ledger_->num_slots = kSlots;
    ledger_->magic = kMagic;
  }
  const int me = static_cast<int>(getpid());
  const std::uint64_t my_start = process_start_time(me);
  for (auto& slot : ledger_->slots) {
    int pid = slot.pid.load();
    if (pid == me || pid == 0 || !process_alive(pid, slot.start_time.load())) {
      slot.bytes.store(0);
      slot.start_time.store(my_start);
      slot.pid.store(me);
      mine_ = &slot;
      break;
    }
  }
  if (mine_ == nullptr) {
    guard_.reset();
    munmap(ledger_, sizeof(Ledger));
    close(fd_);
    throw BackendError("host budget ledger " + path + " has no free slot (over 256 live processes)", ENOSPC);
  }
}

HostBudget::~HostBudget() {
  if (ledger_ != nullptr) {
    FileLock lock(fd_);
    mine_->bytes.store(0);
    mine_->pid.store(0);
    guard_.reset();
    munmap(ledger_, sizeof(Ledger));
  }
  if (fd_ >= 0) close(fd_);
}

std::size_t HostBudget::live_total_locked() {
  std::size_t total = 0;
  for (auto& slot : ledger_->slots) {
    int pid = slot.pid.load();
    if (pid == 0) continue;
    if (&slot != mine_ && !process_alive(pid, slot.start_time.load())) {
      slot.bytes.store(0);  // owner died without cleaning up: its memory went back to the OS with it
      slot.pid.store(0);
      continue;
    }
    // Saturating: a damaged ledger may claim any number, and a wrapped sum would grant memory that is not there.
    const std::size_t held = slot.bytes.load();
    total = held > SIZE_MAX - total ? SIZE_MAX : total + held;
  }
  return total;
}

bool HostBudget::try_charge(std::size_t bytes) {
  FileLock lock(fd_);
  const std::size_t total = live_total_locked();
  if (guard_->damaged() || total > capacity_ || bytes > capacity_ - total) return false;
  mine_->bytes.fetch_add(bytes);
  return true;
}

void HostBudget::uncharge(std::size_t bytes) noexcept { mine_->bytes.fetch_sub(bytes); }

std::size_t HostBudget::used_total() {
  FileLock lock(fd_);
  const std::size_t total = live_total_locked();
  return guard_->damaged() ? capacity_ : total;
}

}  // namespace kvcached
