//! hbmalloc: a caching allocator for accelerator memory.
//!
//! The engine is a deterministic state machine over a [`Device`]: the same
//! code serves a real GPU through `hbmalloc-cuda` and the simulated one,
//! `SimDevice`, that replay and tests run on. The simulator and the
//! simulation harness (`sim`, `simtest`) are test equipment behind the
//! `sim` feature, out of the library a program links. See
//! `ARCHITECTURE.md` at the repository root for the code map.

#![forbid(unsafe_code)]

pub mod adaptor;
pub mod allocator;
pub mod capture;
pub mod concurrent;
pub mod config;
pub mod device;
pub mod error;
mod events;
mod fastmap;
pub mod format;
mod hbm;
pub mod history;
#[cfg(any(test, feature = "sim"))]
pub mod latency;
mod policy;
mod pytorch;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
#[cfg(any(test, feature = "sim"))]
pub mod simtest;
pub mod snapshot;
pub mod stats;
pub mod summary;
mod sync;

pub use adaptor::DeviceAdaptor;
pub use allocator::{Allocator, AllocatorConfig, PolicyConfig};
pub use concurrent::{SharedAllocator, ThreadSafeAllocator};
pub use config::{ConfigError, PytorchConfig, ReserveSpec};
pub use device::{
    CallCounts, CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult, EventId,
    MemoryInfo, PhysicalHandle, PoolId, StreamId,
};
pub use error::{AllocError, FreeGranules, OomReport, OomVerdict, MAX_REQUEST_BYTES};
pub use hbm::HbmConfig;
pub use history::{Action, History, TraceEntry};
#[cfg(any(test, feature = "sim"))]
pub use latency::{LatencyCurve, LatencyModel};
#[cfg(any(test, feature = "sim"))]
pub use sim::{Fault, PendingUse, SimConfig, SimDevice, UseId, UseViolation};
pub use snapshot::{
    BlockImage, BlockSnapshot, BlockState, SegmentImage, SegmentSnapshot, Snapshot,
};
pub use stats::{DeviceStats, Stat, StatArray, StatType, PYTORCH_STAT_KEY_COUNT};
pub use summary::{format_count, format_size, memory_summary};
