#include "backend/cuda_backend.h"

#include <algorithm>

#include "backend/cuda_driver.h"
#include "common/errors.h"

namespace kvcached {

namespace {
const CudaDriver& drv() { return CudaDriver::get(); }
}  // namespace

CudaBackend::CudaBackend(int device_index, bool backstop, std::size_t headroom)
    : MemoryBackend(headroom), index_(device_index) {
  const CudaDriver& d = drv();
  int count = 0;
  KVCACHED_CU(d.cuDeviceGetCount(&count));
  if (device_index < 0 || device_index >= count) {
    throw InvalidArgument("CUDA device " + std::to_string(device_index) + " does not exist: this machine has " +
                          std::to_string(count) + " device(s); pick cuda:0..cuda:" + std::to_string(count - 1));
  }
  KVCACHED_CU(d.cuDeviceGet(&device_, device_index));
  int vmm = 0;
  KVCACHED_CU(d.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_));
  if (!vmm) {
    throw BackendError(
        "CUDA device " + std::to_string(device_index) +
            " does not support virtual memory management (cuMemMap); use a newer GPU/driver or device='cpu'",
        -1);
  }
  KVCACHED_CU(d.cuDevicePrimaryCtxRetain(&context_, device_));
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = device_;
  access_.location = prop_.location;
  access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  KVCACHED_CU(d.cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  backstop_ = backstop;
  if (backstop_) backstop_handle(granularity_);  // a device that cannot make one fails here, not at first use
}

CudaBackend::~CudaBackend() {
  // Reservations hold the backend, so none is left that still maps a backstop.
  for (const auto& [unit, handle] : backstops_) drv().cuMemRelease(handle);
  if (context_ != nullptr) drv().cuDevicePrimaryCtxRelease(device_);
}

CUmemGenericAllocationHandle CudaBackend::backstop_handle(std::size_t unit) {
  std::lock_guard<std::mutex> lock(backstop_mu_);
  if (const auto found = backstops_.find(unit); found != backstops_.end()) return found->second;
  const CudaDriver& d = drv();
  make_current();
  CUmemGenericAllocationHandle handle = 0;
  KVCACHED_CU(d.cuMemCreate(&handle, unit, &prop_, 0));
  // Zeroed once through a scratch mapping, so stray reads see zeros rather than old KV bytes.
  CUdeviceptr scratch = 0;
  CUresult rc = d.cuMemAddressReserve(&scratch, unit, granularity_, 0, 0);
  if (rc == CUDA_SUCCESS) {
    rc = d.cuMemMap(scratch, unit, 0, handle, 0);
    if (rc == CUDA_SUCCESS) {
      rc = d.cuMemSetAccess(scratch, unit, &access_, 1);
      if (rc == CUDA_SUCCESS) rc = d.cuMemsetD8(scratch, 0, unit);
      if (rc == CUDA_SUCCESS) rc = d.cuCtxSynchronize();
      d.cuMemUnmap(scratch, unit);
    }
    d.cuMemAddressFree(scratch, unit);
  }
  if (rc != CUDA_SUCCESS) {
    d.cuMemRelease(handle);
    KVCACHED_CU(rc);
  }
  backstops_.emplace(unit, handle);
  return handle;
}

void CudaBackend::fill_backstop(CUdeviceptr addr, std::size_t bytes, std::size_t unit) {
  const CudaDriver& d = drv();
  const CUmemGenericAllocationHandle handle = backstop_handle(unit);
  std::size_t done = 0;
  CUresult rc = CUDA_SUCCESS;
  for (; done < bytes; done += unit) {
    rc = d.cuMemMap(addr + done, unit, 0, handle, 0);
    if (rc != CUDA_SUCCESS) break;
  }
  if (rc == CUDA_SUCCESS) rc = d.cuMemSetAccess(addr, bytes, &access_, 1);
  if (rc != CUDA_SUCCESS) {
    for (std::size_t off = 0; off < done; off += unit) d.cuMemUnmap(addr + off, unit);
    KVCACHED_CU(rc);
  }
}

void CudaBackend::make_current() const {
  // Driver calls act on the calling thread's current context; the pool thread and engine threads differ.
  CUcontext current = nullptr;
  drv().cuCtxGetCurrent(&current);
  if (current != context_) KVCACHED_CU(drv().cuCtxSetCurrent(context_));
}

std::uintptr_t CudaBackend::reserve(std::size_t bytes, std::size_t unit) {
  if (unit == 0 || unit % granularity_ != 0 || bytes % unit != 0)
    throw InvalidArgument("a reservation's page size must be a multiple of " + std::to_string(granularity_) +
                          " bytes that divides its size");
  make_current();
  CUdeviceptr ptr = 0;
  KVCACHED_CU(drv().cuMemAddressReserve(&ptr, bytes, granularity_, 0, 0));
  if (backstop_) {
    try {
      fill_backstop(ptr, bytes, unit);
    } catch (...) {
      drv().cuMemAddressFree(ptr, bytes);
      throw;
    }
  }
  return static_cast<std::uintptr_t>(ptr);
}

void CudaBackend::free_reservation(std::uintptr_t base, std::size_t bytes, std::size_t unit) noexcept {
  const CUdeviceptr ptr = static_cast<CUdeviceptr>(base);
  if (backstop_ && drv().cuMemUnmap(ptr, bytes) != CUDA_SUCCESS) {
    // A page left without any mapping (a failed refill) makes the range call fail: go one by one.
    for (std::size_t off = 0; off < bytes; off += unit) drv().cuMemUnmap(ptr + off, unit);
  }
  drv().cuMemAddressFree(ptr, bytes);
}

std::optional<PhysHandle> CudaBackend::create(std::size_t bytes) {
  make_current();
  CUmemGenericAllocationHandle handle = 0;
  CUresult rc = drv().cuMemCreate(&handle, bytes, &prop_, 0);
  if (rc == CUDA_ERROR_OUT_OF_MEMORY) return std::nullopt;  // another engine holds the memory: capacity miss
  KVCACHED_CU(rc);
  return static_cast<PhysHandle>(handle);
}

void CudaBackend::map(std::uintptr_t addr, std::size_t bytes, PhysHandle handle) {
  make_current();
  const CudaDriver& d = drv();
  const CUdeviceptr ptr = static_cast<CUdeviceptr>(addr);
  if (backstop_) KVCACHED_CU(d.cuMemUnmap(ptr, bytes));
  CUresult rc = d.cuMemMap(ptr, bytes, 0, static_cast<CUmemGenericAllocationHandle>(handle), 0);
  if (rc == CUDA_SUCCESS) {
    rc = d.cuMemSetAccess(ptr, bytes, &access_, 1);
    if (rc != CUDA_SUCCESS) d.cuMemUnmap(ptr, bytes);  // leave nothing half-mapped
  }
  if (rc != CUDA_SUCCESS) {
    if (backstop_) {
      try {
        fill_backstop(ptr, bytes, bytes);
      } catch (const BackendError&) {
        // the range stays unmapped; the map error below is the one the caller needs
      }
    }
    KVCACHED_CU(rc);
  }
}

void CudaBackend::unmap(std::uintptr_t addr, std::size_t bytes) {
  make_current();
  const CUdeviceptr ptr = static_cast<CUdeviceptr>(addr);
  KVCACHED_CU(drv().cuMemUnmap(ptr, bytes));
  if (backstop_) fill_backstop(ptr, bytes, bytes);  // a page is unmapped whole: its backstop is one handle
}

void CudaBackend::release(PhysHandle handle, std::size_t) noexcept {
  drv().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle));
}

void CudaBackend::fence() {
  make_current();
  KVCACHED_CU(drv().cuCtxSynchronize());
}

std::size_t CudaBackend::allocatable_bytes() {
  // The driver refuses the last few MiB that cuMemGetInfo reports free (3.1 MiB on an H200, whatever the
  // number of mappings: benchmarks/gpu/probe_margin.py). Engines admit work from this figure, so it must not
  // promise a page that cuMemCreate then refuses.
  constexpr std::size_t kDriverReserve = 8u << 20;
  const std::size_t keep = std::max(kDriverReserve, headroom());
  const std::size_t free = mem_info().free_bytes;
  return free > keep ? free - keep : 0;
}

void CudaBackend::zero(std::uintptr_t addr, std::size_t bytes) {
  make_current();
  KVCACHED_CU(drv().cuMemsetD8(static_cast<CUdeviceptr>(addr), 0, bytes));
}

MemInfo CudaBackend::mem_info() {
  make_current();
  MemInfo info;
  KVCACHED_CU(drv().cuMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

}  // namespace kvcached
