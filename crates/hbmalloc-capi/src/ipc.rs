//! CUDA IPC in PyTorch's own format, so that a tensor's memory passes
//! between processes (`torch.multiprocessing`) with hbmalloc on either side
//! or both.
//!
//! The format is the string `CUDACachingAllocator::shareIpcHandle` writes
//! (torch 2.11's `c10/cuda/CUDACachingAllocator.cpp`; sources and the
//! differences of other versions in `docs/compiled-allocator.md`): a version
//! byte, a type byte, then
//!
//! - `'c'` (a `cudaMalloc` segment): the 64 bytes of its `cudaIpcMemHandle_t`;
//! - `'e'` (an expandable segment): `ShareHeader { pid_t pid; size_t
//!   segment_size; size_t num_handles; }` (24 bytes on 64-bit Linux), then one
//!   `int` per handle: a file descriptor of the exporting process
//!   (`cuMemExportToShareableHandle`), which the importer takes with
//!   `pidfd_getfd`. The handles are mapped whole, one after the other.
//!
//! and one type of hbmalloc's own, for what PyTorch's `'e'` cannot carry:
//!
//! - `'h'` (handles of several sizes, as policy `hbm` maps them): `pid`
//!   (`i32`), 4 bytes of padding, the handle count (`u64`), then each
//!   handle's size (`u64`), then each handle's descriptor (`i32`). Only
//!   hbmalloc reads it; PyTorch's own allocator refuses its type byte.
//!
//! A bare 64-byte string is a `'c'` handle from a torch older than the
//! version byte. The offset of the tensor in what is shared travels beside
//! the string (PyTorch's `ShareableHandle::offset`).
//!
//! What another process sent is untrusted: every length is checked before it
//! is read, and bad bytes are an `InvalidArgument` error naming what is wrong.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

use hbmalloc::DevicePtr;
use hbmalloc_cuda::ffi::CU_IPC_HANDLE_SIZE;
use hbmalloc_cuda::{fd_from_process, ImportedRange, IpcExport};

use crate::{device_error, runtime, with_allocator, ApiError, Status};

/// The version byte written: torch 2.11's `SHAREABLE_HANDLE_VERSION`, which
/// every torch that reads versions accepts for `'c'` (2.13 on write 3 with
/// the same `'c'` payload).
pub const SHAREABLE_HANDLE_VERSION: u8 = 2;
/// The newest version byte read (torch 2.13 and later write 3).
pub const NEWEST_READ_VERSION: u8 = 3;
/// PyTorch's `SHAREABLE_CUDA_MALLOC`.
pub const SHAREABLE_CUDA_MALLOC: u8 = b'c';
/// PyTorch's `SHAREABLE_CUDA_EXPANDABLE_SEGMENT`.
pub const SHAREABLE_CUDA_EXPANDABLE_SEGMENT: u8 = b'e';
/// hbmalloc's type for handles of several sizes (see the module's header).
pub const HBMALLOC_MIXED_HANDLES: u8 = b'h';
/// `sizeof(ShareHeader)`: `pid_t`, padding, two `size_t`.
const SHARE_HEADER_BYTES: usize = 24;
/// `'h'`'s header: `pid`, padding, the handle count.
const MIXED_HEADER_BYTES: usize = 16;
/// More handles than any device's memory holds in 2 MiB pieces: a header
/// asking for more is garbage.
const MAX_SHARED_HANDLES: u64 = 1 << 20;

/// A string to send, and where the allocation starts in what it shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shared {
    /// PyTorch's shareable handle bytes.
    pub handle: Vec<u8>,
    /// The allocation's offset from the start of the shared memory.
    pub offset: u64,
}

