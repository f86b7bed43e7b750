// MemoryBackend: the five primitives every elastic allocator needs (reserve address space, create a
// physical handle, map it, unmap it, release it), implemented once for CUDA VMM and once for host memory.
// Everything above this interface is backend-agnostic and is tested for real on the host backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace kvcached {

using PhysHandle = std::uint64_t;

struct MemInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

// DLPack device codes, so the bindings can describe memory without knowing the backend.
enum class DeviceKind : int { kCpu = 1, kCuda = 2 };

class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;

  virtual std::string name() const = 0;
  virtual DeviceKind device_kind() const = 0;
  virtual int device_index() const = 0;

  // Smallest size and alignment of a physical handle and of a mapping.
  virtual std::size_t granularity() const = 0;

  // Reserve `bytes` of virtual address space (no physical memory), to be mapped in pages of `unit` bytes (a
  // multiple of granularity() that divides `bytes`). Throws BackendError.
  virtual std::uintptr_t reserve(std::size_t bytes, std::size_t unit) = 0;
  virtual void free_reservation(std::uintptr_t base, std::size_t bytes, std::size_t unit) noexcept = 0;

  // Create a physical handle of `bytes`. Returns nullopt when the device has no physical memory left
  // (a capacity miss, not an error); throws BackendError for anything else.
  virtual std::optional<PhysHandle> create(std::size_t bytes) = 0;

  // Map `handle` at `addr` (inside a reservation) and make it read/write for the device.
  virtual void map(std::uintptr_t addr, std::size_t bytes, PhysHandle handle) = 0;

  // Unmap [addr, addr + bytes). The caller has fenced outstanding work first (see fence()).
  virtual void unmap(std::uintptr_t addr, std::size_t bytes) = 0;

  // Give a handle's memory back to the device. Only for handles that are not mapped.
  virtual void release(PhysHandle handle, std::size_t bytes) noexcept = 0;

  // Whether a handle stays valid (and holds memory) after unmap(), so it can be pooled and remapped.
  // The host backend returns its pages to the OS on unmap, so its handles do not survive.
  virtual bool handle_survives_unmap() const = 0;

  // Wait for every piece of device work submitted so far, so memory freed before this call can be unmapped.
  virtual void fence() = 0;

  // Fill [addr, addr + bytes) with zeros (only for callers that asked for zeroed pages).
  virtual void zero(std::uintptr_t addr, std::size_t bytes) = 0;

  // Free and total physical memory of the device. Not on the hot path: callers cache it.
  virtual MemInfo mem_info() = 0;

  // How much more create() can be expected to give: free device memory less headroom(), for CUDA and for a
  // host budget.
  virtual std::size_t allocatable_bytes() { return above_headroom(mem_info().free_bytes); }

  // Device memory that KV caches leave free for the engines' own allocations (activations beyond what they
  // hold, library workspaces): a KV cache that took the last MiB would make the engine's next torch
  // allocation fail. Every manager on the device stops growing this far above empty.
  std::size_t headroom() const noexcept { return headroom_; }

 protected:
  explicit MemoryBackend(std::size_t headroom = 0) : headroom_(headroom) {}
  std::size_t above_headroom(std::size_t free) const noexcept { return free > headroom_ ? free - headroom_ : 0; }

 private:
  std::size_t headroom_;
};

}  // namespace kvcached
