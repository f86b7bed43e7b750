#include "bindings/fast_path.h"

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

PyObject* fp_alloc(PyObject* self, PyObject* arg) {
  static thread_local std::vector<std::int32_t> ids;
  std::int64_t count = 0;
  if (!to_int64(arg, count, "alloc() count")) return nullptr;
  ids.clear();
  try {
    if (!allocator_of(self).alloc(count, ids)) Py_RETURN_NONE;
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
  try {
    allocator_of(self).free(ids.data(), ids.size());
  } catch (...) {
    set_python_error();
    return nullptr;
  }
  Py_RETURN_NONE;
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
    {"free", fp_free, METH_O,
     "free(ids) -> None\n\nFree block ids. ValueError (and nothing freed) on an unknown, reserved or duplicate id."},
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
