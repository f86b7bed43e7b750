#include "pages/page_mirror.h"

#include <cerrno>

#include "common/errors.h"

namespace kvcached {

namespace {
bool test_bit(const std::vector<std::uint64_t>& bits, std::int64_t page) {
  return (bits[static_cast<std::size_t>(page / 64)] >> (page % 64)) & 1u;
}
void put_bit(std::vector<std::uint64_t>& bits, std::int64_t page, bool on) {
  const std::uint64_t bit = std::uint64_t{1} << (page % 64);
  auto& word = bits[static_cast<std::size_t>(page / 64)];
  word = on ? (word | bit) : (word & ~bit);
}
}  // namespace

PageMirror::PageMirror(const std::string& path, std::shared_ptr<MemoryBackend> backend, std::size_t pool_target,
                       std::size_t pool_max)
    : table_(PageTable::open(path)), backend_(std::move(backend)) {
  const PageTableGeometry& g = table_.geometry();
  const auto page_bytes = static_cast<std::size_t>(g.page_bytes);
  if (page_bytes == 0 || page_bytes % backend_->granularity() != 0)
    throw InvalidArgument("the planner's page size (" + std::to_string(g.page_bytes) + " bytes) is not a multiple of " +
                          "this device's granularity (" + std::to_string(backend_->granularity()) +
                          "); plan for this device");
  region_ =
      std::make_unique<PagedRegion>(backend_, page_bytes, static_cast<std::size_t>(g.num_pages),
                                    static_cast<std::size_t>(g.num_layers * g.num_kv_buffers), pool_target, pool_max);
  mapped_.assign(static_cast<std::size_t>((g.num_pages + 63) / 64), 0);
  slot_ = table_.claim_worker_slot();
  report(0);
}

PageMirror::~PageMirror() { close(); }

void PageMirror::map_page(std::int64_t page) {
  PageCalls calls;
  if (!region_->map_page(static_cast<std::size_t>(page), false, calls))
    throw BackendError("out of device memory while mapping a page the scheduler planned", ENOMEM);
  put_bit(mapped_, page, true);
}

void PageMirror::unmap_page(std::int64_t page) {
  PageCalls calls;
  if (const std::exception_ptr error = region_->unmap_page(static_cast<std::size_t>(page), calls))
    std::rethrow_exception(error);  // the page stays marked mapped: its state is unknown
  put_bit(mapped_, page, false);
}

void PageMirror::report(std::uint64_t generation) {
  const PagePool& pool = region_->pool();
  table_.report(slot_, pool.ready() * region_->page_bytes() + pool.cached_free_bytes(), generation);
}

SyncResult PageMirror::sync() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw ClosedError("this page mirror is closed");
  SyncResult result;
  result.generation = table_.snapshot(desired_);
  const std::int64_t pages = geometry().num_pages;
  std::vector<std::int64_t> drop, add;
  for (std::size_t w = 0; w < desired_.size(); ++w) {
    if (desired_[w] == mapped_[w]) continue;
    for (std::int64_t page = static_cast<std::int64_t>(w) * 64; page < std::min<std::int64_t>(pages, (w + 1) * 64);
         ++page) {
      const bool want = test_bit(desired_, page);
      if (want != test_bit(mapped_, page)) (want ? add : drop).push_back(page);
    }
  }
  if (!drop.empty()) {
    backend_->fence();  // steps launched before these pages were given up must be done with them
    for (std::int64_t page : drop) unmap_page(page);
  }
  for (std::int64_t page : add) map_page(page);
  result.mapped = static_cast<std::int64_t>(add.size());
  result.unmapped = static_cast<std::int64_t>(drop.size());
  report(result.generation);
  return result;
}

std::int64_t PageMirror::mapped_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::int64_t count = 0;
  for (std::uint64_t word : mapped_) count += __builtin_popcountll(word);
  return count;
}

void PageMirror::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  try {
    backend_->fence();
    for (std::int64_t page = 0; page < geometry().num_pages; ++page) {
      if (test_bit(mapped_, page)) unmap_page(page);
    }
  } catch (...) {
    // Closing must finish: what could not be unmapped is released with the process.
  }
  region_->pool().shutdown();
  table_.release_worker_slot(slot_);
}

}  // namespace kvcached
