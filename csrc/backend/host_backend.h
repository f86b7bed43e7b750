// HostBackend: elastic host memory with the same semantics as CUDA VMM.
//
//   reserve  mmap(PROT_NONE, MAP_NORESERVE): address space only
//   create   a private anonymous run, huge pages requested (madvise), pre-faulted so its cost
//            (page zeroing) is paid here, in the pool thread, not on the allocation path
//   map      mremap(MREMAP_FIXED) moves the pre-faulted run into the reservation (page tables only)
//   unmap    mmap(MAP_FIXED, PROT_NONE) over the range: the pages go back to the OS and RSS falls
//
// Because unmap returns the pages to the OS, host handles do not survive unmap.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "backend/host_budget.h"
#include "backend/memory_backend.h"

namespace kvcached {

class HostBackend final : public MemoryBackend {
 public:
  // With `budget_path` empty, physical memory is whatever the OS gives; otherwise every process using the
  // same ledger shares `budget_bytes` (see HostBudget).
  // `headroom` applies to a budget only: without one the OS decides (see allocatable_bytes()).
  HostBackend(const std::string& budget_path, std::size_t budget_bytes, std::size_t headroom = 0);

  std::string name() const override { return "host"; }
  DeviceKind device_kind() const override { return DeviceKind::kCpu; }
  int device_index() const override { return 0; }
  std::size_t granularity() const override { return granularity_; }

  std::uintptr_t reserve(std::size_t bytes, std::size_t unit) override;
  void free_reservation(std::uintptr_t base, std::size_t bytes, std::size_t unit) noexcept override;
  std::optional<PhysHandle> create(std::size_t bytes) override;
  void map(std::uintptr_t addr, std::size_t bytes, PhysHandle handle) override;
  void unmap(std::uintptr_t addr, std::size_t bytes) override;
  void release(PhysHandle handle, std::size_t bytes) noexcept override;
  bool handle_survives_unmap() const override { return false; }
  void fence() override {}
  void zero(std::uintptr_t addr, std::size_t bytes) override;
  MemInfo mem_info() override;
  // Testing aid: the `n`th map() (or unmap()) from now fails with a BackendError (n <= 0 cancels).
  void fail_map_after(std::int64_t n) noexcept { fail_map_countdown_.store(n > 0 ? n : -1); }
  void fail_unmap_after(std::int64_t n) noexcept { fail_unmap_countdown_.store(n > 0 ? n : -1); }
  // Without a budget the OS decides (overcommit, cgroups): no figure read ahead is trustworthy, so the
  // allocator treats host memory as unbounded and learns of exhaustion from a failed create().
  std::size_t allocatable_bytes() override;

 private:
  std::size_t granularity_;
  std::unique_ptr<HostBudget> budget_;
  std::atomic<std::int64_t> fail_map_countdown_{-1};
  std::atomic<std::int64_t> fail_unmap_countdown_{-1};
};

}  // namespace kvcached
