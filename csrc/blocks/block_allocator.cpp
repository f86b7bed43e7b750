#include "blocks/block_allocator.h"

#include <algorithm>
#include <chrono>
#include <functional>

#include "backend/planner_backend.h"
#include "common/errors.h"

namespace kvcached {

namespace {
std::size_t round_up(std::size_t value, std::size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Relaxed add for counters that only the lock holder writes.
template <typename T>
void bump(std::atomic<T>& counter, T delta) {
  counter.store(counter.load(std::memory_order_relaxed) + delta, std::memory_order_relaxed);
}
}  // namespace

BlockAllocator::BlockAllocator(std::shared_ptr<MemoryBackend> backend, const AllocatorConfig& config)
    : backend_(std::move(backend)), config_(config) {
  const auto& c = config_;
  if (c.num_blocks <= 0 || c.num_blocks > std::numeric_limits<std::int32_t>::max())
    throw InvalidArgument("num_blocks must be between 1 and 2^31-1, got " + std::to_string(c.num_blocks));
  if (c.block_bytes <= 0) throw InvalidArgument("block_bytes must be positive, got " + std::to_string(c.block_bytes));
  if (c.num_buffers <= 0)
    throw InvalidArgument("num_layers * num_kv_buffers must be positive, got " + std::to_string(c.num_buffers));
  if (c.reserved_pages < 0 || c.map_ahead_pages < 0 || c.reclaim_delay_ms < 0 || c.pool_target < 0 || c.pool_max < 0)
    throw InvalidArgument(
        "reserved_pages, map_ahead_pages, reclaim_delay_ms, pool_target and pool_max must not be negative");
  window_ms_.store(c.reclaim_delay_ms, std::memory_order_relaxed);

  const std::size_t gran = backend_->granularity();
  const auto block = static_cast<std::size_t>(c.block_bytes);
  if (c.page_bytes == 0) {
    page_bytes_ = round_up(std::max(kDefaultPageBytes, block), gran);
  } else {
    page_bytes_ = static_cast<std::size_t>(c.page_bytes);
    if (c.page_bytes < 0 || page_bytes_ % gran != 0)
      throw InvalidArgument("page_bytes must be a positive multiple of the " + backend_->name() + " granularity (" +
                            std::to_string(gran) + " bytes), got " + std::to_string(c.page_bytes));
    if (block > page_bytes_)
      throw InvalidArgument("a block of " + std::to_string(block) + " bytes does not fit in a page of " +
                            std::to_string(page_bytes_) + " bytes: set page_bytes to at least " +
                            std::to_string(round_up(block, gran)) + " (or 0 to choose automatically)");
  }

  const std::size_t data_bytes = static_cast<std::size_t>(c.num_blocks) * block;
  const std::size_t num_pages = round_up(data_bytes, page_bytes_) / page_bytes_;
  if (num_pages > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    throw InvalidArgument("too many pages: raise page_bytes");

  pages_.resize(num_pages);
  block_page_.assign(static_cast<std::size_t>(c.num_blocks), -1);
  allocated_.assign(static_cast<std::size_t>(c.num_blocks), 0);
  min_capacity_ = std::numeric_limits<std::int32_t>::max();
  for (std::size_t p = 0; p < num_pages; ++p) {
    Page& page = pages_[p];
    const std::size_t first = (p * page_bytes_ + block - 1) / block;
    const std::size_t end = std::min(((p + 1) * page_bytes_) / block, static_cast<std::size_t>(c.num_blocks));
    page.first_block = static_cast<std::int32_t>(first);
    page.capacity = end > first ? static_cast<std::int32_t>(end - first) : 0;
    for (std::int32_t i = page.capacity - 1; i >= 0; --i) {
      page.free_blocks.push_back(page.first_block + i);
      block_page_[static_cast<std::size_t>(page.first_block + i)] = static_cast<std::int32_t>(p);
    }
    total_blocks_ += page.capacity;
    if (page.capacity > 0) {
      if (tail_page_ >= 0) min_capacity_ = std::min(min_capacity_, tail_capacity_);
      tail_page_ = static_cast<std::int32_t>(p);
      tail_capacity_ = page.capacity;
    }
  }
  if (min_capacity_ == std::numeric_limits<std::int32_t>::max()) min_capacity_ = tail_capacity_;  // one page
  tail_unmapped_.store(tail_page_ >= 0);
  for (std::size_t p = num_pages; p-- > 0;) {
    if (pages_[p].capacity > 0) unmapped_.push_back(static_cast<std::int32_t>(p));
  }
  unmapped_pages_.store(static_cast<std::int64_t>(unmapped_.size()));

  region_ =
      std::make_unique<PagedRegion>(backend_, page_bytes_, num_pages, static_cast<std::size_t>(c.num_buffers),
                                    static_cast<std::size_t>(c.pool_target), static_cast<std::size_t>(c.pool_max));

  if (c.reserve_null_block) {
    if (block_page_[0] < 0) throw InvalidArgument("block 0 straddles a page; cannot reserve it");
    std::lock_guard<std::mutex> lock(mu_);
    if (map_next_page() != MapResult::kMapped) {
      region_->pool().shutdown();
      throw BackendError("no physical memory for the page of the reserved null block", -1);
    }
    std::vector<std::int32_t> null_block;
    take_from_page(0, 1, null_block);  // pages map lowest first: this is page 0, block 0
    --total_blocks_;
  }
  reclaimer_ = std::thread([this] { reclaimer_loop(); });
}

BlockAllocator::~BlockAllocator() { close(); }

std::shared_ptr<PageTable> BlockAllocator::publish_page_table(const std::string& path, std::int64_t num_layers,
                                                              std::int64_t num_kv_buffers) {
  auto* planner = dynamic_cast<PlannerBackend*>(backend_.get());
  if (planner == nullptr) throw InvalidArgument("only a planner (mapped_by_workers) publishes a page table");
  if (num_layers <= 0 || num_kv_buffers <= 0 || num_layers * num_kv_buffers != config_.num_buffers)
    throw InvalidArgument("num_layers * num_kv_buffers must be this allocator's " +
                          std::to_string(config_.num_buffers) + " buffers");
  PageTableGeometry g;
  g.num_blocks = config_.num_blocks;
  g.block_bytes = config_.block_bytes;
  g.num_layers = num_layers;
  g.num_kv_buffers = num_kv_buffers;
  g.page_bytes = static_cast<std::int64_t>(page_bytes_);
  g.num_pages = static_cast<std::int64_t>(region_->num_pages());
  auto table = std::make_shared<PageTable>(PageTable::create(path, g));
  {
    std::lock_guard<std::mutex> lock(mu_);
    page_table_ = table;
    for (std::size_t p = 0; p < pages_.size(); ++p) {
      if (pages_[p].state == PageState::kMapped) page_table_->set_page(static_cast<std::int64_t>(p), true);
    }
  }
  planner->set_allocatable_source([table] { return table->worker_allocatable_bytes(); });
  return table;
}

void BlockAllocator::check_open() const {
  if (closed()) throw ClosedError("this KV cache manager is closed");
}

void BlockAllocator::count_calls(const PageCalls& calls) {
  count(counters_.page_maps_total, calls.maps);
  count(counters_.page_unmaps_total, calls.unmaps);
  count(counters_.mapping_errors_total, calls.errors);
}

void BlockAllocator::record_error(const std::exception& error) {
  auto record = std::make_shared<ErrorRecord>();
  const auto* backend_error = dynamic_cast<const BackendError*>(&error);
  record->code = backend_error != nullptr ? backend_error->code() : -1;
  record->unix_ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  record->message = std::string(error.what()).substr(0, kMaxErrorMessage);
  std::atomic_store(&last_error_, std::shared_ptr<const ErrorRecord>(std::move(record)));
}

// ---- page lists -------------------------------------------------------------------------------------

void BlockAllocator::list_insert(ListId id, std::int32_t page) {
  PageList& l = list(id);
  Page& p = pages_[static_cast<std::size_t>(page)];
  p.list = id;
  p.list_pos = static_cast<std::int32_t>(l.items.size());
  l.items.push_back(page);
}

void BlockAllocator::list_remove(std::int32_t page) {
  Page& p = pages_[static_cast<std::size_t>(page)];
  if (p.list == ListId::kNone) return;
  PageList& l = list(p.list);
  const std::int32_t last = l.items.back();
  l.items[static_cast<std::size_t>(p.list_pos)] = last;
  pages_[static_cast<std::size_t>(last)].list_pos = p.list_pos;
  l.items.pop_back();
  p.list = ListId::kNone;
  p.list_pos = -1;
}

std::int32_t BlockAllocator::page_of_block(std::int64_t block) const {
  if (block < 0 || block >= config_.num_blocks)
    throw InvalidArgument("block " + std::to_string(block) + " is not in [0, " + std::to_string(config_.num_blocks) +
                          ")");
  return page_of(static_cast<std::int32_t>(block));
}

// ---- limit ------------------------------------------------------------------------------------------

std::int64_t BlockAllocator::allowed_pages() const noexcept {
  const std::uint64_t limit =
      std::min(limit_bytes_.load(std::memory_order_relaxed), yield_bytes_.load(std::memory_order_relaxed));
  if (limit == kNoLimit) return std::numeric_limits<std::int64_t>::max();
  return static_cast<std::int64_t>(limit / (page_bytes_ * static_cast<std::uint64_t>(config_.num_buffers)));
}

void BlockAllocator::note_demand(std::int64_t pages) noexcept {
  if (pages > window_peak_.load(std::memory_order_relaxed)) window_peak_.store(pages, std::memory_order_relaxed);
}

std::int64_t BlockAllocator::target_empty_pages() const noexcept {
  const std::int64_t used = used_pages_.load(std::memory_order_relaxed);
  // No window (reclaim_delay_ms = 0): only the reserve stays.
  const std::int64_t recent = window_ms_.load(std::memory_order_relaxed) == 0
                                  ? used
                                  : std::max(window_peak_.load(std::memory_order_relaxed),
                                             previous_window_peak_.load(std::memory_order_relaxed));
  const std::int64_t want = std::max(config_.reserved_pages, recent - used);
  return std::max<std::int64_t>(0, std::min(want, allowed_pages() - used));
}

// ---- alloc / free -----------------------------------------------------------------------------------

void BlockAllocator::take_from_page(std::int32_t page_id, std::int64_t want, std::vector<std::int32_t>& out) {
  Page& page = pages_[static_cast<std::size_t>(page_id)];
  const bool was_empty = page.used == 0;
  const auto n =
      static_cast<std::int32_t>(std::min<std::int64_t>(want, static_cast<std::int64_t>(page.free_blocks.size())));
  for (std::int32_t i = 0; i < n; ++i) {
    const std::int32_t b = page.free_blocks.back();
    page.free_blocks.pop_back();
    allocated_[static_cast<std::size_t>(b)] = 1;
    out.push_back(b);
  }
  page.used += n;
  if (was_empty) {
    bump(empty_pages_, std::int64_t{-1});
    bump(empty_free_, -static_cast<std::int64_t>(page.capacity));
    bump(partial_free_, static_cast<std::int64_t>(page.capacity - n));
    bump(used_pages_, std::int64_t{1});
  } else {
    bump(partial_free_, -static_cast<std::int64_t>(n));
  }
  list_remove(page_id);
  if (page.used < page.capacity) list_insert(ListId::kPartial, page_id);
  bump(allocated_blocks_, static_cast<std::int64_t>(n));
}

void BlockAllocator::return_block(std::int32_t block) {
  const std::int32_t page_id = page_of(block);
  Page& page = pages_[static_cast<std::size_t>(page_id)];
  allocated_[static_cast<std::size_t>(block)] = 0;
  page.free_blocks.push_back(block);
  --page.used;
  bump(allocated_blocks_, std::int64_t{-1});
  if (page.used == 0) {
    list_remove(page_id);
    list_insert(ListId::kEmpty, page_id);
    bump(partial_free_, -static_cast<std::int64_t>(page.capacity - 1));
    bump(empty_pages_, std::int64_t{1});
    bump(empty_free_, static_cast<std::int64_t>(page.capacity));
    bump(used_pages_, std::int64_t{-1});
  } else {
    bump(partial_free_, std::int64_t{1});
    if (page.list == ListId::kNone) list_insert(ListId::kPartial, page_id);
  }
}

BlockAllocator::MapResult BlockAllocator::map_or_wait(std::unique_lock<std::mutex>& lock, std::int64_t allowed) {
  const std::int64_t mapped = mapped_pages_.load(std::memory_order_relaxed);
  if (inflight_ > 0 && (unmapped_.empty() || mapped + inflight_ >= allowed)) {
    ahead_done_.wait(lock, [this] { return inflight_ == 0; });  // milliseconds: one page's map calls
    return MapResult::kRetry;
  }
  if (mapped >= allowed) return MapResult::kNoPage;
  return map_next_page();
}

BlockAllocator::MapResult BlockAllocator::map_next_page() {
  if (unmapped_.empty()) return MapResult::kNoPage;
  const std::int32_t page_id = unmapped_.back();
  PageCalls calls;
  bool mapped = false;
  try {
    mapped = region_->map_page(static_cast<std::size_t>(page_id), config_.zero_on_map, calls);
  } catch (const std::exception& e) {
    count_calls(calls);
    record_error(e);
    throw;
  }
  count_calls(calls);
  if (!mapped) return MapResult::kNoMemory;
  unmapped_.pop_back();
  add_mapped_page(page_id);
  return MapResult::kMapped;
}

void BlockAllocator::add_mapped_page(std::int32_t page_id) {
  if (page_id == tail_page_) tail_unmapped_.store(false, std::memory_order_relaxed);
  if (page_table_) page_table_->set_page(page_id, true);  // before any block of it is handed out
  count(counters_.manager_page_allocations_total);
  Page& page = pages_[static_cast<std::size_t>(page_id)];
  page.state = PageState::kMapped;
  list_insert(ListId::kEmpty, page_id);
  bump(unmapped_pages_, std::int64_t{-1});
  bump(mapped_pages_, std::int64_t{1});
  bump(empty_pages_, std::int64_t{1});
  bump(empty_free_, static_cast<std::int64_t>(page.capacity));
}

bool BlockAllocator::alloc(std::int64_t count, std::vector<std::int32_t>& out, bool past_limit, std::int64_t near) {
  if (count <= 0) throw InvalidArgument("alloc() needs a positive number of blocks, got " + std::to_string(count));
  std::unique_lock<std::mutex> lock(mu_);
  check_open();
  kvcached::count(counters_.allocation_requests_total);
  auto reject = [this] {
    kvcached::count(counters_.allocation_failures_total);
    kvcached::count(counters_.capacity_exhausted_total);
    return false;
  };
  const std::int64_t allowed = past_limit ? std::numeric_limits<std::int64_t>::max() : allowed_pages();
  std::int64_t used_pages = used_pages_.load(std::memory_order_relaxed);
  if (used_pages > allowed) return reject();  // a deferred shrink is in progress: allocation stops
  const std::int64_t partial_free = partial_free_.load(std::memory_order_relaxed);
  if (count > partial_free + empty_free_.load(std::memory_order_relaxed) +
                  unmapped_pages_.load(std::memory_order_relaxed) *
                      static_cast<std::int64_t>(page_bytes_ / config_.block_bytes))
    return reject();  // more than virtual capacity could ever give

  const std::size_t start = out.size();
  std::int64_t need = count;
  auto take = [&](std::int32_t page_id) {
    const std::size_t before = out.size();
    take_from_page(page_id, need, out);
    need -= static_cast<std::int64_t>(out.size() - before);
  };
  // The free blocks beside the request's last one: its growth stays on its page.
  if (near >= 0 && near < config_.num_blocks && allocated_[static_cast<std::size_t>(near)] != 0) {
    const std::int32_t page_id = page_of(static_cast<std::int32_t>(near));
    if (page_id >= 0 && pages_[static_cast<std::size_t>(page_id)].list == ListId::kPartial) take(page_id);
  }
  auto take_partial = [&] {  // partially used pages: no new page becomes used
    while (need > 0 && !partial_.items.empty()) take(partial_.items.back());
  };
  // Mapped empty pages, then new pages, each within the memory limit, until `need` is met or no page can
  // be had (false).
  auto take_fresh = [&]() -> bool {
    while (need > 0) {
      if (used_pages >= allowed) return false;
      if (empty_.items.empty()) {
        MapResult r;
        try {
          r = map_or_wait(lock, allowed);
        } catch (...) {
          for (std::size_t i = out.size(); i-- > start;) return_block(out[i]);
          out.resize(start);
          kvcached::count(counters_.allocation_errors_total);
          throw;
        }
        if (r == MapResult::kRetry) continue;
        if (r != MapResult::kMapped) return false;
      }
      take(empty_.items.back());
      ++used_pages;
    }
    return true;
  };
  if (config_.place_by_request) {
    if (!take_fresh()) take_partial();  // others' pages only when no page of its own can be had
  } else {
    take_partial();
    take_fresh();
  }
  const bool ok = need == 0;
  if (!ok) {
    // Roll back: the caller sees no change. Pages mapped meanwhile stay as reusable empty pages: the demand
    // was real and its retry will want them, so they count as this window's demand (else the reclaimer,
    // asked below, would unmap them under the retry).
    note_demand(used_pages);
    for (std::size_t i = out.size(); i-- > start;) return_block(out[i]);
    out.resize(start);
    if (empty_pages_.load(std::memory_order_relaxed) > target_empty_pages()) request_reclaim();
    return reject();
  }
  note_demand(used_pages);
  if (empty_pages_.load(std::memory_order_relaxed) < config_.map_ahead_pages &&
      !ahead_requested_.exchange(true, std::memory_order_relaxed))
    reclaim_cv_.notify_one();
  kvcached::count(counters_.allocation_successes_total);
  kvcached::count(counters_.allocated_blocks_total, static_cast<std::uint64_t>(count));
  return true;
}

void BlockAllocator::free(const std::int64_t* ids, std::size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  // Validate everything first (marking as we go to catch duplicates), so a bad id changes nothing.
  std::size_t checked = 0;
  auto fail = [&](const std::string& message) {
    for (std::size_t i = 0; i < checked; ++i) allocated_[static_cast<std::size_t>(ids[i])] = 1;
    throw InvalidArgument(message);
  };
  for (; checked < count; ++checked) {
    const std::int64_t id = ids[checked];
    if (id < 0 || id >= config_.num_blocks)
      fail("block id " + std::to_string(id) + " is out of range [0, " + std::to_string(config_.num_blocks) + ")");
    if (id == 0 && config_.reserve_null_block) fail("block 0 is the reserved null block and cannot be freed");
    std::uint8_t& a = allocated_[static_cast<std::size_t>(id)];
    if (!a)
      fail("block id " + std::to_string(id) + " is not allocated (double free, or an id this manager never gave out)");
    a = 0;
  }
  for (std::size_t i = 0; i < count; ++i) return_block(static_cast<std::int32_t>(ids[i]));
  if (count > 0) {
    kvcached::count(counters_.free_requests_total);
    kvcached::count(counters_.freed_blocks_total, count);
  }
  if (empty_pages_.load(std::memory_order_relaxed) > target_empty_pages()) request_reclaim();
}

std::int64_t BlockAllocator::capacity_of_pages(std::int64_t pages, bool may_include_tail) const noexcept {
  if (pages <= 0) return 0;
  if (!may_include_tail) return pages * min_capacity_;
  return (pages - 1) * min_capacity_ + std::min(tail_capacity_, min_capacity_);
}

std::int64_t BlockAllocator::mapped_free(std::int64_t& new_pages) const noexcept {
  new_pages = 0;
  if (closed()) return 0;
  const std::int64_t allowed = allowed_pages();
  const std::int64_t used = used_pages_.load(std::memory_order_relaxed);
  if (used > allowed) return 0;
  const std::int64_t headroom = allowed - used;  // pages that may still become used
  const std::int64_t partial = partial_free_.load(std::memory_order_relaxed);
  const std::int64_t empty = empty_pages_.load(std::memory_order_relaxed);
  if (empty > headroom) return partial + capacity_of_pages(headroom, !tail_unmapped_.load(std::memory_order_relaxed));
  new_pages = headroom - empty;
  return partial + empty_free_.load(std::memory_order_relaxed);
}

std::int64_t BlockAllocator::assured_size() const noexcept {
  std::int64_t new_pages = 0;
  return mapped_free(new_pages);
}

std::int64_t BlockAllocator::available_size() const noexcept {
  std::int64_t headroom = 0;
  const std::int64_t avail = mapped_free(headroom);
  if (headroom == 0) return avail;
  // New pages: bounded by unmapped pages, the limit, and physical memory (pool + cached device free).
  const std::int64_t by_limit = allowed_pages() - mapped_pages_.load(std::memory_order_relaxed);
  const PagePool& pool = region_->pool();
  const auto handles = static_cast<std::int64_t>(pool.ready() + pool.cached_free_bytes() / page_bytes_);
  const std::int64_t by_memory = handles / config_.num_buffers;
  const std::int64_t unmapped = unmapped_pages_.load(std::memory_order_relaxed);
  const std::int64_t fresh = std::max<std::int64_t>(0, std::min({headroom, by_limit, by_memory, unmapped}));
  // The tail sits at the bottom of the unmapped stack: it is among the fresh pages only when all are.
  return avail + capacity_of_pages(fresh, fresh == unmapped && tail_unmapped_.load(std::memory_order_relaxed));
}

std::int64_t BlockAllocator::prepare(std::int64_t count) {
  std::unique_lock<std::mutex> lock(mu_);
  check_open();
  const std::int64_t allowed = allowed_pages();
  while (assured_size() < count) {
    const MapResult r = map_or_wait(lock, allowed);  // a driver error propagates: nothing to roll back
    if (r == MapResult::kRetry) continue;
    if (r != MapResult::kMapped) break;
  }
  // The pages are about to be used: the reclaimer keeps them as this window's demand.
  note_demand(used_pages_.load(std::memory_order_relaxed) + empty_pages_.load(std::memory_order_relaxed));
  return assured_size();
}

// ---- limit ------------------------------------------------------------------------------------------

LimitResult BlockAllocator::set_memory_limit(std::uint64_t limit_bytes, std::optional<std::uint64_t> revision) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  const std::uint64_t current = limit_bytes_.load(std::memory_order_relaxed);
  const std::uint64_t current_rev = limit_revision_.load(std::memory_order_relaxed);
  const std::uint64_t rev = revision.value_or(current_rev + 1);
  count(counters_.resize_requests_total);
  if (rev < current_rev || (rev == current_rev && revision && limit_bytes != current)) {
    count(counters_.resize_errors_total);
    return {rev < current_rev ? LimitStatus::kStale : LimitStatus::kConflict, current, current_rev};
  }
  limit_revision_.store(rev, std::memory_order_relaxed);
  limit_bytes_.store(limit_bytes, std::memory_order_relaxed);
  request_reclaim();
  const std::uint64_t used =
      static_cast<std::uint64_t>(used_pages_.load(std::memory_order_relaxed)) * logical_page_bytes();
  return {used > limit_bytes ? LimitStatus::kDeferred : LimitStatus::kApplied, limit_bytes, rev};
}

void BlockAllocator::set_reclaim_delay_ms(std::int64_t ms) {
  if (ms < 0) throw InvalidArgument("reclaim_delay_ms must not be negative");
  if (window_ms_.exchange(ms, std::memory_order_relaxed) == ms) return;
  {
    std::lock_guard<std::mutex> lock(reclaim_mu_);  // the reclaimer reads the new window at its next turn
    reclaim_requested_.store(true, std::memory_order_relaxed);
  }
  reclaim_cv_.notify_one();
}

void BlockAllocator::set_yield_cap(std::uint64_t bytes) {
  yield_bytes_.store(bytes, std::memory_order_relaxed);
  request_reclaim();  // empty pages above a lower cap go now
}

// ---- reclaim ----------------------------------------------------------------------------------------

void BlockAllocator::request_reclaim() {
  if (!reclaim_requested_.exchange(true, std::memory_order_relaxed)) reclaim_cv_.notify_one();
}

void BlockAllocator::unmap_pages(const std::vector<std::int32_t>& victims) {
  PageCalls calls;
  try {
    backend_->fence();  // work launched before the blocks were freed must finish before their pages go
  } catch (const std::exception& e) {
    record_error(e);
    ++calls.errors;
  }
  for (const std::int32_t page_id : victims) {
    const auto p = static_cast<std::size_t>(page_id);
    const std::exception_ptr error = region_->unmap_page(p, calls);
    PageState outcome = PageState::kUnmapped;
    if (error) {
      outcome = PageState::kBroken;  // never reuse a page in an unknown state
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        record_error(e);
      }
    }
    // Page by page, so mapped_bytes never lags memory already given back (another engine may hold it).
    std::lock_guard<std::mutex> lock(mu_);
    count_calls(calls);
    count(counters_.manager_page_releases_total);
    calls = PageCalls{};
    if (page_table_) page_table_->set_page(page_id, false);
    pages_[p].state = outcome;
    bump(mapped_pages_, std::int64_t{-1});
    if (outcome == PageState::kUnmapped) {
      push_unmapped(page_id);
      bump(unmapped_pages_, std::int64_t{1});
    }
  }
}

void BlockAllocator::push_unmapped(std::int32_t page_id) {
  if (page_id == tail_page_) {
    unmapped_.insert(unmapped_.begin(), page_id);
    tail_unmapped_.store(true, std::memory_order_relaxed);
  } else {
    unmapped_.push_back(page_id);
  }
}

void BlockAllocator::map_ahead() {
  std::lock_guard<std::mutex> serial(unmap_mu_);  // never beside trim()'s unmapping
  bool device_read = false;                       // the device's free memory was read in this pass
  for (;;) {
    std::int32_t page_id = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const std::int64_t empty = empty_pages_.load(std::memory_order_relaxed);
      // Without a demand window only the reserve stays mapped: more would be unmapped right away.
      const std::int64_t want = window_ms_.load(std::memory_order_relaxed) == 0
                                    ? std::min(config_.map_ahead_pages, config_.reserved_pages)
                                    : config_.map_ahead_pages;
      if (closed() || unmapped_.empty() || empty >= want ||
          mapped_pages_.load(std::memory_order_relaxed) >= allowed_pages())
        return;  // enough ahead, or the limit or virtual capacity has no page
      if (available_size() > assured_size()) {
        // Off the stack, so no alloc() maps it too; still counted as unmapped, so availability and the
        // capacity check see it, and as in flight against the limit. An alloc() that needs it waits for it.
        page_id = unmapped_.back();
        unmapped_.pop_back();
        pages_[static_cast<std::size_t>(page_id)].state = PageState::kMapping;
        ++inflight_;
      } else if (device_read) {
        return;  // the device has no page either
      }
    }
    if (page_id < 0) {
      // The last reading may lag memory freed since (or a failed create zeroed it), and nothing would ask
      // again before the engine's next allocation: read the device once (a driver call, off the hot path).
      region_->pool().refresh_free_bytes();
      device_read = true;
      continue;
    }
    PageCalls calls;
    bool mapped = false;
    try {
      mapped = region_->map_page(static_cast<std::size_t>(page_id), config_.zero_on_map, calls);
    } catch (const std::exception& e) {
      record_error(e);  // nothing is mapped; the engine's own next map meets the same error
    }
    std::lock_guard<std::mutex> lock(mu_);
    count_calls(calls);
    --inflight_;
    ahead_done_.notify_all();  // an alloc() waiting for this page looks again once the lock is free
    if (!mapped) {             // no memory (or an error): stop; the engine's own allocations see it as usual
      pages_[static_cast<std::size_t>(page_id)].state = PageState::kUnmapped;
      push_unmapped(page_id);
      return;
    }
    add_mapped_page(page_id);
    // The load is growing into them: the reclaimer keeps them as this window's demand.
    note_demand(used_pages_.load(std::memory_order_relaxed) + empty_pages_.load(std::memory_order_relaxed));
  }
}

