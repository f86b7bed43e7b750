// PlannerBackend: the backend of a scheduler whose workers hold the memory (docs/architecture.md, "Planner and
// workers").
//
// It maps nothing: handles are tokens and map/unmap only do bookkeeping, so the planner's BlockAllocator
// makes its allocation decisions at bookkeeping cost and publishes them through a PageTable, from which
// each worker's PageMirror maps pages on its own device. Its allocatable memory is whatever the workers
// last reported (the least of them), through a callback set by whoever owns the page table.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <string>

#include "backend/memory_backend.h"

namespace kvcached {

class PlannerBackend final : public MemoryBackend {
 public:
  // `granularity` is the workers' physical granularity, so the planner's pages suit their devices.
  PlannerBackend(DeviceKind kind, int device_index, std::size_t granularity);

  std::string name() const override { return "planner"; }
  DeviceKind device_kind() const override { return kind_; }
  int device_index() const override { return index_; }
  std::size_t granularity() const override { return granularity_; }

  std::uintptr_t reserve(std::size_t bytes, std::size_t unit) override;
  void free_reservation(std::uintptr_t base, std::size_t bytes, std::size_t unit) noexcept override;
  std::optional<PhysHandle> create(std::size_t) override { return next_token_.fetch_add(1) + 1; }
  void map(std::uintptr_t, std::size_t, PhysHandle) override {}
  void unmap(std::uintptr_t, std::size_t) override {}
  void release(PhysHandle, std::size_t) noexcept override {}
  bool handle_survives_unmap() const override { return true; }
  void fence() override {}  // the workers fence before they unmap
  void zero(std::uintptr_t, std::size_t) override {}
  MemInfo mem_info() override;
  std::size_t allocatable_bytes() override;

  // Where allocatable_bytes() comes from (the workers' reports); unbounded until set.
  void set_allocatable_source(std::function<std::uint64_t()> source);

 private:
  DeviceKind kind_;
  int index_;
  std::size_t granularity_;
  std::atomic<std::uint64_t> next_token_{0};
  std::mutex source_mu_;
  std::function<std::uint64_t()> source_;
};

}  // namespace kvcached
