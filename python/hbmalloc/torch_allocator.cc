// hbmalloc as PyTorch's CUDA allocator, built in C++ against the installed
// torch: hbmalloc.torch.install(compiled=True) compiles this file once
// (hbmalloc/torch.py, _compiled_library), loads it with ctypes and calls
// hbmalloc_torch_compiled_install.
//
// Why C++: PyTorch's CUDAPluggableAllocator, built from Python, passes only
// alloc and free on. Subclassed here, it answers what it cannot from Python:
// cacheInfo (so cuDNN's benchmark mode works), recordStream (so streams,
// NCCL's included, reach hbmalloc from C++), the statistics behind
// torch.cuda.memory_stats(), out-of-memory errors of PyTorch's own type
// (torch.OutOfMemoryError, which PyTorch's fallbacks catch), memory
// events for torch.profiler(profile_memory=True), and private memory pools
// (torch.cuda.MemPool, use_mem_pool, CUDA graph capture). Everything else
// is CUDAPluggableAllocator's: its pointer bookkeeping, its deleter, and
// whatever a newer torch adds to the interface.
//
// hbmalloc itself is reached through its C ABI (hbmalloc.h), resolved with
// dlopen/dlsym in the library Python already loaded (hbmalloc.library_path(),
// as CUDAPluggableAllocator does), so PyTorch and Python share one
// allocator per device.

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// Built and tested with torch 2.6, 2.8, 2.10 and 2.15. An older torch lacks
// part of the interface overridden here (2.5's CUDAAllocator has no
// getMemoryFraction; before that, DeviceStats lived elsewhere): say so,
// instead of a page of errors.
#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif
#if !defined(TORCH_VERSION_MAJOR) || TORCH_VERSION_MAJOR < 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 6)
#error "hbmalloc's compiled allocator needs torch 2.6 or newer (tested with 2.6, 2.8, 2.10 and 2.15): use hbmalloc.torch.install() without compiled=True"
#endif

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "hbmalloc.h"

namespace hbmalloc_torch {

// The C ABI functions this allocator calls, typed by hbmalloc.h.
struct Abi {
  decltype(&hbmalloc_torch_alloc) torch_alloc;
  decltype(&hbmalloc_torch_pool_alloc) torch_pool_alloc;
  decltype(&hbmalloc_create_or_incref_pool) create_or_incref_pool;
  decltype(&hbmalloc_release_pool) release_pool;
  decltype(&hbmalloc_pool_use_count) pool_use_count;
  decltype(&hbmalloc_pool_live_allocations) pool_live_allocations;
  decltype(&hbmalloc_begin_capture) begin_capture;
  decltype(&hbmalloc_end_capture) end_capture;
  decltype(&hbmalloc_free) free;
  decltype(&hbmalloc_record_stream) record_stream;
  decltype(&hbmalloc_init) init;
  decltype(&hbmalloc_reset) reset;
  decltype(&hbmalloc_set_memory_fraction) set_memory_fraction;
  decltype(&hbmalloc_memory_fraction) memory_fraction;
  decltype(&hbmalloc_mem_get_info) mem_get_info;
  decltype(&hbmalloc_cache_info) cache_info;
  decltype(&hbmalloc_stats_values) stats_values;
  decltype(&hbmalloc_reset_peak_stats) reset_peak_stats;
  decltype(&hbmalloc_reset_accumulated_stats) reset_accumulated_stats;
  decltype(&hbmalloc_set_history_entries) set_history_entries;
  decltype(&hbmalloc_history_entries) history_entries;
  decltype(&hbmalloc_last_error) last_error;
  decltype(&hbmalloc_last_error_code) last_error_code;
  decltype(&hbmalloc_ipc_share) ipc_share;
  decltype(&hbmalloc_ipc_open) ipc_open;
  decltype(&hbmalloc_ipc_close) ipc_close;
};

template <typename F>
void resolve(void* library, const char* name, F* slot) {
  void* symbol = dlsym(library, name);
  if (symbol == nullptr) {
    throw std::runtime_error(
        std::string("hbmalloc: the library has no ") + name +
        " (an hbmalloc older than this file?)");
  }
  *slot = reinterpret_cast<F>(symbol);
}

// hbmalloc's C ABI in the library at `path` (already loaded by Python).
Abi load_abi(const char* path) {
  void* library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error(
        std::string("hbmalloc: cannot load ") + path + ": " +
        (why != nullptr ? why : "unknown error"));
  }
  Abi abi{};
  resolve(library, "hbmalloc_torch_alloc", &abi.torch_alloc);
  resolve(library, "hbmalloc_torch_pool_alloc", &abi.torch_pool_alloc);
  resolve(library, "hbmalloc_create_or_incref_pool", &abi.create_or_incref_pool);
  resolve(library, "hbmalloc_release_pool", &abi.release_pool);
  resolve(library, "hbmalloc_pool_use_count", &abi.pool_use_count);
  resolve(library, "hbmalloc_pool_live_allocations", &abi.pool_live_allocations);
  resolve(library, "hbmalloc_begin_capture", &abi.begin_capture);
  resolve(library, "hbmalloc_end_capture", &abi.end_capture);
  resolve(library, "hbmalloc_free", &abi.free);
  resolve(library, "hbmalloc_record_stream", &abi.record_stream);
  resolve(library, "hbmalloc_init", &abi.init);
  resolve(library, "hbmalloc_reset", &abi.reset);
  resolve(library, "hbmalloc_set_memory_fraction", &abi.set_memory_fraction);
  resolve(library, "hbmalloc_memory_fraction", &abi.memory_fraction);
  resolve(library, "hbmalloc_mem_get_info", &abi.mem_get_info);
  resolve(library, "hbmalloc_cache_info", &abi.cache_info);
  resolve(library, "hbmalloc_stats_values", &abi.stats_values);
  resolve(library, "hbmalloc_reset_peak_stats", &abi.reset_peak_stats);
  resolve(
      library, "hbmalloc_reset_accumulated_stats", &abi.reset_accumulated_stats);
  resolve(library, "hbmalloc_set_history_entries", &abi.set_history_entries);
  resolve(library, "hbmalloc_history_entries", &abi.history_entries);
  resolve(library, "hbmalloc_last_error", &abi.last_error);
  resolve(library, "hbmalloc_last_error_code", &abi.last_error_code);
  resolve(library, "hbmalloc_ipc_share", &abi.ipc_share);
  resolve(library, "hbmalloc_ipc_open", &abi.ipc_open);
  resolve(library, "hbmalloc_ipc_close", &abi.ipc_close);
  return abi;  // The handle stays open: the process keeps the library.
}

