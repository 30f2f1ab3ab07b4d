// Benchmark (not a test) of hbmalloc's compiled PyTorch allocator
// (hbmalloc/torch_allocator.cc) on the driver double: bench_torch_allocator.py
// builds it with hbmalloc.torch._compile and prints the report.

#include <algorithm>
#include <chrono>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "torch_allocator.cc"

// The per-call cost of the compiled allocator next to the C ABI call it
// wraps, on the driver double: ns per allocate/free pair, for a zero-size
// request (no memory: the wrapper alone) and a cached 1 MiB block. Each
// path runs `iterations` pairs, five rounds interleaved; the report gives
// each round's figure, then the median. A benchmark, not a test: nothing
// here fails on a figure.
extern "C" int hbmalloc_torch_compiled_bench(
    const char* library_path, long iterations, char* report, size_t report_len) {
  std::ostringstream out;
  try {
    const hbmalloc_torch::Abi abi = hbmalloc_torch::load_abi(library_path);
    hbmalloc_torch::HbmallocAllocator allocator(abi);
    c10::cuda::CUDACachingAllocator::CUDAAllocator& torch_view = allocator;
    // PyTorch's stock CUDAPluggableAllocator over the same C ABI, as
    // hbmalloc.torch.install() without compiled=True makes it.
    hbmalloc_torch::Pluggable stock(abi.torch_alloc, abi.free);
    using Pair = std::function<void(size_t)>;
    std::vector<std::pair<std::string, Pair>> paths = {
        {"c_abi", [&](size_t size) {
           void* p = abi.torch_alloc(static_cast<ssize_t>(size), 0, nullptr);
           abi.free(p, static_cast<ssize_t>(size), 0, nullptr);
         }},
        {"raw", [&](size_t size) { torch_view.raw_delete(allocator.malloc(size, 0, nullptr)); }},
        {"pluggable", [&](size_t size) { stock.raw_delete(stock.malloc(size, 0, nullptr)); }},
    };
    // The tensor path exists in this allocator only from the version that
    // frees through the DataPtr's deleter (a template, so that an older
    // allocator.cc still builds for a before/after run).
    [&]<typename A>(A& a) {
      if constexpr (requires { a.allocate_on(size_t{0}, c10::DeviceIndex{0}, nullptr); }) {
        paths.push_back({"tensor", [&a](size_t size) { a.allocate_on(size, 0, nullptr).clear(); }});
      }
    }(allocator);
    for (size_t size : {size_t{0}, size_t{1} << 20}) {
      std::vector<std::vector<double>> rounds(paths.size());
      for (int round = 0; round < 5; ++round) {
        for (size_t i = 0; i < paths.size(); ++i) {
          paths[i].second(size);  // warm: the block is cached from here on
          const auto start = std::chrono::steady_clock::now();
          for (long n = 0; n < iterations; ++n) {
            paths[i].second(size);
          }
          const std::chrono::duration<double, std::nano> took =
              std::chrono::steady_clock::now() - start;
          rounds[i].push_back(took.count() / static_cast<double>(iterations));
        }
      }
      for (size_t i = 0; i < paths.size(); ++i) {
        out << "size " << size << " " << paths[i].first << " ns/pair:";
        for (double ns : rounds[i]) {
          out << " " << static_cast<long>(ns);
        }
        std::sort(rounds[i].begin(), rounds[i].end());
        out << " median " << static_cast<long>(rounds[i][2]) << "\n";
      }
    }
  } catch (const c10::Error& e) {
    out << "exception: " << e.msg() << "\n";
  } catch (const std::exception& e) {
    out << "exception: " << e.what() << "\n";
  }
  hbmalloc_torch::write_text(out.str(), report, report_len);
  return 0;
}
