#include "backend/host_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

#include "common/errors.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace kvcached {

namespace {
constexpr std::size_t kHugePage = 2u << 20;

[[noreturn]] void throw_errno(const std::string& what) {
  int err = errno;
  throw BackendError(what + ": " + std::strerror(err), err);
}

// Maps `bytes` aligned to a huge page so that THP can back it and mremap can move whole PMDs.
void* map_aligned(std::size_t bytes, int prot) {
  const std::size_t align = bytes >= kHugePage ? kHugePage : 0;
  const std::size_t span = bytes + align;
  void* raw = mmap(nullptr, span, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return MAP_FAILED;
  auto start = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t aligned = align ? (start + align - 1) / align * align : start;
  if (aligned > start) munmap(raw, aligned - start);
  std::uintptr_t end = start + span;
  if (end > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  return reinterpret_cast<void*>(aligned);
}
bool injected_failure(std::atomic<std::int64_t>& countdown) {
  return countdown.load(std::memory_order_relaxed) > 0 && countdown.fetch_sub(1) == 1;
}
}  // namespace

HostBackend::HostBackend(const std::string& budget_path, std::size_t budget_bytes, std::size_t headroom)
    : MemoryBackend(headroom), granularity_(static_cast<std::size_t>(sysconf(_SC_PAGESIZE))) {
  if (!budget_path.empty()) budget_ = std::make_unique<HostBudget>(budget_path, budget_bytes);
}

std::uintptr_t HostBackend::reserve(std::size_t bytes, std::size_t /*unit*/) {
  void* p = map_aligned(bytes, PROT_NONE);
  if (p == MAP_FAILED) throw_errno("host backend: cannot reserve " + std::to_string(bytes) + " bytes of address space");
  return reinterpret_cast<std::uintptr_t>(p);
}

void HostBackend::free_reservation(std::uintptr_t base, std::size_t bytes, std::size_t /*unit*/) noexcept {
  munmap(reinterpret_cast<void*>(base), bytes);
}

std::optional<PhysHandle> HostBackend::create(std::size_t bytes) {
  if (budget_ && !budget_->try_charge(bytes)) return std::nullopt;
  void* p = map_aligned(bytes, PROT_READ | PROT_WRITE);
  if (p == MAP_FAILED) {
    if (budget_) budget_->uncharge(bytes);
    if (errno == ENOMEM) return std::nullopt;
    throw_errno("host backend: cannot create a " + std::to_string(bytes) + "-byte page");
  }
  if (bytes >= kHugePage) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: fine if THP is off
  if (madvise(p, bytes, MADV_POPULATE_WRITE) != 0) {
    if (errno == ENOMEM || errno == EFAULT) {  // the OS has no memory for it: a capacity miss
      munmap(p, bytes);
      if (budget_) budget_->uncharge(bytes);
      return std::nullopt;
    }
    // Kernels before 5.14 lack MADV_POPULATE_WRITE: touch one byte per OS page instead.
    auto* bytes_ptr = static_cast<volatile char*>(p);
    for (std::size_t off = 0; off < bytes; off += granularity_) bytes_ptr[off] = 0;
  }
  return reinterpret_cast<PhysHandle>(p);
}

void HostBackend::map(std::uintptr_t addr, std::size_t bytes, PhysHandle handle) {
  if (injected_failure(fail_map_countdown_)) throw BackendError("host backend: injected map failure (testing)", EIO);
  void* src = reinterpret_cast<void*>(handle);
  void* got = mremap(src, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(addr));
  if (got == MAP_FAILED) throw_errno("host backend: cannot map a page");
}

void HostBackend::unmap(std::uintptr_t addr, std::size_t bytes) {
  if (injected_failure(fail_unmap_countdown_))
    throw BackendError("host backend: injected unmap failure (testing)", EIO);
  // Replacing the range in one call keeps the reservation whole: no window where the hole could be
  // taken by another mmap in this process.
  void* got = mmap(reinterpret_cast<void*>(addr), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (got == MAP_FAILED) throw_errno("host backend: cannot unmap a page");
  if (budget_) budget_->uncharge(bytes);
}

void HostBackend::release(PhysHandle handle, std::size_t bytes) noexcept {
  munmap(reinterpret_cast<void*>(handle), bytes);
  if (budget_) budget_->uncharge(bytes);
}

void HostBackend::zero(std::uintptr_t addr, std::size_t bytes) { std::memset(reinterpret_cast<void*>(addr), 0, bytes); }

std::size_t HostBackend::allocatable_bytes() {
  return budget_ ? above_headroom(mem_info().free_bytes) : std::numeric_limits<std::size_t>::max() / 2;
}

MemInfo HostBackend::mem_info() {
  if (budget_) {
    std::size_t used = budget_->used_total();
    std::size_t cap = budget_->capacity();
    return {used < cap ? cap - used : 0, cap};
  }
  MemInfo info;
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") info.total_bytes = kib * 1024;
    if (key == "MemAvailable:") info.free_bytes = kib * 1024;
  }
  return info;
}

}  // namespace kvcached