/// PyTorch's bytes for an export.
pub fn encode(export: &IpcExport, pid: i32) -> Shared {
    let mut handle = vec![SHAREABLE_HANDLE_VERSION];
    match export {
        IpcExport::Segment {
            handle: ipc,
            offset,
        } => {
            handle.push(SHAREABLE_CUDA_MALLOC);
            handle.extend_from_slice(ipc);
            Shared {
                handle,
                offset: *offset,
            }
        }
        IpcExport::Handles { sizes, fds, offset } => {
            // PyTorch's own layout wherever it can carry the handles, so
            // that a process under PyTorch's allocator opens them too.
            let common = export.common_handle_size();
            handle.push(match common {
                Some(_) => SHAREABLE_CUDA_EXPANDABLE_SEGMENT,
                None => HBMALLOC_MIXED_HANDLES,
            });
            handle.extend_from_slice(&pid.to_ne_bytes());
            handle.extend_from_slice(&[0; 4]);
            if let Some(handle_size) = common {
                handle.extend_from_slice(&handle_size.to_ne_bytes());
            }
            handle.extend_from_slice(&(fds.len() as u64).to_ne_bytes());
            if common.is_none() {
                for size in sizes {
                    handle.extend_from_slice(&size.to_ne_bytes());
                }
            }
            for fd in fds {
                handle.extend_from_slice(&fd.to_ne_bytes());
            }
            Shared {
                handle,
                offset: *offset,
            }
        }
    }
}

/// What a received string asks to map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// Open this `cudaIpcMemHandle_t`.
    Segment([u8; CU_IPC_HANDLE_SIZE]),
    /// Take these descriptors of process `pid` and map them, one after the
    /// other.
    Handles {
        /// The exporting process.
        pid: i32,
        /// Bytes in each handle.
        sizes: Vec<u64>,
        /// Descriptor numbers in the exporting process.
        fds: Vec<i32>,
    },
}

fn bad(what: String) -> ApiError {
    ApiError::new(
        Status::InvalidArgument,
        format!("hbmalloc: not a CUDA IPC handle PyTorch or hbmalloc wrote: {what}"),
    )
}

/// Reads PyTorch's bytes; any inconsistency is an error saying what.
pub fn decode(bytes: &[u8]) -> Result<Decoded, ApiError> {
    if bytes.len() == CU_IPC_HANDLE_SIZE {
        // A torch from before the version byte.
        let mut handle = [0; CU_IPC_HANDLE_SIZE];
        handle.copy_from_slice(bytes);
        return Ok(Decoded::Segment(handle));
    }
    let [version, kind, payload @ ..] = bytes else {
        return Err(bad(format!("{} bytes", bytes.len())));
    };
    if *version > NEWEST_READ_VERSION {
        return Err(bad(format!(
            "version {version}, newer than the newest this hbmalloc reads ({NEWEST_READ_VERSION}): \
             it comes from a newer torch"
        )));
    }
    match *kind {
        SHAREABLE_CUDA_MALLOC => {
            let handle: [u8; CU_IPC_HANDLE_SIZE] = payload.try_into().map_err(|_| {
                bad(format!(
                    "a cudaMalloc handle of {} bytes, not {CU_IPC_HANDLE_SIZE}",
                    payload.len()
                ))
            })?;
            Ok(Decoded::Segment(handle))
        }
        SHAREABLE_CUDA_EXPANDABLE_SEGMENT => {
            if *version > SHAREABLE_HANDLE_VERSION {
                return Err(bad(format!(
                    "an expandable-segment handle of version {version}: torch 2.13 and later \
                     changed that format, which this hbmalloc does not read yet (the sender can \
                     set expandable_segments:False, or use hbmalloc's policy pytorch)"
                )));
            }
            if payload.len() < SHARE_HEADER_BYTES {
                return Err(bad(format!(
                    "an expandable-segment handle of {} bytes, shorter than its header",
                    payload.len()
                )));
            }
            let word = |at: usize| u64::from_ne_bytes(payload[at..at + 8].try_into().expect("8"));
            let pid = i32::from_ne_bytes(payload[0..4].try_into().expect("4"));
            let (handle_size, count) = (word(8), word(16));
            let fd_bytes = &payload[SHARE_HEADER_BYTES..];
            if pid <= 0
                || handle_size == 0
                || count == 0
                || count > MAX_SHARED_HANDLES
                || fd_bytes.len() as u64 != count * 4
            {
                return Err(bad(format!(
                    "an expandable-segment header (process {pid}, {count} handles of \
                     {handle_size} bytes) that does not match its {} bytes of descriptors",
                    fd_bytes.len()
                )));
            }
            Ok(Decoded::Handles {
                pid,
                sizes: vec![handle_size; count as usize],
                fds: descriptors(fd_bytes),
            })
        }
        HBMALLOC_MIXED_HANDLES => {
            if payload.len() < MIXED_HEADER_BYTES {
                return Err(bad(format!(
                    "an hbmalloc handle list of {} bytes, shorter than its header",
                    payload.len()
                )));
            }
            let pid = i32::from_ne_bytes(payload[0..4].try_into().expect("4"));
            let count = u64::from_ne_bytes(payload[8..16].try_into().expect("8"));
            let rest = &payload[MIXED_HEADER_BYTES..];
            if pid <= 0
                || count == 0
                || count > MAX_SHARED_HANDLES
                || rest.len() as u64 != count * 12
            {
                return Err(bad(format!(
                    "an hbmalloc handle list (process {pid}, {count} handles) that does not \
                     match its {} bytes of sizes and descriptors",
                    rest.len()
                )));
            }
            let (size_bytes, fd_bytes) = rest.split_at(count as usize * 8);
            let sizes: Vec<u64> = size_bytes
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().expect("8")))
                .collect();
            if sizes.contains(&0) {
                return Err(bad("an hbmalloc handle list with an empty handle".into()));
            }
            Ok(Decoded::Handles {
                pid,
                sizes,
                fds: descriptors(fd_bytes),
            })
        }
        other => Err(bad(format!("type byte {other:#04x}"))),
    }
}

