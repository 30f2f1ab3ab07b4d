/*
 * hbmalloc.h: the C ABI of hbmalloc, a caching GPU-memory allocator.
 *
 * Library: libhbmalloc_capi.so (crates/hbmalloc-capi), or the Python
 * package's extension module, which exports the same symbols
 * (hbmalloc.library_path()).
 *
 * PyTorch: hbmalloc_alloc and hbmalloc_free have the signatures that
 * torch.cuda.memory.CUDAPluggableAllocator(path, "hbmalloc_alloc",
 * "hbmalloc_free") expects. Built that way, from Python, PyTorch passes
 * nothing else on: Tensor.record_stream, torch.cuda.empty_cache(), memory
 * fractions and CUDA graph pools stop at hooks only C++ can set
 * (hbmalloc.torch.install() covers the first three from Python and refuses
 * graph capture). From C++, torch::cuda::CUDAPluggableAllocator's
 * set_reset_fn and set_memory_fraction_fn take hbmalloc_reset and
 * hbmalloc_set_memory_fraction; set_record_stream_fn's hook has no device
 * argument, so wrap hbmalloc_record_stream with the tensor's device.
 * CUDAPluggableAllocator has no hook at all for cacheInfo (which cuDNN's
 * benchmark mode calls: hbmalloc.torch.install() keeps that mode off) or the
 * statistics: a C++ subclass overrides them with hbmalloc_cache_info and
 * hbmalloc_stats_values, as the Python package's torch_allocator.cc does
 * (hbmalloc.torch.install(compiled=True)). There is none for CUDA IPC
 * (torch.multiprocessing's sharing of CUDA tensors raises); policy hbm's
 * memory is cuMemMap memory, which CUDA's legacy IPC calls refuse.
 *
 * Errors: every function records its outcome as the calling thread's last
 * error: hbmalloc_last_error_code() gives the status (HBMALLOC_OK after a
 * successful call), hbmalloc_last_error() the message. No function unwinds
 * or aborts on bad input (but hbmalloc_torch_alloc, for C++ callers, throws
 * by design); an internal bug is reported as HBMALLOC_INTERNAL.
 *
 * Configuration, read once at first use from the environment:
 *   HBMALLOC_CONF            settings string, e.g. "policy:pytorch,expandable_segments:True"
 *                            (log:PATH[,log_entries:N] keeps a log: hbmalloc_write_log)
 *   PYTORCH_CUDA_ALLOC_CONF  (else PYTORCH_ALLOC_CONF) PyTorch's syntax, policy pytorch
 *   HBMALLOC_HISTORY_ENTRIES history entries kept for snapshots (default 0)
 *   HBMALLOC_SHARDS          engine shards per device (default 8; 1 = one lock per device)
 *   HBMALLOC_CUDA_DRIVER     path of the CUDA driver library (default: libcuda.so.1)
 * A bad value is reported by every call (HBMALLOC_CONFIG_ERROR, naming the
 * variable and the key).
 *
 * Devices: a device's allocator (and its CUDA context) is created by its
 * first allocation, memory fraction or cache query. Reading its statistics,
 * summary, settings, fraction or snapshot before that creates nothing and
 * answers what a new allocator would (zeros, no segments), as PyTorch's
 * allocator does for a device a process does not use.
 *
 * Threads: every function may be called from any thread. Each device has
 * one allocator, created at its first use and sharded by stream
 * (HBMALLOC_SHARDS, default 8): threads working on different streams do not
 * wait for each other.
 */
#ifndef HBMALLOC_H
#define HBMALLOC_H

#include <stddef.h>    /* size_t */
#include <stdint.h>    /* int64_t */
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA's stream handle, declared as CUDA's headers do, so this header needs
 * no CUDA headers and stays compatible with them. */
#ifndef __CUDA_RUNTIME_H__
struct CUstream_st;
typedef struct CUstream_st *cudaStream_t;
#endif

/* Status codes (hbmalloc_last_error_code(), and the int results below). */
typedef enum hbmalloc_status {
    HBMALLOC_OK = 0,
    /* Not enough device memory; the message is the OOM report (what was
     * asked, what the device and allocator held, why, what would help). */
    HBMALLOC_OUT_OF_MEMORY = 1,
    /* A size (< 0, or over 1 PiB), fraction, buffer or path is invalid. */
    HBMALLOC_INVALID_ARGUMENT = 2,
    /* The pointer is not a live hbmalloc allocation on that device: a
     * foreign pointer or a double free. The allocator is unchanged. */
    HBMALLOC_UNKNOWN_POINTER = 3,
    /* The device index is negative or not below the driver's device count. */
    HBMALLOC_DEVICE_OUT_OF_RANGE = 4,
    /* The CUDA driver reported an error. */
    HBMALLOC_DRIVER_ERROR = 5,
    /* No CUDA driver could be loaded, or it sees no device. */
    HBMALLOC_NO_DRIVER = 6,
    /* The configuration in the environment is invalid. */
    HBMALLOC_CONFIG_ERROR = 7,
    /* A bug in hbmalloc (caught panic). Please report it. */
    HBMALLOC_INTERNAL = 8,
    /* Not allowed now: empty_cache during a CUDA graph capture, a device
     * used for the first time during one (opening it takes driver calls a
     * capture forbids), or the end of a capture when none is underway. */
    HBMALLOC_INVALID_STATE = 9
} hbmalloc_status;

