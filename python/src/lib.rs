//! `hbmalloc._native`: the Python extension behind the `hbmalloc` package.
//!
//! Two faces in one shared library:
//! - Python functions (`memory_stats`, `memory_summary`, `snapshot`,
//!   `empty_cache`, `record_stream`, the resets, `replay`, ...) over the same
//!   per-device allocators that the C ABI serves;
//! - the C ABI of `hbmalloc-capi` (`hbmalloc_alloc`, `hbmalloc_free`, ...),
//!   re-exported so that `torch.cuda.memory.CUDAPluggableAllocator` can load
//!   this very file (`hbmalloc.library_path()`). One library means one set of
//!   allocators: the stats Python reads are those of the memory PyTorch got.

use std::path::PathBuf;

use hbmalloc::PolicyConfig;
use hbmalloc_capi::{ApiError, Status};
use hbmalloc_replay::{evaluate, EvalOptions};
use pyo3::exceptions::{PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// The C ABI, re-exported so the linker keeps its symbols in this library.
pub use hbmalloc_capi::ffi::*;

fn to_py(e: ApiError) -> PyErr {
    match e.status {
        Status::OutOfMemory => PyMemoryError::new_err(e.message),
        Status::InvalidArgument | Status::DeviceOutOfRange | Status::ConfigError => {
            PyValueError::new_err(e.message)
        }
        _ => PyRuntimeError::new_err(e.message),
    }
}

/// `torch.cuda.memory_stats(device)`: a dict with PyTorch's keys.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn memory_stats(device: i32) -> PyResult<std::collections::BTreeMap<String, i64>> {
    hbmalloc_capi::stats_map(device).map_err(to_py)
}

/// `torch.cuda.memory_summary(device, abbreviated)` text.
#[pyfunction]
#[pyo3(signature = (device = 0, abbreviated = false))]
fn memory_summary(device: i32, abbreviated: bool) -> PyResult<String> {
    hbmalloc_capi::summary(device, abbreviated).map_err(to_py)
}

/// Writes `device`'s snapshot to `path` (`torch.cuda.memory._dump_snapshot` format).
#[pyfunction]
#[pyo3(signature = (path, device = 0))]
fn snapshot(path: PathBuf, device: i32) -> PyResult<()> {
    hbmalloc_capi::write_snapshot(device, &path).map_err(to_py)
}

/// Returns `device`'s cached free memory to the driver.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn empty_cache(device: i32) -> PyResult<()> {
    hbmalloc_capi::empty_cache(device).map_err(to_py)
}

/// Replays a trace file on a simulated GPU; a JSON list with one metrics
/// object per device of the trace. `reproduce_recorded_ooms` makes the
/// simulated device report the free memory the real one reported at each
/// recorded out-of-memory error (the CLI's default); off, those requests are
/// skipped (`--ignore-recorded-ooms`).
#[pyfunction]
#[pyo3(signature = (trace_path, policy, config, capacity, find_min_capacity, part_handle_maps, reproduce_recorded_ooms))]
// One argument per keyword of Python's `hbmalloc.replay`.
#[allow(clippy::too_many_arguments)]
fn replay_json(
    py: Python<'_>,
    trace_path: PathBuf,
    policy: &str,
    config: &str,
    capacity: Option<u64>,
    find_min_capacity: bool,
    part_handle_maps: bool,
    reproduce_recorded_ooms: bool,
) -> PyResult<String> {
    let policy =
        PolicyConfig::parse(policy, config).map_err(|e| PyValueError::new_err(e.to_string()))?;
    // The replay holds no Python object: let other Python threads run.
    py.allow_threads(|| {
        let trace =
            hbmalloc_trace::load(&trace_path).map_err(|e| PyOSError::new_err(e.to_string()))?;
        let options = EvalOptions {
            capacity_bytes: capacity,
            find_min_capacity,
            maps_handle_parts: part_handle_maps,
            reproduce_recorded_ooms,
            ..EvalOptions::new(policy)
        };
        let mut rows = Vec::new();
        for device in &trace.devices {
            let metrics = evaluate(&trace.source, device, &options).map_err(|e| {
                PyRuntimeError::new_err(format!("{} device {}: {e}", trace.source, device.device))
            })?;
            rows.push(metrics);
        }
        serde_json::to_string(&rows).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    })
}

/// Declares that the allocation at `ptr` on `device` is also used on
/// `stream` (a `cudaStream_t`, as an integer): its memory is not reused
/// before the work queued there when it is freed has completed. False when
/// `ptr` is not a live allocation of hbmalloc's on `device` (memory from
/// another allocator: nothing to do, as PyTorch's own `recordStream` does).
#[pyfunction]
#[pyo3(signature = (ptr, stream, device = 0))]
fn record_stream(ptr: u64, stream: u64, device: i32) -> PyResult<bool> {
    match hbmalloc_capi::record_stream(ptr, device, hbmalloc::StreamId(stream)) {
        Ok(()) => Ok(true),
        Err(e) if e.status == Status::UnknownPointer => Ok(false),
        Err(e) => Err(to_py(e)),
    }
}

