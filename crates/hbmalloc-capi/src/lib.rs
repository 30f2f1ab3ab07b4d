//! hbmalloc's C ABI (`include/hbmalloc.h`) and the safe Rust layer under it.
//!
//! The C functions ([`ffi`]) are what PyTorch's `CUDAPluggableAllocator`
//! loads (`hbmalloc_alloc`, `hbmalloc_free`) plus statistics, summary,
//! snapshot and error reporting. Each one is a thin wrapper over a safe
//! function of this module that returns `Result<_, ApiError>`; the wrapper
//! catches panics, stores the error as the thread's last error and turns
//! it into a status code. The Python extension calls the safe functions.
//!
//! # The process-wide runtime
//!
//! At first use the runtime reads the configuration, loads the CUDA driver
//! (`hbmalloc_cuda::CudaDriver::load`, which honours `HBMALLOC_CUDA_DRIVER`)
//! and asks it how many devices it sees. The outcome, success or error, is
//! kept for the life of the process. Each device then gets one
//! [`SharedAllocator`] (the engine sharded by stream, so threads working on
//! different streams never wait for each other), created at its first use;
//! after that, finding it takes no lock.
//!
//! Configuration, read once:
//! - `HBMALLOC_CONF`: a settings string (`policy:pytorch,expandable_segments:True`);
//! - else `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`: PyTorch's syntax,
//!   policy `pytorch`;
//! - else the engine's default policy;
//! - `HBMALLOC_HISTORY_ENTRIES`: history entries kept for snapshots (default 0:
//!   snapshots then hold segments only, as PyTorch's do before
//!   `_record_memory_history`);
//! - `HBMALLOC_SHARDS`: engine shards per device (default 8; 1 gives a single
//!   lock per device, exactly PyTorch's locking).
//!
//! Production logging: `log:PATH` in `HBMALLOC_CONF` keeps the last
//! `log_entries:N` ([`DEFAULT_LOG_ENTRIES`] unless given) history entries of
//! each engine and [`write_log`] writes them as snapshots `hbmalloc replay` reads: `PATH`
//! for device 0, `PATH.dev<N>` for device N.

pub mod ffi;
pub mod ipc;

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use hbmalloc::{
    AllocError, AllocatorConfig, CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr,
    DeviceStats, PolicyConfig, PoolId, SharedAllocator, StreamId, ThreadSafeAllocator,
};
use hbmalloc_cuda::{CudaDevice, CudaDriver};

pub use ffi::*;

/// Environment variable holding a settings string (`policy:NAME,key:value,...`).
pub const CONF_ENV: &str = "HBMALLOC_CONF";
/// PyTorch's configuration variables, read (policy `pytorch`) when [`CONF_ENV`] is unset.
pub const PYTORCH_CONF_ENVS: [&str; 2] = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"];
/// Environment variable: history entries each allocator keeps for snapshots.
pub const HISTORY_ENV: &str = "HBMALLOC_HISTORY_ENTRIES";
/// Environment variable: engine shards per device.
pub const SHARDS_ENV: &str = "HBMALLOC_SHARDS";
/// Engine shards per device unless [`SHARDS_ENV`] says otherwise.
pub const DEFAULT_SHARDS: usize = 8;
/// History entries each engine of a device (a stream shard in use, a private
/// pool) keeps for the log (`log_entries:N`) unless told: at 40 bytes an
/// entry, 40 MB for each engine that allocates.
pub const DEFAULT_LOG_ENTRIES: usize = 1_000_000;

/// Where and how much the production log keeps (`log:PATH`,
/// `log_entries:N` in [`CONF_ENV`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    /// The log of device 0; device N's is this path with `.dev<N>` appended.
    pub path: std::path::PathBuf,
    /// History entries each engine keeps (older ones are dropped).
    pub entries: usize,
}

