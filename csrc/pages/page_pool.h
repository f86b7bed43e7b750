// PagePool: physical handles created ahead of need, so making a page usable costs map + access only.
//
// A background thread keeps `target` handles ready (0: nothing is created ahead and every take() creates;
// the thread then only keeps the cached free-memory figure current).
// It refills only once no handle has been taken for `refill_idle_us`: the driver serializes VMM calls, so
// a cuMemCreate running beside a burst of mappings would slow each of them by its own cost.
// Handles given back beyond `max_pooled` are released to the device, and once no handle has been taken for
// `release_idle_ms` the pool shrinks back to `target`: an idle engine keeps no more than it promised. The thread is
// pure C++: it never touches the Python interpreter, so it cannot deadlock with the GIL.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "backend/memory_backend.h"

namespace kvcached {

struct PagePoolConfig {
  std::size_t handle_bytes = 0;  // size of every handle (the allocator's physical page size)
  std::size_t target = 0;        // ready handles the thread keeps; 0 = none created ahead
  std::size_t max_pooled = 0;    // bound on handles kept; extras are released
  int refresh_ms = 20;           // how often the cached free-memory figure is refreshed
  int refill_idle_us = 1000;     // quiet time after the last take() before the thread creates handles
  int release_idle_ms = 1000;    // quiet time after which handles beyond `target` are released
};

class PagePool {
 public:
  PagePool(std::shared_ptr<MemoryBackend> backend, const PagePoolConfig& config);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A ready handle, or one created now; nullopt when the device is out of physical memory.
  std::optional<PhysHandle> take();
  // Returns a valid, unmapped handle (one that still holds memory) for reuse; released if the pool is full.
  void give_back(PhysHandle handle);

  // Handles that take() could return without creating (atomic read, never blocks).
  std::size_t ready() const noexcept { return ready_count_.load(std::memory_order_relaxed); }
  // Memory the device could still give (MemoryBackend::allocatable_bytes), as last read by the pool
  // thread or zeroed by the last create failure.
  std::size_t cached_free_bytes() const noexcept { return free_bytes_.load(std::memory_order_relaxed); }
  // Re-reads free memory now (driver call). For callers off the hot path.
  void refresh_free_bytes();
  void note_created() noexcept;

  // Stops the thread and releases every pooled handle. Idempotent.
  void shutdown();

  const PagePoolConfig& config() const noexcept { return config_; }

 private:
  void run();
  // A new handle, or nullopt when the device has no memory above the backend's headroom.
  std::optional<PhysHandle> create_handle();

  std::shared_ptr<MemoryBackend> backend_;
  PagePoolConfig config_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<PhysHandle> handles_;
  std::atomic<std::size_t> ready_count_{0};
  std::atomic<std::size_t> free_bytes_{0};
  std::mutex free_mu_;                     // orders refresh_free_bytes() against note_created()
  std::atomic<std::uint64_t> created_{0};  // handles created so far
  std::atomic<std::int64_t> last_take_ns_{0};
  bool stop_ = false;
  bool creating_ = false;  // the refill thread is creating a handle outside mu_ (guarded by mu_)
  std::thread thread_;
};

}  // namespace kvcached
