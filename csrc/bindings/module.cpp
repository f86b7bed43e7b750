// Python bindings of the native core (module kvcached_core._native).
//
// The hot path (alloc, free, available_size) lives in fast_path.cpp; calls here may block on the driver
// or on other threads, and release the GIL where they do.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <unordered_map>
#include <string>
#include <vector>

#include "backend/host_backend.h"
#include "backend/planner_backend.h"
#include "bindings/dlpack.h"
#include "bindings/fast_path.h"
#include "blocks/block_allocator.h"
#include "pages/page_mirror.h"
#include "pages/page_table.h"
#include "common/errors.h"
#include "common/process.h"
#include "control/segment.h"
#include "control/segment_layout.h"
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

// A flat uint8 view of [offset, offset + nbytes) of the region's memory from `address`; the view keeps the
// address range reserved until the consumer drops it.
py::object export_view(const PagedRegion& region, std::uintptr_t address, std::size_t limit, std::int64_t offset,
                       std::int64_t nbytes) {
  if (offset < 0 || nbytes <= 0 || static_cast<std::size_t>(offset + nbytes) > limit)
    throw InvalidArgument("byte range [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                          ") is outside a buffer of " + std::to_string(limit) + " bytes");
  auto* view = new ExportedView();
  const MemoryBackend& backend = region.backend();
  view->reservation = region.reservation();
  view->shape[0] = nbytes;
  DLTensor& t = view->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(address + static_cast<std::size_t>(offset));
  t.device = {static_cast<std::int32_t>(backend.device_kind()), backend.device_index()};
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

// [offset, offset + nbytes) of one buffer.
py::object export_bytes(const PagedRegion& region, std::int64_t buffer, std::int64_t offset, std::int64_t nbytes) {
  return export_view(region, region.buffer_address(buffer), region.buffer_stride(), offset, nbytes);
}

// Every buffer at once: [base, base + num_buffers * buffer_stride), the form of an engine that strides all
// layers over one backing buffer.
py::object export_all(const PagedRegion& region) {
  const std::size_t total = region.buffer_stride() * region.num_buffers();
  return export_view(region, region.buffer_address(0), total, 0, static_cast<std::int64_t>(total));
}

// The memory a view of this allocator would show; only an open allocator that holds its own memory has any.
const PagedRegion& viewable(const BlockAllocator& a) {
  if (a.closed()) throw ClosedError("this KV cache manager is closed: its memory cannot be viewed");
  if (a.backend().name() == "planner")
    throw InvalidArgument("this manager only plans: its memory lives in the workers (use PageMirror there)");
  return a.region();
}

const PagedRegion& viewable(const PageMirror& m) {
  if (m.closed()) throw ClosedError("this page mirror is closed: its memory cannot be viewed");
  return m.region();
}

// One of the allocator's byte caps as a Python property: None is kNoLimit (no cap), both ways.
template <auto Get>
std::optional<std::uint64_t> get_cap(const BlockAllocator& a) {
  const std::uint64_t cap = (a.*Get)();
  return cap == BlockAllocator::kNoLimit ? std::nullopt : std::optional<std::uint64_t>(cap);
}

template <auto Set>
void set_cap(BlockAllocator& a, std::optional<std::uint64_t> cap) {
  (a.*Set)(cap.value_or(BlockAllocator::kNoLimit));
}

// Snapshots are polled by collectors: built with the C API (a quarter of pybind11's per-item cost).
class DictBuilder {
 public:
  DictBuilder() : dict_(PyDict_New()) {
    if (dict_ == nullptr) throw py::error_already_set();
  }
  DictBuilder& set(const char* key, PyObject* value) {  // steals `value`; `key` must be a literal
    if (value == nullptr || PyDict_SetItem(dict_, interned(key), value) != 0) {
      Py_XDECREF(value);
      Py_DECREF(dict_);
      throw py::error_already_set();
    }
    Py_DECREF(value);
    return *this;
  }
  DictBuilder& set(const char* key, std::int64_t v) { return set(key, PyLong_FromLongLong(v)); }
  DictBuilder& set_u(const char* key, std::uint64_t v) { return set(key, PyLong_FromUnsignedLongLong(v)); }
  DictBuilder& set_str(const char* key, const std::string& v) {
    return set(key, PyUnicode_DecodeUTF8(v.data(), static_cast<Py_ssize_t>(v.size()), "replace"));
  }
  DictBuilder& set_limit(const char* key, std::uint64_t v) {
    if (v != BlockAllocator::kNoLimit) return set_u(key, v);
    Py_INCREF(Py_None);
    return set(key, Py_None);
  }
  py::dict done() { return py::reinterpret_steal<py::dict>(dict_); }

 private:
  // Keys are string literals: intern each once, keyed by its address, instead of once per call.
  static PyObject* interned(const char* key) {
    static std::unordered_map<const char*, PyObject*> cache;
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    PyObject* name = PyUnicode_InternFromString(key);  // kept for the life of the process
    cache.emplace(key, name);
    return name;
  }

  PyObject* dict_;
};

py::dict snapshot_dict(const BlockAllocator& a) {
  const AllocatorSnapshot s = a.snapshot();
  return DictBuilder()
      .set("total_blocks", s.total_blocks)
      .set("allocated_blocks", s.allocated_blocks)
      .set("available_blocks", s.available_blocks)
      .set("mapped_pages", s.mapped_pages)
      .set("used_pages", s.used_pages)
      .set_u("mapped_bytes", s.mapped_bytes)
      .set_u("used_bytes", s.used_bytes)
      .set_limit("limit_bytes", s.limit_bytes)
      .set_u("limit_revision", s.limit_revision)
      .set("pool_ready_handles", s.pool_ready)
      .done();
}

py::dict limit_dict(const LimitResult& r) {
  return DictBuilder()
      .set_str("status", limit_status_name(r.status))
      .set_limit("limit_bytes", r.limit_bytes)
      .set_u("revision", r.revision)
      .done();
}

py::tuple counter_names() {
  std::vector<std::string> names;
#define KVCACHED_NAME(name) names.emplace_back(#name);
  KVCACHED_OPERATION_COUNTERS(KVCACHED_NAME)
#undef KVCACHED_NAME
  return py::tuple(py::cast(names));
}

py::dict operation_snapshot(const BlockAllocator& a) {
  const OperationCounters& c = a.counters();
  DictBuilder d;
#define KVCACHED_COPY(name) d.set_u(#name, c.name.load(std::memory_order_relaxed));
  KVCACHED_OPERATION_COUNTERS(KVCACHED_COPY)
#undef KVCACHED_COPY
  const auto error = a.last_error();
  d.set("last_error_code", std::int64_t{error ? error->code : 0});
  if (error) {
    d.set("last_error_time", PyFloat_FromDouble(static_cast<double>(error->unix_ns) / 1e9));
    d.set_str("last_error_message", error->message);
  } else {
    Py_INCREF(Py_None);
    d.set("last_error_time", Py_None);
    d.set("last_error_message", PyUnicode_FromString(""));
  }
  return d.done();
}

py::dict segment_dict(const SegmentInfo& i) {
  DictBuilder counters;
#define KVCACHED_COUNTER_ITEM(name) counters.set_u(#name, i.counters.name);
  KVCACHED_OPERATION_COUNTERS(KVCACHED_COUNTER_ITEM)
#undef KVCACHED_COUNTER_ITEM
  return DictBuilder()
      .set("owner_pid", std::int64_t{i.owner_pid})
      .set_u("owner_uid", i.owner_uid)
      .set_u("owner_start_time", i.owner_start_time)
      .set_u("created_unix_ns", i.created_unix_ns)
      .set_str("engine", i.engine)
      .set_str("device", i.device)
      .set_str("name", i.instance_name)
      .set_str("pool_name", i.pool_name)
      .set_u("device_total_bytes", i.device_total_bytes)
      .set_u("virtual_bytes", i.virtual_bytes)
      .set_u("page_bytes", i.page_bytes)
      .set_u("block_bytes", i.block_bytes)
      .set_u("num_buffers", i.num_buffers)
      .set_limit("request_limit_bytes", i.request_limit_bytes)
      .set_u("request_revision", i.request_revision)
      .set_limit("applied_limit_bytes", i.applied_limit_bytes)
      .set_u("applied_revision", i.applied_revision)
      .set_u("handled_revision", i.handled_revision)
      .set_str("limit_status", limit_status_name(static_cast<LimitStatus>(i.applied_status)))
      .set_u("publish_unix_ns", i.publish_unix_ns)
      .set("total_blocks", i.total_blocks)
      .set("allocated_blocks", i.allocated_blocks)
      .set("available_blocks", i.available_blocks)
      .set_u("mapped_bytes", i.mapped_bytes)
      .set_u("used_bytes", i.used_bytes)
      .set_limit("limit_bytes", i.limit_bytes)
      .set_u("limit_revision", i.limit_revision)
      .set("pool_ready_handles", i.pool_ready_handles)
      .set_limit("admit_cap_bytes", i.admit_cap_bytes)
      .set_limit("yield_cap_bytes", i.yield_cap_bytes)
      .set("counters", counters.done().release().ptr())
      .done();
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvcached native core: memory backends, physical page pool, block allocator";

  auto backend_error = py::register_exception<BackendError>(m, "BackendError", PyExc_RuntimeError);
  auto closed_error = py::register_exception<ClosedError>(m, "ClosedError", PyExc_RuntimeError);
  py::register_exception<SegmentError>(m, "SegmentError", PyExc_ValueError);
  m.attr("OPERATION_COUNTERS") = counter_names();
  m.attr("DEFAULT_PAGE_BYTES") = kDefaultPageBytes;
  // The longest labels a control segment holds (its text fields, less the terminating NUL).
  py::dict text_bytes;
  text_bytes["engine"] = sizeof(SegmentLayout::engine) - 1;
  text_bytes["device"] = sizeof(SegmentLayout::device) - 1;
  text_bytes["name"] = sizeof(SegmentLayout::instance_name) - 1;
  text_bytes["pool_name"] = sizeof(SegmentLayout::pool_name) - 1;
  m.attr("SEGMENT_TEXT_BYTES") = text_bytes;
#ifdef KVCACHED_NO_COUNTERS
  m.attr("counting") = false;
#else
  m.attr("counting") = true;
#endif
  register_fast_path(m.ptr(), closed_error.ptr(), backend_error.ptr());
  if (PyErr_Occurred()) throw py::error_already_set();

  py::class_<MemoryBackend, std::shared_ptr<MemoryBackend>>(m, "MemoryBackend")
      .def_property_readonly("name", &MemoryBackend::name)
      .def_property_readonly("granularity", &MemoryBackend::granularity)
      .def_property_readonly("device_index", &MemoryBackend::device_index)
      .def_property_readonly("headroom", &MemoryBackend::headroom,
                             "Device memory the KV caches leave free for the engines' own allocations.")
      .def("allocatable_bytes", &MemoryBackend::allocatable_bytes,
           "How much more the device can be expected to give: free memory less the headroom.")
      .def(
          "mem_info",
          [](MemoryBackend& b) {
            MemInfo info = b.mem_info();
            return py::make_tuple(info.free_bytes, info.total_bytes);
          },
          "(free_bytes, total_bytes) of the device (or of the host budget).");

  py::class_<HostBackend, MemoryBackend, std::shared_ptr<HostBackend>>(m, "HostBackend")
      .def(py::init<const std::string&, std::size_t, std::size_t>(), py::arg("budget_path") = "",
           py::arg("budget_bytes") = 0, py::arg("headroom") = 0)
      .def("_fail_map_after", &HostBackend::fail_map_after, py::arg("n"),
           "Testing aid: the n-th map from now fails with BackendError (n <= 0 cancels).")
      .def("_fail_unmap_after", &HostBackend::fail_unmap_after, py::arg("n"),
           "Testing aid: the n-th unmap from now fails with BackendError (n <= 0 cancels).");

#ifdef KVCACHED_WITH_CUDA
  py::class_<CudaBackend, MemoryBackend, std::shared_ptr<CudaBackend>>(m, "CudaBackend")
      .def(py::init<int, bool, std::size_t>(), py::arg("device_index"), py::arg("backstop") = false,
           py::arg("headroom") = 0,
           "backstop=True backs every unmapped page with one shared zeroed granule: stray reads see zeros; "
           "headroom: device memory that mapping never takes.")
      .def_property_readonly("backstop", &CudaBackend::backstop);
  m.def("cuda_unavailable_reason", &CudaDriver::unavailable_reason,
        "Why the CUDA backend cannot be used here, or '' when it can.");
  m.attr("built_with_cuda") = true;
  m.def(
      "_cuda_driver_floor",
      [](int device_index, std::size_t page_bytes, int iterations) {
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
      },
      py::arg("device_index"), py::arg("page_bytes"), py::arg("iterations"),
      "Per-call microseconds of bare driver calls for `iterations` pages (benchmarks' floor).");
#else
  m.def("cuda_unavailable_reason", [] {
    return std::string(
        "kvcached-core was built without CUDA (no cuda.h found, or KVCACHED_DISABLE_CUDA set): rebuild it where "
        "the CUDA toolkit's headers are (CUDA_HOME)");
  });
  m.attr("built_with_cuda") = false;
#endif

  py::class_<BlockAllocator, std::shared_ptr<BlockAllocator>>(m, "BlockAllocator")
      .def(py::init([](std::shared_ptr<MemoryBackend> backend, std::int64_t num_blocks, std::int64_t block_bytes,
                       std::int64_t num_buffers, std::int64_t page_bytes, bool reserve_null_block,
                       std::int64_t reserved_pages, std::int64_t reclaim_delay_ms, std::int64_t pool_target,
                       std::int64_t pool_max, bool zero_on_map, std::int64_t map_ahead_pages, bool place_by_request) {
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
             c.map_ahead_pages = map_ahead_pages;
             c.place_by_request = place_by_request;
             return std::make_shared<BlockAllocator>(std::move(backend), c);
           }),
           py::arg("backend"), py::arg("num_blocks"), py::arg("block_bytes"), py::arg("num_buffers"),
           py::arg("page_bytes"), py::arg("reserve_null_block"), py::arg("reserved_pages"), py::arg("reclaim_delay_ms"),
           py::arg("pool_target"), py::arg("pool_max"), py::arg("zero_on_map"), py::arg("map_ahead_pages") = 0,
           py::arg("place_by_request") = false, py::call_guard<py::gil_scoped_release>())
      .def(
          "_fast_path",
          [](std::shared_ptr<BlockAllocator> self) {
            PyObject* fp = make_fast_path(std::move(self));
            if (fp == nullptr) throw py::error_already_set();
            return py::reinterpret_steal<py::object>(fp);
          },
          "A FastPath object whose alloc/free/available_size are plain CPython methods.")
      .def(
          "alloc_past_limit",
          [](BlockAllocator& a, std::int64_t count) -> py::object {
            std::vector<std::int32_t> ids;
            bool ok;
            {
              py::gil_scoped_release release;
              ok = a.alloc(count, ids, /*past_limit=*/true);
            }
            if (!ok) return py::none();
            return py::cast(ids);
          },
          py::arg("count"),
          "alloc() ignoring the memory limit for this call: for an engine that promised blocks before a\n"
          "lower limit arrived. Virtual capacity and physical memory still bound it; None when they cannot.")
      .def(
          "_set_memory_limit",
          [](BlockAllocator& a, std::optional<std::uint64_t> limit, std::optional<std::uint64_t> revision) {
            return limit_dict(a.set_memory_limit(limit.value_or(BlockAllocator::kNoLimit), revision));
          },
          py::arg("limit_bytes"), py::arg("revision"))
      .def_property("yield_cap", &get_cap<&BlockAllocator::yield_cap>, &set_cap<&BlockAllocator::set_yield_cap>,
                    "Bytes this allocator may map while it yields memory to a neighbour (None: no such cap); binds\n"
                    "like the memory limit, which it leaves as set.")
      .def_property(
          "admit_cap", &get_cap<&BlockAllocator::admit_cap>, &set_cap<&BlockAllocator::set_admit_cap>,
          "Bytes above which a plugin that gates admissions admits no new request while a neighbour is short\n"
          "(None: no such cap). Never enforced by the allocator; published for kvctl and kvtop.")
      .def_property("reclaim_delay_ms", &BlockAllocator::reclaim_delay_ms, &BlockAllocator::set_reclaim_delay_ms,
                    "The demand window now: empty pages in use within the last one or two windows stay mapped.\n"
                    "Settable while the allocator runs (a policy lengthens it while no neighbour could use the\n"
                    "pages); a shorter window starts at once.")
      .def("assured_size", &BlockAllocator::assured_size,
           "Blocks alloc() can hand out from pages mapped now, within the memory limit: memory this process\n"
           "holds, which no other process can take (at most available_size()). Lock-free, no driver call.")
      .def("prepare", &BlockAllocator::prepare, py::arg("count"), py::call_guard<py::gil_scoped_release>(),
           "Map pages until `count` blocks are assured (or the limit, virtual capacity or physical memory\n"
           "stops it); returns assured_size(). For a scheduler about to commit to `count` blocks: a device\n"
           "another process filled since kvcached last read it shows as a smaller count, not a refused alloc().")
      .def("trim", &BlockAllocator::trim, py::arg("keep_empty_pages") = 0, py::call_guard<py::gil_scoped_release>(),
           "Unmap every mapped page that holds no allocated block, except `keep_empty_pages` of them (the\n"
           "lowest); returns the bytes unmapped.")
      .def("clear", &BlockAllocator::clear, "Free every allocated block (the null block stays reserved).")
      .def("close", &BlockAllocator::close, py::call_guard<py::gil_scoped_release>(),
           "Unmap and release all memory. Idempotent.")
      .def_property_readonly("closed", &BlockAllocator::closed)
      .def("_snapshot", &snapshot_dict)
      .def("operation_snapshot", &operation_snapshot,
           "Cumulative operation counters and the last error, copied without taking the allocator lock.")
      .def(
          "_export_bytes",
          [](const BlockAllocator& a, std::int64_t buffer, std::int64_t offset, std::int64_t nbytes) {
            return export_bytes(viewable(a), buffer, offset, nbytes);
          },
          py::arg("buffer"), py::arg("offset"), py::arg("nbytes"))
      .def("_export_all", [](const BlockAllocator& a) { return export_all(viewable(a)); })
      .def("_publish_page_table", &BlockAllocator::publish_page_table, py::arg("path"), py::arg("num_layers"),
           py::arg("num_kv_buffers"))
      .def("page_of", &BlockAllocator::page_of_block, py::arg("block"),
           "The page `block` lies on; -1 for a block that straddles two pages, which is never handed out.")
      .def(
          "block_pages", [](const BlockAllocator& a) { return py::cast(a.block_pages()); },
          "page_of() of every block, as a list indexed by block id (one call: a plugin's page bookkeeping).")
      .def_property_readonly("page_bytes", &BlockAllocator::page_bytes)
      .def_property_readonly("buffer_stride", &BlockAllocator::buffer_stride)
      .def_property_readonly("_backend_name", [](const BlockAllocator& a) { return a.backend().name(); })
      .def_property_readonly("_device_index", [](const BlockAllocator& a) { return a.backend().device_index(); });

  py::class_<ControlSegment>(m, "ControlSegment")
      .def(py::init([](const std::string& path, std::shared_ptr<BlockAllocator> allocator, const std::string& engine,
                       const std::string& device, const std::string& name, const std::string& pool_name,
                       std::uint64_t device_total_bytes, int poll_ms) {
             SegmentIdentity id{engine, device, name, pool_name, device_total_bytes};
             return std::make_unique<ControlSegment>(path, id, std::move(allocator), poll_ms);
           }),
           py::arg("path"), py::arg("allocator"), py::arg("engine"), py::arg("device"), py::arg("name"),
           py::arg("pool_name"), py::arg("device_total_bytes"), py::arg("poll_ms"))
      .def("publish", &ControlSegment::publish)
      .def(
          "set_memory_limit",
          [](ControlSegment& c, std::optional<std::uint64_t> limit, std::optional<std::uint64_t> revision) {
            return limit_dict(c.set_memory_limit(limit.value_or(BlockAllocator::kNoLimit), revision));
          },
          py::arg("limit_bytes"), py::arg("revision"), "Set the allocator's limit and record it in the segment.")
      .def("close", &ControlSegment::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("path", &ControlSegment::path);

  m.def(
      "read_segment", [](const std::string& path) { return segment_dict(read_segment(path)); }, py::arg("path"),
      "Reads and validates one control segment; SegmentError says what is wrong with a bad file.");
  m.def(
      "request_limit",
      [](const std::string& path, std::optional<std::uint64_t> limit, std::uint64_t revision) {
        request_limit(path, limit.value_or(BlockAllocator::kNoLimit), revision);
      },
      py::arg("path"), py::arg("limit_bytes"), py::arg("revision"),
      "Asks the owner of a segment to apply a limit (None = no limit) under a revision, and wakes it.");
  m.def("process_alive", &process_alive, py::arg("pid"), py::arg("start_time"),
        "True when pid runs (not a zombie) and started at start_time (0 = do not compare).");
  m.def("process_start_time", &process_start_time, py::arg("pid"));

  py::class_<PlannerBackend, MemoryBackend, std::shared_ptr<PlannerBackend>>(m, "PlannerBackend")
      .def(py::init([](const std::string& kind, int index, std::size_t granularity) {
             return std::make_shared<PlannerBackend>(kind == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu, index,
                                                     granularity);
           }),
           py::arg("kind"), py::arg("device_index"), py::arg("granularity"));

  py::class_<PageTable, std::shared_ptr<PageTable>>(m, "PageTable")
      .def_property_readonly("path", &PageTable::path)
      .def("unlink", &PageTable::unlink)
      .def("worker_allocatable_bytes", &PageTable::worker_allocatable_bytes);

  py::class_<PageMirror, std::shared_ptr<PageMirror>>(m, "PageMirror")
      .def(py::init<const std::string&, std::shared_ptr<MemoryBackend>, std::size_t, std::size_t>(), py::arg("path"),
           py::arg("backend"), py::arg("pool_target"), py::arg("pool_max"), py::call_guard<py::gil_scoped_release>())
      .def(
          "sync",
          [](PageMirror& mirror) {
            SyncResult r;
            {
              py::gil_scoped_release release;
              r = mirror.sync();
            }
            return DictBuilder()
                .set("mapped", r.mapped)
                .set("unmapped", r.unmapped)
                .set_u("generation", r.generation)
                .done();
          },
          "Bring this worker's mappings to the planner's page bitmap (call at the start of each step).")
      .def("close", &PageMirror::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &PageMirror::closed)
      .def_property_readonly("mapped_pages", &PageMirror::mapped_pages)
      .def_property_readonly("buffer_stride", [](const PageMirror& mirror) { return mirror.region().buffer_stride(); })
      .def_property_readonly("geometry",
                             [](const PageMirror& mirror) {
                               const PageTableGeometry& g = mirror.geometry();
                               return DictBuilder()
                                   .set("num_blocks", g.num_blocks)
                                   .set("block_bytes", g.block_bytes)
                                   .set("num_layers", g.num_layers)
                                   .set("num_kv_buffers", g.num_kv_buffers)
                                   .set("page_bytes", g.page_bytes)
                                   .set("num_pages", g.num_pages)
                                   .done();
                             })
      .def(
          "_export_bytes",
          [](const PageMirror& mirror, std::int64_t buffer, std::int64_t offset, std::int64_t nbytes) {
            return export_bytes(viewable(mirror), buffer, offset, nbytes);
          },
          py::arg("buffer"), py::arg("offset"), py::arg("nbytes"))
      .def("_export_all", [](const PageMirror& mirror) { return export_all(viewable(mirror)); });
}
