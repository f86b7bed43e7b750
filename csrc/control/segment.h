// Control segments (layout in segment_layout.h).
//
// ControlSegment is the owner's side: it creates the file for one manager, publishes the manager's state,
// and runs a watcher thread that applies limit requests within the poll interval (at once when the
// requester's futex wake arrives). read_segment() and request_limit() are the readers' side (kvctl, kvtop).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "blocks/block_allocator.h"
#include "common/errors.h"
#include "common/sigbus_guard.h"
#include "control/segment_layout.h"

namespace kvcached {

struct SegmentIdentity {
  std::string engine;
  std::string device;
  std::string instance_name;
  std::string pool_name;
  std::uint64_t device_total_bytes = 0;
};

class ControlSegment {
 public:
  // Creates `path` (mode 0600; it must not exist), publishes once and starts the watcher.
  ControlSegment(const std::string& path, const SegmentIdentity& identity, std::shared_ptr<BlockAllocator> allocator,
                 int poll_ms);
  ~ControlSegment();
  ControlSegment(const ControlSegment&) = delete;
  ControlSegment& operator=(const ControlSegment&) = delete;

  // Writes the allocator's current state (seqlock; lock-free reads of the allocator's counters).
  void publish() noexcept;
  // Sets a limit on the allocator in-process and records the outcome, so kvctl sees it and picks a later
  // revision.
  LimitResult set_memory_limit(std::uint64_t limit_bytes, std::optional<std::uint64_t> revision);
  // Stops the watcher, removes the file and unmaps it. Idempotent.
  void close() noexcept;
  const std::string& path() const noexcept { return path_; }

 private:
  void run(std::uint32_t seen);
  void publish_to(SegmentLayout* seg) noexcept;
  void apply_request(std::uint64_t limit, std::uint64_t revision);
  void record_limit(const LimitResult& result) noexcept;
  // Builds the file under a temporary name, publishes once and renames it to path_; returns its mapping.
  SegmentLayout* create_file();
  // The file was truncated, removed or replaced under us: write it again at path_. False where it could not
  // be written (the old mapping stays; retried later).
  bool recreate() noexcept;
  // Whether path_ is still the file we map (checked about once a second by the watcher).
  bool file_intact() const noexcept;

  std::string path_;
  SegmentIdentity identity_;
  std::uint64_t created_unix_ns_;
  std::shared_ptr<BlockAllocator> allocator_;
  std::atomic<SegmentLayout*> seg_{nullptr};
  std::unique_ptr<SigbusGuard> guard_;
  ino_t inode_ = 0;  // of the file at path_ we map: another file renamed over it, or none, is noticed
  int poll_ms_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> closed_{false};
  std::thread watcher_;
};

// Everything a reader needs from one segment, read consistently.
struct SegmentInfo {
  std::int32_t owner_pid;
  std::uint32_t owner_uid;
  std::uint64_t owner_start_time;
  std::uint64_t created_unix_ns;
  std::string engine, device, instance_name, pool_name;
  std::uint64_t device_total_bytes, virtual_bytes, page_bytes, block_bytes, num_buffers;
  std::uint64_t request_limit_bytes, request_revision;
  std::uint64_t applied_limit_bytes, applied_revision, handled_revision;
  std::uint32_t applied_status;
  std::uint64_t publish_unix_ns;
  std::int64_t total_blocks, allocated_blocks, available_blocks;
  std::uint64_t mapped_bytes, used_bytes, limit_bytes, limit_revision;
  std::int64_t pool_ready_handles;
  std::uint64_t admit_cap_bytes, yield_cap_bytes;
  struct Counters {
#define KVCACHED_INFO_COUNTER(name) std::uint64_t name = 0;
    KVCACHED_OPERATION_COUNTERS(KVCACHED_INFO_COUNTER)
#undef KVCACHED_INFO_COUNTER
  } counters;
};

// Reads and validates the segment at `path`. Throws SegmentError naming what is wrong with the file.
SegmentInfo read_segment(const std::string& path);

// Asks the owner of `path` to apply `limit_bytes` (UINT64_MAX = none) under `revision`, and wakes it.
void request_limit(const std::string& path, std::uint64_t limit_bytes, std::uint64_t revision);

}  // namespace kvcached