/* Allocates size bytes on device for use on stream. Returns NULL on failure
 * (last error says why); size 0 returns NULL without error. */
void *hbmalloc_alloc(ssize_t size, int device, cudaStream_t stream);

/* hbmalloc_alloc for C++ callers, and what hbmalloc.torch.install() gives
 * PyTorch: a failure throws std::runtime_error (the last error as its
 * message, beginning "CUDA out of memory." when memory ran out) instead of
 * returning NULL, which PyTorch's CUDAPluggableAllocator would hand to a
 * tensor unchecked. PyTorch raises the exception as a Python RuntimeError.
 * size 0 returns NULL without throwing. Never call it from C. */
void *hbmalloc_torch_alloc(ssize_t size, int device, cudaStream_t stream);

/* Private memory pools: a torch.cuda.MemPool, or the pool a CUDA graph
 * capture allocates from. A pool is named by PyTorch's MempoolId_t, a pair
 * of unsigned 64-bit numbers (pool_first, pool_second). Its memory is
 * PyTorch-style plain segments, reused only by allocations into the same
 * pool, and given back once every holder has released it and its last
 * allocation is freed. Each returns a status unless noted. */

/* Makes the pool, or counts one more holder (PyTorch's createOrIncrefPool). */
int hbmalloc_create_or_incref_pool(int device, unsigned long long pool_first,
                                   unsigned long long pool_second);

/* One holder fewer (PyTorch's releasePool); HBMALLOC_INVALID_ARGUMENT when
 * none is left. Giving the pool's memory back is best effort here. */
int hbmalloc_release_pool(int device, unsigned long long pool_first,
                          unsigned long long pool_second);

/* How many hold the pool, into *count (0: no such pool). */
int hbmalloc_pool_use_count(int device, unsigned long long pool_first,
                            unsigned long long pool_second, int *count);

/* CUDA IPC in PyTorch's format (torch.multiprocessing, CUDAAllocator's
 * shareIpcHandle / getIpcDevPtr). hbmalloc_ipc_share writes the bytes to
 * send for allocation ptr into handle (PyTorch's 'c' or 'e', or hbmalloc's
 * own 'h' for physical handles of several sizes, which only hbmalloc opens;
 * at most capacity bytes, their number into *length: call again with a
 * larger buffer when it exceeds capacity) and ptr's offset in the shared
 * memory into *offset. hbmalloc_ipc_open maps
 * what another process (hbmalloc's or PyTorch's own allocator) shared, on
 * device, into *base (the same bytes again: the same base); each open needs
 * one hbmalloc_ipc_close(base), the last unmapping it. */
int hbmalloc_ipc_share(void *ptr, char *handle, size_t capacity,
                       size_t *length, unsigned long long *offset);
int hbmalloc_ipc_open(const char *handle, size_t length, int device,
                      void **base);
int hbmalloc_ipc_close(void *base);

/* The pool's live allocations (handed out, not yet freed): their number
 * into *count, the first capacity addresses into ptrs (NULL when capacity
 * is 0). PyTorch's checkPoolLiveAllocations. */
int hbmalloc_pool_live_allocations(int device, unsigned long long pool_first,
                                   unsigned long long pool_second, void **ptrs,
                                   size_t capacity, size_t *count);

/* hbmalloc_alloc from the pool; an unknown or released pool is
 * HBMALLOC_INVALID_ARGUMENT. Returns the pointer, or NULL (last error). */
void *hbmalloc_pool_alloc(ssize_t size, int device, cudaStream_t stream,
                          unsigned long long pool_first,
                          unsigned long long pool_second);

/* hbmalloc_pool_alloc that throws as hbmalloc_torch_alloc does (C++ only). */
void *hbmalloc_torch_pool_alloc(ssize_t size, int device, cudaStream_t stream,
                                unsigned long long pool_first,
                                unsigned long long pool_second);

/* A CUDA graph capture (or torch.cuda.use_mem_pool) begins on device, and
 * ends. Meanwhile device's allocator queries and synchronizes no event,
 * records the events of frees with uses on other streams only after the
 * last capture ends, gives no memory back (empty_cache of device is
 * HBMALLOC_INVALID_STATE; other devices' allocators are not affected), and
 * creates memory in relaxed capture mode.
 * Captures nest; an end with none underway is HBMALLOC_INVALID_STATE. */
int hbmalloc_begin_capture(int device);
int hbmalloc_end_capture(int device);

