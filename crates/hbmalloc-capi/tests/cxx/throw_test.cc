// Calls hbmalloc_torch_alloc through include/hbmalloc.h from C++, as
// PyTorch's CUDAPluggableAllocator does after hbmalloc.torch.install():
// failures arrive as std::runtime_error, never as NULL. Built and run on the
// driver double (devices of 1 GiB) by tests/c_abi.rs.
#include "hbmalloc.h"

#include <cstdio>
#include <stdexcept>
#include <string>

#include "../c/check.h"

// The message hbmalloc_torch_alloc threw, or "" when it returned.
static std::string thrown(ssize_t size, int device, void **out) {
    *out = nullptr;
    try {
        *out = hbmalloc_torch_alloc(size, device, nullptr);
    } catch (const std::runtime_error &e) {
        return e.what();
    }
    return "";
}

static bool starts_with(const std::string &text, const std::string &prefix) {
    return text.compare(0, prefix.size(), prefix) == 0;
}

int main() {
    void *p = nullptr;

    // A request the device cannot hold: PyTorch's words, then hbmalloc's report.
    std::string oom = thrown(ssize_t(4) << 30, 0, &p);
    std::printf("out of memory: %s\n", oom.c_str());
    CHECK(starts_with(oom, "CUDA out of memory. "));
    CHECK(oom.find("tried to allocate 4") != std::string::npos);
    CHECK(p == nullptr);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_OUT_OF_MEMORY);

    // The allocator still serves afterwards, and success does not throw.
    CHECK(thrown(4096, 0, &p).empty());
    CHECK(p != nullptr);
    hbmalloc_free(p, 4096, 0, nullptr);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_OK);

    // Size 0 is NULL without an exception, as from hbmalloc_alloc.
    CHECK(thrown(0, 0, &p).empty());
    CHECK(p == nullptr);

    // Other failures throw their own message.
    std::string negative = thrown(-1, 0, &p);
    std::printf("negative size: %s\n", negative.c_str());
    CHECK(!negative.empty() && !starts_with(negative, "CUDA out of memory"));
    CHECK(hbmalloc_last_error_code() == HBMALLOC_INVALID_ARGUMENT);
    std::string device = thrown(4096, 99, &p);
    std::printf("device 99: %s\n", device.c_str());
    CHECK(!device.empty());
    CHECK(hbmalloc_last_error_code() == HBMALLOC_DEVICE_OUT_OF_RANGE);

    std::printf("%d checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
