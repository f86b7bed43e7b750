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
  // `unit`: the size of the pages mapped into it (see MemoryBackend::reserve).
  Reservation(std::shared_ptr<MemoryBackend> backend, std::size_t bytes, std::size_t unit)
      : backend_(std::move(backend)), base_(backend_->reserve(bytes, unit)), bytes_(bytes), unit_(unit) {}
  ~Reservation() { backend_->free_reservation(base_, bytes_, unit_); }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  std::uintptr_t base() const noexcept { return base_; }
  std::size_t bytes() const noexcept { return bytes_; }
  MemoryBackend& backend() const noexcept { return *backend_; }

 private:
  std::shared_ptr<MemoryBackend> backend_;
  std::uintptr_t base_;
  std::size_t bytes_;
  std::size_t unit_;
};

}  // namespace kvcached
