//! Typed errors of the allocator, and the out-of-memory report.

use std::fmt;

use crate::device::{DeviceError, DevicePtr, PoolId, StreamId};
use crate::format::format_bytes;

/// The largest request accepted (1 PiB): anything larger is a caller's bug,
/// and rejecting it keeps all size arithmetic far from overflow.
pub const MAX_REQUEST_BYTES: u64 = 1 << 50;

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
    /// The request is larger than the address space of one expandable segment
    /// (`expandable_segments_reserve`), and one allocation cannot span segments.
    SegmentReserve,
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
            OomVerdict::SegmentReserve => {
                "the request exceeds one expandable-segment reserve \
                 (expandable_segments_reserve), and an allocation cannot span segments"
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
    /// The policy that ran out: `"pytorch"` or `"hbm"` (advice differs).
    pub policy: &'static str,
    /// Where the cached free memory lies, for a policy that maps granules
    /// (`hbm` on a virtual-memory driver); `None` otherwise.
    pub free_granules: Option<FreeGranules>,
    /// The address space one expandable segment reserves, where the request is
    /// larger than that (policy `pytorch` with expandable segments); `None` otherwise.
    pub segment_reserve_bytes: Option<u64>,
    /// The verdict.
    pub verdict: OomVerdict,
}

/// Cached free memory in whole free granules, by whether it can move: the
/// rest of it lies in granules that live blocks share with free space,
/// which no remapping can give to another request.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FreeGranules {
    /// In whole free granules the allocator may map elsewhere.
    pub movable_bytes: u64,
    /// In whole free granules of physical handles that live blocks lie on
    /// too, on a driver that maps whole handles only: they move with their
    /// handle or not at all.
    pub pinned_bytes: u64,
}

impl FreeGranules {
    /// What is left of `cached_free` outside whole free granules.
    fn shared(&self, cached_free: u64) -> u64 {
        cached_free.saturating_sub(self.movable_bytes + self.pinned_bytes)
    }
}

impl OomReport {
    /// Works out the verdict from the numbers.
    ///
    /// What this allocator could hold at most is what it reserves plus what
    /// the driver still has free (other processes hold the rest), capped by a
    /// configured limit. If live memory plus the request exceeds that, no
    /// policy could have served it; otherwise the memory was there, either
    /// waiting on other streams or in pieces too small.
    pub fn judge(&mut self) {
        let reachable = self.reserved_bytes.saturating_add(self.device_free_bytes);
        let needed = self.allocated_bytes.saturating_add(self.rounded_bytes);
        let available = self.limit_bytes.map_or(reachable, |l| l.min(reachable));
        // Only where the device (or limit) could hold the request on its own
        // is the segment's reserve to blame.
        let capacity = self
            .limit_bytes
            .map_or(self.device_total_bytes, |l| l.min(self.device_total_bytes));
        self.verdict = if self
            .segment_reserve_bytes
            .is_some_and(|reserve| self.rounded_bytes > reserve)
            && self.rounded_bytes <= capacity
        {
            OomVerdict::SegmentReserve
        } else if needed > available {
            if self.limit_bytes.is_some_and(|l| l < reachable) && needed <= reachable {
                OomVerdict::ConfiguredLimit
            } else {
                OomVerdict::RealDemand
            }
        } else if needed.saturating_add(self.pending_free_bytes) > available {
            OomVerdict::PendingStreams
        } else {
            OomVerdict::Fragmentation
        };
    }

