#include "backend/cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

#include "common/errors.h"

namespace kvcached {

namespace {
// cuda.h maps many names to versioned symbols (cuMemGetInfo -> cuMemGetInfo_v2): expand before quoting
// so we look up the same symbol the header declares.
#define KVCACHED_STR2(x) #x
#define KVCACHED_STR(x) KVCACHED_STR2(x)

struct Loaded {
  CudaDriver driver;
  std::string error;
};

Loaded load() {
  Loaded out;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out.error = std::string("no CUDA driver: dlopen(libcuda.so.1) failed: ") + (why ? why : "unknown error");
    return out;
  }
#define KVCACHED_LOAD_CALL(name)                                                         \
  out.driver.name = reinterpret_cast<decltype(&::name)>(dlsym(lib, KVCACHED_STR(name))); \
  if (out.driver.name == nullptr) {                                                      \
    out.error = "CUDA driver too old: it lacks " KVCACHED_STR(name);                     \
    return out;                                                                          \
  }
  KVCACHED_CUDA_DRIVER_CALLS(KVCACHED_LOAD_CALL)
#undef KVCACHED_LOAD_CALL
  CUresult rc = out.driver.cuInit(0);
  if (rc != CUDA_SUCCESS) {
    const char* text = nullptr;
    out.driver.cuGetErrorString(rc, &text);
    out.error = std::string("cuInit failed: ") + (text ? text : "unknown error");
  }
  return out;
}

const Loaded& loaded() {
  static const Loaded instance = load();  // thread-safe, once per process
  return instance;
}
}  // namespace

const CudaDriver& CudaDriver::get() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw BackendError(l.error, -1);
  return l.driver;
}

std::string CudaDriver::unavailable_reason() {
  const Loaded& l = loaded();
  if (!l.error.empty()) return l.error;
  int count = 0;
  if (l.driver.cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) return "no CUDA device found";
  return "";
}

void cuda_check(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return;
  const char* text = nullptr;
  const Loaded& l = loaded();
  if (l.driver.cuGetErrorString != nullptr) l.driver.cuGetErrorString(result, &text);
  throw BackendError(std::string(call) + " failed: " + (text ? text : "unknown CUDA error") + " (CUresult " +
                         std::to_string(static_cast<int>(result)) + ")",
                     static_cast<int>(result));
}

}  // namespace kvcached
