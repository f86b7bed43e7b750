// HostBudget: a bounded "host device" shared by every process on the machine that uses the same ledger
// file, so CPU-only engines share one host-memory budget the way GPU engines share one device.
//
// The ledger is a small owner-only file of per-process slots (pid, start time, bytes held). A charge sums
// the slots of live processes under an exclusive file lock; slots of dead processes (SIGKILLed owners
// included) count as zero and are reclaimed, so a crash never leaks budget. A damaged ledger fails safe:
// claims beyond every integer saturate, and a ledger truncated under a running process stops its charges.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/sigbus_guard.h"

namespace kvcached {

class HostBudget {
 public:
  // Opens (creating if needed) the ledger at `path` and claims a slot for this process.
  // `capacity_bytes` is this process's view of the device size. Throws BackendError.
  HostBudget(const std::string& path, std::size_t capacity_bytes);
  ~HostBudget();
  HostBudget(const HostBudget&) = delete;
  HostBudget& operator=(const HostBudget&) = delete;

  // Takes `bytes` from the budget; false when live processes already hold too much.
  bool try_charge(std::size_t bytes);
  void uncharge(std::size_t bytes) noexcept;

  std::size_t capacity() const noexcept { return capacity_; }
  // Bytes held by all live processes (takes the file lock; not for the hot path).
  std::size_t used_total();

 private:
  struct Slot;
  struct Ledger;
  std::size_t live_total_locked();

  std::string path_;
  std::size_t capacity_;
  int fd_ = -1;
  Ledger* ledger_ = nullptr;
  Slot* mine_ = nullptr;
  // A ledger truncated under us reads as zeros from then on: charges are refused (never grant memory the
  // ledger cannot account for); what is held stays held until it is freed.
  std::unique_ptr<SigbusGuard> guard_;
};

}  // namespace kvcached
