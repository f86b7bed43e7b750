// BlockAllocator: hands out KV-cache block ids and keeps physical memory mapped only under used blocks.
//
// Geometry. The manager's memory is `num_buffers` equal virtual buffers (one per layer and K/V buffer in
// the per-layer layout, or a single one when an engine packs all layers of a block together). Block b
// occupies bytes [b * block_bytes, (b + 1) * block_bytes) of every buffer, so engine tensor views keep a
// uniform stride. A logical page p is the range [p * page_bytes, (p + 1) * page_bytes) in every buffer:
// mapping it maps `num_buffers` physical pages. A block that would straddle two pages is never handed out.
//
// Policy. Allocation fills partially used pages first, then mapped empty pages, and maps new pages last.
// Freed pages stay mapped while recent demand reached them: the most pages in use during the current and
// the previous reclaim window (`reclaim_delay_ms`) stay mapped, at least `reserved_pages` empty ones, so a
// serving engine whose load goes up and down within a window maps nothing anew. A reclaimer thread unmaps
// the rest after a backend fence, never on the caller's path; trim() unmaps every empty page at once. With
// `map_ahead_pages`, the same thread also maps pages ahead of an engine that is allocating, outside the
// allocator's lock, so that a growing load finds mapped empty pages instead of mapping on its own path;
// pages mapped ahead count as the window's demand and go back like any other when the load stops.
// Virtual capacity, physical memory and the memory limit all bound alloc() and available_size(); a miss
// returns false (never throws).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend/memory_backend.h"
#include "blocks/memory_limit.h"
#include "blocks/operation_counters.h"
#include "pages/paged_region.h"
#include "pages/page_table.h"

namespace kvcached {

// The page size chosen when AllocatorConfig::page_bytes is 0 and a block fits: CUDA's mapping granularity.
constexpr std::size_t kDefaultPageBytes = 2u << 20;

struct AllocatorConfig {
  std::int64_t num_blocks = 0;
  std::int64_t block_bytes = 0;
  std::int64_t num_buffers = 1;
  std::int64_t page_bytes = 0;           // 0 = automatic: 2 MiB, or the smallest granule multiple above a block
  bool reserve_null_block = false;       // block 0 is never handed out; its page stays mapped
  std::int64_t reserved_pages = 2;       // mapped empty pages kept for reuse
  std::int64_t map_ahead_pages = 0;      // empty pages mapped ahead of an allocating engine, off its path (0 = none)
  std::int64_t reclaim_delay_ms = 1000;  // demand window: empty pages used within 1-2 windows stay mapped
  std::int64_t pool_target = 4;          // physical handles the pool thread keeps ready (0 = none)
  std::int64_t pool_max = 16;            // bound on pooled handles
  bool zero_on_map = false;              // zero pages when they are mapped
  // Where blocks go. false: pages already in use first, so that few pages are used. true: a request's
  // blocks on pages of its own (empty and new pages before other requests' partly used ones), so that a
  // finished or preempted request empties pages, and giving memory back costs in proportion.
  bool place_by_request = false;
};

struct AllocatorSnapshot {
  std::int64_t total_blocks;  // blocks that can ever be handed out
  std::int64_t allocated_blocks;
  std::int64_t available_blocks;  // what alloc() could serve now
  std::int64_t mapped_pages;      // logical pages holding physical memory (incl. ones being unmapped)
  std::int64_t used_pages;        // logical pages holding at least one allocated block
  std::uint64_t mapped_bytes;
  std::uint64_t used_bytes;   // bytes of allocated blocks
  std::uint64_t limit_bytes;  // UINT64_MAX when unlimited
  std::uint64_t limit_revision;
  std::int64_t pool_ready;  // physical handles ready in the pool
};

class BlockAllocator {
 public:
  static constexpr std::uint64_t kNoLimit = std::numeric_limits<std::uint64_t>::max();

  // Validates the geometry (InvalidArgument naming the fix), reserves address space and starts threads.
  BlockAllocator(std::shared_ptr<MemoryBackend> backend, const AllocatorConfig& config);
  ~BlockAllocator();
  BlockAllocator(const BlockAllocator&) = delete;
  BlockAllocator& operator=(const BlockAllocator&) = delete;

  // Appends `count` distinct block ids to `out` and returns true, or returns false and changes nothing
  // when virtual capacity, physical memory or the memory limit cannot serve them now. `past_limit`
  // ignores the memory limit for this call (an engine honouring a promise made before the limit fell;
  // the limit holds again from the next call). `near` (an allocated block, or -1) is the last block of the
  // request these blocks extend: the free blocks of its page come first, so a request grows on its page.
  bool alloc(std::int64_t count, std::vector<std::int32_t>& out, bool past_limit = false, std::int64_t near = -1);
  // Frees `ids`. Throws InvalidArgument (and frees nothing) on an unknown, reserved or duplicate id.
  void free(const std::int64_t* ids, std::size_t count);
  // Blocks alloc() could hand out now (a lower bound). Lock-free, no driver call. Fresh pages count by a
  // free-memory reading up to one refresh old, which other processes may have used since.
  std::int64_t available_size() const noexcept;
  // Blocks alloc() can hand out from pages mapped now, within the memory limit: memory this process holds
  // and no other process can take. Lock-free, no driver call; never more than available_size().
  std::int64_t assured_size() const noexcept;
  // Maps pages until `count` blocks are assured, or the limit, virtual capacity or physical memory stops
  // it; returns assured_size(). For a scheduler about to commit to `count` blocks: a device another process
  // filled since the last free-memory reading shows here, as a smaller count, instead of as a refused alloc().
  std::int64_t prepare(std::int64_t count);

