// Reservation: a range of virtual address space of one backend, released when the last owner drops it.
// Shared with exported tensor views so the address space outlives close() while a view still exists
// (physical memory does not).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend/memory_backend.h"

namespace kvcached {

class Reservation {
 public:
  Reservation(std::shared_ptr<MemoryBackend> backend, std::size_t bytes)
      : backend_(std::move(backend)), base_(backend_->reserve(bytes)), bytes_(bytes) {}
  ~Reservation() { backend_->free_reservation(base_, bytes_); }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  std::uintptr_t base() const noexcept { return base_; }
  std::size_t bytes() const noexcept { return bytes_; }
  MemoryBackend& backend() const noexcept { return *backend_; }

 private:
  std::shared_ptr<MemoryBackend> backend_;
  std::uintptr_t base_;
  std::size_t bytes_;
};

}  // namespace kvcached
