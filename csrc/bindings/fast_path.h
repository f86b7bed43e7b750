// FastPath: alloc/free/available_size as plain CPython methods (METH_O / METH_NOARGS).
//
// pybind11's generic dispatcher costs ~0.4 us a call on a small VM, more than the allocator itself, so the
// three hot calls bypass it. KVCacheManager stores the bound methods of one FastPath in its instance dict.
// The FastPath shares ownership of the allocator (no reference back to the Python object, so no cycle).
#pragma once

#include <Python.h>

#include <memory>

#include "blocks/block_allocator.h"

namespace kvcached {

// Registers the FastPath type in `module`; `closed_error` and `backend_error` are the Python exception
// types that ClosedError and BackendError map to.
void register_fast_path(PyObject* module, PyObject* closed_error, PyObject* backend_error);

// A new FastPath over `allocator` (new reference).
PyObject* make_fast_path(std::shared_ptr<BlockAllocator> allocator);

// Sets the Python error for the C++ exception being handled (call inside a catch block).
void set_python_error();

}  // namespace kvcached