// Raises hbmalloc's last error as PyTorch's error (RuntimeError in Python)
// unless `status` is HBMALLOC_OK.
void check(const Abi& abi, int status) {
  if (status == HBMALLOC_OK) {
    return;
  }
  std::string message(abi.last_error(nullptr, 0), '\0');
  abi.last_error(message.data(), message.size() + 1);
  TORCH_CHECK(false, message);
}

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::StatArray;

// The device's allocated and reserved bytes now, as memory_stats() has
// them ("allocated_bytes.all.current", "reserved_bytes.all.current"); 0 and
// 0 if hbmalloc cannot say (its last error keeps why).
std::pair<size_t, size_t> current_bytes(const Abi& abi, int device) {
  static const char* const keys[] = {
      "allocated_bytes.all.current", "reserved_bytes.all.current"};
  int64_t values[2] = {0, 0};
  if (abi.stats_values(device, keys, 2, values) != HBMALLOC_OK) {
    return {0, 0};
  }
  return {static_cast<size_t>(values[0]), static_cast<size_t>(values[1])};
}

// Device `device` as PyTorch names it.
c10::Device cuda_device(int device) {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
}

// Tells PyTorch's profiler (torch.profiler with profile_memory=True) of an
// allocation (`bytes` > 0) or a free (`bytes` < 0), with the device's totals
// after it, as PyTorch's own allocator does; CUDAPluggableAllocator tells it
// nothing. The size is the request's (PyTorch passes the same one to free).
// While no profiler records memory this is one thread-local lookup.
void report_to_profiler(const Abi& abi, void* ptr, int64_t bytes, int device) {
  if (!c10::memoryProfilingEnabled()) {
    return;
  }
  const auto [allocated, reserved] = current_bytes(abi, device);
  c10::reportMemoryUsageToProfiler(ptr, bytes, allocated, reserved, cuda_device(device));
}

// Each DeviceStats field and its memory_stats() key: a StatArray has one
// Stat per pool (StatType: aggregate, small pool, large pool), a Stat four
// fields.
constexpr std::pair<const char*, StatArray DeviceStats::*> kStatArrays[] = {
    {"allocation", &DeviceStats::allocation},
    {"segment", &DeviceStats::segment},
    {"active", &DeviceStats::active},
    {"inactive_split", &DeviceStats::inactive_split},
    {"allocated_bytes", &DeviceStats::allocated_bytes},
    {"reserved_bytes", &DeviceStats::reserved_bytes},
    {"active_bytes", &DeviceStats::active_bytes},
    {"inactive_split_bytes", &DeviceStats::inactive_split_bytes},
    {"requested_bytes", &DeviceStats::requested_bytes}};
constexpr const char* kPools[] = {"all", "small_pool", "large_pool"};
constexpr std::pair<const char*, Stat DeviceStats::*> kStats[] = {
    {"oversize_allocations", &DeviceStats::oversize_allocations},
    {"oversize_segments", &DeviceStats::oversize_segments}};
constexpr std::pair<const char*, int64_t Stat::*> kFields[] = {
    {"current", &Stat::current},
    {"peak", &Stat::peak},
    {"allocated", &Stat::allocated},
    {"freed", &Stat::freed}};
constexpr std::pair<const char*, int64_t DeviceStats::*> kCounters[] = {
    {"num_alloc_retries", &DeviceStats::num_alloc_retries},
    {"num_ooms", &DeviceStats::num_ooms},
    {"num_sync_all_streams", &DeviceStats::num_sync_all_streams},
    {"num_device_alloc", &DeviceStats::num_device_alloc},
    {"num_device_free", &DeviceStats::num_device_free},
    {"max_split_size", &DeviceStats::max_split_size}};