  // Caps the physical memory this allocator may map (kNoLimit: none) under `revision` (default: the next).
  LimitResult set_memory_limit(std::uint64_t limit_bytes, std::optional<std::uint64_t> revision);
  // A second cap, for a policy that yields memory to a neighbour for a while (kNoLimit: none). It binds like
  // the memory limit (the lower of the two does) but leaves the limit, and kvctl's view of it, as set.
  void set_yield_cap(std::uint64_t bytes);
  std::uint64_t yield_cap() const noexcept { return yield_bytes_.load(std::memory_order_relaxed); }
  // The same policy's admission cap (kNoLimit: none): never enforced here. Plugins that gate admissions read
  // it, and the control segment publishes it beside the yield cap, so kvctl and kvtop show why an engine
  // waits.
  void set_admit_cap(std::uint64_t bytes) noexcept { admit_bytes_.store(bytes, std::memory_order_relaxed); }
  std::uint64_t admit_cap() const noexcept { return admit_bytes_.load(std::memory_order_relaxed); }
  // Sets the demand window (AllocatorConfig::reclaim_delay_ms) from now on: a policy lengthens it while no
  // other engine could use this allocator's idle pages and shortens it when one could. A shorter window
  // starts at once, so pages kept for the long one go back within two of the new windows.
  void set_reclaim_delay_ms(std::int64_t ms);
  std::int64_t reclaim_delay_ms() const noexcept { return window_ms_.load(std::memory_order_relaxed); }
  // Unmaps every mapped page that holds no allocated block except `keep_empty_pages` of them (the lowest);
  // returns the bytes unmapped.
  std::uint64_t trim(std::int64_t keep_empty_pages = 0);
  // Frees every allocated block (the null block stays reserved); pages are reclaimed as usual.
  void clear();
  // Unmaps and releases everything; later calls raise. Idempotent.
  void close();
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }

  AllocatorSnapshot snapshot() const noexcept;

  // For a planner (its backend is a PlannerBackend): creates the page table at `path` with this
  // allocator's geometry, publishes every page mapped now and every later map and unmap to it, and bounds
  // what the planner plans by what the table's workers report. InvalidArgument for any other backend or
  // when num_layers * num_kv_buffers is not this allocator's buffer count.
  std::shared_ptr<PageTable> publish_page_table(const std::string& path, std::int64_t num_layers,
                                                std::int64_t num_kv_buffers);

  // Geometry, for tensor views.
  const AllocatorConfig& config() const noexcept { return config_; }
  std::size_t page_bytes() const noexcept { return page_bytes_; }
  // The page `block` lies on, -1 for a block that straddles two pages (never handed out). InvalidArgument
  // outside [0, num_blocks).
  std::int32_t page_of_block(std::int64_t block) const;
  const std::vector<std::int32_t>& block_pages() const noexcept { return block_page_; }
  std::size_t buffer_stride() const noexcept { return region_->buffer_stride(); }
  const PagedRegion& region() const noexcept { return *region_; }
  MemoryBackend& backend() const noexcept { return *backend_; }
  // Counters and last error, read without the allocator lock.
  const OperationCounters& counters() const noexcept { return counters_; }
  std::shared_ptr<const ErrorRecord> last_error() const noexcept { return std::atomic_load(&last_error_); }

 private:
  enum class PageState : std::uint8_t { kUnmapped, kMapping, kMapped, kUnmapping, kBroken };
  enum class ListId : std::uint8_t { kNone, kPartial, kEmpty };

  struct Page {
    std::int32_t first_block = 0;
    std::int32_t capacity = 0;  // blocks wholly inside this page
    std::int32_t used = 0;
    PageState state = PageState::kUnmapped;
    ListId list = ListId::kNone;
    std::int32_t list_pos = -1;
    std::vector<std::int32_t> free_blocks;  // stack; lowest id on top
  };

  // A set of page ids with O(1) insert/remove (swap with last).
  struct PageList {
    std::vector<std::int32_t> items;
  };

  void list_insert(ListId id, std::int32_t page);
  void list_remove(std::int32_t page);
  PageList& list(ListId id) { return id == ListId::kPartial ? partial_ : empty_; }

