#include "bindings/fast_path.h"

#include <algorithm>
#include <new>
#include <string>
#include <vector>

#include "common/errors.h"

namespace kvcached {

namespace {

PyObject* g_type = nullptr;
PyObject* g_closed_error = nullptr;
PyObject* g_backend_error = nullptr;

struct FastPathObject {
  PyObject_HEAD std::shared_ptr<BlockAllocator> allocator;
};

BlockAllocator& allocator_of(PyObject* self) { return *reinterpret_cast<FastPathObject*>(self)->allocator; }

bool to_int64(PyObject* obj, std::int64_t& out, const char* what) {
  if (!PyLong_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", what, Py_TYPE(obj)->tp_name);
    return false;
  }
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0) {  // beyond 64 bits: out of every range below, said as such rather than OverflowError
    PyErr_Format(PyExc_ValueError, "%s is out of range (beyond 64 bits)", what);
    return false;
  }
  return !(out == -1 && PyErr_Occurred());
}

// alloc(count) after the block `near` of the same request (-1: none), as a list; None when not served.
PyObject* alloc_list(PyObject* self, std::int64_t count, std::int64_t near) {
  static thread_local std::vector<std::int32_t> ids;
  ids.clear();
  try {
    if (!allocator_of(self).alloc(count, ids, false, near)) Py_RETURN_NONE;
  } catch (...) {
    set_python_error();
    return nullptr;
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(ids.size()));
  if (list == nullptr) return nullptr;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), PyLong_FromLong(ids[i]));
  }
  return list;
}

PyObject* fp_alloc(PyObject* self, PyObject* arg) {
  std::int64_t count = 0;
  if (!to_int64(arg, count, "alloc() count")) return nullptr;
  return alloc_list(self, count, -1);
}

PyObject* fp_alloc_near(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "alloc_near() takes (count, near)");
    return nullptr;
  }
  std::int64_t count = 0;
  std::int64_t near = 0;
  if (!to_int64(args[0], count, "alloc_near() count") || !to_int64(args[1], near, "alloc_near() near")) return nullptr;
  return alloc_list(self, count, near);
}

// Frees `n` ids; None, or nullptr with the Python error set (nothing freed on a bad id).
PyObject* free_ids(PyObject* self, const std::int64_t* ids, std::size_t n) {
  try {
    allocator_of(self).free(ids, n);
  } catch (...) {
    set_python_error();
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* fp_free(PyObject* self, PyObject* arg) {
  static thread_local std::vector<std::int64_t> ids;
  PyObject* seq = PySequence_Fast(arg, "free() takes a sequence of block ids");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  ids.resize(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!to_int64(items[i], ids[static_cast<std::size_t>(i)], "a block id")) {
      Py_DECREF(seq);
      return nullptr;
    }
  }
  Py_DECREF(seq);
  return free_ids(self, ids.data(), ids.size());
}

// The buffer's element width when it holds native 4- or 8-byte integers (numpy's i/l/q, a CPU tensor's
// .numpy()), else 0.
std::size_t integer_width(const Py_buffer& view) {
  const char* f = view.format != nullptr ? view.format : "B";
  if (*f == '@' || *f == '=' || *f == '<') ++f;  // native or little-endian (this module runs on x86/arm LE)
  if (f[0] == '\0' || f[1] != '\0') return 0;
  if ((*f == 'i' || *f == 'I') && view.itemsize == 4) return 4;
  if ((*f == 'l' || *f == 'L' || *f == 'q' || *f == 'Q') && view.itemsize == 8) return 8;
  return 0;
}

// Fills `view` over `obj`: C-contiguous, one dimension, 4- or 8-byte integers. False with a Python error set.
bool integer_buffer(PyObject* obj, Py_buffer& view, bool writable, const char* what) {
  const int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj, &view, flags) != 0) return false;
  if (view.ndim != 1 || integer_width(view) == 0) {
    PyErr_Format(PyExc_TypeError, "%s must be a one-dimensional buffer of int32 or int64", what);
    PyBuffer_Release(&view);
    return false;
  }
  return true;
}

