#include "pages/page_pool.h"

#include <algorithm>
#include <chrono>

namespace kvcached {

namespace {
std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

PagePool::PagePool(std::shared_ptr<MemoryBackend> backend, const PagePoolConfig& config)
    : backend_(std::move(backend)), config_(config) {
  if (config_.max_pooled < config_.target) config_.max_pooled = config_.target;
  if (config_.target == 0) config_.max_pooled = 0;  // no pool at all: handles are released on give-back
  refresh_free_bytes();
  // Runs even with target 0: the free-memory figure that available_size() reads must keep following the
  // device (other engines take and give back memory), or one miss would hide new pages for good.
  thread_ = std::thread([this] { run(); });
}

PagePool::~PagePool() { shutdown(); }

void PagePool::refresh_free_bytes() {
  std::size_t bytes = 0;
  const std::uint64_t seen = created_.load(std::memory_order_acquire);
  try {
    bytes = backend_->allocatable_bytes();
  } catch (...) {
    return;  // a failed query leaves the previous estimate; the next create reports any real failure
  }
  // A handle created while the device was queried may or may not be in the figure: keep the figure that
  // note_created() already lowered rather than risk counting that handle twice (ready and free).
  std::lock_guard<std::mutex> lock(free_mu_);
  if (created_.load(std::memory_order_relaxed) == seen) free_bytes_.store(bytes, std::memory_order_relaxed);
}

void PagePool::note_created() noexcept {
  // A new handle moves its bytes from "free on the device" to "ours": take them off the cached figure at once,
  // or ready() + cached_free_bytes() would count them twice until the next refresh.
  std::lock_guard<std::mutex> lock(free_mu_);
  const std::size_t free = free_bytes_.load(std::memory_order_relaxed);
  free_bytes_.store(free > config_.handle_bytes ? free - config_.handle_bytes : 0, std::memory_order_relaxed);
  created_.fetch_add(1, std::memory_order_release);
}

std::optional<PhysHandle> PagePool::create_handle() {
  // The cached figure lags other processes' growth by up to one refresh, and a burst maps GiBs in that time:
  // close to the backend's headroom, read the device before each create so as not to eat into it.
  constexpr std::size_t kReadDeviceBelow = std::size_t{4} << 30;
  if (free_bytes_.load(std::memory_order_relaxed) < config_.handle_bytes + kReadDeviceBelow) {
    refresh_free_bytes();
    if (free_bytes_.load(std::memory_order_relaxed) < config_.handle_bytes) return std::nullopt;
  }
  std::optional<PhysHandle> h = backend_->create(config_.handle_bytes);
  if (h) note_created();
  return h;
}

std::optional<PhysHandle> PagePool::take() {
  // No wake-up for the thread: it polls, and refills only once takes have stopped (see the header).
  last_take_ns_.store(now_ns(), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!handles_.empty()) {
      PhysHandle h = handles_.back();
      handles_.pop_back();
      ready_count_.store(handles_.size(), std::memory_order_relaxed);
      return h;
    }
  }
  if (std::optional<PhysHandle> h = create_handle()) return h;
  {
    // The device is full, but the refill thread may hold the last memory in a handle it is creating: wait
    // for it, so a refill never turns into a failed allocation.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !creating_ || stop_; });
    if (!handles_.empty()) {
      PhysHandle pooled = handles_.back();
      handles_.pop_back();
      ready_count_.store(handles_.size(), std::memory_order_relaxed);
      return pooled;
    }
  }
  free_bytes_.store(0, std::memory_order_relaxed);
  return std::nullopt;
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
  const std::int64_t idle_ns = std::int64_t{config_.refill_idle_us} * 1000;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const std::int64_t quiet_ns = now_ns() - last_take_ns_.load(std::memory_order_relaxed);
    const bool short_of_target = handles_.size() < config_.target;
    if (short_of_target && quiet_ns >= idle_ns) {
      creating_ = true;
      lock.unlock();
      std::optional<PhysHandle> h;
      try {
        h = create_handle();
      } catch (...) {
        h.reset();  // a driver error here is reported by the allocation that needs the page
      }
      if (!h) refresh_free_bytes();
      lock.lock();
      creating_ = false;
      cv_.notify_all();  // a take() that found the device full waits for this handle
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
      // The device is full (another engine holds the memory): try again after a pause.
      cv_.wait_for(lock, milliseconds(config_.refresh_ms));
      continue;
    }
    if (short_of_target) {
      cv_.wait_for(lock, nanoseconds(std::max<std::int64_t>(idle_ns - quiet_ns, 100000)));
      continue;
    }
    cv_.wait_for(lock, milliseconds(config_.refresh_ms));
    const std::int64_t quiet_now = now_ns() - last_take_ns_.load(std::memory_order_relaxed);
    if (stop_ || quiet_now < idle_ns) continue;
    std::vector<PhysHandle> extra;
    if (quiet_now >= std::int64_t{config_.release_idle_ms} * 1000000 && handles_.size() > config_.target) {
      extra.assign(handles_.begin() + static_cast<std::ptrdiff_t>(config_.target), handles_.end());
      handles_.resize(config_.target);
      ready_count_.store(handles_.size(), std::memory_order_relaxed);
    }
    lock.unlock();
    for (PhysHandle h : extra) backend_->release(h, config_.handle_bytes);
    refresh_free_bytes();
    lock.lock();
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
