// The outcome of a memory-limit change: returned by the allocator, recorded in the control segment, and
// turned into Python's {"status": ...} dict once, at the binding.
#pragma once

#include <cstdint>

namespace kvcached {

// Values are stored in control segments: never renumber.
enum class LimitStatus : std::uint32_t {
  kNone = 0,      // no limit was ever set
  kApplied = 1,   // in force
  kDeferred = 2,  // in force, below what is in use: allocation stops until frees bring use under it
  kStale = 3,     // an older revision than the current one: ignored
  kConflict = 4,  // the current revision with another value: ignored
};

inline const char* limit_status_name(LimitStatus status) noexcept {
  switch (status) {
    case LimitStatus::kNone: return "none";
    case LimitStatus::kApplied: return "applied";
    case LimitStatus::kDeferred: return "deferred";
    case LimitStatus::kStale: return "stale";
    case LimitStatus::kConflict: return "conflict";
  }
  return "unknown";
}

struct LimitResult {
  LimitStatus status;
  std::uint64_t limit_bytes;  // the limit in force afterwards (UINT64_MAX: none)
  std::uint64_t revision;     // its revision
};

}  // namespace kvcached
