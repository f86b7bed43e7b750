// The DLPack tensor ABI (dmlc/dlpack, unversioned "dltensor" capsules), declared here so the native
// module needs no torch headers: torch.from_dlpack() and numpy.from_dlpack() both consume it.
#pragma once

#include <cstdint>

extern "C" {

struct DLDevice {
  std::int32_t device_type;  // 1 = CPU, 2 = CUDA
  std::int32_t device_id;
};

struct DLDataType {
  std::uint8_t code;  // 1 = unsigned int
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // nullptr = compact row-major
  std::uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // extern "C"
