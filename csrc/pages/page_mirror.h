// PageMirror: a worker's side of a PageTable. sync() brings this process's mappings to the planner's
// desired state: pages no longer wanted are unmapped after a fence (work from earlier steps may still
// read them), then newly wanted pages are mapped from this worker's own page pool. Call it at the start
// of each step, before the step touches its blocks. It also reports what this device can still give.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/memory_backend.h"
#include "pages/page_table.h"
#include "pages/paged_region.h"

namespace kvcached {

struct SyncResult {
  std::int64_t mapped = 0;    // pages mapped by this call
  std::int64_t unmapped = 0;  // pages unmapped by this call
  std::uint64_t generation = 0;
};

class PageMirror {
 public:
  // Opens the table at `path` and reserves this worker's buffers on `backend`.
  PageMirror(const std::string& path, std::shared_ptr<MemoryBackend> backend, std::size_t pool_target,
             std::size_t pool_max);
  ~PageMirror();
  PageMirror(const PageMirror&) = delete;
  PageMirror& operator=(const PageMirror&) = delete;

  // Applies the planner's current page bitmap. Throws BackendError when the device has no memory for a
  // planned page (another process took it since this worker last reported).
  SyncResult sync();
  // Unmaps everything and releases the slot. Idempotent.
  void close();
  bool closed() const noexcept { return closed_; }

  const PageTableGeometry& geometry() const noexcept { return table_.geometry(); }
  const PagedRegion& region() const noexcept { return *region_; }
  MemoryBackend& backend() const noexcept { return *backend_; }
  std::int64_t mapped_pages() const;

 private:
  void map_page(std::int64_t page);
  void unmap_page(std::int64_t page);
  void report(std::uint64_t generation);

  PageTable table_;
  std::shared_ptr<MemoryBackend> backend_;
  std::unique_ptr<PagedRegion> region_;
  int slot_ = -1;
  mutable std::mutex mu_;
  std::vector<std::uint64_t> mapped_;   // this worker's bitmap
  std::vector<std::uint64_t> desired_;  // scratch copy of the planner's
  bool closed_ = false;
};

}  // namespace kvcached
