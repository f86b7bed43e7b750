// Process identity: a pid plus its start time names one process for good, so a pid reused after its
// owner died is never mistaken for that owner. Used for ledgers and shared-memory segments.
#pragma once

#include <cstdint>

namespace kvcached {

// Start time of process `pid` in clock ticks since boot (field 22 of /proc/PID/stat); 0 if unknown.
std::uint64_t process_start_time(int pid);

// True when `pid` runs (not a zombie) and started at `start_time` (0 = do not compare).
bool process_alive(int pid, std::uint64_t start_time);

}  // namespace kvcached
