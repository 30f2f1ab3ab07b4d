//! One fixed random program of allocations and frees ([`Buffers`]: a
//! [`CudaPool`], or the C ABI in its tests) that checks, byte by byte, that
//! no live buffer ever shares memory with another: the property policy
//! `hbm`'s stitching (one physical granule mapped at several addresses)
//! rests on. Tests run it on the driver double, whose memory reaches each
//! handle's bytes through its mappings; the `driver_check` example runs it
//! on a real GPU.
#![forbid(unsafe_code)]

use hbmalloc::{AllocError, StreamId, ThreadSafeAllocator};

use crate::CudaPool;

/// Where the program's buffers come from: a [`CudaPool`], or the C ABI in
/// its own tests.
pub trait Buffers {
    /// `size` bytes for use on `stream`: the device address, or `None` when
    /// the device is out of memory.
    fn alloc(&self, size: usize, stream: StreamId) -> Result<Option<u64>, String>;
    /// Gives back what [`Buffers::alloc`] returned.
    fn free(&self, ptr: u64) -> Result<(), String>;
}

impl Buffers for CudaPool {
    fn alloc(&self, size: usize, stream: StreamId) -> Result<Option<u64>, String> {
        match self.allocator.malloc(size as u64, stream) {
            Ok(ptr) => Ok(Some(ptr)),
            Err(AllocError::OutOfMemory(_)) => Ok(None),
            Err(e) => Err(format!("allocating {size} bytes: {e}")),
        }
    }

    fn free(&self, ptr: u64) -> Result<(), String> {
        self.allocator.free(ptr).map_err(|e| e.to_string())
    }
}

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

/// Runs `steps` operations on `buffers` (a fixed xorshift seeded by `seed`
/// picks frees, sizes and `streams`). Each buffer is filled with its own
/// byte through `bytes` when allocated and read back whole when freed and
/// at the end; the first buffer found changed ends the program with an
/// error naming it, as does any error but out of memory. Every buffer still
/// held is given back before it returns.
pub fn byte_program(
    buffers: &dyn Buffers,
    bytes: &dyn DeviceBytes,
    seed: u64,
    streams: &[StreamId],
    steps: u64,
) -> Result<ByteReport, String> {
    let mut live: Vec<Buffer> = Vec::new();
    let outcome = run_program(buffers, bytes, (seed, streams, steps), &mut live);
    for buffer in live {
        buffers.free(buffer.ptr)?;
    }
    outcome
}

/// A live buffer of the program and the byte it holds.
struct Buffer {
    ptr: u64,
    len: usize,
    byte: u8,
}

fn run_program(
    buffers: &dyn Buffers,
    bytes: &dyn DeviceBytes,
    (seed, streams, steps): (u64, &[StreamId], u64),
    live: &mut Vec<Buffer>,
) -> Result<ByteReport, String> {
    let check = |buffer: &Buffer| -> Result<(), String> {
        let seen = bytes.read(buffer.ptr, buffer.len)?;
        // Compared whole first (a `memcmp`): a byte at a time is slow in
        // an unoptimised test build.
        if seen == vec![buffer.byte; seen.len()] {
            return Ok(());
        }
        let at = seen.iter().position(|&b| b != buffer.byte).unwrap_or(0);
        Err(format!(
            "the buffer at {:#x} ({} bytes) lost its byte {:#x}: {:#x} at offset {at}",
            buffer.ptr, buffer.len, buffer.byte, seen[at]
        ))
    };
    // Checked, then given back.
    let release = |buffer: Buffer| -> Result<(), String> {
        check(&buffer)?;
        buffers.free(buffer.ptr)
    };
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0xA24B_AED4_963E_E407);
    let mut next = move |bound: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % bound
    };
    let mut report = ByteReport::default();
    for step in 0..steps {
        if !live.is_empty() && (next(3) == 0 || live.len() >= MAX_LIVE) {
            release(live.swap_remove(next(live.len() as u64) as usize))?;
            continue;
        }
        let len = if (step / PHASE) % 2 == 0 {
            match next(8) {
                0 => 1 + next(9 << 20),
                _ => 1 + next(1 << 20),
            }
        } else {
            (2 << 20) + next(7 << 20)
        } as usize;
        let stream = streams[next(streams.len() as u64) as usize];
        let Some(ptr) = buffers.alloc(len, stream)? else {
            report.out_of_memory += 1;
            for buffer in live.drain(..live.len() / 2).collect::<Vec<_>>() {
                release(buffer)?;
            }
            continue;
        };
        let byte = (seed.wrapping_mul(31).wrapping_add(step) % 255 + 1) as u8;
        live.push(Buffer { ptr, len, byte });
        bytes.fill(ptr, byte, len)?;
        report.buffers += 1;
    }
    live.iter().try_for_each(check)?;
    Ok(report)
}