/// The `int`s of a descriptor list.
fn descriptors(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_ne_bytes(c.try_into().expect("4")))
        .collect()
}

/// What `ptr` (a live allocation of this process's hbmalloc, on any device)
/// sends to another process.
pub fn share(ptr: DevicePtr) -> Result<Shared, ApiError> {
    let runtime = runtime()?;
    for slot in &runtime.devices {
        let Some(allocator) = slot.get() else {
            continue;
        };
        let Ok(size) = allocator.allocation_size(ptr) else {
            continue;
        };
        let export = allocator.device().ipc_export(ptr, size).map_err(|e| {
            ApiError::new(
                Status::DriverError,
                format!("hbmalloc: cannot share {ptr:#x} with another process: {e}"),
            )
        })?;
        return Ok(encode(&export, std::process::id() as i32));
    }
    Err(ApiError::new(
        Status::UnknownPointer,
        format!(
            "hbmalloc: cannot share {ptr:#x} with another process: it is not a live allocation \
             of hbmalloc's (the start of a tensor's storage hbmalloc allocated)"
        ),
    ))
}

/// Memory of another process mapped here.
enum Mapped {
    Segment(DevicePtr),
    Handles(ImportedRange),
}

struct Opened {
    device: i32,
    mapped: Mapped,
    base: DevicePtr,
    /// Opens not yet closed: one mapping per handle string, as PyTorch
    /// keeps (a `cudaMalloc` handle opens once per process).
    holders: u64,
}

