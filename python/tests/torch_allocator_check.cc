// Drives hbmalloc's compiled PyTorch allocator (hbmalloc/torch_allocator.cc)
// through PyTorch's allocator interface, as PyTorch's C++ calls it, on a
// machine without a GPU: nothing here asks CUDA's runtime for a device or a
// stream. test_torch.py builds it with hbmalloc.torch._compile, runs it on
// the driver double and checks the report, a line per step.

#include <algorithm>
#include <cstdint>
#include <sstream>

#include "torch_allocator.cc"

namespace {

// The first line of a PyTorch error's message.
std::string first_line(const c10::Error& e) {
  const std::string& message = e.msg();
  return message.substr(0, message.find('\n'));
}

// What torch.profiler(profile_memory=True) installs, as far as an allocator
// sees it: records what it is told, a line each.
struct ProfilerRecorder final : c10::MemoryReportingInfoBase {
  std::ostringstream told;

  void reportMemoryUsage(
      void* ptr, int64_t bytes, size_t allocated, size_t reserved,
      c10::Device device) override {
    told << "usage " << (ptr != nullptr) << " " << bytes << " allocated " << allocated
         << " reserved " << (reserved >= allocated) << " " << device << "; ";
  }

  void reportOutOfMemory(
      int64_t bytes, size_t allocated, size_t reserved, c10::Device device) override {
    told << "out of memory " << bytes << " " << device << "; ";
  }

  bool memoryProfilingEnabled() const override {
    return true;
  }
};

// Records the warnings PyTorch's TORCH_WARN gives, a line each.
struct WarningRecorder final : c10::WarningHandler {
  std::ostringstream told;

  void process(const c10::Warning& warning) override {
    told << warning.msg() << "; ";
  }
};

}  // namespace

