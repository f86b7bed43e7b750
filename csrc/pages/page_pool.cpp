#include "pages/page_pool.h"

#include <chrono>

namespace kvcached {

PagePool::PagePool(std::shared_ptr<MemoryBackend> backend, const PagePoolConfig& config)
    : backend_(std::move(backend)), config_(config) {
  if (config_.max_pooled < config_.target) config_.max_pooled = config_.target;
  refresh_free_bytes();
  if (config_.target > 0) thread_ = std::thread([this] { run(); });
}

PagePool::~PagePool() { shutdown(); }

void PagePool::refresh_free_bytes() {
  try {
    free_bytes_.store(backend_->mem_info().free_bytes, std::memory_order_relaxed);
  } catch (...) {
    // A failed query leaves the previous estimate; the next create reports any real failure.
  }
}

std::optional<PhysHandle> PagePool::take() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!handles_.empty()) {
      PhysHandle h = handles_.back();
      handles_.pop_back();
      ready_count_.store(handles_.size(), std::memory_order_relaxed);
      if (handles_.size() < config_.target) cv_.notify_one();
      return h;
    }
  }
  auto h = backend_->create(config_.handle_bytes);
  if (!h) free_bytes_.store(0, std::memory_order_relaxed);
  cv_.notify_one();
  return h;
}

void PagePool::give_back(PhysHandle handle) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_ && handles_.size() < config_.max_pooled) {
      handles_.push_back(handle);
      ready_count_.store(handles_.size(), std::memory_order_relaxed);
      return;
    }
  }
  backend_->release(handle, config_.handle_bytes);
}

void PagePool::run() {
  using namespace std::chrono;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    bool short_of_target = handles_.size() < config_.target;
    if (short_of_target) {
      lock.unlock();
      std::optional<PhysHandle> h;
      try {
        h = backend_->create(config_.handle_bytes);
      } catch (...) {
        h.reset();  // a driver error here is reported by the allocation that needs the page
      }
      refresh_free_bytes();
      lock.lock();
      if (h) {
        if (stop_) {
          lock.unlock();
          backend_->release(*h, config_.handle_bytes);
          lock.lock();
        } else {
          handles_.push_back(*h);
          ready_count_.store(handles_.size(), std::memory_order_relaxed);
        }
        continue;
      }
      // Device full (another engine holds the memory): wait before trying again.
    }
    cv_.wait_for(lock, milliseconds(config_.refresh_ms));
    if (!stop_ && handles_.size() >= config_.target) {
      lock.unlock();
      refresh_free_bytes();
      lock.lock();
    }
  }
}

void PagePool::shutdown() {
  std::vector<PhysHandle> to_release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable() && handles_.empty()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    to_release.swap(handles_);
    ready_count_.store(0, std::memory_order_relaxed);
  }
  for (PhysHandle h : to_release) backend_->release(h, config_.handle_bytes);
}

}  // namespace kvcached
