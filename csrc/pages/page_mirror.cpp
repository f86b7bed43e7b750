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
  page_bytes_ = static_cast<std::size_t>(g.page_bytes);
  if (page_bytes_ == 0 || page_bytes_ % backend_->granularity() != 0)
    throw InvalidArgument("the planner's page size (" + std::to_string(g.page_bytes) + " bytes) is not a multiple of " +
                          "this device's granularity (" + std::to_string(backend_->granularity()) + "); plan for this device");
  buffer_stride_ = static_cast<std::size_t>(g.num_pages) * page_bytes_;
  reservation_ = std::make_shared<Reservation>(backend_, buffer_stride_ * static_cast<std::size_t>(num_buffers()));
  PagePoolConfig pool_config;
  pool_config.handle_bytes = page_bytes_;
  pool_config.target = pool_target;
  pool_config.max_pooled = pool_max;
  pool_ = std::make_unique<PagePool>(backend_, pool_config);
  mapped_.assign(static_cast<std::size_t>((g.num_pages + 63) / 64), 0);
  handles_.assign(static_cast<std::size_t>(g.num_pages * num_buffers()), 0);
  slot_ = table_.claim_worker_slot();
  report(0);
}

PageMirror::~PageMirror() { close(); }

std::uintptr_t PageMirror::buffer_address(std::int64_t buffer) const {
  if (buffer < 0 || buffer >= num_buffers())
    throw InvalidArgument("buffer index " + std::to_string(buffer) + " out of range [0, " + std::to_string(num_buffers()) + ")");
  return reservation_->base() + static_cast<std::size_t>(buffer) * buffer_stride_;
}

void PageMirror::map_page(std::int64_t page) {
  const auto n = static_cast<std::size_t>(num_buffers());
  PhysHandle* handles = &handles_[static_cast<std::size_t>(page) * n];
  std::size_t done = 0;
  try {
    for (; done < n; ++done) {
      std::optional<PhysHandle> h = pool_->take();
      if (!h) throw BackendError("out of device memory while mapping a page the scheduler planned", ENOMEM);
      try {
        backend_->map(buffer_address(static_cast<std::int64_t>(done)) + static_cast<std::size_t>(page) * page_bytes_,
                      page_bytes_, *h);
      } catch (...) {
        pool_->give_back(*h);
        throw;
      }
      handles[done] = *h;
    }
  } catch (...) {
    for (std::size_t i = 0; i < done; ++i) {  // leave nothing half-mapped
      backend_->unmap(buffer_address(static_cast<std::int64_t>(i)) + static_cast<std::size_t>(page) * page_bytes_,
                      page_bytes_);
      if (backend_->handle_survives_unmap()) pool_->give_back(handles[i]);
    }
    throw;
  }
  put_bit(mapped_, page, true);
}

void PageMirror::unmap_page(std::int64_t page) {
  const auto n = static_cast<std::size_t>(num_buffers());
  for (std::size_t i = 0; i < n; ++i) {
    backend_->unmap(buffer_address(static_cast<std::int64_t>(i)) + static_cast<std::size_t>(page) * page_bytes_,
                    page_bytes_);
    if (backend_->handle_survives_unmap()) pool_->give_back(handles_[static_cast<std::size_t>(page) * n + i]);
  }
  put_bit(mapped_, page, false);
}

void PageMirror::report(std::uint64_t generation) {
  table_.report(slot_, pool_->ready() * page_bytes_ + pool_->cached_free_bytes(), generation);
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
    for (std::int64_t page = static_cast<std::int64_t>(w) * 64; page < std::min<std::int64_t>(pages, (w + 1) * 64); ++page) {
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
  pool_->shutdown();
  table_.release_worker_slot(slot_);
}

}  // namespace kvcached