/// Status codes of the C ABI (`hbmalloc_status` in the header).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// Not enough device memory; the message is the OOM report.
    OutOfMemory = 1,
    /// A size, fraction, buffer or path argument is invalid.
    InvalidArgument = 2,
    /// The pointer is not a live allocation of hbmalloc on that device
    /// (foreign pointer, or double free).
    UnknownPointer = 3,
    /// The device index is negative or not below the driver's device count.
    DeviceOutOfRange = 4,
    /// The CUDA driver reported an error.
    DriverError = 5,
    /// No CUDA driver could be loaded, or it sees no device.
    NoDriver = 6,
    /// The configuration (`HBMALLOC_CONF`, `PYTORCH_CUDA_ALLOC_CONF`, ...) is invalid.
    ConfigError = 7,
    /// A bug in hbmalloc (a caught panic, a poisoned lock).
    Internal = 8,
    /// Not allowed now: `empty_cache` while a CUDA graph capture is
    /// underway, a device used for the first time during one, or the end of
    /// a capture when none is.
    InvalidState = 9,
}

/// An error of the API: a status and a message for people.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The status code the C functions report.
    pub status: Status,
    /// What went wrong, in one or more lines.
    pub message: String,
}

impl ApiError {
    /// An error with `status` and `message`.
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ApiError {}

impl From<AllocError> for ApiError {
    fn from(e: AllocError) -> Self {
        let status = match &e {
            AllocError::OutOfMemory(_) => Status::OutOfMemory,
            AllocError::InvalidSize { .. } | AllocError::InvalidConfig(_) => {
                Status::InvalidArgument
            }
            AllocError::UnknownPointer { .. } => Status::UnknownPointer,
            AllocError::UnknownPool { .. } => Status::InvalidArgument,
            AllocError::CaptureUnderway { .. } | AllocError::NoCaptureUnderway => {
                Status::InvalidState
            }
            AllocError::Device(d) => device_status(d),
        };
        ApiError::new(status, e.to_string())
    }
}

fn device_status(e: &DeviceError) -> Status {
    match &e.kind {
        DeviceErrorKind::NoDriver => Status::NoDriver,
        DeviceErrorKind::Driver(name) if name == "CUDA_ERROR_NO_DEVICE" => Status::NoDriver,
        DeviceErrorKind::OutOfMemory => Status::OutOfMemory,
        _ => Status::DriverError,
    }
}

fn device_error(e: DeviceError) -> ApiError {
    ApiError::new(device_status(&e), format!("hbmalloc: {e}"))
}

/// The driver, the configuration and one allocator slot per device.
struct Runtime {
    driver: Arc<CudaDriver>,
    config: AllocatorConfig,
    log: Option<LogConfig>,
    shards: usize,
    devices: Vec<OnceLock<SharedAllocator<CudaDevice>>>,
    /// Serialises creating allocators (and changing how much history they
    /// keep); holds the history entries an allocator created now keeps
    /// (`HBMALLOC_HISTORY_ENTRIES`, then [`set_history_entries`]).
    creating: Mutex<usize>,
    /// CUDA graph captures underway on any device ([`begin_capture`]):
    /// opening a device meanwhile is refused, as its probe makes driver
    /// calls a capture forbids (`CudaDevice::new`).
    captures: AtomicUsize,
}

/// Reads [`SHARDS_ENV`].
fn shards_from_env() -> Result<usize, ApiError> {
    match std::env::var(SHARDS_ENV) {
        Err(_) => Ok(DEFAULT_SHARDS),
        Ok(text) => match text.trim().parse::<usize>() {
            Ok(n) if (1..=1024).contains(&n) => Ok(n),
            _ => Err(ApiError::new(
                Status::ConfigError,
                format!(
                    "hbmalloc: invalid configuration in {SHARDS_ENV}: expected a number from 1 to 1024, got '{}'",
                    text.escape_debug()
                ),
            )),
        },
    }
}

/// A configuration variable's value, when it is set and not blank.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The variable the policy's configuration comes from, and its value:
/// [`CONF_ENV`], else the first of [`PYTORCH_CONF_ENVS`] (policy `pytorch`),
/// else `None` (the engine's default policy). Creates nothing, so callers
/// (the Python package) can say which policy will run before any allocator
/// exists.
pub fn configuration_source() -> Option<(&'static str, String)> {
    std::iter::once(CONF_ENV)
        .chain(PYTORCH_CONF_ENVS)
        .find_map(|var| env(var).map(|value| (var, value)))
}

fn config_error(var: &str, e: &dyn fmt::Display) -> ApiError {
    ApiError::new(
        Status::ConfigError,
        format!("hbmalloc: invalid configuration in {var}: {e}"),
    )
}

/// Takes the log's keys (`log:PATH`, `log_entries:N`) out of a settings
/// string: the rest, and the log when `log:` is there.
fn split_log_settings(settings: &str) -> Result<(String, Option<LogConfig>), ApiError> {
    let mut rest = Vec::new();
    let (mut path, mut entries) = (None, None);
    for item in settings.split(',') {
        match item.split_once(':').map(|(k, v)| (k.trim(), v.trim())) {
            Some(("log", "")) => return Err(config_error(CONF_ENV, &"log: needs a path")),
            Some(("log", value)) => path = Some(std::path::PathBuf::from(value)),
            Some(("log_entries", value)) => {
                entries = Some(
                    value
                        .parse::<usize>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| {
                            config_error(
                                CONF_ENV,
                                &format!(
                                    "log_entries: expected a number above 0, got '{}'",
                                    value.escape_debug()
                                ),
                            )
                        })?,
                )
            }
            _ => rest.push(item),
        }
    }
    let log = match (path, entries) {
        (Some(path), entries) => Some(LogConfig {
            path,
            entries: entries.unwrap_or(DEFAULT_LOG_ENTRIES),
        }),
        (None, Some(_)) => {
            return Err(config_error(
                CONF_ENV,
                &"log_entries: is given without log:PATH",
            ))
        }
        (None, None) => None,
    };
    Ok((rest.join(","), log))
}