std::uint64_t BlockAllocator::reclaim(std::int64_t keep_empty) {
  std::lock_guard<std::mutex> serial(unmap_mu_);
  std::vector<std::int32_t> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Highest pages go first: allocation maps lowest first, so memory stays packed at the bottom.
    std::vector<std::int32_t> empty = empty_.items;
    std::sort(empty.begin(), empty.end(), std::greater<>());
    const auto excess = static_cast<std::int64_t>(empty.size()) - keep_empty;
    for (std::int64_t k = 0; k < excess; ++k) {
      const std::int32_t page_id = empty[static_cast<std::size_t>(k)];
      list_remove(page_id);
      Page& page = pages_[static_cast<std::size_t>(page_id)];
      page.state = PageState::kUnmapping;
      bump(empty_pages_, std::int64_t{-1});
      bump(empty_free_, -static_cast<std::int64_t>(page.capacity));
      victims.push_back(page_id);
    }
  }
  if (!victims.empty()) unmap_pages(victims);
  return victims.size() * logical_page_bytes();
}

void BlockAllocator::reclaimer_loop() {
  using namespace std::chrono;
  milliseconds window(window_ms_.load(std::memory_order_relaxed));
  auto window_end = steady_clock::now() + window;
  std::unique_lock<std::mutex> lock(reclaim_mu_);
  while (!stop_) {
    const milliseconds poll =
        window.count() == 0 ? milliseconds(100) : std::clamp(window, milliseconds(1), milliseconds(100));
    reclaim_cv_.wait_for(lock, poll, [this] { return stop_ || reclaim_requested_.load() || ahead_requested_.load(); });
    if (stop_) break;
    reclaim_requested_.store(false);
    if (ahead_requested_.exchange(false)) {
      lock.unlock();
      map_ahead();
      lock.lock();
    }
    const milliseconds now_window(window_ms_.load(std::memory_order_relaxed));
    if (now_window != window) {
      // A shorter window starts now (what was kept for the longer one goes within two of these); a longer
      // one extends the current window.
      window_end = now_window < window ? steady_clock::now() : window_end + (now_window - window);
      window = now_window;
    }
    if (steady_clock::now() >= window_end) {
      // A new window: demand older than the previous window no longer keeps pages mapped.
      std::lock_guard<std::mutex> state(mu_);
      previous_window_peak_.store(window_peak_.load(std::memory_order_relaxed), std::memory_order_relaxed);
      window_peak_.store(used_pages_.load(std::memory_order_relaxed), std::memory_order_relaxed);
      window_end = steady_clock::now() + window;
    }
    if (empty_pages_.load(std::memory_order_relaxed) <= target_empty_pages()) continue;
    lock.unlock();
    reclaim(target_empty_pages());
    lock.lock();
  }
}