/// Every peak statistic of `device` becomes its current value.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn reset_peak_memory_stats(device: i32) -> PyResult<()> {
    hbmalloc_capi::reset_peak_stats(device).map_err(to_py)
}

/// The running totals and event counts of `device` start again from zero.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn reset_accumulated_memory_stats(device: i32) -> PyResult<()> {
    hbmalloc_capi::reset_accumulated_stats(device).map_err(to_py)
}

/// Limits `device`'s allocator to `fraction` of the device's memory.
#[pyfunction]
#[pyo3(signature = (fraction, device = 0))]
fn set_memory_fraction(fraction: f64, device: i32) -> PyResult<()> {
    hbmalloc_capi::set_memory_fraction(fraction, device).map_err(to_py)
}

/// Every allocator, and those created later, keeps its last `entries`
/// history entries from now on (0 stops recording); `clear` drops those kept.
#[pyfunction]
#[pyo3(signature = (entries, clear = false))]
fn set_history_entries(entries: usize, clear: bool) -> PyResult<()> {
    hbmalloc_capi::set_history_entries(entries, clear).map_err(to_py)
}

/// The share of `device`'s memory its allocator may hold.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn memory_fraction(device: i32) -> PyResult<f64> {
    hbmalloc_capi::memory_fraction(device).map_err(to_py)
}

/// Returns the cached free memory of every device that has an allocator
/// (the C ABI's `hbmalloc_reset`).
#[pyfunction]
fn empty_cache_all() -> PyResult<()> {
    hbmalloc_capi::reset().map_err(to_py)
}

/// The number of devices the CUDA driver sees.
#[pyfunction]
fn device_count() -> PyResult<usize> {
    hbmalloc_capi::init().map_err(to_py)
}

/// `device`'s snapshot as the bytes of a memory-snapshot pickle, or `None`
/// when `device` has not allocated yet.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn existing_snapshot_bytes(device: i32) -> PyResult<Option<std::borrow::Cow<'static, [u8]>>> {
    hbmalloc_capi::existing_snapshot_pickle(device)
        .map(|bytes| bytes.map(std::borrow::Cow::Owned))
        .map_err(to_py)
}

/// The settings string of `device`'s allocator (`policy:pytorch,...`).
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn settings(device: i32) -> PyResult<String> {
    hbmalloc_capi::settings(device).map_err(to_py)
}

/// `(variable, value)`: the environment variable hbmalloc's configuration
/// comes from (`HBMALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF` or
/// `PYTORCH_ALLOC_CONF`: policy pytorch), or `None` (policy hbm's defaults).
/// Creates no allocator.
#[pyfunction]
fn configuration_source() -> Option<(&'static str, String)> {
    hbmalloc_capi::configuration_source()
}

/// Writes the production log (`log:PATH` in `HBMALLOC_CONF`): each device
/// that has allocated to `PATH` (device 0) or `PATH.dev<N>`; the paths
/// written.
#[pyfunction]
fn write_log() -> PyResult<Vec<std::path::PathBuf>> {
    hbmalloc_capi::write_log().map_err(to_py)
}

/// The production log's path (`log:PATH` in `HBMALLOC_CONF`), or `None`;
/// read from the environment, creating no allocator.
#[pyfunction]
fn log_path() -> PyResult<Option<std::path::PathBuf>> {
    Ok(hbmalloc_capi::log_config_from_env()
        .map_err(to_py)?
        .map(|log| log.path))
}

/// `[(kind, calls, seconds)]`: the driver calls `device`'s allocator has
/// made, by kind, and the wall-clock seconds spent in them.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn driver_calls(device: i32) -> PyResult<Vec<(&'static str, u64, f64)>> {
    hbmalloc_capi::driver_calls(device).map_err(to_py)
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MAX_CAPACITY_BYTES", hbmalloc_replay::MAX_CAPACITY_BYTES)?;
    m.add_function(wrap_pyfunction!(memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(memory_summary, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(replay_json, m)?)?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(driver_calls, m)?)?;
    m.add_function(wrap_pyfunction!(configuration_source, m)?)?;
    m.add_function(wrap_pyfunction!(record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_accumulated_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache_all, m)?)?;
    m.add_function(wrap_pyfunction!(set_history_entries, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(existing_snapshot_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(write_log, m)?)?;
    m.add_function(wrap_pyfunction!(log_path, m)?)?;
    Ok(())
}