/// The production log [`CONF_ENV`] asks for (`log:PATH`), if any.
pub fn log_config_from_env() -> Result<Option<LogConfig>, ApiError> {
    match configuration_source() {
        Some((CONF_ENV, settings)) => Ok(split_log_settings(&settings)?.1),
        _ => Ok(None),
    }
}

/// Reads the configuration from the environment (see the crate docs).
pub fn config_from_env() -> Result<AllocatorConfig, ApiError> {
    let mut config = AllocatorConfig::default();
    match configuration_source() {
        Some((CONF_ENV, settings)) => {
            let (settings, log) = split_log_settings(&settings)?;
            config.policy =
                PolicyConfig::from_settings(&settings).map_err(|e| config_error(CONF_ENV, &e))?;
            if let Some(log) = log {
                config.history_entries = log.entries;
            }
        }
        Some((var, conf)) => {
            config.policy =
                PolicyConfig::parse("pytorch", &conf).map_err(|e| config_error(var, &e))?;
        }
        None => {}
    }
    if let Some(entries) = env(HISTORY_ENV) {
        let entries: usize = entries.trim().parse().map_err(|_| {
            config_error(
                HISTORY_ENV,
                &format!(
                    "expected a number of entries, got '{}'",
                    entries.escape_debug()
                ),
            )
        })?;
        // A log keeps at least what it was configured to.
        config.history_entries = config.history_entries.max(entries);
    }
    Ok(config)
}

impl Runtime {
    fn load() -> Result<Runtime, ApiError> {
        let config = config_from_env()?;
        let log = log_config_from_env()?;
        let shards = shards_from_env()?;
        let driver = CudaDriver::load().map_err(device_error)?;
        let count = driver.device_count().map_err(device_error)?;
        let devices = (0..count.max(0)).map(|_| OnceLock::new()).collect();
        Ok(Runtime {
            driver,
            creating: Mutex::new(config.history_entries),
            config,
            log,
            shards,
            devices,
            captures: AtomicUsize::new(0),
        })
    }

    fn slot(&self, device: i32) -> Result<&OnceLock<SharedAllocator<CudaDevice>>, ApiError> {
        usize::try_from(device)
            .ok()
            .and_then(|i| self.devices.get(i))
            .ok_or_else(|| {
                ApiError::new(
                    Status::DeviceOutOfRange,
                    format!(
                        "hbmalloc: device {device} is out of range: the CUDA driver ({}) sees {} device(s)",
                        self.driver.path(),
                        self.devices.len()
                    ),
                )
            })
    }
}

