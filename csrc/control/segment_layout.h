// The binary layout of a control segment: one small owner-only file per live manager, mapped shared by
// its owner (which publishes state and applies limits) and by kvctl/kvtop (which read state and request
// limits). This header is the only definition of the layout; Python reads it through the native module.
//
// Concurrency: identity fields are written once before the file appears (created under a temporary name,
// then renamed). The limit request is a seqlock written by kvctl under an exclusive flock; its sequence
// word is also a futex the owner's watcher sleeps on. Published state is a seqlock written only by the
// owner, so a reader never shows a torn snapshot.
#pragma once

#include <atomic>
#include <cstdint>

#include "blocks/memory_limit.h"
#include "blocks/operation_counters.h"

namespace kvcached {

constexpr std::uint64_t kSegmentMagic = 0x0131474553435654ULL;  // "TVCSEG\x31\x01" little-endian
constexpr std::uint32_t kSegmentLayoutVersion = 3;              // 2: operation counters published; 3: fair share's caps

struct SegmentLayout {
  // -- identity: written once, before the file is visible
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t layout_bytes;  // sizeof(SegmentLayout) of the writer
  std::int32_t owner_pid;
  std::uint32_t owner_uid;
  std::uint64_t owner_start_time;  // clock ticks since boot: tells a reused pid from the owner
  std::uint64_t created_unix_ns;
  char engine[32];
  char device[32];
  char instance_name[128];
  char pool_name[32];
  std::uint64_t device_total_bytes;  // for limits given in percent
  std::uint64_t virtual_bytes;       // address space of the pool: splits an instance limit across pools
  std::uint64_t page_bytes;
  std::uint64_t block_bytes;
  std::uint64_t num_buffers;

  // -- limit request: kvctl -> owner (seqlock; request_seq is the futex word)
  alignas(64) std::atomic<std::uint32_t> request_seq;
  std::uint32_t pad0;
  std::atomic<std::uint64_t> request_limit_bytes;  // UINT64_MAX = no limit
  std::atomic<std::uint64_t> request_revision;

  // -- limit outcome: owner -> readers
  alignas(64) std::atomic<std::uint64_t> applied_limit_bytes;
  std::atomic<std::uint64_t> applied_revision;
  std::atomic<std::uint32_t> applied_status;  // LimitStatus of the last request or in-process call
  std::uint32_t pad1;
  std::atomic<std::uint64_t> handled_revision;  // revision of the last request the owner processed

  // -- published state: owner -> readers (seqlock)
  alignas(64) std::atomic<std::uint64_t> state_seq;
  std::atomic<std::uint64_t> publish_unix_ns;
  std::atomic<std::int64_t> total_blocks;
  std::atomic<std::int64_t> allocated_blocks;
  std::atomic<std::int64_t> available_blocks;
  std::atomic<std::uint64_t> mapped_bytes;
  std::atomic<std::uint64_t> used_bytes;
  std::atomic<std::uint64_t> limit_bytes;
  std::atomic<std::uint64_t> limit_revision;
  std::atomic<std::int64_t> pool_ready_handles;
  std::atomic<std::uint64_t> admit_cap_bytes;  // fair share's caps (UINT64_MAX = none): new requests wait
  std::atomic<std::uint64_t> yield_cap_bytes;  // above the first; no block is handed out above the second
  // The pool's operation counters, in KVCACHED_OPERATION_COUNTERS order: an engine's metrics endpoint in
  // another process (vLLM's API server) reads them here.
#define KVCACHED_SEGMENT_COUNTER(name) std::atomic<std::uint64_t> name;
  KVCACHED_OPERATION_COUNTERS(KVCACHED_SEGMENT_COUNTER)
#undef KVCACHED_SEGMENT_COUNTER
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "segment atomics must be lock-free to share");
static_assert(sizeof(SegmentLayout) % 64 == 0, "segment layout is padded to a cache line");

}  // namespace kvcached