// The counters only a newer torch's DeviceStats has (num_oom_rejections:
// 2.15 has it, 2.10 not), where it has them. A template, so that a missing
// field is a false requirement, not an error.
template <typename Stats, typename Visit>
void visit_newer_counters(Stats& stats, Visit& visit) {
  if constexpr (requires { stats.num_oom_rejections; }) {
    visit(std::string("num_oom_rejections"), stats.num_oom_rejections);
  }
}

// Visits every int64_t of `stats` with its memory_stats() key, always in
// the same order.
template <typename Visit>
void for_each_stat(DeviceStats& stats, Visit visit) {
  for (const auto& [name, array] : kStatArrays) {
    for (size_t pool = 0; pool < std::size(kPools); ++pool) {
      for (const auto& [field, member] : kFields) {
        visit(std::string(name) + "." + kPools[pool] + "." + field, (stats.*array)[pool].*member);
      }
    }
  }
  for (const auto& [name, stat] : kStats) {
    for (const auto& [field, member] : kFields) {
      visit(std::string(name) + "." + field, (stats.*stat).*member);
    }
  }
  for (const auto& [name, counter] : kCounters) {
    visit(std::string(name), stats.*counter);
  }
  visit_newer_counters(stats, visit);
}

}  // namespace hbmalloc_torch

// A torch without OomRejectionObserver gets this stand-in, so that the
// method below compiles there (a qualified name finds c10's own first).
namespace hbmalloc_torch::fallback {
struct OomRejectionObserver {};
}  // namespace hbmalloc_torch::fallback
namespace c10::cuda::CUDACachingAllocator {
using namespace hbmalloc_torch::fallback;
}  // namespace c10::cuda::CUDACachingAllocator

namespace hbmalloc_torch {

using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using c10::cuda::MempoolId_t;
namespace cca = c10::cuda::CUDACachingAllocator;

// hbmalloc's last error, as text.
std::string last_error(const Abi& abi) {
  std::string message(abi.last_error(nullptr, 0), '\0');
  abi.last_error(message.data(), message.size() + 1);
  return message;
}

class HbmallocAllocator;

// The allocator whose tensors' deleter (delete_tensor) is running: set by
// the newest HbmallocAllocator, which PyTorch keeps for the process.
std::atomic<HbmallocAllocator*> tensor_owner{nullptr};

// A tensor's deleter context: its address with the device in the top byte
// (device + 1; CUDA's addresses lie below 2^56), so that freeing one needs
// no table and no lock. An address that does not fit, and any allocation
// made while a profiler records memory (its free must report the size),
// gets a heap record instead, whose top byte is 0.
struct Record {
  void* ptr;
  size_t size;
  int device;
};
constexpr int kTagShift = 56;

void* tag(void* ptr, int device) {
  return reinterpret_cast<void*>(
      reinterpret_cast<uintptr_t>(ptr) | (static_cast<uintptr_t>(device + 1) << kTagShift));
}

bool fits_tag(void* ptr, int device) {
  return (reinterpret_cast<uintptr_t>(ptr) >> kTagShift) == 0 && device >= 0 && device < 255;
}

void delete_tensor(void* context);

class HbmallocAllocator final : public Pluggable {
 public:
  explicit HbmallocAllocator(const Abi& abi)
      : Pluggable(
            // CUDAPluggableAllocator's own paths (none of which PyTorch
            // reaches: allocate and the raw calls are overridden below)
            // still end in hbmalloc.
            [this](size_t size, int device, cudaStream_t stream) {
              return allocate_on_device(size, device, stream);
            },
            [abi](void* ptr, size_t, int device, cudaStream_t) { abi.free(ptr, 0, device, nullptr); }),
        abi_(abi) {
    set_init_fn([abi](int device_count) { check(abi, abi.init(device_count)); });
    // torch.cuda.empty_cache(): every device's cache.
    set_reset_fn([abi] { check(abi, abi.reset()); });
    set_memory_fraction_fn([abi](double fraction, int device) {
      check(abi, abi.set_memory_fraction(fraction, device));
    });
    tensor_owner.store(this, std::memory_order_release);
  }

  ~HbmallocAllocator() override {
    HbmallocAllocator* self = this;
    tensor_owner.compare_exchange_strong(self, nullptr);
  }

  // torch.empty and every tensor: hbmalloc's pointer, freed by
  // delete_tensor with no table in between.
  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return allocate_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  // allocate, once the device and the stream are known.
  c10::DataPtr allocate_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    void* ptr = allocate_on_device(size, device, stream);
    void* context = nullptr;
    if (!c10::memoryProfilingEnabled() && fits_tag(ptr, device)) {
      context = tag(ptr, device);
    } else {
      context = new Record{ptr, size, device};
      // The memory is the caller's now: a profiler that fails must not lose it.
      try {
        report_to_profiler(abi_, ptr, static_cast<int64_t>(size), device);
      } catch (...) {
      }
    }
    return c10::DataPtr(ptr, context, &delete_tensor, cuda_device(device));
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_tensor;
  }