/// Every handle string open, by its bytes.
fn opened() -> &'static Mutex<HashMap<Vec<u8>, Opened>> {
    static OPENED: OnceLock<Mutex<HashMap<Vec<u8>, Opened>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Maps on `device` the memory another process shared as `handle` (the
/// same string again gives the same address); the base of what is shared,
/// to which the sender's offset is added. Release with [`close`].
pub fn open(handle: &[u8], device: i32) -> Result<DevicePtr, ApiError> {
    let decoded = decode(handle)?;
    let mut table = opened().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(entry) = table.get_mut(handle) {
        entry.holders += 1;
        return Ok(entry.base);
    }
    let mapped = with_allocator(device, |allocator| {
        let cuda = allocator.device();
        match &decoded {
            Decoded::Segment(ipc) => cuda.ipc_open_segment(*ipc).map(Mapped::Segment),
            Decoded::Handles { pid, sizes, fds } => {
                // Closed on every path when `mine` drops.
                let mine = fds
                    .iter()
                    .map(|&fd| {
                        fd_from_process(*pid, fd).map_err(|e| {
                            ApiError::new(
                                Status::DriverError,
                                format!(
                                    "hbmalloc: cannot take descriptor {fd} of process {pid} \
                                     (pidfd_getfd, as PyTorch does for expandable segments): {e}"
                                ),
                            )
                        })
                    })
                    .collect::<Result<Vec<OwnedFd>, ApiError>>()?;
                let borrowed: Vec<_> = mine.iter().map(|fd| fd.as_fd()).collect();
                cuda.ipc_import_handles(&borrowed, sizes)
                    .map(Mapped::Handles)
            }
        }
        .map_err(device_error)
    })?;
    let base = match &mapped {
        Mapped::Segment(ptr) => *ptr,
        Mapped::Handles(range) => range.base,
    };
    table.insert(
        handle.to_vec(),
        Opened {
            device,
            mapped,
            base,
            holders: 1,
        },
    );
    Ok(base)
}

/// Releases one [`open`] of the memory mapped at `base`; the last unmaps it
/// (its memory returns to the driver once the sender has let go too).
pub fn close(base: DevicePtr) -> Result<(), ApiError> {
    let mut table = opened().lock().unwrap_or_else(|e| e.into_inner());
    let key = table
        .iter()
        .find(|(_, entry)| entry.base == base)
        .map(|(key, _)| key.clone())
        .ok_or_else(|| {
            ApiError::new(
                Status::UnknownPointer,
                format!("hbmalloc: {base:#x} is not memory of another process opened here"),
            )
        })?;
    let entry = table.get_mut(&key).expect("just found");
    entry.holders -= 1;
    if entry.holders > 0 {
        return Ok(());
    }
    let entry = table.remove(&key).expect("just found");
    drop(table);
    with_allocator(entry.device, |allocator| {
        let cuda = allocator.device();
        match entry.mapped {
            Mapped::Segment(ptr) => cuda.ipc_close_segment(ptr),
            Mapped::Handles(range) => cuda.ipc_release_import(range),
        }
        .map_err(device_error)
    })
}

/// Other processes' allocations mapped here now (distinct handle strings).
pub fn open_count() -> usize {
    opened().lock().unwrap_or_else(|e| e.into_inner()).len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_handles_round_trip() {
        let export = IpcExport::Segment {
            handle: [7; CU_IPC_HANDLE_SIZE],
            offset: 512,
        };
        let shared = encode(&export, 42);
        assert_eq!(shared.offset, 512);
        assert_eq!(&shared.handle[..2], &[2, b'c']);
        assert_eq!(shared.handle.len(), 66);
        assert_eq!(
            decode(&shared.handle).unwrap(),
            Decoded::Segment([7; CU_IPC_HANDLE_SIZE])
        );
        // Before the version byte, and torch 2.13's version 3.
        assert_eq!(
            decode(&[9; 64]).unwrap(),
            Decoded::Segment([9; CU_IPC_HANDLE_SIZE])
        );
        let mut v3 = shared.handle.clone();
        v3[0] = 3;
        assert!(decode(&v3).is_ok());
    }

    #[test]
    fn expandable_handles_round_trip_in_pytorchs_layout() {
        let export = IpcExport::Handles {
            sizes: vec![2 << 20; 2],
            fds: vec![5, 9],
            offset: 4096,
        };
        let shared = encode(&export, 1234);
        // version, type, ShareHeader (pid, padding, segment_size,
        // num_handles), two ints.
        assert_eq!(shared.handle.len(), 2 + 24 + 8);
        assert_eq!(&shared.handle[2..6], &1234i32.to_ne_bytes());
        assert_eq!(&shared.handle[10..18], &(2u64 << 20).to_ne_bytes());
        assert_eq!(&shared.handle[18..26], &2u64.to_ne_bytes());
        assert_eq!(
            decode(&shared.handle).unwrap(),
            Decoded::Handles {
                pid: 1234,
                sizes: vec![2 << 20; 2],
                fds: vec![5, 9]
            }
        );
    }

    #[test]
    fn handles_of_several_sizes_round_trip_in_hbmallocs_layout() {
        let export = IpcExport::Handles {
            sizes: vec![4 << 20, 32 << 20, 2 << 20],
            fds: vec![5, 9, 11],
            offset: 4096,
        };
        let shared = encode(&export, 1234);
        // version, type, pid, padding, count, three sizes, three ints.
        assert_eq!(&shared.handle[..2], &[2, b'h']);
        assert_eq!(shared.handle.len(), 2 + 16 + 3 * 8 + 3 * 4);
        assert_eq!(shared.offset, 4096);
        assert_eq!(
            decode(&shared.handle).unwrap(),
            Decoded::Handles {
                pid: 1234,
                sizes: vec![4 << 20, 32 << 20, 2 << 20],
                fds: vec![5, 9, 11]
            }
        );
        let good = shared.handle;
        let mut zero = good.clone();
        zero[18..26].copy_from_slice(&0u64.to_ne_bytes());
        for (bytes, reason) in [
            (good[..good.len() - 1].to_vec(), "does not match"),
            (good[..12].to_vec(), "shorter than its header"),
            (zero, "an empty handle"),
        ] {
            let e = decode(&bytes).unwrap_err();
            assert!(e.message.contains(reason), "{bytes:?}: {}", e.message);
        }
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let export = IpcExport::Handles {
            sizes: vec![2 << 20; 2],
            fds: vec![5, 9],
            offset: 0,
        };
        let good = encode(&export, 1234).handle;
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "0 bytes"),
            (vec![2], "1 bytes"),
            (vec![4, b'c'], "newer"),
            (vec![2, b'x', 0, 0], "type byte"),
            (vec![2, b'c', 1, 2, 3], "not 64"),
            (good[..good.len() - 1].to_vec(), "does not match"),
            (good[..10].to_vec(), "shorter than its header"),
            ([&[3u8, b'e'][..], &good[2..]].concat(), "torch 2.13"),
        ];
        for (bytes, reason) in cases {
            let e = decode(&bytes).unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument);
            assert!(e.message.contains(reason), "{bytes:?}: {}", e.message);
        }
        // A header claiming more handles than bytes, or absurdly many.
        let mut lying = good.clone();
        lying[18..26].copy_from_slice(&u64::MAX.to_ne_bytes());
        assert!(decode(&lying).is_err());
    }

    /// Another process's bytes, corrupted anyhow (bytes overwritten, the
    /// string cut or lengthened, header words set to extremes): decoding
    /// gives a handle consistent with itself or an invalid-argument error,
    /// never a panic.
    #[test]
    fn corrupted_handles_decode_or_are_refused() {
        use hbmalloc::simtest::{RandomSource, SplitMix64};
        let exports = [
            IpcExport::Segment {
                handle: [7; CU_IPC_HANDLE_SIZE],
                offset: 0,
            },
            IpcExport::Handles {
                sizes: vec![2 << 20; 3],
                fds: vec![5, 9, 11],
                offset: 0,
            },
            IpcExport::Handles {
                sizes: vec![4 << 20, 32 << 20],
                fds: vec![5, 9],
                offset: 0,
            },
        ];
        let mut draw = SplitMix64::new(1);
        let extremes = [0u64, 1, 3, u64::MAX, u64::MAX / 12, MAX_SHARED_HANDLES + 1];
        for export in &exports {
            let good = encode(export, 4321).handle;
            for _ in 0..3000 {
                let mut bytes = good.clone();
                for _ in 0..1 + draw.below(3) {
                    match draw.below(4) {
                        0 if !bytes.is_empty() => {
                            let at = draw.below(bytes.len() as u64) as usize;
                            bytes[at] = draw.next_u64() as u8;
                        }
                        1 => bytes.truncate(draw.below(bytes.len() as u64 + 1) as usize),
                        2 => bytes.extend((0..draw.below(16)).map(|_| draw.next_u64() as u8)),
                        _ if bytes.len() >= 10 => {
                            let at = 2 + draw.below(bytes.len() as u64 - 9) as usize;
                            let word = *draw.pick(&extremes);
                            bytes[at..at + 8].copy_from_slice(&word.to_ne_bytes());
                        }
                        _ => {}
                    }
                }
                match decode(&bytes) {
                    Ok(Decoded::Segment(_)) => {}
                    Ok(Decoded::Handles { pid, sizes, fds }) => {
                        assert!(pid > 0, "{bytes:?}");
                        assert!(!sizes.is_empty() && sizes.len() == fds.len(), "{bytes:?}");
                        assert!(sizes.len() as u64 <= MAX_SHARED_HANDLES, "{bytes:?}");
                        assert!(!sizes.contains(&0), "{bytes:?}");
                    }
                    Err(e) => assert_eq!(e.status, Status::InvalidArgument, "{bytes:?}"),
                }
            }
        }
    }
}
