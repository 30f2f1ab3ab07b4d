//! hbmalloc: a caching allocator for accelerator memory.
//!
//! The engine is a deterministic state machine over a [`Device`]: the same
//! code serves a real GPU through `hbmalloc-cuda` and the simulated one,
//! [`SimDevice`], that replay and tests run on. See `ARCHITECTURE.md` at the
//! repository root for the code map.

pub mod config;
pub mod device;
pub mod sim;
pub mod stats;
pub mod summary;

pub use config::{Backend, ConfigError, PytorchConfig, ReserveSpec};
pub use device::{
    CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult, EventId, MemoryInfo,
    PhysicalHandle, StreamId,
};
pub use sim::{CallCounts, Fault, LatencyModel, SimConfig, SimDevice};
pub use stats::{DeviceStats, Stat, StatArray, StatType, PYTORCH_STAT_KEY_COUNT};
pub use summary::{format_count, format_size, memory_summary};