  // A tensor's DataPtr is as simple as the default's (its context is its
  // address, tagged): copy-on-write clones may wrap it.
  bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override {
    const auto bits = reinterpret_cast<uintptr_t>(data_ptr.get_context());
    return (bits >> kTagShift) != 0 &&
        (bits & ((uintptr_t{1} << kTagShift) - 1)) == reinterpret_cast<uintptr_t>(data_ptr.get());
  }

  // Frees what allocate_on handed out (a tensor's deleter: never throws).
  void free_context(void* context) noexcept {
    const auto bits = reinterpret_cast<uintptr_t>(context);
    const uintptr_t tag_byte = bits >> kTagShift;
    if (tag_byte != 0) {
      const int device = static_cast<int>(tag_byte) - 1;
      void* ptr = reinterpret_cast<void*>(bits & ((uintptr_t{1} << kTagShift) - 1));
      if (ptr == nullptr) {
        return;  // A zero-size tensor: nothing was allocated.
      }
      abi_.free(ptr, 0, device, nullptr);
      // Allocated before a profiler began recording memory: the size is not
      // kept (keeping it would cost every allocation), so the free says 0.
      if (c10::memoryProfilingEnabled()) {
        try {
          report_to_profiler(abi_, ptr, 0, device);
        } catch (...) {
        }
      }
      return;
    }
    auto* record = static_cast<Record*>(context);
    if (record == nullptr) {
      return;
    }
    abi_.free(record->ptr, 0, record->device, nullptr);
    try {
      report_to_profiler(abi_, record->ptr, -static_cast<int64_t>(record->size), record->device);
    } catch (...) {
    }
    delete record;
  }

