// CudaBackend: CUDA virtual memory management (cuMemAddressReserve / cuMemCreate / cuMemMap /
// cuMemSetAccess / cuMemUnmap / cuMemRelease) on one device, in the device's primary context (the one
// PyTorch uses). Handles survive unmap, so the page pool can reuse them without cuMemCreate.
//
// With a backstop, every page of a reservation that holds no page of its own maps one shared zeroed
// handle instead of nothing: a kernel that reads a block the engine never allocated (padding rows,
// stale block-table entries, warm-up passes) reads zeros instead of faulting the whole CUDA context.
// The price is one more driver call on each side: map() first unmaps the backstop, unmap() maps it back.
// The shared handle has the size of the reservation's pages (one per page size in use), because the
// driver charges each unmap and access call per handle in the range: a 32 MiB page backed by sixteen
// 2 MiB granules would cost sixteen unmaps to grow instead of one.
#pragma once

#include <cuda.h>

#include <map>
#include <mutex>

#include "backend/memory_backend.h"

namespace kvcached {

class CudaBackend final : public MemoryBackend {
 public:
  // Throws InvalidArgument for a device index out of range, BackendError when the device cannot do VMM.
  explicit CudaBackend(int device_index, bool backstop = false, std::size_t headroom = 0);
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  DeviceKind device_kind() const override { return DeviceKind::kCuda; }
  int device_index() const override { return index_; }
  std::size_t granularity() const override { return granularity_; }

  std::uintptr_t reserve(std::size_t bytes, std::size_t unit) override;
  void free_reservation(std::uintptr_t base, std::size_t bytes, std::size_t unit) noexcept override;
  std::optional<PhysHandle> create(std::size_t bytes) override;
  std::size_t allocatable_bytes() override;
  void map(std::uintptr_t addr, std::size_t bytes, PhysHandle handle) override;
  void unmap(std::uintptr_t addr, std::size_t bytes) override;
  void release(PhysHandle handle, std::size_t bytes) noexcept override;
  bool handle_survives_unmap() const override { return true; }
  void fence() override;
  void zero(std::uintptr_t addr, std::size_t bytes) override;
  MemInfo mem_info() override;
  bool backstop() const noexcept { return backstop_; }

 private:
  void make_current() const;
  // The shared zeroed handle of `unit` bytes, created on first use.
  CUmemGenericAllocationHandle backstop_handle(std::size_t unit);
  // Map the `unit`-byte backstop over each unit of [addr, addr + bytes); all or nothing.
  void fill_backstop(CUdeviceptr addr, std::size_t bytes, std::size_t unit);

  int index_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  std::size_t granularity_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  bool backstop_ = false;
  std::mutex backstop_mu_;  // reservations of several managers share this backend
  std::map<std::size_t, CUmemGenericAllocationHandle> backstops_;  // by unit
};

}  // namespace kvcached
