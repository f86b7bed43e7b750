#include "control/segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/errors.h"
#include "common/process.h"

namespace kvcached {

namespace {

std::uint64_t unix_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

void copy_text(char* dst, std::size_t cap, const std::string& src) {
  std::memset(dst, 0, cap);
  std::memcpy(dst, src.data(), std::min(src.size(), cap - 1));
}

// Shared (not private) futex: the word lives in a file mapping seen by several processes.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, int timeout_ms) {
  struct timespec ts{};
  ts.tv_sec = timeout_ms / 1000;
  ts.tv_nsec = static_cast<long>(timeout_ms % 1000) * 1000000L;
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

std::string text_field(const char* field, std::size_t cap, const std::string& path, const char* name) {
  const void* end = std::memchr(field, 0, cap);
  if (end == nullptr) throw SegmentError(path + ": corrupt segment (" + name + " is not terminated)");
  return std::string(field);
}

// Opens and maps a segment for a reader, checking everything a foreign or broken file could get wrong.
struct MappedSegment {
  int fd = -1;
  SegmentLayout* seg = nullptr;
  std::unique_ptr<SigbusGuard> guard;  // the file may be truncated while we read it
  // A file truncated while it was read or written: what was read is not the owner's.
  void check_intact(const std::string& path) const {
    if (guard && guard->damaged()) throw SegmentError(path + ": changed size while it was read; try again");
  }
  ~MappedSegment() {
    guard.reset();
    if (seg != nullptr) munmap(seg, sizeof(SegmentLayout));
    if (fd >= 0) ::close(fd);
  }
};

void open_segment(const std::string& path, bool writable, MappedSegment& out) {
  out.fd = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (out.fd < 0) {
    if (errno == ENOENT) throw SegmentError(path + ": gone (its owner closed it)");
    throw SegmentError(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st{};
  if (fstat(out.fd, &st) != 0 || !S_ISREG(st.st_mode)) throw SegmentError(path + ": not a regular file");
  if (st.st_uid != geteuid())
    throw SegmentError(path + ": owned by uid " + std::to_string(st.st_uid) + ", not by you; not a segment of yours");
  if (st.st_mode & 077)
    throw SegmentError(path + ": open to other users (mode " + std::to_string(st.st_mode & 0777) + "); refusing it");
  if (static_cast<std::size_t>(st.st_size) < sizeof(SegmentLayout))
    throw SegmentError(path + ": truncated (" + std::to_string(st.st_size) + " bytes; a segment has " +
                       std::to_string(sizeof(SegmentLayout)) + ")");
  void* mem =
      mmap(nullptr, sizeof(SegmentLayout), writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, out.fd, 0);
  if (mem == MAP_FAILED) throw SegmentError(path + ": cannot map: " + std::strerror(errno));
  out.seg = static_cast<SegmentLayout*>(mem);
  out.guard = std::make_unique<SigbusGuard>(mem, sizeof(SegmentLayout));
  if (out.seg->magic != kSegmentMagic) throw SegmentError(path + ": not a kvcached segment (bad magic)");
  if (out.seg->layout_version != kSegmentLayoutVersion || out.seg->layout_bytes != sizeof(SegmentLayout))
    throw SegmentError(path + ": segment layout version " + std::to_string(out.seg->layout_version) +
                       ", this kvcached reads version " + std::to_string(kSegmentLayoutVersion) +
                       "; use the kvctl of the kvcached that wrote it");
}

}  // namespace

// ---- owner side -------------------------------------------------------------------------------------

ControlSegment::ControlSegment(const std::string& path, const SegmentIdentity& identity,
                               std::shared_ptr<BlockAllocator> allocator, int poll_ms)
    : path_(path),
      identity_(identity),
      created_unix_ns_(unix_ns()),
      allocator_(std::move(allocator)),
      poll_ms_(poll_ms > 0 ? poll_ms : 10) {
  SegmentLayout* seg = create_file();
  seg_.store(seg, std::memory_order_release);
  // `seen` is fixed here, not when the thread first runs: a request that arrives before the thread is
  // scheduled must still count as new.
  const std::uint32_t seen = seg->request_seq.load(std::memory_order_acquire);
  watcher_ = std::thread([this, seen] { run(seen); });
}

SegmentLayout* ControlSegment::create_file() {
  // Build the file under a temporary name and rename it into place: readers never see a half-written one.
  const std::string tmp = path_ + ".tmp";
  int fd = open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw BackendError("cannot create control segment " + tmp + ": " + std::strerror(errno), errno);
  if (ftruncate(fd, sizeof(SegmentLayout)) != 0) {
    const int err = errno;
    ::close(fd);
    unlink(tmp.c_str());
    throw BackendError("cannot size control segment " + tmp + ": " + std::strerror(err), err);
  }
  struct stat st{};
  void* mem = fstat(fd, &st) == 0 ? mmap(nullptr, sizeof(SegmentLayout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                                  : MAP_FAILED;
  ::close(fd);
  if (mem == MAP_FAILED) {
    const int err = errno;
    unlink(tmp.c_str());
    throw BackendError("cannot map control segment " + tmp + ": " + std::strerror(err), err);
  }
  auto guard = std::make_unique<SigbusGuard>(mem, sizeof(SegmentLayout));
  auto* seg = new (mem) SegmentLayout();  // zero-initialized atomics
  const AllocatorConfig& c = allocator_->config();
  seg->layout_version = kSegmentLayoutVersion;
  seg->layout_bytes = sizeof(SegmentLayout);
  seg->owner_pid = static_cast<std::int32_t>(getpid());
  seg->owner_uid = geteuid();
  seg->owner_start_time = process_start_time(static_cast<int>(getpid()));
  seg->created_unix_ns = created_unix_ns_;
  copy_text(seg->engine, sizeof(seg->engine), identity_.engine);
  copy_text(seg->device, sizeof(seg->device), identity_.device);
  copy_text(seg->instance_name, sizeof(seg->instance_name), identity_.instance_name);
  copy_text(seg->pool_name, sizeof(seg->pool_name), identity_.pool_name);
  seg->device_total_bytes = identity_.device_total_bytes;
  seg->virtual_bytes = allocator_->buffer_stride() * static_cast<std::uint64_t>(c.num_buffers);
  seg->page_bytes = allocator_->page_bytes();
  seg->block_bytes = static_cast<std::uint64_t>(c.block_bytes);
  seg->num_buffers = static_cast<std::uint64_t>(c.num_buffers);
  seg->request_limit_bytes.store(BlockAllocator::kNoLimit);
  seg->applied_limit_bytes.store(BlockAllocator::kNoLimit);
  publish_to(seg);
  seg->magic = kSegmentMagic;
  if (rename(tmp.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    guard.reset();
    munmap(mem, sizeof(SegmentLayout));
    unlink(tmp.c_str());
    throw BackendError("cannot publish control segment " + path_ + ": " + std::strerror(err), err);
  }
  guard_ = std::move(guard);
  inode_ = st.st_ino;
  return seg;
}

bool ControlSegment::file_intact() const noexcept {
  struct stat st{};
  return lstat(path_.c_str(), &st) == 0 && st.st_ino == inode_ && S_ISREG(st.st_mode);
}

bool ControlSegment::recreate() noexcept {
  try {
    SegmentLayout* fresh = create_file();
    // The old file's revisions are gone with it; the allocator still knows the limit it applies.
    const AllocatorSnapshot snap = allocator_->snapshot();
    fresh->applied_limit_bytes.store(snap.limit_bytes);
    fresh->applied_revision.store(snap.limit_revision);
    fresh->handled_revision.store(snap.limit_revision);
    SegmentLayout* old = seg_.exchange(fresh, std::memory_order_acq_rel);
    // Another thread may still be publishing into the old mapping: private pages take its place (never
    // unmapped, one page), so whatever becomes of the old file cannot fault that thread.
    mmap(old, sizeof(SegmentLayout), PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return true;
  } catch (const std::exception&) {
    // The directory is gone or a directory sits at path_: keep publishing where we do; retried later.
    return false;
  }
}

ControlSegment::~ControlSegment() { close(); }

void ControlSegment::publish() noexcept {
  SegmentLayout* seg = seg_.load(std::memory_order_acquire);
  if (seg != nullptr) publish_to(seg);
}

void ControlSegment::publish_to(SegmentLayout* seg) noexcept {
  const AllocatorSnapshot s = allocator_->snapshot();
  // A deferred limit turns applied once pages in use have fallen under it.
  const std::uint32_t status = seg->applied_status.load(std::memory_order_relaxed);
  if (status == static_cast<std::uint32_t>(LimitStatus::kDeferred) ||
      status == static_cast<std::uint32_t>(LimitStatus::kApplied)) {
    const std::uint64_t in_use = static_cast<std::uint64_t>(s.used_pages) * seg->page_bytes * seg->num_buffers;
    const bool over = s.limit_bytes != BlockAllocator::kNoLimit && in_use > s.limit_bytes;
    seg->applied_status.store(static_cast<std::uint32_t>(over ? LimitStatus::kDeferred : LimitStatus::kApplied),
                              std::memory_order_relaxed);
  }
  constexpr auto r = std::memory_order_relaxed;
  seg->state_seq.fetch_add(1, std::memory_order_acq_rel);  // odd: writing
  seg->publish_unix_ns.store(unix_ns(), r);
  seg->total_blocks.store(s.total_blocks, r);
  seg->allocated_blocks.store(s.allocated_blocks, r);
  seg->available_blocks.store(s.available_blocks, r);
  seg->mapped_bytes.store(s.mapped_bytes, r);
  seg->used_bytes.store(s.used_bytes, r);
  seg->limit_bytes.store(s.limit_bytes, r);
  seg->limit_revision.store(s.limit_revision, r);
  seg->pool_ready_handles.store(s.pool_ready, r);
  seg->admit_cap_bytes.store(allocator_->admit_cap(), r);
  seg->yield_cap_bytes.store(allocator_->yield_cap(), r);
  const OperationCounters& ops = allocator_->counters();
#define KVCACHED_PUBLISH_COUNTER(name) seg->name.store(ops.name.load(r), r);
  KVCACHED_OPERATION_COUNTERS(KVCACHED_PUBLISH_COUNTER)
#undef KVCACHED_PUBLISH_COUNTER
  seg->state_seq.fetch_add(1, std::memory_order_release);  // even: consistent
}

void ControlSegment::record_limit(const LimitResult& result) noexcept {
  SegmentLayout* seg = seg_.load(std::memory_order_acquire);
  if (seg == nullptr) return;
  seg->applied_limit_bytes.store(result.limit_bytes);
  seg->applied_status.store(static_cast<std::uint32_t>(result.status));
  publish_to(seg);
  // Last, with release: a reader that sees this revision also sees its limit, status and state.
  seg->applied_revision.store(result.revision, std::memory_order_release);
}

LimitResult ControlSegment::set_memory_limit(std::uint64_t limit_bytes, std::optional<std::uint64_t> revision) {
  const LimitResult result = allocator_->set_memory_limit(limit_bytes, revision);
  record_limit(result);
  return result;
}

void ControlSegment::apply_request(std::uint64_t limit, std::uint64_t revision) {
  try {
    record_limit(allocator_->set_memory_limit(limit, revision));
    SegmentLayout* seg = seg_.load(std::memory_order_acquire);
    if (revision > seg->handled_revision.load(std::memory_order_relaxed)) {
      seg->handled_revision.store(revision, std::memory_order_release);  // after the outcome: readers wait on it
    }
  } catch (const std::exception&) {
    // The manager closed under us: nothing left to limit.
  }
}

void ControlSegment::run(std::uint32_t seen) {
  const unsigned checks_every = static_cast<unsigned>(std::max(1, 1000 / poll_ms_));  // about once a second
  unsigned turns = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    SegmentLayout* seg = seg_.load(std::memory_order_acquire);
    futex_wait(&seg->request_seq, seen, poll_ms_);
    if (stop_.load(std::memory_order_acquire)) break;
    // Truncated (the guard saw it), removed or replaced by another process: write the file again.
    if (guard_->damaged() || (++turns % checks_every == 0 && !file_intact())) {
      // A fresh file's request_seq starts at 0, and kvctl may write a request into it as soon as it is in
      // place, before recreate() returns: counting from 0 keeps that request new (reading the sequence now
      // would take it as seen and lose the limit).
      if (recreate()) seen = 0;
      continue;
    }
    const std::uint32_t now = seg->request_seq.load(std::memory_order_acquire);
    if (now != seen && (now & 1u) == 0) {
      const std::uint64_t limit = seg->request_limit_bytes.load(std::memory_order_relaxed);
      const std::uint64_t revision = seg->request_revision.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (seg->request_seq.load(std::memory_order_relaxed) == now) {  // not torn by a newer request
        seen = now;
        apply_request(limit, revision);
        continue;
      }
    }
    publish();
  }
}

void ControlSegment::close() noexcept {
  if (closed_.exchange(true)) return;
  stop_.store(true, std::memory_order_release);
  SegmentLayout* seg = seg_.load(std::memory_order_acquire);
  if (seg != nullptr) {
    seg->request_seq.fetch_add(2, std::memory_order_acq_rel);  // an even bump wakes the watcher at once
    futex_wake_all(&seg->request_seq);
  }
  if (watcher_.joinable()) watcher_.join();
  unlink(path_.c_str());
  seg_.store(nullptr, std::memory_order_release);
  guard_.reset();
  if (seg != nullptr) munmap(seg, sizeof(SegmentLayout));
}

// ---- reader side ------------------------------------------------------------------------------------

SegmentInfo read_segment(const std::string& path) {
  MappedSegment m;
  open_segment(path, false, m);
  const SegmentLayout* s = m.seg;
  SegmentInfo info{};
  info.owner_pid = s->owner_pid;
  info.owner_uid = s->owner_uid;
  info.owner_start_time = s->owner_start_time;
  info.created_unix_ns = s->created_unix_ns;
  info.engine = text_field(s->engine, sizeof(s->engine), path, "engine");
  info.device = text_field(s->device, sizeof(s->device), path, "device");
  info.instance_name = text_field(s->instance_name, sizeof(s->instance_name), path, "instance name");
  info.pool_name = text_field(s->pool_name, sizeof(s->pool_name), path, "pool name");
  info.device_total_bytes = s->device_total_bytes;
  info.virtual_bytes = s->virtual_bytes;
  info.page_bytes = s->page_bytes;
  info.block_bytes = s->block_bytes;
  info.num_buffers = s->num_buffers;
  info.request_limit_bytes = s->request_limit_bytes.load();
  info.request_revision = s->request_revision.load();
  info.handled_revision = s->handled_revision.load(std::memory_order_acquire);  // first: outcomes precede it
  info.applied_revision = s->applied_revision.load(std::memory_order_acquire);
  info.applied_limit_bytes = s->applied_limit_bytes.load();
  info.applied_status = s->applied_status.load();
  constexpr auto r = std::memory_order_relaxed;
  for (int attempt = 0;; ++attempt) {
    const std::uint64_t before = s->state_seq.load(std::memory_order_acquire);
    if ((before & 1u) == 0) {
      info.publish_unix_ns = s->publish_unix_ns.load(r);
      info.total_blocks = s->total_blocks.load(r);
      info.allocated_blocks = s->allocated_blocks.load(r);
      info.available_blocks = s->available_blocks.load(r);
      info.mapped_bytes = s->mapped_bytes.load(r);
      info.used_bytes = s->used_bytes.load(r);
      info.limit_bytes = s->limit_bytes.load(r);
      info.limit_revision = s->limit_revision.load(r);
      info.pool_ready_handles = s->pool_ready_handles.load(r);
      info.admit_cap_bytes = s->admit_cap_bytes.load(r);
      info.yield_cap_bytes = s->yield_cap_bytes.load(r);
#define KVCACHED_READ_COUNTER(name) info.counters.name = s->name.load(r);
      KVCACHED_OPERATION_COUNTERS(KVCACHED_READ_COUNTER)
#undef KVCACHED_READ_COUNTER
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s->state_seq.load(r) == before) break;
    }
    if (attempt > 10000) throw SegmentError(path + ": state never settled (writer stuck mid-update)");
    if (attempt > 100) sched_yield();
  }
  m.check_intact(path);
  return info;
}

void request_limit(const std::string& path, std::uint64_t limit_bytes, std::uint64_t revision) {
  MappedSegment m;
  open_segment(path, true, m);
  // Another process may hold the lock (another kvctl, or anything of this user): wait a bounded time.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (flock(m.fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) throw SegmentError(path + ": cannot lock: " + std::strerror(errno));
    if (std::chrono::steady_clock::now() > deadline) {
      throw SegmentError(path + ": locked by another process for 2 s; nothing was requested");
    }
    usleep(1000);
  }
  SegmentLayout* s = m.seg;
  s->request_seq.fetch_add(1, std::memory_order_acq_rel);  // odd: writing
  s->request_limit_bytes.store(limit_bytes, std::memory_order_relaxed);
  s->request_revision.store(revision, std::memory_order_relaxed);
  s->request_seq.fetch_add(1, std::memory_order_release);  // even: a complete request
  flock(m.fd, LOCK_UN);
  futex_wake_all(&s->request_seq);
  m.check_intact(path);
}

}  // namespace kvcached