  // PyTorch's raw calls (cuBLAS and cuDNN workspaces,
  // torch.cuda.caching_allocator_alloc): raw_delete has the pointer alone,
  // so these keep its device and size.
  void* raw_alloc(size_t nbytes) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return malloc(nbytes, c10::cuda::current_device(), stream);
  }

  // raw_alloc, once the device and the stream are known (CUDAPluggableAllocator's
  // malloc, which this hides).
  void* malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    void* ptr = allocate_on_device(size, device, stream);
    if (ptr != nullptr) {
      try {
        std::lock_guard<std::mutex> lock(raw_mutex_);
        raw_.emplace(ptr, Record{ptr, size, device});
      } catch (...) {
        abi_.free(ptr, 0, device, nullptr);
        throw;
      }
      try {
        report_to_profiler(abi_, ptr, static_cast<int64_t>(size), device);
      } catch (...) {
      }
    }
    return ptr;
  }

  // Called from deleters: never throws. A pointer not from raw_alloc is
  // PyTorch's bug, said as a warning.
  void raw_delete(void* ptr) override {
    if (ptr == nullptr) {
      return;
    }
    std::optional<Record> record;
    {
      std::lock_guard<std::mutex> lock(raw_mutex_);
      auto found = raw_.find(ptr);
      if (found != raw_.end()) {
        record = found->second;
        raw_.erase(found);
      }
    }
    if (!record) {
      try {
        TORCH_WARN("hbmalloc: raw_delete of a pointer raw_alloc did not hand out (ignored)");
      } catch (...) {
      }
      return;
    }
    abi_.free(ptr, 0, record->device, nullptr);
    try {
      report_to_profiler(abi_, ptr, -static_cast<int64_t>(record->size), record->device);
    } catch (...) {
    }
  }

  // hbmalloc_torch_alloc throws std::runtime_error; PyTorch's fallbacks
  // (cuDNN's smaller workspace, the benchmark's next algorithm) catch only
  // its own OutOfMemoryError, so lack of memory becomes that, after the
  // pools set to serve on out-of-memory (MemPool's use_on_oom) were tried
  // and the out-of-memory observers told (as PyTorch's allocator does).
  void* allocate_on_device(size_t size, int device, cudaStream_t stream) {
    if (size == 0) {
      return nullptr;  // As PyTorch's allocator: no memory, no call.
    }
    try {
      const auto pool = pool_for(device, stream);
      return pool ? abi_.torch_pool_alloc(
                        static_cast<ssize_t>(size), device, stream, pool->first, pool->second)
                  : abi_.torch_alloc(static_cast<ssize_t>(size), device, stream);
    } catch (const std::runtime_error& e) {
      if (abi_.last_error_code() != HBMALLOC_OUT_OF_MEMORY) {
        TORCH_CHECK(false, e.what());
      }
      const std::string message = e.what();
      if (void* ptr = allocate_from_oom_pools(size, device, stream)) {
        return ptr;
      }
      tell_oom_observers(device, size);
      if (c10::memoryProfilingEnabled()) {
        const auto [allocated, reserved] = current_bytes(abi_, device);
        c10::reportOutOfMemoryToProfiler(
            static_cast<int64_t>(size), allocated, reserved, cuda_device(device));
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    }
  }

  // torch._C._cuda_attach_out_of_memory_observer: PyTorch's recipe for
  // dumping a snapshot where memory ran out.
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  // Observers of requests refused before the driver was asked (PyTorch's
  // throw_on_cudamalloc_oom). hbmalloc refuses none that way, so they are
  // accepted and never called. Not marked override: newer torch only.
  void attachOomRejectionObserver(cca::OomRejectionObserver) {}

  // PyTorch's trace trackers (ProcessGroupNCCL's buffer registration with
  // TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK) hear of segments
  // mapped and unmapped; hbmalloc's C ABI does not report those, so a
  // tracker is accepted (a process group must start) and told nothing,
  // with a warning.
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    (void)tracker;
    TORCH_WARN_ONCE(
        "hbmalloc: an allocator trace tracker was attached (NCCL buffer registration?); "
        "hbmalloc does not report segment events to it, so nothing is registered");
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    record_stream(ptr, stream.stream());
  }

  // recordStream, with the stream as CUDA's handle.
  void record_stream(const c10::DataPtr& ptr, cudaStream_t stream) {
    // Memory this allocator did not hand out is not its to track (as in
    // PyTorch's own allocator).
    if (ptr.get() == nullptr || ptr.get_deleter() != raw_deleter()) {
      return;
    }
    check(abi_, abi_.record_stream(ptr.get(), ptr.device().index(), stream));
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    size_t largest = 0;
    check(abi_, abi_.cache_info(device, &largest));
    *largest_block = std::max(*largest_block, largest);
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    double fraction = 1.0;
    check(abi_, abi_.memory_fraction(device, &fraction));
    return fraction;
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    static const std::vector<std::string> keys = [] {
      std::vector<std::string> names;
      DeviceStats unused;
      for_each_stat(unused, [&](std::string key, int64_t&) { names.push_back(std::move(key)); });
      return names;
    }();
    static const std::vector<const char*> key_pointers = [] {
      std::vector<const char*> pointers;
      for (const std::string& key : keys) {
        pointers.push_back(key.c_str());
      }
      return pointers;
    }();
    std::vector<int64_t> values(keys.size());
    check(abi_, abi_.stats_values(device, key_pointers.data(), keys.size(), values.data()));
    DeviceStats stats;
    size_t next = 0;
    for_each_stat(stats, [&](const std::string&, int64_t& slot) { slot = values[next++]; });
    return stats;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check(abi_, abi_.reset_peak_stats(device));
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(abi_, abi_.reset_accumulated_stats(device));
  }

  // torch.cuda.memory._record_memory_history from C++: hbmalloc keeps the
  // last alloc_trace_max_entries entries (no stacks: its entries have no
  // frames). Overloads for each torch's signature; none marked override.
  void recordHistory(
      bool enabled, cca::CreateContextFn, size_t alloc_trace_max_entries, cca::RecordContext) {
    record_history(enabled, alloc_trace_max_entries, false);
  }
  void recordHistory(
      bool enabled, cca::CreateContextFn, size_t alloc_trace_max_entries, cca::RecordContext,
      bool clear_history) {
    record_history(enabled, alloc_trace_max_entries, clear_history);
  }
  void recordHistory(
      bool enabled, cca::CreateContextFn, size_t alloc_trace_max_entries, cca::RecordContext,
      bool clear_history, const std::vector<std::string>&) {
    record_history(enabled, alloc_trace_max_entries, clear_history);
  }

  // PyTorch's snapshot from C++: hbmalloc's snapshot is its own pickle
  // (install() routes torch.cuda.memory._snapshot() to it), which C++
  // cannot hand back as PyTorch's structures. Overloads for each torch's
  // signature; none marked override.
  cca::SnapshotInfo snapshot() {
    TORCH_CHECK(false, kNoCppSnapshot);
  }
  cca::SnapshotInfo snapshot(MempoolId_t) {
    TORCH_CHECK(false, kNoCppSnapshot);
  }
  cca::SnapshotInfo snapshot(MempoolId_t, bool) {
    TORCH_CHECK(false, kNoCppSnapshot);
  }

  // Whether hbmalloc keeps history now. Not marked override: newer torch only.
  bool isHistoryEnabled() {
    size_t entries = 0;
    check(abi_, abi_.history_entries(&entries));
    return entries > 0;
  }

  // Private memory pools, as PyTorch's allocator keeps them: a
  // torch.cuda.MemPool makes one (createOrIncrefPool) and releases it when
  // it goes; a CUDA graph capture (and torch.cuda.use_mem_pool) makes or
  // holds one, routes the allocations its filter accepts there until
  // endAllocateToPool, and the graph releases it when it is reset. hbmalloc
  // keeps a pool's memory for that pool alone, and while any capture or
  // use_mem_pool is underway it waits for no event and gives no memory
  // back, which CUDA would refuse during a capture (hbmalloc.h).
  void beginAllocateToPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    {
      std::lock_guard<std::mutex> lock(routes_mutex_);
      TORCH_CHECK(
          std::none_of(
              routes_.begin(), routes_.end(),
              [&](const Route& r) { return r.device == device && r.pool == mempool_id; }),
          "hbmalloc: beginAllocateToPool: already allocating to pool (", mempool_id.first, ", ",
          mempool_id.second, ") on device ", static_cast<int>(device));
    }
    check(abi_, abi_.create_or_incref_pool(device, mempool_id.first, mempool_id.second));
    if (abi_.begin_capture(device) != HBMALLOC_OK) {
      const std::string message = last_error(abi_);
      abi_.release_pool(device, mempool_id.first, mempool_id.second);
      TORCH_CHECK(false, message);
    }
    std::lock_guard<std::mutex> lock(routes_mutex_);
    routes_.push_back(Route{device, mempool_id, std::move(filter)});
    route_count_.store(routes_.size(), std::memory_order_release);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    {
      std::lock_guard<std::mutex> lock(routes_mutex_);
      auto route = std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) {
        return r.device == device && r.pool == mempool_id;
      });
      TORCH_CHECK(
          route != routes_.end(), "hbmalloc: endAllocateToPool for pool (", mempool_id.first,
          ", ", mempool_id.second, ") on device ", static_cast<int>(device),
          ", which is not being allocated to");
      routes_.erase(route);
      route_count_.store(routes_.size(), std::memory_order_release);
    }
    check(abi_, abi_.end_capture(device));
  }

  // Called from ~MemPool and ~CUDAGraph: never throws. A pool released
  // once too often is PyTorch's bug, said as a warning.
  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    if (abi_.release_pool(device, mempool_id.first, mempool_id.second) != HBMALLOC_OK) {
      TORCH_WARN("hbmalloc: releasePool: ", last_error(abi_));
    }
    int holders = 0;
    if (abi_.pool_use_count(device, mempool_id.first, mempool_id.second, &holders) ==
            HBMALLOC_OK &&
        holders == 0) {
      forget_pool_options(device, mempool_id);
    }
  }

  // torch.cuda.MemPool(use_on_oom=...): when the device is out of memory,
  // hbmalloc serves the request from such a pool's memory before it
  // raises. ~MemPool calls this (with false): never throws.
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) {
    set_pool_option(device, mempool_id, [&](PoolOptions& o) { o.use_on_oom = use_on_oom; });
  }

  // torch 2.8's form, which MemPool(use_on_oom=True) calls to set it.
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id) {
    setUseOnOOM(device, mempool_id, true);
  }

  // torch.cuda.MemPool(no_split=True): recorded (poolNoSplit answers it),
  // but hbmalloc's pools split blocks as its policy does. Never throws.
  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) {
    set_pool_option(device, mempool_id, [](PoolOptions& o) { o.no_split = true; });
  }

  // What setUseOnOOM and setNoSplit recorded for the pool.
  bool poolUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id) {
    std::lock_guard<std::mutex> lock(options_mutex_);
    const auto* options = find_options(device, mempool_id);
    return options != nullptr && options->use_on_oom;
  }
  bool poolNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) {
    std::lock_guard<std::mutex> lock(options_mutex_);
    const auto* options = find_options(device, mempool_id);
    return options != nullptr && options->no_split;
  }

  // How many pools have an option set (none are kept for pools gone).
  size_t poolsWithOptions() {
    std::lock_guard<std::mutex> lock(options_mutex_);
    return options_.size();
  }

  // CUDA graph trees' check: are the pool's live allocations exactly
  // `expected`? Answered from hbmalloc's pool.
  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected) {
    size_t count = 0;
    check(
        abi_, abi_.pool_live_allocations(
                  device, mempool_id.first, mempool_id.second, nullptr, 0, &count));
    if (count != expected.size()) {
      return false;
    }
    std::vector<void*> live(count);
    check(
        abi_, abi_.pool_live_allocations(
                  device, mempool_id.first, mempool_id.second, live.data(), live.size(), &count));
    return count == expected.size() &&
        std::all_of(live.begin(), live.end(), [&](void* p) { return expected.count(p) == 1; });
  }

  // What torch.cuda.MemPool's constructor calls: ensureExistsAndIncrefPool
  // (torch 2.6, 2.7), createOrIncrefPool with a CUDAAllocator* (2.8-2.10)
  // or a shared_ptr (2.11 on). Not marked override: each exists in some
  // versions only, and overrides where the signature matches.
  void ensureExistsAndIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id) {
    create_or_incref_pool(device, mempool_id, nullptr);
  }

  void createOrIncrefPool(
      c10::DeviceIndex device, MempoolId_t mempool_id, cca::CUDAAllocator* allocator) {
    create_or_incref_pool(device, mempool_id, allocator);
  }

  void createOrIncrefPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::shared_ptr<cca::CUDAAllocator> allocator) {
    create_or_incref_pool(device, mempool_id, allocator.get());
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) {
    int count = 0;
    check(abi_, abi_.pool_use_count(device, mempool_id.first, mempool_id.second, &count));
    return count;
  }

  // emptyCache of one pool (~MemPool calls it after releasePool): hbmalloc
  // gave the pool's cache back when its last holder released it, and a pool
  // still held keeps its memory for its graphs.
  // Not marked override: before torch 2.8 emptyCache takes no pool (and
  // ~MemPool calls CUDAPluggableAllocator's emptyCache(), every device's).
  void emptyCache(MempoolId_t mempool_id) {
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      check(abi_, abi_.reset());
    }
  }

  // Sharing CUDA tensors between processes (torch.multiprocessing): in
  // PyTorch's own format (hbmalloc's C ABI writes and reads the bytes, see
  // crates/hbmalloc-capi/src/ipc.rs), so either side may be PyTorch's own
  // allocator (but for a block over handles of several sizes, which goes in
  // hbmalloc's own format, for hbmalloc only). The sender's block stays allocated while the receiver holds
  // it: PyTorch's CUDA IPC reference counting keeps the sender's DataPtr.
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    std::string handle(128, '\0');
    size_t length = 0;
    unsigned long long offset = 0;
    check(abi_, abi_.ipc_share(ptr, handle.data(), handle.size(), &length, &offset));
    if (length > handle.size()) {
      handle.resize(length);
      check(abi_, abi_.ipc_share(ptr, handle.data(), handle.size(), &length, &offset));
    }
    handle.resize(length);
    return cca::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(handle)};
  }

  // The receiver's side: maps what another process shared on the current
  // device. The memory stays mapped until the last holder of the returned
  // pointer lets go (PyTorch keeps one per handle string, as hbmalloc does).
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    // The current device, as PyTorch's own getIpcDevPtr takes it; where the
    // CUDA runtime cannot say (no driver it can use: the driver double's
    // machines), device 0, and hbmalloc's driver answers for it.
    c10::DeviceIndex device = 0;
    if (c10::cuda::GetDevice(&device) != cudaSuccess) {
      device = 0;
    }
    void* base = nullptr;
    check(abi_, abi_.ipc_open(handle.data(), handle.size(), device, &base));
    // Runs from a destructor: a failed unmap cannot be reported, and must
    // not throw. The function pointer is copied: it outlives this allocator.
    auto ipc_close = abi_.ipc_close;
    return std::shared_ptr<void>(base, [ipc_close](void* p) noexcept { ipc_close(p); });
  }

  // CUDA graph trees' checkpointing (torch.compile(mode="reduce-overhead")
  // when a tree's path changes) rebuilds a pool at the addresses it had;
  // hbmalloc's engine cannot place blocks at given addresses.
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex, MempoolId_t) override {
    TORCH_CHECK(false, kNoCheckpoint);
  }
  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex, std::shared_ptr<cca::AllocatorState>) override {
    TORCH_CHECK(false, kNoCheckpoint);
  }
  c10::DataPtr allocateWithAddress(size_t, void*) {
    TORCH_CHECK(false, kNoCheckpoint);
  }

  std::string name() override {
    return "hbmalloc";
  }

 private:
  static constexpr const char* kNoCppSnapshot =
      "hbmalloc: a memory snapshot from C++ is not available; take it from Python "
      "(torch.cuda.memory._snapshot(), which hbmalloc.torch.install() routes to hbmalloc, "
      "or hbmalloc.torch.memory_snapshot())";
  static constexpr const char* kNoCheckpoint =
      "hbmalloc: CUDA graph tree checkpointing (getCheckpointState, setCheckpointPoolState, "
      "allocateWithAddress) is not supported: hbmalloc cannot rebuild a pool at given "
      "addresses. torch.compile(mode='reduce-overhead') with more than one graph path per "
      "tree needs PyTorch's own allocator";

  void record_history(bool enabled, size_t entries, bool clear) {
    const auto limit = static_cast<size_t>(std::numeric_limits<ssize_t>::max());
    check(
        abi_, abi_.set_history_entries(
                  enabled ? static_cast<ssize_t>(std::min(entries, limit)) : 0, clear ? 1 : 0));
  }

  struct PoolOptions {
    int device;
    MempoolId_t pool;
    bool use_on_oom = false;
    bool no_split = false;
  };

  PoolOptions* find_options(int device, MempoolId_t pool) {
    auto found = std::find_if(options_.begin(), options_.end(), [&](const PoolOptions& o) {
      return o.device == device && o.pool == pool;
    });
    return found == options_.end() ? nullptr : &*found;
  }

  // Sets a pool's option; never throws (destructors call this).
  template <typename Set>
  void set_pool_option(int device, MempoolId_t pool, Set set) noexcept {
    try {
      std::lock_guard<std::mutex> lock(options_mutex_);
      PoolOptions* options = find_options(device, pool);
      if (options == nullptr) {
        options_.push_back(PoolOptions{device, pool});
        options = &options_.back();
      }
      set(*options);
      // Defaults are not kept: ~MemPool sets use_on_oom off after the pool
      // is gone, which must not leave an entry behind for each pool.
      if (!options->use_on_oom && !options->no_split) {
        options_.erase(options_.begin() + (options - options_.data()));
      }
      oom_pools_.store(
          std::count_if(
              options_.begin(), options_.end(), [](const PoolOptions& o) { return o.use_on_oom; }),
          std::memory_order_release);
    } catch (...) {
    }
  }

  void forget_pool_options(int device, MempoolId_t pool) noexcept {
    try {
      std::lock_guard<std::mutex> lock(options_mutex_);
      options_.erase(
          std::remove_if(
              options_.begin(), options_.end(),
              [&](const PoolOptions& o) { return o.device == device && o.pool == pool; }),
          options_.end());
      oom_pools_.store(
          std::count_if(
              options_.begin(), options_.end(), [](const PoolOptions& o) { return o.use_on_oom; }),
          std::memory_order_release);
    } catch (...) {
    }
  }

  // The request served from a use_on_oom pool of the device, if one can.
  void* allocate_from_oom_pools(size_t size, int device, cudaStream_t stream) {
    if (oom_pools_.load(std::memory_order_acquire) == 0) {
      return nullptr;
    }
    std::vector<MempoolId_t> pools;
    {
      std::lock_guard<std::mutex> lock(options_mutex_);
      for (const auto& o : options_) {
        if (o.device == device && o.use_on_oom) {
          pools.push_back(o.pool);
        }
      }
    }
    for (const auto& pool : pools) {
      try {
        return abi_.torch_pool_alloc(
            static_cast<ssize_t>(size), device, stream, pool.first, pool.second);
      } catch (const std::runtime_error&) {
      }
    }
    return nullptr;
  }

  // Each observer gets the device, the request, and the device's total and
  // free memory (0 and 0 if the driver cannot say).
  void tell_oom_observers(int device, size_t size) {
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(observers_mutex_);
      observers = oom_observers_;
    }
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (!observers.empty() &&
        abi_.mem_get_info(device, &free_bytes, &total_bytes) != HBMALLOC_OK) {
      free_bytes = total_bytes = 0;
    }
    for (const auto& observer : observers) {
      observer(device, size, total_bytes, free_bytes);
    }
  }

  void create_or_incref_pool(
      c10::DeviceIndex device, MempoolId_t mempool_id, const cca::CUDAAllocator* allocator) {
    TORCH_CHECK(
        allocator == nullptr || allocator == this,
        "hbmalloc is PyTorch's CUDA allocator (hbmalloc.torch.install(compiled=True)): a "
        "torch.cuda.MemPool with an allocator of its own is not supported; make it without one");
    check(abi_, abi_.create_or_incref_pool(device, mempool_id.first, mempool_id.second));
  }

  // The private pool the allocation on `stream` goes to, if a route's
  // filter takes it (the first route begun, as in PyTorch's allocator).
  std::optional<MempoolId_t> pool_for(int device, cudaStream_t stream) {
    if (route_count_.load(std::memory_order_acquire) == 0) {
      return std::nullopt;
    }
    std::lock_guard<std::mutex> lock(routes_mutex_);
    for (const auto& route : routes_) {
      if (route.device == device && route.filter(stream)) {
        return route.pool;
      }
    }
    return std::nullopt;
  }

  // Allocations of `device` that `filter` accepts go to `pool`.
  struct Route {
    int device;
    MempoolId_t pool;
    std::function<bool(cudaStream_t)> filter;
  };

  Abi abi_;
  std::mutex routes_mutex_;
  std::vector<Route> routes_;
  // routes_.size(), read without the lock on every allocation.
  std::atomic<size_t> route_count_{0};
  std::mutex observers_mutex_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::mutex options_mutex_;
  std::vector<PoolOptions> options_;
  // How many pools have use_on_oom set, read without the lock on an OOM.
  std::atomic<size_t> oom_pools_{0};
  std::mutex raw_mutex_;
  std::unordered_map<void*, Record> raw_;
};