fn runtime() -> Result<&'static Runtime, ApiError> {
    static RUNTIME: OnceLock<Result<Runtime, ApiError>> = OnceLock::new();
    RUNTIME
        .get_or_init(Runtime::load)
        .as_ref()
        .map_err(Clone::clone)
}

/// Runs `f` on the allocator of `device`, creating it on first use.
pub fn with_allocator<R>(
    device: i32,
    f: impl FnOnce(&SharedAllocator<CudaDevice>) -> Result<R, ApiError>,
) -> Result<R, ApiError> {
    let runtime = runtime()?;
    let slot = runtime.slot(device)?;
    if let Some(allocator) = slot.get() {
        return f(allocator);
    }
    let history_entries = runtime.creating.lock().unwrap_or_else(|e| e.into_inner());
    if slot.get().is_none() && runtime.captures.load(Ordering::SeqCst) > 0 {
        return Err(ApiError::new(
            Status::InvalidState,
            format!(
                "hbmalloc: device {device} is used for the first time while a CUDA graph capture is \
                 underway; opening it takes driver calls a capture forbids: use the device once \
                 (an allocation, say) before capturing"
            ),
        ));
    }
    if slot.get().is_none() {
        let cuda = CudaDevice::new(Arc::clone(&runtime.driver), device).map_err(device_error)?;
        let config = AllocatorConfig {
            history_entries: *history_entries,
            ..runtime.config.clone()
        };
        let allocator = SharedAllocator::new(cuda, config, runtime.shards)?;
        // Only this thread sets slots (under `creating`), so this cannot fail.
        let _ = slot.set(allocator);
    }
    match slot.get() {
        Some(allocator) => f(allocator),
        None => Err(ApiError::new(
            Status::Internal,
            format!("hbmalloc: the allocator of device {device} could not be stored"),
        )),
    }
}

/// Runs `f` on the allocator of `device` if it exists; `None` when the
/// device has not allocated yet.
pub fn with_existing_allocator<R>(
    device: i32,
    f: impl FnOnce(&SharedAllocator<CudaDevice>) -> Result<R, ApiError>,
) -> Result<Option<R>, ApiError> {
    runtime()?.slot(device)?.get().map(f).transpose()
}

/// Loads the runtime now (driver, configuration); `Ok` with the number of
/// devices the driver sees.
pub fn init() -> Result<usize, ApiError> {
    Ok(runtime()?.devices.len())
}

/// A request's size from the C ABI: `None` for 0 (no allocation), an error
/// for a negative or absurd one.
fn request_size(size: i64) -> Result<Option<u64>, ApiError> {
    if size == 0 {
        return Ok(None);
    }
    let size = u64::try_from(size).map_err(|_| {
        ApiError::new(
            Status::InvalidArgument,
            format!("hbmalloc: invalid allocation size {size}: sizes must be positive"),
        )
    })?;
    if size > hbmalloc::MAX_REQUEST_BYTES {
        return Err(AllocError::InvalidSize { size }.into());
    }
    Ok(Some(size))
}

/// Allocates `size` bytes on `device` for use on `stream`. `Ok(0)` for size 0.
pub fn alloc(size: i64, device: i32, stream: StreamId) -> Result<DevicePtr, ApiError> {
    match request_size(size)? {
        Some(size) => with_allocator(device, |a| Ok(a.malloc(size, stream)?)),
        None => Ok(0),
    }
}

/// Allocates `size` bytes on `device` for use on `stream` from the private
/// pool `pool` (see [`create_or_incref_pool`]). `Ok(0)` for size 0.
pub fn pool_alloc(
    pool: PoolId,
    size: i64,
    device: i32,
    stream: StreamId,
) -> Result<DevicePtr, ApiError> {
    match request_size(size)? {
        Some(size) => with_allocator(device, |a| Ok(a.malloc_in_pool(pool, size, stream)?)),
        None => Ok(0),
    }
}

/// Makes the private memory pool `pool` on `device` (PyTorch's
/// `createOrIncrefPool`: a `MemPool`, or the pool of a CUDA graph capture),
/// or counts one more holder of it.
pub fn create_or_incref_pool(device: i32, pool: PoolId) -> Result<(), ApiError> {
    with_allocator(device, |a| Ok(a.create_or_incref_pool(pool)?))
}

