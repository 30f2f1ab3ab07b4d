//! hbmalloc: a caching allocator for accelerator memory.
//!
//! The engine is a deterministic state machine over a [`Device`]: the same
//! code serves a real GPU through `hbmalloc-cuda` and the simulated one,
//! [`SimDevice`], that replay and tests run on. See `ARCHITECTURE.md` at the
//! repository root for the code map.

pub mod allocator;
pub mod capture;
pub mod concurrent;
pub mod config;
pub mod device;
pub mod error;
pub mod format;
mod hbm;
pub mod history;
mod pytorch;
pub mod sim;
pub mod simtest;
pub mod snapshot;
pub mod stats;
pub mod summary;

pub use allocator::{
    Allocator, AllocatorConfig, BlockImage, PolicyConfig, SegmentImage, MAX_REQUEST_BYTES,
};
pub use concurrent::{PoolId, SharedAllocator, ThreadSafeAllocator};
pub use config::{ConfigError, PytorchConfig, ReserveSpec};
pub use device::{
    CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult, EventId, MemoryInfo,
    PhysicalHandle, StreamId,
};
pub use error::{AllocError, OomReport, OomVerdict};
pub use hbm::HbmConfig;
pub use history::{Action, History, TraceEntry};
pub use sim::{
    CallCounts, Fault, LatencyModel, PendingUse, SimConfig, SimDevice, UseId, UseViolation,
};
pub use snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot};
pub use stats::{DeviceStats, Stat, StatArray, StatType, PYTORCH_STAT_KEY_COUNT};
pub use summary::{format_count, format_size, memory_summary};

/// A hash map keyed by device pointers. Pointers are 512-byte aligned, so
/// the hash mixes the high bits down (std's SipHash is needlessly slow here,
/// and keys come from the allocator, not from an attacker).
pub(crate) type FastMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<PointerHasher>>;

/// The hasher behind [`FastMap`].
#[derive(Default, Clone, Copy)]
pub(crate) struct PointerHasher(u64);

impl std::hash::Hasher for PointerHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }
}