    /// The message PyTorch's allocator raises for the same numbers (its
    /// `OutOfMemoryError` text; the process's memory in use is taken to be
    /// what this allocator reserves, where PyTorch asks NVML), so users can
    /// compare. Note that PyTorch names the segment size it tried, not the
    /// tensor size.
    pub fn pytorch_message(&self, device: i64) -> String {
        let allowed = self.limit_bytes.map_or(String::new(), |l| {
            format!("{} allowed; ", pytorch_format_size(l))
        });
        format!(
            "CUDA out of memory. Tried to allocate {}. GPU {device} has a total capacity of {} of which {} is free. \
             Including non-PyTorch memory, this process has {} memory in use. \
             {allowed}Of the allocated memory {} is allocated by PyTorch, and {} is reserved by PyTorch but unallocated. \
             If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
             to avoid fragmentation.  See documentation for Memory Management  \
             (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
            pytorch_format_size(self.device_request_bytes),
            pytorch_format_size(self.device_total_bytes),
            pytorch_format_size(self.device_free_bytes),
            pytorch_format_size(self.reserved_bytes),
            pytorch_format_size(self.allocated_bytes),
            pytorch_format_size(self.reserved_bytes.saturating_sub(self.allocated_bytes)),
        )
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
            "  device: {} total, {} free",
            format_bytes(self.device_total_bytes),
            format_bytes(self.device_free_bytes)
        );
        let elsewhere = self
            .device_total_bytes
            .saturating_sub(self.device_free_bytes)
            .saturating_sub(self.reserved_bytes);
        if elsewhere > 0 {
            out += &format!(", {} held outside this allocator", format_bytes(elsewhere));
        }
        out += "\n";
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
        // Named only where it is to blame, so a request larger than the device
        // does not send the user to the setting.
        if let (Some(reserve), OomVerdict::SegmentReserve) =
            (self.segment_reserve_bytes, self.verdict)
        {
            out += &format!(
                "  expandable segments: {} of address space each (expandable_segments_reserve)\n",
                format_bytes(reserve)
            );
        }
        if let Some(free) = self.free_granules {
            out += &format!(
                "  cached free: {} in whole granules that may move, {} in whole granules of \
                 handles live blocks lie on (a handle maps whole), {} in granules live blocks share\n",
                format_bytes(free.movable_bytes),
                format_bytes(free.pinned_bytes),
                format_bytes(free.shared(self.cached_free_bytes)),
            );
        }
        out += &format!("  verdict: {}\n", self.verdict.explain());
        out += "  what would help: ";
        out += match self.verdict {
            OomVerdict::RealDemand => "less live memory (smaller batch, activation checkpointing) or a larger device",
            OomVerdict::ConfiguredLimit => "a larger per_process_memory_fraction",
            OomVerdict::PendingStreams => "synchronize the streams named in record_stream before allocating, or avoid record_stream",
            OomVerdict::Fragmentation => self.fragmentation_help(),
            OomVerdict::SegmentReserve => {
                "a larger expandable_segments_reserve (at least the request), or leave it unset \
                 for the default of 9/8 of the device"
            }
        };
        out
    }

    /// What would help a request that fragmentation refused, by where most
    /// of the free memory lies.
    fn fragmentation_help(&self) -> &'static str {
        if self.policy != "hbm" {
            return "policy hbm (stitches free granules), or expandable_segments:True under policy pytorch";
        }
        let releasable = "empty_cache() between phases whose tensors differ (idle mappings are \
             released, so their memory can be stitched anew), or a larger device";
        let Some(free) = self.free_granules else {
            return releasable;
        };
        let shared = free.shared(self.cached_free_bytes);
        if free.pinned_bytes > shared.max(free.movable_bytes) {
            "smaller physical handles, which move whole (whole_handle_granules:4 or 1, at more \
             driver calls: hbmalloc advise weighs them), or a larger device"
        } else if free.movable_bytes > shared {
            // Memory the retry did not give back: a capture forbids it.
            releasable
        } else {
            "a larger device, or fewer small tensors kept among large ones: the free memory lies \
             in granules that live blocks share, which no remapping frees"
        }
    }
}

/// PyTorch's C++ `format_size`: two decimals, `bytes` up to 1024, then
/// KiB, MiB and GiB, each up to and including its upper bound.
fn pytorch_format_size(size: u64) -> String {
    let s = size as f64;
    if size <= 1024 {
        format!("{size} bytes")
    } else if size <= 1 << 20 {
        format!("{:.2} KiB", s / 1024.0)
    } else if size <= 1 << 30 {
        format!("{:.2} MiB", s / 1048576.0)
    } else {
        format!("{:.2} GiB", s / 1073741824.0)
    }
}