PyObject* fp_alloc_into(PyObject* self, PyObject* args) {
  static thread_local std::vector<std::int32_t> ids;
  PyObject* count_obj = nullptr;
  PyObject* out_obj = nullptr;
  if (!PyArg_ParseTuple(args, "OO:alloc_into", &count_obj, &out_obj)) return nullptr;
  std::int64_t count = 0;
  if (!to_int64(count_obj, count, "alloc_into() count")) return nullptr;
  Py_buffer out;
  if (!integer_buffer(out_obj, out, true, "alloc_into() out")) return nullptr;
  const std::int64_t room = static_cast<std::int64_t>(out.len / out.itemsize);
  if (count > room) {
    PyBuffer_Release(&out);
    PyErr_Format(PyExc_ValueError, "alloc_into() count %lld exceeds the buffer's %lld elements",
                 static_cast<long long>(count), static_cast<long long>(room));
    return nullptr;
  }
  ids.clear();
  bool served = false;
  try {
    served = allocator_of(self).alloc(count, ids);
  } catch (...) {
    PyBuffer_Release(&out);
    set_python_error();
    return nullptr;
  }
  if (served) {
    if (out.itemsize == 8) {
      auto* dst = static_cast<std::int64_t*>(out.buf);
      for (std::size_t i = 0; i < ids.size(); ++i) dst[i] = ids[i];
    } else {
      std::copy(ids.begin(), ids.end(), static_cast<std::int32_t*>(out.buf));
    }
  }
  PyBuffer_Release(&out);
  return PyBool_FromLong(served);
}

PyObject* fp_free_from(PyObject* self, PyObject* arg) {
  static thread_local std::vector<std::int64_t> ids;
  Py_buffer view;
  if (!integer_buffer(arg, view, false, "free_from() ids")) return nullptr;
  const auto n = static_cast<std::size_t>(view.len / view.itemsize);
  PyObject* result = nullptr;
  if (view.itemsize == 8) {
    result = free_ids(self, static_cast<const std::int64_t*>(view.buf), n);
  } else {
    const auto* src = static_cast<const std::int32_t*>(view.buf);
    ids.assign(src, src + n);
    result = free_ids(self, ids.data(), n);
  }
  PyBuffer_Release(&view);
  return result;
}

PyObject* fp_available_size(PyObject* self, PyObject*) {
  return PyLong_FromLongLong(allocator_of(self).available_size());
}

void fp_dealloc(PyObject* self) {
  auto* obj = reinterpret_cast<FastPathObject*>(self);
  PyTypeObject* type = Py_TYPE(self);
  obj->allocator.~shared_ptr();
  type->tp_free(self);
  Py_DECREF(type);
}

PyMethodDef fp_methods[] = {
    {"alloc", fp_alloc, METH_O,
     "alloc(count) -> list[int] | None\n\nDistinct block ids, or None when virtual capacity, physical memory "
     "or the memory limit cannot serve `count` blocks now. ValueError for count <= 0."},
    {"alloc_near", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fp_alloc_near)), METH_FASTCALL,
     "alloc_near(count, near) -> list[int] | None\n\nalloc(count) for a request whose last block is `near`: the "
     "free blocks on that block's page come first (an id that is not allocated is ignored)."},
    {"free", fp_free, METH_O,
     "free(ids) -> None\n\nFree block ids. ValueError (and nothing freed) on an unknown, reserved or duplicate id."},
    {"alloc_into", fp_alloc_into, METH_VARARGS,
     "alloc_into(count, out) -> bool\n\nalloc(count), the ids written into the first `count` elements of `out` (a "
     "writable one-dimensional int32/int64 buffer, e.g. a pinned CPU tensor's .numpy()) instead of a list. "
     "False (out untouched) when alloc() would return None."},
    {"free_from", fp_free_from, METH_O,
     "free_from(ids) -> None\n\nfree() of the ids in a one-dimensional int32/int64 buffer (no list built)."},
    {"available_size", fp_available_size, METH_NOARGS,
     "available_size() -> int\n\nBlocks alloc() could hand out now (lock-free; never calls the driver)."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot fp_slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(fp_dealloc)},
                          {Py_tp_methods, fp_methods},
                          {Py_tp_doc, const_cast<char*>("Hot-path methods of one KV cache manager.")},
                          {0, nullptr}};

PyType_Spec fp_spec = {"kvcached_core._native.FastPath", sizeof(FastPathObject), 0, Py_TPFLAGS_DEFAULT, fp_slots};

}  // namespace

void set_python_error() {
  try {
    throw;
  } catch (const InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const ClosedError& e) {
    PyErr_SetString(g_closed_error, e.what());
  } catch (const BackendError& e) {
    PyErr_SetString(g_backend_error, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

void register_fast_path(PyObject* module, PyObject* closed_error, PyObject* backend_error) {
  g_closed_error = closed_error;
  g_backend_error = backend_error;
  g_type = PyType_FromSpec(&fp_spec);
  if (g_type == nullptr) return;
  Py_INCREF(g_type);
  PyModule_AddObject(module, "FastPath", g_type);
}

PyObject* make_fast_path(std::shared_ptr<BlockAllocator> allocator) {
  auto* type = reinterpret_cast<PyTypeObject*>(g_type);
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  new (&reinterpret_cast<FastPathObject*>(self)->allocator) std::shared_ptr<BlockAllocator>(std::move(allocator));
  return self;
}

}  // namespace kvcached
