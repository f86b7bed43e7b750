// PagedRegion: the memory of one KV cache as `num_buffers` equal virtual buffers in one reservation, and
// the physical handles mapped under each logical page.
//
// A logical page p is the range [p * page_bytes, (p + 1) * page_bytes) of every buffer: mapping it maps one
// physical handle (taken from the region's page pool) into each buffer, all or nothing. Both the block
// allocator (a process that owns its memory, or a planner's worker-free twin) and a worker's page mirror
// keep their memory in one of these; they differ only in who decides which pages are mapped.
// Not thread-safe: the owner serializes calls per page.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "backend/memory_backend.h"
#include "backend/reservation.h"
#include "pages/page_pool.h"

namespace kvcached {

// Backend calls made by one map_page/unmap_page, for the owner's operation counters.
struct PageCalls {
  std::uint64_t maps = 0;
  std::uint64_t unmaps = 0;
  std::uint64_t errors = 0;  // map or unmap calls that failed
};

class PagedRegion {
 public:
  // Reserves num_buffers * num_pages * page_bytes of address space and starts a page pool of page_bytes
  // handles. page_bytes must be a multiple of the backend's granularity (the owner checks and explains).
  PagedRegion(std::shared_ptr<MemoryBackend> backend, std::size_t page_bytes, std::size_t num_pages,
              std::size_t num_buffers, std::size_t pool_target, std::size_t pool_max);
  PagedRegion(const PagedRegion&) = delete;
  PagedRegion& operator=(const PagedRegion&) = delete;

  // Maps `page` in every buffer (zeroed when `zero`). Returns false, with nothing mapped, when the device
  // has no physical memory for it; throws the backend's error, with nothing mapped, when a call fails.
  bool map_page(std::size_t page, bool zero, PageCalls& calls);
  // Unmaps `page` from every buffer; handles that survive an unmap go back to the pool. Every buffer is
  // tried even after a failure; the first failure is returned (null when none), and leaves the page in an
  // unknown state that the owner must never map again.
  std::exception_ptr unmap_page(std::size_t page, PageCalls& calls);

  std::size_t page_bytes() const noexcept { return page_bytes_; }
  std::size_t num_pages() const noexcept { return num_pages_; }
  std::size_t num_buffers() const noexcept { return num_buffers_; }
  std::size_t buffer_stride() const noexcept { return num_pages_ * page_bytes_; }
  // Start of `buffer`; InvalidArgument outside [0, num_buffers).
  std::uintptr_t buffer_address(std::int64_t buffer) const;
  std::shared_ptr<Reservation> reservation() const noexcept { return reservation_; }
  MemoryBackend& backend() const noexcept { return *backend_; }
  PagePool& pool() const noexcept { return *pool_; }

 private:
  std::uintptr_t page_address(std::size_t buffer, std::size_t page) const noexcept {
    return reservation_->base() + buffer * buffer_stride() + page * page_bytes_;
  }

  std::shared_ptr<MemoryBackend> backend_;
  std::size_t page_bytes_;
  std::size_t num_pages_;
  std::size_t num_buffers_;
  std::shared_ptr<Reservation> reservation_;
  std::unique_ptr<PagePool> pool_;
  std::vector<PhysHandle> handles_;  // [page * num_buffers + buffer]
};

}  // namespace kvcached
