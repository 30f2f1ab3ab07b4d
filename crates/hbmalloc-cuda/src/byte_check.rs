//! One fixed random program of allocations and frees on a [`CudaPool`] that
//! checks, byte by byte, that no live buffer ever shares memory with
//! another: the property policy `hbm`'s stitching (one physical granule
//! mapped at several addresses) rests on. Tests run it on the driver
//! double, whose memory reaches each handle's bytes through its mappings;
//! the `driver_check` example runs it on a real GPU.
#![forbid(unsafe_code)]

use std::sync::Arc;

use hbmalloc::{AllocError, StreamId};

use crate::{CudaPool, DeviceBuffer};

/// Device memory as the check writes and reads it.
pub trait DeviceBytes {
    /// Sets `len` bytes from `ptr` to `value`.
    fn fill(&self, ptr: u64, value: u8, len: usize) -> Result<(), String>;
    /// The `len` bytes from `ptr`.
    fn read(&self, ptr: u64, len: usize) -> Result<Vec<u8>, String>;
}

/// What [`byte_program`] did.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ByteReport {
    /// Buffers allocated, filled and checked.
    pub buffers: u64,
    /// Allocations that ran out of memory (the program then frees half its
    /// buffers and goes on).
    pub out_of_memory: u64,
}

/// Most buffers the program holds at once.
const MAX_LIVE: usize = 24;
/// Operations per phase: phases of mostly small buffers alternate with
/// phases of large ones, so memory freed in one place is wanted in another.
const PHASE: u64 = 100;

/// Runs `steps` operations on `pool` (a fixed xorshift seeded by `seed`
/// picks frees, sizes and `streams`). Each buffer is filled with its own
/// byte through `bytes` when allocated and read back whole when freed and
/// at the end; the first buffer found changed ends the program with an
/// error naming it. Allocation errors other than out of memory end it too.
pub fn byte_program(
    pool: &Arc<CudaPool>,
    bytes: &dyn DeviceBytes,
    seed: u64,
    streams: &[StreamId],
    steps: u64,
) -> Result<ByteReport, String> {
    let check = |buffer: &DeviceBuffer, byte: u8| -> Result<(), String> {
        let seen = bytes.read(buffer.device_ptr(), buffer.len())?;
        // Compared whole first (a `memcmp`): a byte at a time is slow in
        // an unoptimised test build.
        if seen == vec![byte; seen.len()] {
            return Ok(());
        }
        match seen.iter().position(|&b| b != byte) {
            None => Ok(()),
            Some(at) => Err(format!(
                "the buffer at {:#x} ({} bytes) lost its byte {byte:#x}: {:#x} at offset {at}",
                buffer.device_ptr(),
                buffer.len(),
                seen[at]
            )),
        }
    };
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0xA24B_AED4_963E_E407);
    let mut next = move |bound: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % bound
    };
    let mut live: Vec<(DeviceBuffer, u8)> = Vec::new();
    let mut report = ByteReport::default();
    for step in 0..steps {
        if !live.is_empty() && (next(3) == 0 || live.len() >= MAX_LIVE) {
            let (buffer, byte) = live.swap_remove(next(live.len() as u64) as usize);
            check(&buffer, byte)?;
            continue;
        }
        let size = if (step / PHASE) % 2 == 0 {
            match next(8) {
                0 => 1 + next(9 << 20),
                _ => 1 + next(1 << 20),
            }
        } else {
            (2 << 20) + next(7 << 20)
        };
        let stream = streams[next(streams.len() as u64) as usize];
        let buffer = match pool.alloc(size as usize, stream) {
            Ok(buffer) => buffer,
            Err(AllocError::OutOfMemory(_)) => {
                report.out_of_memory += 1;
                for (buffer, byte) in live.drain(..live.len() / 2) {
                    check(&buffer, byte)?;
                }
                continue;
            }
            Err(e) => return Err(format!("allocating {size} bytes: {e}")),
        };
        let byte = (seed.wrapping_mul(31).wrapping_add(step) % 255 + 1) as u8;
        bytes.fill(buffer.device_ptr(), byte, buffer.len())?;
        live.push((buffer, byte));
        report.buffers += 1;
    }
    for (buffer, byte) in &live {
        check(buffer, *byte)?;
    }
    Ok(report)
}
