//! Typed errors of the allocator, and the out-of-memory report.

use std::fmt;

use crate::device::{DeviceError, DevicePtr, StreamId};
use crate::format::format_bytes;

/// Why memory ran out, as far as the allocator can tell at the moment it failed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum OomVerdict {
    /// Live memory plus the request exceeds what the device (or the limit) allows:
    /// no policy could have served it.
    RealDemand,
    /// A configured limit (memory fraction) refused it while the device had room.
    ConfiguredLimit,
    /// Enough memory is held by blocks whose frees wait on other streams.
    PendingStreams,
    /// Enough memory is free in total, but not in one piece the request fits in.
    Fragmentation,
}

impl OomVerdict {
    /// A short explanation for reports.
    pub fn explain(self) -> &'static str {
        match self {
            OomVerdict::RealDemand => {
                "real demand: live memory plus this request exceeds what is available"
            }
            OomVerdict::ConfiguredLimit => {
                "a configured limit: the memory fraction refused it while the device had room"
            }
            OomVerdict::PendingStreams => {
                "memory held by frees still pending on other streams (record_stream)"
            }
            OomVerdict::Fragmentation => {
                "fragmentation: enough memory is free in total, but not in one usable piece"
            }
        }
    }
}

/// Everything needed to explain an out-of-memory error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomReport {
    /// Bytes the program asked for.
    pub requested_bytes: u64,
    /// The request after rounding.
    pub rounded_bytes: u64,
    /// What the allocator last tried to get from the driver for it.
    pub device_request_bytes: u64,
    /// The stream it was requested on.
    pub stream: StreamId,
    /// Device capacity.
    pub device_total_bytes: u64,
    /// Free device memory as the driver reported it.
    pub device_free_bytes: u64,
    /// Bytes of live allocations (rounded).
    pub allocated_bytes: u64,
    /// Bytes held from the driver.
    pub reserved_bytes: u64,
    /// Reserved but not allocated: cached free memory.
    pub cached_free_bytes: u64,
    /// The largest cached free block.
    pub largest_free_block_bytes: u64,
    /// Bytes freed by the program whose frees wait on other streams.
    pub pending_free_bytes: u64,
    /// The configured limit (memory fraction), if any.
    pub limit_bytes: Option<u64>,
    /// The verdict.
    pub verdict: OomVerdict,
}

impl OomReport {
    /// Works out the verdict from the numbers.
    pub fn judge(&mut self) {
        let available = self
            .limit_bytes
            .unwrap_or(u64::MAX)
            .min(self.device_total_bytes);
        let needed = self.allocated_bytes.saturating_add(self.rounded_bytes);
        // Pending frees explain the failure only when the request fits once
        // they complete, and does not fit while they hold their memory.
        self.verdict = if self.pending_free_bytes > 0
            && needed <= available
            && needed.saturating_add(self.pending_free_bytes) > available
        {
            OomVerdict::PendingStreams
        } else if needed > self.device_total_bytes.min(available) {
            if self
                .limit_bytes
                .is_some_and(|l| needed > l && needed <= self.device_total_bytes)
            {
                OomVerdict::ConfiguredLimit
            } else {
                OomVerdict::RealDemand
            }
        } else {
            OomVerdict::Fragmentation
        };
    }

    /// A multi-line report: what was asked, what the device held, why it
    /// failed, and what would help.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out += &format!(
            "out of memory: tried to allocate {} (rounded to {}; the allocator asked the driver for {}) on stream {:#x}\n",
            format_bytes(self.requested_bytes),
            format_bytes(self.rounded_bytes),
            format_bytes(self.device_request_bytes),
            self.stream.0
        );
        out += &format!(
            "  device: {} total, {} free\n",
            format_bytes(self.device_total_bytes),
            format_bytes(self.device_free_bytes)
        );
        out += &format!(
            "  allocator: {} live, {} reserved, {} cached free (largest free block {}), {} pending on other streams\n",
            format_bytes(self.allocated_bytes),
            format_bytes(self.reserved_bytes),
            format_bytes(self.cached_free_bytes),
            format_bytes(self.largest_free_block_bytes),
            format_bytes(self.pending_free_bytes)
        );
        if let Some(limit) = self.limit_bytes {
            out += &format!("  limit: {} (memory fraction)\n", format_bytes(limit));
        }
        out += &format!("  verdict: {}\n", self.verdict.explain());
        out += "  what would help: ";
        out += match self.verdict {
            OomVerdict::RealDemand => "less live memory (smaller batch, activation checkpointing) or a larger device",
            OomVerdict::ConfiguredLimit => "a larger per_process_memory_fraction",
            OomVerdict::PendingStreams => "synchronize the streams named in record_stream before allocating, or avoid record_stream",
            OomVerdict::Fragmentation => "policy hbm (remaps free granules), or expandable_segments:True under policy pytorch",
        };
        out
    }
}

/// An allocator error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllocError {
    /// Not enough device memory for the request, after every retry.
    OutOfMemory(Box<OomReport>),
    /// The size is zero or beyond what any device could hold.
    InvalidSize {
        /// The size asked for.
        size: u64,
    },
    /// The pointer is not a live allocation of this allocator: a double free,
    /// or a pointer it never returned.
    UnknownPointer {
        /// The pointer.
        ptr: DevicePtr,
    },
    /// A driver call failed for a reason other than memory.
    Device(DeviceError),
    /// A configuration value was rejected.
    InvalidConfig(String),
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory(report) => {
                let text = report.render();
                f.write_str(text.trim_end())
            }
            AllocError::InvalidSize { size } => write!(
                f,
                "invalid allocation size {size}: must be between 1 and {} bytes",
                crate::MAX_REQUEST_BYTES
            ),
            AllocError::UnknownPointer { ptr } => write!(
                f,
                "pointer {ptr:#x} is not a live allocation of this allocator (double free, or never allocated here)"
            ),
            AllocError::Device(e) => write!(f, "driver error: {e}"),
            AllocError::InvalidConfig(msg) => write!(f, "invalid configuration: {msg}"),
        }
    }
}

impl std::error::Error for AllocError {}

impl From<DeviceError> for AllocError {
    fn from(e: DeviceError) -> Self {
        AllocError::Device(e)
    }
}
