// Python bindings of the native core (module kvcached_core._native).
//
// The hot path (alloc, free, available_size) lives in fast_path.cpp; calls here may block on the driver
// or on other threads, and release the GIL where they do.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/host_backend.h"
#include "bindings/dlpack.h"
#include "bindings/fast_path.h"
#include "blocks/block_allocator.h"
#include "common/errors.h"
#ifdef KVCACHED_WITH_CUDA
#include "backend/cuda_backend.h"
#include "backend/cuda_driver.h"
#include "backend/cuda_floor.h"
#endif

namespace py = pybind11;
using namespace kvcached;

namespace {

// One exported view: keeps the address range reserved until the consumer drops the tensor.
struct ExportedView {
  DLManagedTensor managed{};
  std::int64_t shape[1] = {0};
  std::shared_ptr<Reservation> reservation;
};

void delete_view(DLManagedTensor* self) { delete static_cast<ExportedView*>(self->manager_ctx); }

void capsule_destructor(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and owns it; only an unconsumed one is ours to free.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    managed->deleter(managed);
  }
}

py::object export_bytes(const BlockAllocator& a, std::int64_t buffer, std::int64_t offset, std::int64_t nbytes) {
  if (offset < 0 || nbytes <= 0 || static_cast<std::size_t>(offset + nbytes) > a.buffer_stride())
    throw InvalidArgument("byte range [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                          ") is outside a buffer of " + std::to_string(a.buffer_stride()) + " bytes");
  auto* view = new ExportedView();
  view->reservation = a.reservation();
  view->shape[0] = nbytes;
  DLTensor& t = view->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(a.buffer_address(buffer) + static_cast<std::size_t>(offset));
  t.device = {static_cast<std::int32_t>(a.backend().device_kind()), a.backend().device_index()};
  t.ndim = 1;
  t.dtype = {1, 8, 1};
  t.shape = view->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  view->managed.manager_ctx = view;
  view->managed.deleter = delete_view;
  PyObject* capsule = PyCapsule_New(&view->managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) {
    delete view;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

py::dict snapshot_dict(const BlockAllocator& a) {
  const AllocatorSnapshot s = a.snapshot();
  py::dict d;
  d["total_blocks"] = s.total_blocks;
  d["allocated_blocks"] = s.allocated_blocks;
  d["available_blocks"] = s.available_blocks;
  d["mapped_pages"] = s.mapped_pages;
  d["used_pages"] = s.used_pages;
  d["mapped_bytes"] = s.mapped_bytes;
  d["used_bytes"] = s.used_bytes;
  d["limit_bytes"] = s.limit_bytes == BlockAllocator::kNoLimit ? py::object(py::none()) : py::int_(s.limit_bytes);
  d["limit_revision"] = s.limit_revision;
  d["pool_ready_handles"] = s.pool_ready;
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvcached native core: memory backends, physical page pool, block allocator";

  auto backend_error = py::register_exception<BackendError>(m, "BackendError", PyExc_RuntimeError);
  auto closed_error = py::register_exception<ClosedError>(m, "ClosedError", PyExc_RuntimeError);
  register_fast_path(m.ptr(), closed_error.ptr(), backend_error.ptr());
  if (PyErr_Occurred()) throw py::error_already_set();

  py::class_<MemoryBackend, std::shared_ptr<MemoryBackend>>(m, "MemoryBackend")
      .def_property_readonly("name", &MemoryBackend::name)
      .def_property_readonly("granularity", &MemoryBackend::granularity)
      .def_property_readonly("device_index", &MemoryBackend::device_index)
      .def("mem_info", [](MemoryBackend& b) {
        MemInfo info = b.mem_info();
        return py::make_tuple(info.free_bytes, info.total_bytes);
      }, "(free_bytes, total_bytes) of the device (or of the host budget).");

  py::class_<HostBackend, MemoryBackend, std::shared_ptr<HostBackend>>(m, "HostBackend")
      .def(py::init<const std::string&, std::size_t>(), py::arg("budget_path") = "", py::arg("budget_bytes") = 0);

#ifdef KVCACHED_WITH_CUDA
  py::class_<CudaBackend, MemoryBackend, std::shared_ptr<CudaBackend>>(m, "CudaBackend")
      .def(py::init<int>(), py::arg("device_index"));
  m.def("cuda_unavailable_reason", &CudaDriver::unavailable_reason,
        "Why the CUDA backend cannot be used here, or '' when it can.");
  m.attr("built_with_cuda") = true;
  m.def("_cuda_driver_floor", [](int device_index, std::size_t page_bytes, int iterations) {
        DriverFloor f;
        {
          py::gil_scoped_release release;
          f = measure_cuda_driver_floor(device_index, page_bytes, iterations);
        }
        py::dict d;
        d["cuMemCreate"] = f.create_us;
        d["cuMemMap"] = f.map_us;
        d["cuMemSetAccess"] = f.set_access_us;
        d["cuMemUnmap"] = f.unmap_us;
        d["cuMemRelease"] = f.release_us;
        return d;
      }, py::arg("device_index"), py::arg("page_bytes"), py::arg("iterations"),
      "Per-call microseconds of bare driver calls for `iterations` pages (benchmarks' floor).");
#else
  m.def("cuda_unavailable_reason", [] { return std::string("kvcached-core was built without CUDA headers (cuda.h)"); });
  m.attr("built_with_cuda") = false;
#endif

  py::class_<BlockAllocator, std::shared_ptr<BlockAllocator>>(m, "BlockAllocator")
      .def(py::init([](std::shared_ptr<MemoryBackend> backend, std::int64_t num_blocks, std::int64_t block_bytes,
                       std::int64_t num_buffers, std::int64_t page_bytes, bool reserve_null_block,
                       std::int64_t reserved_pages, std::int64_t reclaim_delay_ms, std::int64_t pool_target,
                       std::int64_t pool_max, bool zero_on_map) {
             AllocatorConfig c;
             c.num_blocks = num_blocks;
             c.block_bytes = block_bytes;
             c.num_buffers = num_buffers;
             c.page_bytes = page_bytes;
             c.reserve_null_block = reserve_null_block;
             c.reserved_pages = reserved_pages;
             c.reclaim_delay_ms = reclaim_delay_ms;
             c.pool_target = pool_target;
             c.pool_max = pool_max;
             c.zero_on_map = zero_on_map;
             return std::make_shared<BlockAllocator>(std::move(backend), c);
           }),
           py::arg("backend"), py::arg("num_blocks"), py::arg("block_bytes"), py::arg("num_buffers"),
           py::arg("page_bytes"), py::arg("reserve_null_block"), py::arg("reserved_pages"),
           py::arg("reclaim_delay_ms"), py::arg("pool_target"), py::arg("pool_max"), py::arg("zero_on_map"),
           py::call_guard<py::gil_scoped_release>())
      .def("_fast_path", [](std::shared_ptr<BlockAllocator> self) {
             PyObject* fp = make_fast_path(std::move(self));
             if (fp == nullptr) throw py::error_already_set();
             return py::reinterpret_steal<py::object>(fp);
           }, "A FastPath object whose alloc/free/available_size are plain CPython methods.")
      .def("_set_memory_limit", [](BlockAllocator& a, std::optional<std::uint64_t> limit,
                                   std::optional<std::uint64_t> revision) {
             LimitResult r = a.set_memory_limit(limit.value_or(BlockAllocator::kNoLimit), revision);
             py::dict d;
             d["status"] = r.status;
             d["limit_bytes"] = r.limit_bytes == BlockAllocator::kNoLimit ? py::object(py::none()) : py::int_(r.limit_bytes);
             d["revision"] = r.revision;
             return d;
           }, py::arg("limit_bytes"), py::arg("revision"))
      .def("trim", &BlockAllocator::trim, py::call_guard<py::gil_scoped_release>(),
           "Unmap every mapped page that holds no allocated block; returns the bytes unmapped.")
      .def("clear", &BlockAllocator::clear, "Free every allocated block (the null block stays reserved).")
      .def("close", &BlockAllocator::close, py::call_guard<py::gil_scoped_release>(),
           "Unmap and release all memory. Idempotent.")
      .def_property_readonly("closed", &BlockAllocator::closed)
      .def("_snapshot", &snapshot_dict)
      .def("_last_error", &BlockAllocator::last_error)
      .def("_export_bytes", &export_bytes, py::arg("buffer"), py::arg("offset"), py::arg("nbytes"))
      .def_property_readonly("page_bytes", &BlockAllocator::page_bytes)
      .def_property_readonly("buffer_stride", &BlockAllocator::buffer_stride)
      .def_property_readonly("_backend_name", [](const BlockAllocator& a) { return a.backend().name(); })
      .def_property_readonly("_device_index", [](const BlockAllocator& a) { return a.backend().device_index(); });
}