std::uint64_t BlockAllocator::trim(std::int64_t keep_empty_pages) {
  check_open();
  return reclaim(std::max<std::int64_t>(0, keep_empty_pages));
}

void BlockAllocator::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  std::uint64_t freed = 0;
  for (std::size_t b = 0; b < allocated_.size(); ++b) {
    if (allocated_[b] && !(b == 0 && config_.reserve_null_block)) {
      return_block(static_cast<std::int32_t>(b));
      ++freed;
    }
  }
  if (freed > 0) {
    count(counters_.free_requests_total);
    count(counters_.freed_blocks_total, freed);
  }
  if (empty_pages_.load(std::memory_order_relaxed) > target_empty_pages()) request_reclaim();
}

void BlockAllocator::close() {
  if (closed_.exchange(true, std::memory_order_acq_rel)) return;
  {
    std::lock_guard<std::mutex> lock(reclaim_mu_);
    stop_ = true;
  }
  reclaim_cv_.notify_all();
  if (reclaimer_.joinable()) reclaimer_.join();
  std::lock_guard<std::mutex> serial(unmap_mu_);
  std::vector<std::int32_t> mapped;
  {
    std::lock_guard<std::mutex> lock(mu_);  // waits for any alloc/free still inside
    for (std::size_t p = 0; p < pages_.size(); ++p) {
      if (pages_[p].state == PageState::kMapped) mapped.push_back(static_cast<std::int32_t>(p));
    }
  }
  if (!mapped.empty()) unmap_pages(mapped);
  region_->pool().shutdown();
}

AllocatorSnapshot BlockAllocator::snapshot() const noexcept {
  AllocatorSnapshot s{};
  s.total_blocks = total_blocks_;
  s.allocated_blocks = allocated_blocks_.load(std::memory_order_relaxed) - (config_.reserve_null_block ? 1 : 0);
  s.available_blocks = available_size();
  s.mapped_pages = mapped_pages_.load(std::memory_order_relaxed);
  s.used_pages = used_pages_.load(std::memory_order_relaxed);
  s.mapped_bytes = static_cast<std::uint64_t>(s.mapped_pages) * logical_page_bytes();
  s.used_bytes = static_cast<std::uint64_t>(std::max<std::int64_t>(0, s.allocated_blocks)) *
                 static_cast<std::uint64_t>(config_.block_bytes) * static_cast<std::uint64_t>(config_.num_buffers);
  s.limit_bytes = limit_bytes_.load(std::memory_order_relaxed);
  s.limit_revision = limit_revision_.load(std::memory_order_relaxed);
  s.pool_ready = static_cast<std::int64_t>(region_->pool().ready());
  return s;
}

}  // namespace kvcached
