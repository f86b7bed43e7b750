// Error types of the native core. Nothing in the core aborts: every failure is one of these
// exceptions (translated to Python by the bindings) or an empty optional (capacity misses).
#pragma once

#include <stdexcept>
#include <string>

namespace kvcached {

// A caller passed something that can never work (bad geometry, unknown id, ...). -> ValueError
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The memory backend (CUDA driver or the OS) reported an error. -> kvcached_core.BackendError
class BackendError : public std::runtime_error {
 public:
  BackendError(const std::string& what, int code) : std::runtime_error(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

// A shared-memory file that cannot be used (corrupt, truncated, another version or owner).
// -> kvcached_core.SegmentError (a ValueError)
class SegmentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The object was used after close(). -> RuntimeError
class ClosedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kvcached
