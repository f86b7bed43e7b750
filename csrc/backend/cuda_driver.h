// The CUDA driver, loaded at run time with dlopen("libcuda.so.1"): the native module links neither
// libcuda nor libcudart, so one build installs and imports on machines with and without a GPU.
// Every driver entry point we use is listed once in KVCACHED_CUDA_DRIVER_CALLS.
#pragma once

#include <cuda.h>

#include <string>

namespace kvcached {

#define KVCACHED_CUDA_DRIVER_CALLS(_) \
  _(cuInit)                           \
  _(cuGetErrorString)                 \
  _(cuDeviceGet)                      \
  _(cuDeviceGetCount)                 \
  _(cuDeviceGetAttribute)             \
  _(cuDevicePrimaryCtxRetain)         \
  _(cuDevicePrimaryCtxRelease)        \
  _(cuCtxGetCurrent)                  \
  _(cuCtxSetCurrent)                  \
  _(cuCtxSynchronize)                 \
  _(cuMemGetInfo)                     \
  _(cuMemGetAllocationGranularity)    \
  _(cuMemAddressReserve)              \
  _(cuMemAddressFree)                 \
  _(cuMemCreate)                      \
  _(cuMemRelease)                     \
  _(cuMemMap)                         \
  _(cuMemUnmap)                       \
  _(cuMemSetAccess)                   \
  _(cuMemsetD8)

struct CudaDriver {
#define KVCACHED_DECLARE_CALL(name) decltype(&::name) name = nullptr;
  KVCACHED_CUDA_DRIVER_CALLS(KVCACHED_DECLARE_CALL)
#undef KVCACHED_DECLARE_CALL

  // The loaded driver, initialised with cuInit; throws BackendError naming why it is unusable.
  static const CudaDriver& get();
  // Why get() would throw, or "" when the driver is usable. Never throws.
  static std::string unavailable_reason();
};

// Turns a failed driver call into a BackendError carrying cuGetErrorString's text.
void cuda_check(CUresult result, const char* call);

}  // namespace kvcached

#define KVCACHED_CU(call) ::kvcached::cuda_check((call), #call)