/* Frees ptr. NULL is a no-op. size and stream are ignored (hbmalloc knows
 * both); an unknown pointer sets HBMALLOC_UNKNOWN_POINTER. */
void hbmalloc_free(void *ptr, ssize_t size, int device, cudaStream_t stream);

/* Declares that ptr is also used on stream: its memory is reused only after
 * the work queued on stream before the free completes. Returns a status. */
int hbmalloc_record_stream(void *ptr, int device, cudaStream_t stream);

/* Returns device's cached free memory to the driver. Returns a status. */
int hbmalloc_empty_cache(int device);

/* Limits device's allocator to fraction (0..1) of the device's memory.
 * Returns a status. */
int hbmalloc_set_memory_fraction(double fraction, int device);

/* The share of device's memory its allocator may hold, into *fraction
 * (torch.cuda.get_per_process_memory_fraction). Returns a status. */
int hbmalloc_memory_fraction(int device, double *fraction);

/* PyTorch's cacheInfo (which cuDNN's benchmark mode asks for to bound the
 * workspaces it tries): the largest request device's allocator could serve
 * now without freeing anything, into *largest_block: its largest cached
 * free block, or the device's free memory within the memory fraction if
 * that is more. Returns a status. */
int hbmalloc_cache_info(int device, size_t *largest_block);

/* torch.cuda.reset_peak_memory_stats(device): every peak statistic becomes
 * its current value. Returns a status. */
int hbmalloc_reset_peak_stats(int device);

/* torch.cuda.reset_accumulated_memory_stats(device): the allocated and freed
 * totals, num_alloc_retries and num_ooms start again from 0. Returns a status. */
int hbmalloc_reset_accumulated_stats(int device);

/* Every device's allocator, and those created later, keeps its last entries
 * history entries (for hbmalloc_snapshot) from now on; 0 stops recording and
 * keeps what was recorded, a non-zero clear drops it. HBMALLOC_HISTORY_ENTRIES
 * gives the first value. Returns a status (HBMALLOC_INVALID_ARGUMENT for
 * entries < 0). */
int hbmalloc_set_history_entries(ssize_t entries, int clear);

/* The history entries each allocator keeps now, into *entries (0: history
 * is off). Returns a status. */
int hbmalloc_history_entries(size_t *entries);

/* Writes torch.cuda.memory_stats(device) as one JSON object into buf, like
 * snprintf: at most len - 1 bytes and a NUL. Returns the JSON's length
 * (call with buf NULL, len 0 to size the buffer), or -1 on error. */
ssize_t hbmalloc_stats_json(int device, char *buf, size_t len);

/* The driver's free and total memory of device, in bytes, into *free_bytes
 * and *total_bytes (cudaMemGetInfo; what PyTorch's out-of-memory observers
 * are told). Returns a status. */
int hbmalloc_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes);

/* values[i] = torch.cuda.memory_stats(device)[keys[i]] for each of count
 * keys ("allocated_bytes.all.current", ...): what a C++ allocator fills
 * PyTorch's DeviceStats from. Nothing is written unless every key is known
 * (an unknown one is HBMALLOC_INVALID_ARGUMENT, naming it). Returns a
 * status. */
int hbmalloc_stats_values(int device, const char *const *keys, size_t count,
                          int64_t *values);

/* Writes torch.cuda.memory_summary(device, abbreviated) text into buf, as
 * hbmalloc_stats_json. Returns the text's length, or -1 on error. */
ssize_t hbmalloc_summary(int device, int abbreviated, char *buf, size_t len);

/* Writes device's memory snapshot to the file path, in the pickle format of
 * torch.cuda.memory._dump_snapshot (pytorch.org/memory_viz reads it).
 * Returns a status. */
int hbmalloc_snapshot(int device, const char *path);

/* Production log: with log:PATH in HBMALLOC_CONF (and log_entries:N, default
 * 1000000 per stream shard), writes each device's snapshot and kept history, which
 * hbmalloc replay reads, to PATH (device 0) or PATH.dev<N>. Returns a status
 * (HBMALLOC_INVALID_STATE when no log is configured). */
int hbmalloc_write_log(void);

/* Copies the calling thread's last error message into buf, as
 * hbmalloc_stats_json. Returns its length (0 when the last call succeeded). */
ssize_t hbmalloc_last_error(char *buf, size_t len);

/* The calling thread's last status (an hbmalloc_status value). */
int hbmalloc_last_error_code(void);

/* Loads the driver and configuration now instead of at the first call, so
 * errors show early. PyTorch's init hook passes the number of devices it
 * uses: an error if that exceeds the driver's count (negative: unchecked).
 * Returns a status. */
int hbmalloc_init(int device_count);

/* Returns every device's cached free memory to the driver (PyTorch's reset
 * hook, called by torch.cuda.empty_cache()). Returns a status. */
int hbmalloc_reset(void);

#ifdef __cplusplus
}
#endif

#endif /* HBMALLOC_H */
