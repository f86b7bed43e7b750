// The driver floor of making one page usable, measured with bare driver calls on the same machine and in
// the same run as the allocator, so benchmarks report a ratio against it rather than against a number
// measured elsewhere.
#pragma once

#include <cstddef>
#include <vector>

namespace kvcached {

struct DriverFloor {
  std::vector<double> create_us, map_us, set_access_us, unmap_us, release_us;  // one sample per page
};

// Creates, maps, sets access on, unmaps and releases `iterations` pages of `page_bytes` on `device_index`,
// timing each call. Throws BackendError.
DriverFloor measure_cuda_driver_floor(int device_index, std::size_t page_bytes, int iterations);

}  // namespace kvcached
