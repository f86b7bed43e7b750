// SigbusGuard: survive shared file mappings that another process truncates.
//
// Control segments, the host budget ledger and page tables are files in the runtime directory mapped
// MAP_SHARED. Any process of the user can truncate such a file; touching a mapped page past its new end
// raises SIGBUS, which would kill the engine. For a range registered here, the handler maps private zero
// pages over the range instead (the faulting access is retried and lands there) and marks it damaged, so
// its user stops trusting it: the ledger refuses further charges, a control segment is recreated, a reader
// reports the file as changed. A SIGBUS anywhere else goes to the handler installed before (or the default
// action), as if this guard did not exist.
#pragma once

#include <cstddef>

namespace kvcached {

class SigbusGuard {
 public:
  // Guards [addr, addr + bytes) until destroyed. Throws std::runtime_error when every slot is taken.
  SigbusGuard(void* addr, std::size_t bytes);
  ~SigbusGuard();
  SigbusGuard(const SigbusGuard&) = delete;
  SigbusGuard& operator=(const SigbusGuard&) = delete;

  // Whether the range was hit past its file's end (its contents are private zeros from then on).
  bool damaged() const noexcept;

 private:
  int slot_;
};

}  // namespace kvcached
