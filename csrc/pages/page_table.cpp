#include "pages/page_table.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <new>

#include "common/errors.h"
#include "common/process.h"

namespace kvcached {

namespace {
std::size_t words_for(std::int64_t pages) { return static_cast<std::size_t>((pages + 63) / 64); }
std::size_t file_bytes(std::int64_t pages) {
  return sizeof(PageTableHeader) + words_for(pages) * sizeof(std::atomic<std::uint64_t>);
}
}  // namespace

PageTable::PageTable(std::string path, PageTableHeader* header, std::size_t bytes)
    : path_(std::move(path)), header_(header), bytes_(bytes) {}

PageTable::PageTable(PageTable&& other) noexcept
    : path_(std::move(other.path_)), header_(other.header_), bytes_(other.bytes_) {
  other.header_ = nullptr;
}

PageTable::~PageTable() {
  if (header_ != nullptr) munmap(header_, bytes_);
}

std::atomic<std::uint64_t>* PageTable::bits() const noexcept {
  return reinterpret_cast<std::atomic<std::uint64_t>*>(reinterpret_cast<char*>(header_) + sizeof(PageTableHeader));
}

PageTable PageTable::create(const std::string& path, const PageTableGeometry& geometry) {
  const std::size_t bytes = file_bytes(geometry.num_pages);
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw BackendError("cannot create page table " + tmp + ": " + std::strerror(errno), errno);
  void* mem = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0)
    mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (mem == MAP_FAILED) {
    ::unlink(tmp.c_str());
    throw BackendError("cannot size or map page table " + tmp + ": " + std::strerror(err), err);
  }
  auto* header = new (mem) PageTableHeader();
  header->version = kPageTableVersion;
  header->header_bytes = sizeof(PageTableHeader);
  header->owner_pid = static_cast<std::int32_t>(getpid());
  header->owner_start_time = process_start_time(static_cast<int>(getpid()));
  header->geometry = geometry;
  header->magic = kPageTableMagic;
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = errno;
    munmap(mem, bytes);
    ::unlink(tmp.c_str());
    throw BackendError("cannot publish page table " + path + ": " + std::strerror(rename_err), rename_err);
  }
  return PageTable(path, header, bytes);
}

PageTable PageTable::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw SegmentError(path + ": cannot open page table: " + std::strerror(errno));
  struct stat st{};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077) ||
      static_cast<std::size_t>(st.st_size) < sizeof(PageTableHeader)) {
    ::close(fd);
    throw SegmentError(path + ": not a page table of yours (owner, mode or size)");
  }
  void* mem = mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mem == MAP_FAILED) throw SegmentError(path + ": cannot map page table: " + std::strerror(errno));
  auto* header = static_cast<PageTableHeader*>(mem);
  const auto size = static_cast<std::size_t>(st.st_size);
  if (header->magic != kPageTableMagic || header->version != kPageTableVersion ||
      header->header_bytes != sizeof(PageTableHeader) || header->geometry.num_pages < 0 ||
      size < file_bytes(header->geometry.num_pages)) {
    munmap(mem, size);
    throw SegmentError(path + ": not a page table of this kvcached version");
  }
  return PageTable(path, header, size);
}

void PageTable::set_page(std::int64_t page, bool mapped) noexcept {
  const std::uint64_t bit = std::uint64_t{1} << (page % 64);
  std::atomic<std::uint64_t>& word = bits()[page / 64];
  header_->generation.fetch_add(1, std::memory_order_acq_rel);  // odd: changing
  if (mapped) {
    word.fetch_or(bit, std::memory_order_relaxed);
  } else {
    word.fetch_and(~bit, std::memory_order_relaxed);
  }
  header_->generation.fetch_add(1, std::memory_order_release);  // even: consistent
}

std::uint64_t PageTable::snapshot(std::vector<std::uint64_t>& out) const {
  const std::size_t n = words_for(header_->geometry.num_pages);
  out.resize(n);
  for (int attempt = 0;; ++attempt) {
    const std::uint64_t before = header_->generation.load(std::memory_order_acquire);
    if ((before & 1u) == 0) {
      for (std::size_t i = 0; i < n; ++i) out[i] = bits()[i].load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (header_->generation.load(std::memory_order_relaxed) == before) return before;
    }
    if (attempt > 100) sched_yield();
  }
}

std::uint64_t PageTable::worker_allocatable_bytes() const noexcept {
  std::uint64_t least = std::numeric_limits<std::uint64_t>::max();
  for (const WorkerSlot& slot : header_->workers) {
    const int pid = slot.pid.load(std::memory_order_acquire);
    if (pid == 0 || !process_alive(pid, slot.start_time.load())) continue;
    least = std::min(least, slot.allocatable_bytes.load(std::memory_order_relaxed));
  }
  return least;
}

int PageTable::claim_worker_slot() {
  const int me = static_cast<int>(getpid());
  const std::uint64_t start = process_start_time(me);
  for (int i = 0; i < kMaxWorkers; ++i) {
    WorkerSlot& slot = header_->workers[i];
    std::int32_t pid = slot.pid.load();
    if (pid != 0 && pid != me && process_alive(pid, slot.start_time.load())) continue;
    if (slot.pid.compare_exchange_strong(pid, me)) {
      slot.start_time.store(start);
      slot.allocatable_bytes.store(std::numeric_limits<std::uint64_t>::max());
      return i;
    }
  }
  throw BackendError(path_ + ": all " + std::to_string(kMaxWorkers) + " worker slots are taken", ENOSPC);
}

void PageTable::report(int slot, std::uint64_t allocatable_bytes, std::uint64_t generation) noexcept {
  header_->workers[slot].allocatable_bytes.store(allocatable_bytes, std::memory_order_relaxed);
  header_->workers[slot].synced_generation.store(generation, std::memory_order_release);
}

void PageTable::release_worker_slot(int slot) noexcept { header_->workers[slot].pid.store(0); }

void PageTable::unlink() noexcept { ::unlink(path_.c_str()); }

}  // namespace kvcached
