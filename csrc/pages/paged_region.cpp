#include "pages/paged_region.h"

#include <string>

#include "common/errors.h"

namespace kvcached {

namespace {
PagePoolConfig pool_config(std::size_t page_bytes, std::size_t target, std::size_t max_pooled) {
  PagePoolConfig config;
  config.handle_bytes = page_bytes;
  config.target = target;
  config.max_pooled = max_pooled;
  return config;
}
}  // namespace

PagedRegion::PagedRegion(std::shared_ptr<MemoryBackend> backend, std::size_t page_bytes, std::size_t num_pages,
                         std::size_t num_buffers, std::size_t pool_target, std::size_t pool_max)
    : backend_(std::move(backend)),
      page_bytes_(page_bytes),
      num_pages_(num_pages),
      num_buffers_(num_buffers),
      reservation_(std::make_shared<Reservation>(backend_, num_buffers * num_pages * page_bytes, page_bytes)),
      pool_(std::make_unique<PagePool>(backend_, pool_config(page_bytes, pool_target, pool_max))),
      handles_(num_pages * num_buffers, 0) {}

std::uintptr_t PagedRegion::buffer_address(std::int64_t buffer) const {
  if (buffer < 0 || static_cast<std::size_t>(buffer) >= num_buffers_)
    throw InvalidArgument("buffer index " + std::to_string(buffer) + " out of range [0, " +
                          std::to_string(num_buffers_) + ")");
  return page_address(static_cast<std::size_t>(buffer), 0);
}

bool PagedRegion::map_page(std::size_t page, bool zero, PageCalls& calls) {
  PhysHandle* handles = &handles_[page * num_buffers_];
  std::size_t mapped = 0;
  auto undo = [&] {  // leave nothing half-mapped
    for (std::size_t i = 0; i < mapped; ++i) {
      try {
        backend_->unmap(page_address(i, page), page_bytes_);
        ++calls.unmaps;
        if (backend_->handle_survives_unmap()) pool_->give_back(handles[i]);
      } catch (...) {
        ++calls.errors;  // the error that started the undo is the one reported
      }
    }
  };
  for (std::size_t i = 0; i < num_buffers_; ++i) {
    std::optional<PhysHandle> h = pool_->take();
    if (!h) {
      undo();
      return false;
    }
    try {
      backend_->map(page_address(i, page), page_bytes_, *h);
    } catch (...) {
      pool_->give_back(*h);  // never mapped: it still holds its memory
      ++calls.errors;
      undo();
      throw;
    }
    ++calls.maps;
    handles[i] = *h;
    ++mapped;
    if (zero) {
      try {
        backend_->zero(page_address(i, page), page_bytes_);
      } catch (...) {
        ++calls.errors;
        undo();
        throw;
      }
    }
  }
  return true;
}

std::exception_ptr PagedRegion::unmap_page(std::size_t page, PageCalls& calls) {
  std::exception_ptr first;
  for (std::size_t i = 0; i < num_buffers_; ++i) {
    try {
      backend_->unmap(page_address(i, page), page_bytes_);
      ++calls.unmaps;
      if (backend_->handle_survives_unmap()) pool_->give_back(handles_[page * num_buffers_ + i]);
    } catch (...) {
      ++calls.errors;
      if (!first) first = std::current_exception();
    }
  }
  return first;
}

}  // namespace kvcached
