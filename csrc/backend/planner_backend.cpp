#include "backend/planner_backend.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "common/errors.h"

namespace kvcached {

PlannerBackend::PlannerBackend(DeviceKind kind, int device_index, std::size_t granularity)
    : kind_(kind), index_(device_index), granularity_(granularity) {
  if (granularity == 0) throw InvalidArgument("planner granularity must be positive");
}

std::uintptr_t PlannerBackend::reserve(std::size_t bytes, std::size_t /*unit*/) {
  // Address space only, never touched: it gives block ids the same geometry as the workers' buffers.
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw BackendError(std::string("planner: cannot reserve address space: ") + std::strerror(errno), errno);
  return reinterpret_cast<std::uintptr_t>(p);
}

void PlannerBackend::free_reservation(std::uintptr_t base, std::size_t bytes, std::size_t /*unit*/) noexcept {
  munmap(reinterpret_cast<void*>(base), bytes);
}

void PlannerBackend::set_allocatable_source(std::function<std::uint64_t()> source) {
  std::lock_guard<std::mutex> lock(source_mu_);
  source_ = std::move(source);
}

std::size_t PlannerBackend::allocatable_bytes() {
  std::lock_guard<std::mutex> lock(source_mu_);
  const std::uint64_t reported = source_ ? source_() : std::numeric_limits<std::uint64_t>::max();
  return static_cast<std::size_t>(std::min<std::uint64_t>(reported, std::numeric_limits<std::size_t>::max() / 2));
}

MemInfo PlannerBackend::mem_info() {
  const std::size_t free = allocatable_bytes();
  return {free, free};
}

}  // namespace kvcached
