// Cumulative operation counters of one pool, and its last error.
//
// KVCACHED_OPERATION_COUNTERS is the one list of counter names: the struct, the Python snapshot and
// kvcached_core.capabilities() are all generated from it. Every counter is written only while the
// allocator lock is held, so an increment is a relaxed load and store (no locked instruction on the hot
// path); readers copy them without the lock. Built with KVCACHED_NO_COUNTERS, counting compiles to nothing
// (benchmarks/operation_counters.py measures the difference).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace kvcached {

#define KVCACHED_OPERATION_COUNTERS(_)                                                                 \
  /* the alloc/free path touches only these five: they share one cache line */                         \
  _(allocation_requests_total)      /* alloc() calls with a valid count, counted before the attempt */ \
  _(allocation_successes_total)     /* alloc() calls that returned blocks */                           \
  _(allocated_blocks_total)         /* blocks handed out by successful alloc() calls */                \
  _(free_requests_total)            /* free() calls that freed blocks */                               \
  _(freed_blocks_total)             /* blocks freed by callers */                                      \
  _(allocation_failures_total)      /* alloc() calls that returned None (capacity rejections) */       \
  _(capacity_exhausted_total)       /* rejections for virtual, physical or limit capacity */           \
  _(allocation_errors_total)        /* alloc() calls that raised (a driver or mapping error) */        \
  _(manager_page_allocations_total) /* logical pages mapped for the pool */                            \
  _(manager_page_releases_total)    /* logical pages unmapped */                                       \
  _(page_maps_total)                /* backend map calls (one per buffer of a logical page) */         \
  _(page_unmaps_total)              /* backend unmap calls */                                          \
  _(mapping_errors_total)           /* backend map/unmap/fence calls that failed */                    \
  _(resize_requests_total)          /* memory-limit changes asked for (in-process or by kvctl) */      \
  _(resize_errors_total)            /* memory-limit changes refused (stale or conflicting revision) */

struct alignas(64) OperationCounters {
#define KVCACHED_DECLARE_COUNTER(name) std::atomic<std::uint64_t> name{0};
  KVCACHED_OPERATION_COUNTERS(KVCACHED_DECLARE_COUNTER)
#undef KVCACHED_DECLARE_COUNTER
};

// Adds to a counter; the caller holds the allocator lock (the only writer).
inline void count(std::atomic<std::uint64_t>& counter, std::uint64_t n = 1) noexcept {
#ifndef KVCACHED_NO_COUNTERS
  counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
#else
  (void)counter;
  (void)n;
#endif
}

constexpr std::size_t kMaxErrorMessage = 256;

// The last error, published whole: readers see one record or the next, never a mix.
struct ErrorRecord {
  int code = 0;  // the driver's CUresult, an errno, or -1
  std::uint64_t unix_ns = 0;
  std::string message;  // cut to kMaxErrorMessage bytes
};

}  // namespace kvcached
