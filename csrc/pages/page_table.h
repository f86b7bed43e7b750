// PageTable: the desired-state page bitmap through which a scheduler process (which plans) and worker
// processes (which hold the memory) agree on mapped pages, without a round trip per allocation.
//
// The planner's BlockAllocator sets a page's bit before it hands out blocks in that page and clears it
// when it gives the page up; workers call PageMirror::sync() at the start of each step and bring their
// own mappings to the bitmap (mapping before the step uses a page, unmapping only after a fence). Each
// worker reports the memory its device can still give, which bounds what the planner plans.
//
// Layout: one owner-only file; a header (geometry, a generation seqlock, worker slots), then the bitmap.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace kvcached {

constexpr std::uint64_t kPageTableMagic = 0x3142415447504b56ULL;  // "VKPGTAB1"
constexpr std::uint32_t kPageTableVersion = 1;
constexpr int kMaxWorkers = 16;

struct PageTableGeometry {
  std::int64_t num_blocks = 0;
  std::int64_t block_bytes = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_kv_buffers = 0;
  std::int64_t page_bytes = 0;
  std::int64_t num_pages = 0;
};

struct WorkerSlot {
  std::atomic<std::int32_t> pid;
  std::uint32_t pad;
  std::atomic<std::uint64_t> start_time;
  std::atomic<std::uint64_t> allocatable_bytes;  // what its device can still give (pool + free memory)
  std::atomic<std::uint64_t> synced_generation;  // the bitmap generation it last applied
};

struct PageTableHeader {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t header_bytes;
  std::int32_t owner_pid;
  std::uint32_t pad;
  std::uint64_t owner_start_time;
  PageTableGeometry geometry;
  alignas(64) std::atomic<std::uint64_t> generation;  // odd while the planner changes bits
  alignas(64) WorkerSlot workers[kMaxWorkers];
};

class PageTable {
 public:
  // The planner's side: creates `path` (0600, must not exist) for `geometry`.
  static PageTable create(const std::string& path, const PageTableGeometry& geometry);
  // A worker's side: opens and validates an existing table. Throws SegmentError for a bad file.
  static PageTable open(const std::string& path);

  PageTable(PageTable&& other) noexcept;
  PageTable& operator=(PageTable&&) = delete;
  PageTable(const PageTable&) = delete;
  ~PageTable();

  const PageTableGeometry& geometry() const noexcept { return header_->geometry; }
  const std::string& path() const noexcept { return path_; }

  // Planner: one page's desired state (the caller serializes writers).
  void set_page(std::int64_t page, bool mapped) noexcept;
  // Planner: the least memory any live worker reported, or UINT64_MAX before any worker has reported.
  std::uint64_t worker_allocatable_bytes() const noexcept;
  // Planner: removes the file (workers keep their mapping until they close).
  void unlink() noexcept;

  // Worker: a consistent copy of the bitmap and its generation.
  std::uint64_t snapshot(std::vector<std::uint64_t>& bits) const;
  // Worker: claims a slot for this process (throws BackendError when all are taken).
  int claim_worker_slot();
  void report(int slot, std::uint64_t allocatable_bytes, std::uint64_t generation) noexcept;
  void release_worker_slot(int slot) noexcept;

 private:
  PageTable(std::string path, PageTableHeader* header, std::size_t bytes);
  std::atomic<std::uint64_t>* bits() const noexcept;

  std::string path_;
  PageTableHeader* header_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace kvcached
