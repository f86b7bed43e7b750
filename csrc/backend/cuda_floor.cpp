#include "backend/cuda_floor.h"

#include <chrono>

#include "backend/cuda_driver.h"

namespace kvcached {

namespace {
template <typename F>
double time_us(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

DriverFloor measure_cuda_driver_floor(int device_index, std::size_t page_bytes, int iterations) {
  const CudaDriver& d = CudaDriver::get();
  CUdevice dev = 0;
  KVCACHED_CU(d.cuDeviceGet(&dev, device_index));
  CUcontext ctx = nullptr;
  KVCACHED_CU(d.cuDevicePrimaryCtxRetain(&ctx, dev));
  KVCACHED_CU(d.cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr base = 0;
  const std::size_t span = page_bytes * static_cast<std::size_t>(iterations);
  KVCACHED_CU(d.cuMemAddressReserve(&base, span, page_bytes, 0, 0));
  DriverFloor out;
  std::vector<CUmemGenericAllocationHandle> handles(static_cast<std::size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    auto& h = handles[static_cast<std::size_t>(i)];
    out.create_us.push_back(time_us([&] { KVCACHED_CU(d.cuMemCreate(&h, page_bytes, &prop, 0)); }));
  }
  for (int i = 0; i < iterations; ++i) {
    const CUdeviceptr ptr = base + static_cast<std::size_t>(i) * page_bytes;
    const auto h = handles[static_cast<std::size_t>(i)];
    out.map_us.push_back(time_us([&] { KVCACHED_CU(d.cuMemMap(ptr, page_bytes, 0, h, 0)); }));
    out.set_access_us.push_back(time_us([&] { KVCACHED_CU(d.cuMemSetAccess(ptr, page_bytes, &access, 1)); }));
  }
  for (int i = 0; i < iterations; ++i) {
    const CUdeviceptr ptr = base + static_cast<std::size_t>(i) * page_bytes;
    out.unmap_us.push_back(time_us([&] { KVCACHED_CU(d.cuMemUnmap(ptr, page_bytes)); }));
  }
  for (auto h : handles) out.release_us.push_back(time_us([&] { KVCACHED_CU(d.cuMemRelease(h)); }));
  d.cuMemAddressFree(base, span);
  d.cuDevicePrimaryCtxRelease(dev);
  return out;
}

}  // namespace kvcached