/// An allocator error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllocError {
    /// Not enough device memory for the request, after every retry.
    OutOfMemory(Box<OomReport>),
    /// The size is zero or beyond what any device could hold, or a restored
    /// segment's block is not a multiple of 512 bytes.
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
    /// The call is not allowed while a CUDA graph capture is underway on the
    /// device (see [`crate::capture`]).
    CaptureUnderway {
        /// What was asked (`"empty_cache"`).
        operation: &'static str,
    },
    /// The end of a CUDA graph capture was announced, but none was underway.
    NoCaptureUnderway,
    /// No private memory pool of that id exists on this device (see
    /// [`crate::SharedAllocator::create_or_incref_pool`]).
    UnknownPool {
        /// The pool's id.
        pool: PoolId,
    },
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory(report) => {
                let text = report.render();
                f.write_str(text.trim_end())
            }
            // Within the bounds, only a restored block's size is refused: one
            // not a multiple of PyTorch's block size (`kMinBlockSize`).
            AllocError::InvalidSize { size } if (1..=MAX_REQUEST_BYTES).contains(size) => write!(
                f,
                "invalid block size {size}: a restored segment's blocks are multiples of 512 bytes"
            ),
            AllocError::InvalidSize { size } => write!(
                f,
                "invalid allocation size {size}: must be between 1 and {} bytes",
                MAX_REQUEST_BYTES
            ),
            AllocError::UnknownPointer { ptr } => write!(
                f,
                "pointer {ptr:#x} is not a live allocation of this allocator (double free, or never allocated here)"
            ),
            AllocError::Device(e) => write!(f, "driver error: {e}"),
            AllocError::InvalidConfig(msg) => write!(f, "invalid configuration: {msg}"),
            AllocError::CaptureUnderway { operation } => write!(
                f,
                "{operation} is not allowed while a CUDA graph capture is underway on this device: \
                 call it before the capture begins or after it ends"
            ),
            AllocError::NoCaptureUnderway => f.write_str(
                "the end of a CUDA graph capture was announced, but none is underway \
                 (endAllocateToPool without beginAllocateToPool)",
            ),
            AllocError::UnknownPool { pool } => write!(
                f,
                "no private memory pool ({}, {}) on this device: create it first \
                 (create_or_incref_pool, which PyTorch reaches when a MemPool is made or a \
                 graph capture begins), or it was released",
                pool.0, pool.1
            ),
        }
    }
}

impl std::error::Error for AllocError {}

