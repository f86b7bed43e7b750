#include "backend/cuda_backend.h"

#include "backend/cuda_driver.h"
#include "common/errors.h"

namespace kvcached {

namespace {
const CudaDriver& drv() { return CudaDriver::get(); }
}  // namespace

CudaBackend::CudaBackend(int device_index) : index_(device_index) {
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
    throw BackendError("CUDA device " + std::to_string(device_index) +
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
}

CudaBackend::~CudaBackend() {
  if (context_ != nullptr) drv().cuDevicePrimaryCtxRelease(device_);
}

void CudaBackend::make_current() const {
  // Driver calls act on the calling thread's current context; the pool thread and engine threads differ.
  CUcontext current = nullptr;
  drv().cuCtxGetCurrent(&current);
  if (current != context_) KVCACHED_CU(drv().cuCtxSetCurrent(context_));
}

std::uintptr_t CudaBackend::reserve(std::size_t bytes) {
  make_current();
  CUdeviceptr ptr = 0;
  KVCACHED_CU(drv().cuMemAddressReserve(&ptr, bytes, granularity_, 0, 0));
  return static_cast<std::uintptr_t>(ptr);
}

void CudaBackend::free_reservation(std::uintptr_t base, std::size_t bytes) noexcept {
  drv().cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes);
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
  const CUdeviceptr ptr = static_cast<CUdeviceptr>(addr);
  KVCACHED_CU(drv().cuMemMap(ptr, bytes, 0, static_cast<CUmemGenericAllocationHandle>(handle), 0));
  CUresult rc = drv().cuMemSetAccess(ptr, bytes, &access_, 1);
  if (rc != CUDA_SUCCESS) {
    drv().cuMemUnmap(ptr, bytes);  // leave nothing half-mapped
    KVCACHED_CU(rc);
  }
}

void CudaBackend::unmap(std::uintptr_t addr, std::size_t bytes) {
  make_current();
  KVCACHED_CU(drv().cuMemUnmap(static_cast<CUdeviceptr>(addr), bytes));
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
  const std::size_t free = mem_info().free_bytes;
  return free > kDriverReserve ? free - kDriverReserve : 0;
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
