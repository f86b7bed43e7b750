#include "common/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>

namespace kvcached {

namespace {
constexpr int kSlots = 256;  // segments, ledgers and page tables of one process, and readers in flight

struct Range {
  std::atomic<std::uintptr_t> begin{0};
  std::atomic<std::uintptr_t> end{0};
  std::atomic<bool> damaged{false};
};

Range g_ranges[kSlots];
std::mutex g_slots_mu;  // taking and giving back slots (never in the handler)
struct sigaction g_previous{};
std::once_flag g_installed;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (Range& r : g_ranges) {
    const std::uintptr_t begin = r.begin.load(std::memory_order_acquire);
    const std::uintptr_t end = r.end.load(std::memory_order_acquire);
    if (begin != 0 && addr >= begin && addr < end) {
      // mmap is a plain system call: safe in a signal handler.
      void* p = mmap(reinterpret_cast<void*>(begin), end - begin, PROT_READ | PROT_WRITE,
                     MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p != MAP_FAILED) {
        r.damaged.store(true, std::memory_order_release);
        return;  // the access is retried on the zero pages
      }
    }
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);  // the fault repeats with the default action: the process ends as it would have
}

void install() {
  struct sigaction action{};
  action.sa_sigaction = on_sigbus;
  action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &g_previous);
}
}  // namespace

SigbusGuard::SigbusGuard(void* addr, std::size_t bytes) : slot_(-1) {
  std::call_once(g_installed, install);
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (int i = 0; i < kSlots; ++i) {
    if (g_ranges[i].begin.load(std::memory_order_relaxed) == 0) {
      const auto begin = reinterpret_cast<std::uintptr_t>(addr);
      g_ranges[i].damaged.store(false, std::memory_order_relaxed);
      g_ranges[i].end.store(begin + bytes, std::memory_order_release);
      g_ranges[i].begin.store(begin, std::memory_order_release);
      slot_ = i;
      return;
    }
  }
  throw std::runtime_error("kvcached: more than 256 shared file mappings guarded in one process");
}

SigbusGuard::~SigbusGuard() {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  g_ranges[slot_].begin.store(0, std::memory_order_release);
  g_ranges[slot_].end.store(0, std::memory_order_release);
}

bool SigbusGuard::damaged() const noexcept { return g_ranges[slot_].damaged.load(std::memory_order_acquire); }

}  // namespace kvcached