/// One holder of `pool` fewer (PyTorch's `releasePool`); with none left its
/// memory goes back to the driver as its allocations are freed.
pub fn release_pool(device: i32, pool: PoolId) -> Result<(), ApiError> {
    match with_existing_allocator(device, |a| Ok(a.release_pool(pool)?))? {
        Some(()) => Ok(()),
        None => Err(AllocError::UnknownPool { pool }.into()),
    }
}

/// How many hold `pool` on `device` (0: no such pool).
pub fn pool_use_count(device: i32, pool: PoolId) -> Result<u64, ApiError> {
    Ok(with_existing_allocator(device, |a| Ok(a.pool_use_count(pool)))?.unwrap_or(0))
}

/// The live allocations of `pool` on `device`, in address order (PyTorch's
/// `checkPoolLiveAllocations`); an unknown pool is an error.
pub fn pool_live_allocations(device: i32, pool: PoolId) -> Result<Vec<DevicePtr>, ApiError> {
    with_existing_allocator(device, |a| Ok(a.pool_live_allocations(pool)))?
        .flatten()
        .ok_or_else(|| AllocError::UnknownPool { pool }.into())
}

/// A CUDA graph capture (or `torch.cuda.use_mem_pool`) begins on `device`:
/// see `hbmalloc::capture` for what the allocator stops doing meanwhile.
pub fn begin_capture(device: i32) -> Result<(), ApiError> {
    with_allocator(device, |a| Ok(a.begin_capture()?))?;
    runtime()?.captures.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// The capture begun by [`begin_capture`] ended.
pub fn end_capture(device: i32) -> Result<(), ApiError> {
    match with_existing_allocator(device, |a| Ok(a.end_capture()?))? {
        Some(()) => {
            runtime()?.captures.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
        None => Err(AllocError::NoCaptureUnderway.into()),
    }
}

/// Frees `ptr`, allocated on `device`. Freeing 0 (NULL) does nothing.
pub fn free(ptr: DevicePtr, device: i32) -> Result<(), ApiError> {
    if ptr == 0 {
        return Ok(());
    }
    match with_existing_allocator(device, |a| Ok(a.free(ptr)?))? {
        Some(()) => Ok(()),
        None => Err(AllocError::UnknownPointer { ptr }.into()),
    }
}

/// Declares that `ptr` (allocated on `device`) is also used on `stream`.
pub fn record_stream(ptr: DevicePtr, device: i32, stream: StreamId) -> Result<(), ApiError> {
    match with_existing_allocator(device, |a| Ok(a.record_stream(ptr, stream)?))? {
        Some(()) => Ok(()),
        None => Err(AllocError::UnknownPointer { ptr }.into()),
    }
}

/// Returns the cached memory of `device` to the driver.
pub fn empty_cache(device: i32) -> Result<(), ApiError> {
    with_existing_allocator(device, |a| Ok(a.empty_cache()?)).map(|_| ())
}

/// Limits `device`'s allocator to `fraction` of its memory.
pub fn set_memory_fraction(fraction: f64, device: i32) -> Result<(), ApiError> {
    with_allocator(device, |a| Ok(a.set_memory_fraction(fraction)?))
}

/// The share of `device`'s memory its allocator may hold
/// (`torch.cuda.get_per_process_memory_fraction`).
pub fn memory_fraction(device: i32) -> Result<f64, ApiError> {
    let configured = runtime()?.config.policy.memory_fraction();
    Ok(with_existing_allocator(device, |a| Ok(a.memory_fraction()))?.unwrap_or(configured))
}

/// The driver's free and total memory of `device`, in bytes
/// (`cudaMemGetInfo`).
pub fn mem_get_info(device: i32) -> Result<(u64, u64), ApiError> {
    with_allocator(device, |a| {
        let info = a.device().memory_info().map_err(device_error)?;
        Ok((info.free_bytes, info.total_bytes))
    })
}

/// `empty_cache` on every device with an allocator (PyTorch's `reset` hook,
/// called by `torch.cuda.empty_cache()`).
pub fn reset() -> Result<(), ApiError> {
    let runtime = runtime()?;
    for device in 0..runtime.devices.len() {
        // `devices` has at most i32::MAX entries: the driver counts in an int.
        empty_cache(device as i32)?;
    }
    Ok(())
}

/// The statistics of `device`'s allocator, or those a new one would report
/// when the device has not allocated yet. Reading them never creates an
/// allocator: its CUDA context would take memory on that GPU (a process
/// that logs every device's statistics would hold a context on each, as
/// PyTorch's own allocator does not).
fn stats_of(device: i32) -> Result<DeviceStats, ApiError> {
    let runtime = runtime()?;
    Ok(match runtime.slot(device)?.get() {
        Some(allocator) => allocator.stats(),
        None => runtime.config.policy.initial_stats(),
    })
}

/// `torch.cuda.memory_stats()` of `device` as one JSON object.
pub fn stats_json(device: i32) -> Result<String, ApiError> {
    Ok(hbmalloc_export::stats_to_json(&stats_of(device)?))
}

/// PyTorch's `memory_stats()` dictionary for `device`.
pub fn stats_map(device: i32) -> Result<std::collections::BTreeMap<String, i64>, ApiError> {
    Ok(stats_of(device)?.to_pytorch_map())
}

/// The values of `keys` among `device`'s [`stats_map`], in their order:
/// what a C++ allocator fills PyTorch's `DeviceStats` from. A key
/// `memory_stats()` does not have is an error naming it.
pub fn stats_values(device: i32, keys: &[&str]) -> Result<Vec<i64>, ApiError> {
    let stats = stats_of(device)?;
    keys.iter()
        .map(|key| {
            stats.pytorch_value(key).ok_or_else(|| {
                ApiError::new(
                    Status::InvalidArgument,
                    format!("hbmalloc: memory_stats() has no key {key:?}"),
                )
            })
        })
        .collect()
}

/// The largest request `device`'s allocator could serve now without
/// freeing anything: PyTorch's `cacheInfo`, which cuDNN's benchmark mode
/// asks for (see [`SharedAllocator::largest_free_block_bytes`]).
pub fn largest_free_block(device: i32) -> Result<u64, ApiError> {
    with_allocator(device, |a| Ok(a.largest_free_block_bytes()?))
}

/// `torch.cuda.reset_peak_memory_stats(device)`: every peak statistic of
/// `device` becomes its current value.
pub fn reset_peak_stats(device: i32) -> Result<(), ApiError> {
    with_existing_allocator(device, |a| {
        a.reset_peak_stats();
        Ok(())
    })
    .map(|_| ())
}

/// `torch.cuda.reset_accumulated_memory_stats(device)`: the running totals
/// and event counts of `device` start again from zero.
pub fn reset_accumulated_stats(device: i32) -> Result<(), ApiError> {
    with_existing_allocator(device, |a| {
        a.reset_accumulated_stats();
        Ok(())
    })
    .map(|_| ())
}

/// `torch.cuda.memory._record_memory_history`: every allocator, and those
/// created later, keeps its last `entries` history entries from now on (0
/// stops recording); `clear` drops the entries kept so far.
pub fn set_history_entries(entries: usize, clear: bool) -> Result<(), ApiError> {
    let runtime = runtime()?;
    let mut history_entries = runtime.creating.lock().unwrap_or_else(|e| e.into_inner());
    *history_entries = entries;
    for allocator in runtime.devices.iter().filter_map(OnceLock::get) {
        allocator.set_history_entries(entries, clear);
    }
    Ok(())
}

/// The history entries allocators keep now ([`set_history_entries`]); 0
/// when history is off (PyTorch's `isHistoryEnabled`).
pub fn history_entries() -> Result<usize, ApiError> {
    Ok(*runtime()?
        .creating
        .lock()
        .unwrap_or_else(|e| e.into_inner()))
}

/// `torch.cuda.memory_summary()` text for `device`.
pub fn summary(device: i32, abbreviated: bool) -> Result<String, ApiError> {
    Ok(hbmalloc::memory_summary(
        &stats_of(device)?,
        i64::from(device),
        abbreviated,
    ))
}

/// The snapshot of `device` as a PyTorch memory-snapshot pickle: no
/// segments for a device that has not allocated (no allocator is created
/// for it).
pub fn snapshot_pickle(device: i32) -> Result<Vec<u8>, ApiError> {
    match existing_snapshot_pickle(device)? {
        Some(bytes) => Ok(bytes),
        None => {
            let empty = hbmalloc::Snapshot {
                settings: runtime()?.config.policy.to_settings(),
                ..Default::default()
            };
            Ok(hbmalloc_export::snapshot_to_pickle(
                &empty,
                i64::from(device),
            ))
        }
    }
}

/// [`snapshot_pickle`], or `None` when `device` has not allocated yet (no
/// allocator is created for it).
pub fn existing_snapshot_pickle(device: i32) -> Result<Option<Vec<u8>>, ApiError> {
    with_existing_allocator(device, |a| Ok(pickle_snapshot(a, device)))
}

fn pickle_snapshot(allocator: &SharedAllocator<CudaDevice>, device: i32) -> Vec<u8> {
    hbmalloc_export::snapshot_to_pickle(&allocator.snapshot(), i64::from(device))
}

/// Writes the snapshot of `device` to `path` (`torch.cuda.memory._dump_snapshot` format).
pub fn write_snapshot(device: i32, path: &std::path::Path) -> Result<(), ApiError> {
    let bytes = snapshot_pickle(device)?;
    std::fs::write(path, bytes).map_err(|e| {
        ApiError::new(
            Status::InvalidArgument,
            format!("hbmalloc: cannot write snapshot to {}: {e}", path.display()),
        )
    })
}

/// The log file of `device` under the log path `path` ([`LogConfig`]).
pub fn log_path_of_device(path: &std::path::Path, device: i32) -> std::path::PathBuf {
    if device == 0 {
        return path.to_path_buf();
    }
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".dev{device}"));
    name.into()
}