impl From<DeviceError> for AllocError {
    fn from(e: DeviceError) -> Self {
        AllocError::Device(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> OomReport {
        OomReport {
            requested_bytes: 3 << 30,
            rounded_bytes: 3 << 30,
            device_request_bytes: 3 << 30,
            stream: StreamId(0),
            device_total_bytes: 80 << 30,
            device_free_bytes: 1 << 30,
            allocated_bytes: 70 << 30,
            reserved_bytes: 78 << 30,
            cached_free_bytes: 8 << 30,
            largest_free_block_bytes: 1 << 30,
            pending_free_bytes: 0,
            limit_bytes: None,
            policy: "pytorch",
            free_granules: None,
            segment_reserve_bytes: None,
            verdict: OomVerdict::RealDemand,
        }
    }

    #[test]
    fn verdicts() {
        let mut r = report();
        r.judge();
        assert_eq!(
            r.verdict,
            OomVerdict::Fragmentation,
            "73 GiB needed, 79 GiB reachable"
        );
        r.allocated_bytes = 77 << 30;
        r.judge();
        assert_eq!(
            r.verdict,
            OomVerdict::RealDemand,
            "80 GiB needed, 79 GiB reachable"
        );
        r.allocated_bytes = 70 << 30;
        r.pending_free_bytes = 7 << 30;
        r.judge();
        assert_eq!(r.verdict, OomVerdict::PendingStreams);
        r.pending_free_bytes = 0;
        r.limit_bytes = Some(72 << 30);
        r.judge();
        assert_eq!(r.verdict, OomVerdict::ConfiguredLimit);
        // Past what the device could give even without the limit, the
        // limit is not to blame.
        r.allocated_bytes = 77 << 30;
        r.judge();
        assert_eq!(
            r.verdict,
            OomVerdict::RealDemand,
            "80 GiB needed, 79 reachable"
        );
    }

    /// Memory other processes hold is named only when there is some.
    #[test]
    fn memory_held_elsewhere_is_named_when_there_is_some() {
        let mut r = report();
        assert!(r.render().contains("1.00 GiB held outside this allocator"));
        r.device_free_bytes = 2 << 30;
        assert!(!r.render().contains("held outside"));
    }

    /// The report says which verdict it reached, each in words of its own.
    #[test]
    fn a_request_that_exactly_fits_what_is_reachable_is_fragmentation() {
        let verdict = |rounded: u64| {
            let mut r = OomReport {
                rounded_bytes: rounded,
                ..report()
            };
            r.judge();
            r.verdict
        };
        // 70 GiB live, 78 reserved, 1 free: 9 GiB more would fit in one piece.
        assert_eq!(verdict(9 << 30), OomVerdict::Fragmentation);
        assert_eq!(verdict((9 << 30) + 1), OomVerdict::RealDemand);
    }

    #[test]
    fn the_segment_reserve_is_blamed_only_for_a_request_the_device_could_hold() {
        let verdict = |rounded: u64| {
            let mut r = OomReport {
                rounded_bytes: rounded,
                allocated_bytes: 0,
                segment_reserve_bytes: Some(4 << 30),
                ..report()
            };
            r.judge();
            r.verdict
        };
        assert_ne!(verdict(4 << 30), OomVerdict::SegmentReserve);
        assert_eq!(verdict((4 << 30) + 1), OomVerdict::SegmentReserve);
        assert_eq!(verdict(80 << 30), OomVerdict::SegmentReserve);
        assert_eq!(verdict((80 << 30) + 1), OomVerdict::RealDemand);
    }

    #[test]
    fn each_verdict_explains_itself() {
        let verdicts = [
            OomVerdict::RealDemand,
            OomVerdict::ConfiguredLimit,
            OomVerdict::PendingStreams,
            OomVerdict::Fragmentation,
            OomVerdict::SegmentReserve,
        ];
        let texts: std::collections::BTreeSet<&str> =
            verdicts.iter().map(|v| v.explain()).collect();
        assert_eq!(texts.len(), verdicts.len());
        for verdict in verdicts {
            let mut r = report();
            r.verdict = verdict;
            assert!(!verdict.explain().is_empty());
            assert!(r.render().contains(verdict.explain()), "{verdict:?}");
        }
    }

    #[test]
    fn fragmentation_advice_fits_the_policy() {
        let mut r = report();
        r.judge();
        assert!(r.render().contains("policy hbm"));
        r.policy = "hbm";
        let text = r.render();
        assert!(
            !text.contains("policy hbm") && text.contains("empty_cache()"),
            "{text}"
        );
    }

    #[test]
    fn pytorch_message_uses_pytorch_units() {
        assert_eq!(pytorch_format_size(1024), "1024 bytes");
        assert_eq!(pytorch_format_size(1025), "1.00 KiB");
        assert_eq!(pytorch_format_size(1 << 20), "1024.00 KiB");
        assert_eq!(pytorch_format_size(3 << 30), "3.00 GiB");
        let message = report().pytorch_message(0);
        assert!(message.starts_with(
            "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which 1024.00 MiB is free. Including non-PyTorch memory, this process has 78.00 GiB memory in use. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 8.00 GiB is reserved by PyTorch but unallocated."
        ), "{message}");
    }
}