extern "C" int hbmalloc_torch_compiled_check(
    const char* library_path, char* report, size_t report_len) {
  std::ostringstream out;
  try {
    const hbmalloc_torch::Abi allocator_abi = hbmalloc_torch::load_abi(library_path);
    hbmalloc_torch::HbmallocAllocator allocator(allocator_abi);
    // What PyTorch holds: calls go through the virtual interface.
    c10::cuda::CUDACachingAllocator::CUDAAllocator& torch_view = allocator;
    out << "name: " << torch_view.name() << "\n";

    // CUDAPluggableAllocator::malloc is what raw_alloc and allocate call
    // once they know the device and stream.
    void* p = allocator.malloc(3 << 20, 0, nullptr);
    out << "malloc: " << (p != nullptr) << "\n";
    auto stats = torch_view.getDeviceStats(0);
    out << "allocated: " << stats.allocated_bytes[0].current << "\n";
    out << "requested large pool: " << stats.requested_bytes[2].current << "\n";

    size_t largest = 0;
    torch_view.cacheInfo(0, &largest);
    out << "cacheInfo: " << (largest > 0) << "\n";
    size_t guess = SIZE_MAX;
    torch_view.cacheInfo(0, &guess);
    out << "cacheInfo keeps a larger guess: " << (guess == SIZE_MAX) << "\n";

    // A stream recorded on this allocator's memory reaches hbmalloc: after
    // the free, the block stays active until that stream's work is done.
    c10::DataPtr ours(p, p, allocator.raw_deleter(), c10::Device(c10::DeviceType::CUDA, 0));
    try {
      // recordStream less its first step, CUDAStream::stream(), which asks
      // CUDA's runtime for the stream's handle (no GPU here).
      auto side_stream = reinterpret_cast<cudaStream_t>(0x7700);
      allocator.record_stream(ours, side_stream);
      // Memory another allocator handed out is ignored, as PyTorch's does.
      int foreign_byte = 0;
      c10::DataPtr foreign(&foreign_byte, c10::Device(c10::DeviceType::CUDA, 0));
      allocator.record_stream(foreign, side_stream);
      out << "recordStream: ok\n";
    } catch (const c10::Error& e) {
      out << "recordStream: Error: " << first_line(e) << "\n";
    }
    // Freed here, not by the deleter, which calls the installed allocator
    // (none is installed in this test).
    ours.release_context();
    torch_view.raw_delete(p);
    stats = torch_view.getDeviceStats(0);
    out << "after free: allocated " << stats.allocated_bytes[0].current << ", active "
        << (stats.active_bytes[0].current >= (3 << 20)) << "\n";

    // A failed malloc: which of PyTorch's errors, and its first line.
    auto failing_malloc = [&](const char* label, size_t size, int device) {
      out << label << ": ";
      try {
        allocator.malloc(size, device, nullptr);
        out << "no error\n";
      } catch (const c10::OutOfMemoryError& e) {
        out << "OutOfMemoryError: " << first_line(e) << "\n";
      } catch (const c10::Error& e) {
        out << "Error: " << first_line(e) << "\n";
      }
    };
    // Out-of-memory observers hear of lack of memory, and only of that.
    std::ostringstream observed;
    torch_view.attachOutOfMemoryObserver(
        [&](int64_t device, size_t size, size_t total, size_t free) {
          observed << "device " << device << ", " << size << " bytes, total " << (total > 0)
                   << ", free " << (free <= total) << "; ";
        });
    failing_malloc("too large", size_t{1} << 50, 0);
    failing_malloc("bad device", 64, 7);
    out << "observed: " << observed.str() << "\n";

    // A CUDA graph capture as PyTorch drives it: allocations its filter
    // accepts go to the graph's private pool until endAllocateToPool.
    {
      const c10::cuda::MempoolId_t graph_pool{9, 0};
      auto capturing = reinterpret_cast<cudaStream_t>(0x4400);
      auto reserved = [&] { return torch_view.getDeviceStats(0).reserved_bytes[0].current; };
      torch_view.beginAllocateToPool(
          0, graph_pool, [=](cudaStream_t stream) { return stream == capturing; });
      void* g = allocator.malloc(1 << 20, 0, capturing);
      void* h = allocator.malloc(1 << 20, 0, nullptr);
      out << "pool holders: " << allocator.getPoolUseCount(0, graph_pool) << "\n";
      try {
        torch_view.emptyCache();
        out << "empty_cache during capture: allowed\n";
      } catch (const c10::Error& e) {
        out << "empty_cache during capture: " << first_line(e) << "\n";
      }
      torch_view.raw_delete(g);
      void* g2 = allocator.malloc(1 << 20, 0, capturing);
      out << "the pool reuses its memory: " << (g2 == g) << "\n";
      torch_view.raw_delete(h);
      void* h2 = allocator.malloc(1 << 20, 0, nullptr);
      out << "others never get it: " << (h2 != g2) << "\n";
      torch_view.endAllocateToPool(0, graph_pool);
      try {
        torch_view.endAllocateToPool(0, graph_pool);
        out << "second end: allowed\n";
      } catch (const c10::Error& e) {
        out << "second end: " << first_line(e) << "\n";
      }
      torch_view.raw_delete(g2);
      void* after = allocator.malloc(1 << 20, 0, capturing);
      out << "not routed after the end: " << (after != g2) << "\n";
      const auto held = reserved();
      torch_view.releasePool(0, graph_pool);
      out << "released: holders " << allocator.getPoolUseCount(0, graph_pool)
          << ", memory given back " << (held - reserved()) << "\n";
      torch_view.raw_delete(h2);
      torch_view.raw_delete(after);
      // A torch.cuda.MemPool: made (through the virtual its constructor
      // calls in this torch) and released by its owner.
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 8
      torch_view.createOrIncrefPool(0, {0, 5});
#else
      torch_view.ensureExistsAndIncrefPool(0, {0, 5});
#endif
      out << "MemPool holders: " << torch_view.getPoolUseCount(0, {0, 5});
      torch_view.releasePool(0, {0, 5});
      out << " then " << allocator.getPoolUseCount(0, {0, 5}) << "\n";
      {
        // Released once too often (from a destructor, say): a warning, no throw.
        WarningRecorder warnings;
        c10::WarningUtils::WarningHandlerGuard guard(&warnings);
        torch_view.releasePool(0, {0, 5});
        out << "release again: " << warnings.told.str() << "\n";
      }
      try {
        torch_view.beginAllocateToPool(0, graph_pool, [](cudaStream_t) { return true; });
        torch_view.beginAllocateToPool(0, graph_pool, [](cudaStream_t) { return true; });
        out << "begin twice: allowed\n";
      } catch (const c10::Error& e) {
        out << "begin twice: " << first_line(e) << "\n";
      }
      torch_view.endAllocateToPool(0, graph_pool);
      torch_view.releasePool(0, graph_pool);
    }

    // A tensor's path (allocate less its device and stream queries, which
    // ask CUDA's runtime): the DataPtr's deleter gives the memory back.
    {
      const auto allocated = [&] { return torch_view.getDeviceStats(0).allocated_bytes[0].current; };
      const auto before = allocated();
      c10::DataPtr tensor = allocator.allocate_on(1 << 20, 0, nullptr);
      out << "tensor: deleter is raw_deleter " << (tensor.get_deleter() == torch_view.raw_deleter())
          << ", simple " << torch_view.is_simple_data_ptr(tensor) << ", allocated "
          << (allocated() - before);
      tensor.clear();
      c10::DataPtr empty = allocator.allocate_on(0, 0, nullptr);
      out << ", after its delete " << (allocated() - before) << ", zero-size null "
          << (empty.get() == nullptr) << "\n";
    }

    // What torch.cuda.MemPool(use_on_oom=True, no_split=True) calls, and
    // ~MemPool's setUseOnOOM(false) after the pool is gone: no throw.
    {
      const c10::cuda::MempoolId_t pool{0, 6};
      cudaStream_t routed = nullptr;
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 8
      torch_view.createOrIncrefPool(0, pool);
#else
      torch_view.ensureExistsAndIncrefPool(0, pool);
#endif
      allocator.setUseOnOOM(0, pool, true);
      allocator.setNoSplit(0, pool);
      out << "pool options: use_on_oom " << allocator.poolUseOnOOM(0, pool) << ", no_split "
          << allocator.poolNoSplit(0, pool) << "\n";
      torch_view.beginAllocateToPool(0, pool, [=](cudaStream_t s) { return s == routed; });
      void* a = allocator.malloc(2 << 20, 0, routed);
      void* b = allocator.malloc(2 << 20, 0, routed);
      // As torch.cuda.use_mem_pool ends: the route's hold is released.
      torch_view.endAllocateToPool(0, pool);
      torch_view.releasePool(0, pool);
      int foreign = 0;
      out << "live: exact " << allocator.checkPoolLiveAllocations(0, pool, {a, b})
          << ", one missing " << allocator.checkPoolLiveAllocations(0, pool, {a})
          << ", one foreign " << allocator.checkPoolLiveAllocations(0, pool, {a, &foreign});
      torch_view.raw_delete(b);
      out << ", after a free " << allocator.checkPoolLiveAllocations(0, pool, {a}) << "\n";
      // Out of memory everywhere but in the pool's cache (b's 2 MiB, on the
      // same stream): the request is served from the pool, and only while
      // use_on_oom is set.
      size_t free_bytes = 0, total_bytes = 0;
      hbmalloc_torch::check(allocator_abi, allocator_abi.mem_get_info(0, &free_bytes, &total_bytes));
      const auto reserved = torch_view.getDeviceStats(0).reserved_bytes[0].current;
      torch_view.setMemoryFraction(static_cast<double>(reserved) / total_bytes, 0);
      void* c = nullptr;
      try {
        c = allocator.malloc(2 << 20, 0, nullptr);
        out << "out of memory, use_on_oom: served " << (c != nullptr);
      } catch (const c10::Error& e) {
        out << "out of memory, use_on_oom: " << first_line(e);
      }
      torch_view.raw_delete(c);
      allocator.setUseOnOOM(0, pool, false);
      try {
        c = allocator.malloc(2 << 20, 0, nullptr);
        out << "; without: served\n";
        torch_view.raw_delete(c);
      } catch (const c10::OutOfMemoryError& e) {
        out << "; without: OutOfMemoryError\n";
      }
      torch_view.setMemoryFraction(1.0, 0);
      torch_view.raw_delete(a);
      torch_view.releasePool(0, pool);
      allocator.setUseOnOOM(0, pool, false);
      out << "after release: options " << allocator.poolUseOnOOM(0, pool)
          << allocator.poolNoSplit(0, pool) << ", pools with options "
          << allocator.poolsWithOptions() << "\n";
      try {
        allocator.checkPoolLiveAllocations(0, pool, {});
        out << "unknown pool: answered\n";
      } catch (const c10::Error& e) {
        out << "unknown pool: " << first_line(e) << "\n";
      }
    }

    // History, IPC and checkpointing through the virtual interface.
    {
      out << "history: " << torch_view.isHistoryEnabled();
      allocator.recordHistory(false, nullptr, 0, c10::cuda::CUDACachingAllocator::RecordContext::NEVER, false, {});
      out << " off " << torch_view.isHistoryEnabled();
      allocator.recordHistory(true, nullptr, 1000, c10::cuda::CUDACachingAllocator::RecordContext::ALLOC, false, {});
      out << " on " << torch_view.isHistoryEnabled() << "\n";
      auto refused = [&](const char* label, auto call) {
        try {
          call();
          out << label << ": allowed\n";
        } catch (const c10::Error& e) {
          out << label << ": " << first_line(e) << "\n";
        }
      };
      refused("shareIpcHandle", [&] { torch_view.shareIpcHandle(nullptr); });
      refused("getIpcDevPtr", [&] { torch_view.getIpcDevPtr("x"); });
      {
        // A live block shares in PyTorch's format: version 2, 'c' and the
        // segment's 64-byte handle (policy pytorch), its offset beside.
        void* block = allocator.malloc(4096, 0, nullptr);
        const auto shared = torch_view.shareIpcHandle(block);
        out << "shareIpcHandle: " << shared.handle.size() << " bytes, version "
            << int(shared.handle[0]) << ", type " << shared.handle[1] << ", offset within "
            << "its 2 MiB segment " << (shared.offset >= 0 && shared.offset < (2 << 20)) << "\n";
        allocator.raw_delete(block);
      }
      refused("snapshot", [&] { torch_view.snapshot(); });
      refused("getCheckpointState", [&] { torch_view.getCheckpointState(0, {1, 0}); });
      refused("allocateWithAddress", [&] { allocator.allocateWithAddress(64, nullptr); });
      {
        WarningRecorder warnings;
        c10::WarningUtils::WarningHandlerGuard guard(&warnings);
        int foreign = 0;
        torch_view.raw_delete(&foreign);
        out << "raw_delete of a foreign pointer: " << warnings.told.str() << "\n";
      }
    }

    // With a profiler recording memory: an allocation, its free and an
    // out-of-memory error reach it, with the device's totals after each.
    {
      auto recorder = std::make_shared<ProfilerRecorder>();
      c10::DebugInfoGuard profiling(c10::DebugInfoKind::PROFILER_STATE, recorder);
      void* q = allocator.malloc(1 << 20, 0, nullptr);
      torch_view.raw_delete(q);
      failing_malloc("too large while profiling", size_t{1} << 50, 0);
      out << "profiler: " << recorder->told.str() << "\n";
    }

    torch_view.setMemoryFraction(0.5, 0);
    out << "fraction: " << torch_view.getMemoryFraction(0) << "\n";
    torch_view.setMemoryFraction(1.0, 0);
    torch_view.resetAccumulatedStats(0);
    out << "allocations counted after reset: "
        << torch_view.getDeviceStats(0).allocation[0].allocated << "\n";
    torch_view.resetPeakStats(0);
    stats = torch_view.getDeviceStats(0);
    out << "peak is current after reset: "
        << (stats.reserved_bytes[0].peak == stats.reserved_bytes[0].current) << "\n";
  } catch (const c10::Error& e) {
    out << "exception: " << first_line(e) << "\n";
  } catch (const std::exception& e) {
    out << "exception: " << e.what() << "\n";
  }
  hbmalloc_torch::write_text(out.str(), report, report_len);
  return 0;
}