/// The production log's path (`log:PATH` in [`CONF_ENV`]), if one is configured.
pub fn log_path() -> Result<Option<std::path::PathBuf>, ApiError> {
    Ok(runtime()?.log.as_ref().map(|log| log.path.clone()))
}

/// Writes the production log: the snapshot of every device that has
/// allocated, with the history it kept, to [`log_path_of_device`]; the
/// paths written. An error when no log is configured.
pub fn write_log() -> Result<Vec<std::path::PathBuf>, ApiError> {
    let runtime = runtime()?;
    let Some(log) = &runtime.log else {
        return Err(ApiError::new(
            Status::InvalidState,
            format!("hbmalloc: no log is configured: add log:PATH to {CONF_ENV}"),
        ));
    };
    let mut written = Vec::new();
    for (device, slot) in runtime.devices.iter().enumerate() {
        if slot.get().is_none() {
            continue;
        }
        // `devices` has at most i32::MAX entries: the driver counts in an int.
        let path = log_path_of_device(&log.path, device as i32);
        write_snapshot(device as i32, &path)?;
        written.push(path);
    }
    Ok(written)
}

/// Checks `device`'s allocator invariants (`Ok` when it has none yet).
pub fn check_invariants(device: i32) -> Result<(), ApiError> {
    with_existing_allocator(device, |a| {
        a.check_invariants().map_err(|e| {
            ApiError::new(Status::Internal, format!("hbmalloc: invariant broken: {e}"))
        })
    })
    .map(|_| ())
}

/// The settings string of `device`'s allocator (`policy:pytorch,...`).
pub fn settings(device: i32) -> Result<String, ApiError> {
    let configured = runtime()?.config.policy.to_settings();
    Ok(with_existing_allocator(device, |a| Ok(a.settings()))?.unwrap_or(configured))
}

/// The driver calls `device`'s allocator has made, by kind: (kind, calls,
/// wall-clock seconds spent in them), every kind in `CallKind::ALL`'s order
/// (all zero before the device's first allocation).
pub fn driver_calls(device: i32) -> Result<Vec<(&'static str, u64, f64)>, ApiError> {
    let (calls, nanos) = with_existing_allocator(device, |a| {
        Ok((a.device().call_counts().by_kind, a.device().call_nanos()))
    })?
    .unwrap_or_default();
    Ok(CallKind::ALL
        .iter()
        .zip(calls.iter().zip(nanos))
        .map(|(kind, (&count, ns))| (kind.name(), count, ns as f64 * 1e-9))
        .collect())
}