void delete_tensor(void* context) {
  if (HbmallocAllocator* owner = tensor_owner.load(std::memory_order_acquire)) {
    owner->free_context(context);
  }
}

// Copies `text` into `buf` (at most `len - 1` bytes and a NUL).
void write_text(const std::string& text, char* buf, size_t len) {
  if (buf == nullptr || len == 0) {
    return;
  }
  size_t n = std::min(text.size(), len - 1);
  std::memcpy(buf, text.data(), n);
  buf[n] = '\0';
}

}  // namespace hbmalloc_torch

// Makes an HbmallocAllocator over the library at `library_path` PyTorch's
// CUDA allocator. Returns 0; 1 when the allocator could not be made (a
// symbol missing, ...), or 2 when PyTorch refused the swap (its allocator
// is already initialised), with the reason in `error`. Never throws.
extern "C" int hbmalloc_torch_compiled_install(
    const char* library_path, char* error, size_t error_len) {
  std::shared_ptr<hbmalloc_torch::HbmallocAllocator> allocator;
  try {
    allocator = std::make_shared<hbmalloc_torch::HbmallocAllocator>(
        hbmalloc_torch::load_abi(library_path));
  } catch (const std::exception& e) {
    hbmalloc_torch::write_text(e.what(), error, error_len);
    return 1;
  }
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  } catch (const c10::Error& e) {
    hbmalloc_torch::write_text(e.what_without_backtrace(), error, error_len);
    return 2;
  } catch (const std::exception& e) {
    hbmalloc_torch::write_text(e.what(), error, error_len);
    return 2;
  }
  return 0;
}