  std::int32_t page_of(std::int32_t block) const { return block_page_[block]; }
  std::size_t logical_page_bytes() const { return page_bytes_ * static_cast<std::size_t>(config_.num_buffers); }
  std::int64_t allowed_pages() const noexcept;
  std::int64_t target_empty_pages() const noexcept;
  // `pages` were wanted in this reclaim window: the reclaimer keeps that many mapped (caller holds mu_).
  void note_demand(std::int64_t pages) noexcept;
  std::int64_t capacity_of_pages(std::int64_t pages, bool may_include_tail) const noexcept;  // lower bound
  // Free blocks on mapped pages that alloc() may hand out now, within the memory limit; `new_pages` gets how
  // many unmapped pages the limit lets become used besides (0 when closed or over the limit).
  std::int64_t mapped_free(std::int64_t& new_pages) const noexcept;

  void take_from_page(std::int32_t page, std::int64_t want, std::vector<std::int32_t>& out);
  void return_block(std::int32_t block);
  enum class MapResult { kMapped, kNoPage, kNoMemory, kRetry };
  MapResult map_next_page();  // caller holds mu_
  // Bookkeeping of a page just mapped, already off the unmapped stack: it joins the empty list (caller holds mu_).
  void add_mapped_page(std::int32_t page);
  // Maps the next page within `allowed` pages; when the page that would come next is being mapped ahead,
  // waits for it instead and returns kRetry (look at the empty pages again). Caller holds mu_ via `lock`.
  MapResult map_or_wait(std::unique_lock<std::mutex>& lock, std::int64_t allowed);
  void unmap_pages(const std::vector<std::int32_t>& pages);  // caller does NOT hold mu_
  void push_unmapped(std::int32_t page);                     // back on the unmapped stack; caller holds mu_
  // Reclaimer thread: maps pages, outside mu_, until `map_ahead_pages` are empty or nothing more may be mapped.
  void map_ahead();
  std::uint64_t reclaim(std::int64_t keep_empty);
  void request_reclaim();
  void reclaimer_loop();
  void check_open() const;
  void record_error(const std::exception& error);
  void count_calls(const PageCalls& calls);

  std::shared_ptr<MemoryBackend> backend_;
  AllocatorConfig config_;
  std::size_t page_bytes_ = 0;
  std::unique_ptr<PagedRegion> region_;
  std::shared_ptr<PageTable> page_table_;  // written under mu_

  mutable std::mutex mu_;
  std::vector<Page> pages_;
  std::vector<std::int32_t> block_page_;  // page of each block, -1 for straddling blocks
  std::vector<std::uint8_t> allocated_;   // per block
  PageList partial_, empty_;
  std::vector<std::int32_t> unmapped_;  // stack of unmapped pages with capacity; lowest on top, tail at the bottom
  // The last page with capacity may hold few blocks (the pool ends inside it). It is kept at the bottom of
  // unmapped_, so it is mapped last, and min_capacity_ is taken over the other pages: availability then stays
  // a tight lower bound instead of counting every fresh page as the short one.
  std::int32_t tail_page_ = -1;
  std::int32_t tail_capacity_ = 0;
  std::int32_t min_capacity_ = 0;  // over pages with capacity other than the tail
  std::int64_t total_blocks_ = 0;

  // Written under mu_, read lock-free by available_size() and snapshot().
  std::atomic<std::int64_t> partial_free_{0};  // free blocks in partially used pages
  std::atomic<std::int64_t> empty_pages_{0};
  std::atomic<std::int64_t> empty_free_{0};  // free blocks in mapped empty pages
  std::atomic<std::int64_t> used_pages_{0};
  std::atomic<std::int64_t> mapped_pages_{0};
  std::atomic<std::int64_t> unmapped_pages_{0};
  std::atomic<bool> tail_unmapped_{false};
  std::atomic<std::int64_t> allocated_blocks_{0};
  // Most pages in use during the current and the previous reclaim window (rotated by the reclaimer).
  std::atomic<std::int64_t> window_peak_{0};
  std::atomic<std::int64_t> previous_window_peak_{0};
  std::atomic<std::int64_t> window_ms_{0};  // the demand window now (config_.reclaim_delay_ms at start)
  std::atomic<std::uint64_t> limit_bytes_{kNoLimit};
  std::atomic<std::uint64_t> yield_bytes_{kNoLimit};
  std::atomic<std::uint64_t> admit_bytes_{kNoLimit};
  std::atomic<std::uint64_t> limit_revision_{0};
  std::atomic<bool> closed_{false};

  // Reclaimer thread.
  std::mutex reclaim_mu_;
  std::condition_variable reclaim_cv_;
  std::atomic<bool> reclaim_requested_{false};
  std::atomic<bool> ahead_requested_{false};
  // A page being mapped ahead is off the unmapped stack but still counted as unmapped (so availability and
  // the capacity check see it); `inflight_` counts it against the limit (guarded by mu_).
  std::int64_t inflight_ = 0;
  std::condition_variable ahead_done_;  // signalled under mu_ when a page mapped ahead is done
  bool stop_ = false;
  std::thread reclaimer_;
  std::mutex unmap_mu_;  // serializes reclaimer, trim() and close() unmapping

  OperationCounters counters_;
  std::shared_ptr<const ErrorRecord> last_error_;
};

}  // namespace kvcached
