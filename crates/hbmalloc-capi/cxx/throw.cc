// The one piece of C++ in hbmalloc: hbmalloc_torch_alloc's failure path.
//
// PyTorch's CUDAPluggableAllocator hands whatever its alloc function returns
// to a tensor without checking it, so a NULL for "out of memory" becomes a
// tensor at address 0 and the first kernel to touch it faults. A C++
// exception thrown from the alloc function instead unwinds through PyTorch's
// C++ frames to its Python bindings, which raise it as RuntimeError with
// this message, at the line that allocated.
#include <stdexcept>

extern "C" [[noreturn]] void hbmalloc_capi_throw(const char* message) {
    throw std::runtime_error(message);
}
