//! Sharing device memory with other processes (CUDA IPC): what backs an
//! address, exported; and another process's memory, imported.
//!
//! The device keeps its own record of the segments it allocated and of the
//! physical handles it mapped where (`ShareTable`), so that "which memory
//! lies under this range" is answered here, from what the driver was told,
//! without the engine knowing of handles' file descriptors or of any wire
//! format. A segment (`cuMemAlloc`) is shared through `cuIpcGetMemHandle`; a
//! range of mapped physical handles through `cuMemExportToShareableHandle`
//! with POSIX file descriptors, which is why handles are created exportable.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};

use hbmalloc::{Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult};

use crate::device::CudaDevice;
use crate::ffi::{CUipcMemHandle, CU_IPC_HANDLE_SIZE};
use crate::SETUP_CALL_KIND;

/// One physical handle this device created.
#[derive(Debug)]
pub(crate) struct HandleEntry {
    pub(crate) size: u64,
    /// Created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
    pub(crate) shareable: bool,
    /// Its export, made at the first share and kept open until the handle is
    /// released: the importer takes it by number from this process
    /// (`pidfd_getfd`), as PyTorch's expandable segments do.
    pub(crate) fd: Option<OwnedFd>,
}

/// One `cuMemMap` this device made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MapEntry {
    pub(crate) size: u64,
    pub(crate) handle: u64,
    pub(crate) offset: u64,
}

/// What the device allocated and mapped, kept for sharing.
#[derive(Debug, Default)]
pub(crate) struct ShareTable {
    pub(crate) segments: BTreeMap<u64, u64>,
    pub(crate) handles: HashMap<u64, HandleEntry>,
    pub(crate) mappings: BTreeMap<u64, MapEntry>,
}

impl ShareTable {
    /// Forgets the mappings that start inside `[va, va + size)`.
    pub(crate) fn unmapped(&mut self, va: u64, size: u64) {
        let starts: Vec<u64> = self
            .mappings
            .range(va..va.saturating_add(size))
            .map(|(&start, _)| start)
            .collect();
        for start in starts {
            self.mappings.remove(&start);
        }
    }
}

/// What another process needs to map the memory under an allocation.
#[derive(Debug)]
pub enum IpcExport {
    /// The allocation lies in a `cuMemAlloc` segment: the segment's IPC
    /// handle (`cuIpcGetMemHandle`), and where the allocation starts in it.
    Segment {
        /// `CUipcMemHandle`'s bytes.
        handle: [u8; CU_IPC_HANDLE_SIZE],
        /// The allocation's offset from the segment's start.
        offset: u64,
    },
    /// The allocation lies in mapped physical memory: handles mapped whole,
    /// one after the other, from an address `offset` bytes before the
    /// allocation.
    Handles {
        /// Bytes in each handle, in address order.
        sizes: Vec<u64>,
        /// Each handle's export, in address order: descriptors of this
        /// process, open until the handle is released.
        fds: Vec<RawFd>,
        /// The allocation's offset from the first handle's start.
        offset: u64,
    },
}

/// Another process's physical handles, mapped here by
/// [`CudaDevice::ipc_import_handles`]; give it back with
/// [`CudaDevice::ipc_release_import`].
#[derive(Debug)]
pub struct ImportedRange {
    /// Where the handles are mapped, one after the other.
    pub base: DevicePtr,
    /// Bytes mapped (the handles' sizes summed).
    pub size: u64,
    /// Each handle and its size, in address order.
    handles: Vec<(u64, u64)>,
}

impl IpcExport {
    /// The size every handle has, when they all have one (what PyTorch's
    /// expandable-segment format can carry); `None` for a segment or handles
    /// of several sizes.
    pub fn common_handle_size(&self) -> Option<u64> {
        match self {
            IpcExport::Handles { sizes, .. } => {
                let first = *sizes.first()?;
                sizes.iter().all(|&s| s == first).then_some(first)
            }
            IpcExport::Segment { .. } => None,
        }
    }
}

fn ipc_error(kind: DeviceErrorKind, detail: String) -> DeviceError {
    DeviceError::new(SETUP_CALL_KIND, kind, detail)
}

fn unsupported(detail: String) -> DeviceError {
    ipc_error(DeviceErrorKind::Unsupported, detail)
}

impl CudaDevice {
    /// What another process needs to map the `size` bytes at `ptr` (an
    /// allocation of this device's): see [`IpcExport`]. Fails with
    /// [`DeviceErrorKind::Unsupported`] when the range lies in memory this
    /// device did not allocate, in handles not created exportable, or in a
    /// layout no format carries (handles mapped in part).
    pub fn ipc_export(&self, ptr: DevicePtr, size: u64) -> DeviceResult<IpcExport> {
        let end = ptr.checked_add(size.max(1)).ok_or_else(|| {
            unsupported(format!("range {ptr:#x}+{size} overflows the address space"))
        })?;
        let segment = {
            let table = self.lock_shared();
            table
                .segments
                .range(..=ptr)
                .next_back()
                .filter(|(&base, &len)| end <= base + len)
                .map(|(&base, _)| base)
        };
        if let Some(base) = segment {
            let _current = self.make_current(SETUP_CALL_KIND)?;
            let handle = self
                .driver()
                .ipc_get_mem_handle(base)
                .map_err(|e| self.error(SETUP_CALL_KIND, e, &format!("segment {base:#x}")))?;
            return Ok(IpcExport::Segment {
                handle: handle.reserved,
                offset: ptr - base,
            });
        }
        let mut table = self.lock_shared();
        let pieces = covering_mappings(&table.mappings, ptr, end)?;
        for (_, m) in &pieces {
            let entry = table.handles.get(&m.handle).ok_or_else(|| {
                unsupported(format!(
                    "handle {:#x} was not created by this device",
                    m.handle
                ))
            })?;
            if m.offset != 0 || m.size != entry.size {
                return Err(unsupported(format!(
                    "the memory under {ptr:#x}+{size} is mapped from parts of handles, which \
                     another process cannot map (it maps handles whole)"
                )));
            }
            if !entry.shareable {
                return Err(unsupported(format!(
                    "the memory under {ptr:#x}+{size} was created without \
                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (the driver refused exportable \
                     memory), so it cannot be shared"
                )));
            }
        }
        let _current = self.make_current(SETUP_CALL_KIND)?;
        let mut fds = Vec::with_capacity(pieces.len());
        for (_, m) in &pieces {
            let entry = table.handles.get_mut(&m.handle).expect("checked above");
            if entry.fd.is_none() {
                let fd = self.driver().mem_export_fd(m.handle).map_err(|e| {
                    self.error(SETUP_CALL_KIND, e, &format!("handle {:#x}", m.handle))
                })?;
                entry.fd = Some(fd);
            }
            fds.push(entry.fd.as_ref().expect("just set").as_raw_fd());
        }
        Ok(IpcExport::Handles {
            sizes: pieces.iter().map(|(_, m)| m.size).collect(),
            fds,
            offset: ptr - pieces[0].0,
        })
    }

    /// Maps another process's segment, named by the bytes of its
    /// `cuIpcGetMemHandle`, into this one (`cuIpcOpenMemHandle`); close it
    /// with [`CudaDevice::ipc_close_segment`].
    pub fn ipc_open_segment(&self, handle: [u8; CU_IPC_HANDLE_SIZE]) -> DeviceResult<DevicePtr> {
        let _current = self.make_current(SETUP_CALL_KIND)?;
        self.driver()
            .ipc_open_mem_handle(CUipcMemHandle { reserved: handle })
            .map_err(|e| self.error(SETUP_CALL_KIND, e, "opening another process's segment"))
    }

    /// Unmaps a segment [`CudaDevice::ipc_open_segment`] mapped at `ptr`.
    pub fn ipc_close_segment(&self, ptr: DevicePtr) -> DeviceResult<()> {
        let _current = self.make_current(SETUP_CALL_KIND)?;
        self.driver()
            .ipc_close_mem_handle(ptr)
            .map_err(|e| self.error(SETUP_CALL_KIND, e, &format!("segment {ptr:#x}")))
    }

    /// Imports the physical handles exported as `fds` (descriptors of this
    /// process, left open: the caller closes them), of `sizes` bytes each,
    /// and maps them one after the other in a fresh address range, readable
    /// and writable by this device and its peers. On failure, everything
    /// made is undone.
    pub fn ipc_import_handles(
        &self,
        fds: &[BorrowedFd<'_>],
        sizes: &[u64],
    ) -> DeviceResult<ImportedRange> {
        let granule = self.granularity().ok_or_else(|| {
            unsupported(format!(
                "device {} has no virtual-memory API to map shared handles",
                self.ordinal()
            ))
        })?;
        let size = sizes
            .iter()
            .try_fold(0u64, |sum, &s| {
                (s > 0 && s % granule == 0).then(|| sum.checked_add(s))?
            })
            .filter(|&s| s > 0 && sizes.len() == fds.len())
            .ok_or_else(|| {
                ipc_error(
                    DeviceErrorKind::Driver("CUDA_ERROR_INVALID_VALUE".into()),
                    format!(
                        "{} shared handles of {sizes:?} bytes: not a whole number of {granule}-byte granules each, one per descriptor",
                        fds.len()
                    ),
                )
            })?;
        let bytes = usize::try_from(size)
            .map_err(|_| unsupported(format!("{size} bytes do not fit in size_t")))?;
        let _current = self.make_current(SETUP_CALL_KIND)?;
        let driver = self.driver();
        let base = driver
            .mem_address_reserve(bytes)
            .map_err(|e| self.error(SETUP_CALL_KIND, e, &format!("size {size}")))?;
        let mut range = ImportedRange {
            base,
            size,
            handles: Vec::with_capacity(fds.len()),
        };
        let mut mapped = 0usize;
        let result = (|| {
            for (fd, &handle_size) in fds.iter().zip(sizes) {
                let handle = driver
                    .mem_import_fd(fd.as_raw_fd())
                    .map_err(|e| self.error(SETUP_CALL_KIND, e, "a shared handle"))?;
                range.handles.push((handle, handle_size));
            }
            let mut va = base;
            for &(handle, handle_size) in &range.handles {
                driver
                    .mem_map(va, handle_size as usize, handle, 0)
                    .map_err(|e| self.error(SETUP_CALL_KIND, e, &format!("at {va:#x}")))?;
                mapped += 1;
                va += handle_size;
            }
            driver
                .mem_set_access(base, bytes, self.access_ordinals())
                .map_err(|e| self.error(SETUP_CALL_KIND, e, &format!("{base:#x}+{size}")))
        })();
        match result {
            Ok(()) => Ok(range),
            Err(e) => {
                // The first failure is the one to report; the undoing is best effort.
                let _ = self.undo_import(&range, mapped);
                Err(e)
            }
        }
    }

    /// Unmaps and releases what [`CudaDevice::ipc_import_handles`] mapped;
    /// the memory goes back to the driver once its exporter has let go too.
    pub fn ipc_release_import(&self, range: ImportedRange) -> DeviceResult<()> {
        let _current = self.make_current(SETUP_CALL_KIND)?;
        self.undo_import(&range, range.handles.len())
    }

    /// Unmaps the first `mapped` handles of `range`, releases all its
    /// handles and frees its addresses; the first error is returned after
    /// every step was tried. The context must be current.
    fn undo_import(&self, range: &ImportedRange, mapped: usize) -> DeviceResult<()> {
        let driver = self.driver();
        let mut first = Ok(());
        let mut keep = |r: Result<(), crate::driver::CuError>, what: String| {
            if let (Err(e), Ok(())) = (r, &first) {
                first = Err(self.error(SETUP_CALL_KIND, e, &what));
            }
        };
        let mut va = range.base;
        for &(_, handle_size) in &range.handles[..mapped] {
            keep(
                driver.mem_unmap(va, handle_size as usize),
                format!("{va:#x}"),
            );
            va += handle_size;
        }
        for &(handle, _) in &range.handles {
            keep(driver.mem_release(handle), format!("handle {handle:#x}"));
        }
        keep(
            driver.mem_address_free(range.base, range.size as usize),
            format!("{:#x}", range.base),
        );
        first
    }
}

/// The mappings that tile `[ptr, end)` without a hole, in address order.
fn covering_mappings(
    mappings: &BTreeMap<u64, MapEntry>,
    ptr: u64,
    end: u64,
) -> DeviceResult<Vec<(u64, MapEntry)>> {
    let not_ours = || {
        ipc_error(
            DeviceErrorKind::Unsupported,
            format!(
                "{ptr:#x} is not memory this device allocated or mapped, so it cannot be shared"
            ),
        )
    };
    let first = mappings
        .range(..=ptr)
        .next_back()
        .filter(|(&start, m)| start + m.size > ptr)
        .map(|(&start, _)| start)
        .ok_or_else(not_ours)?;
    let mut pieces = Vec::new();
    let mut cursor = first;
    for (&start, m) in mappings.range(first..end) {
        if start != cursor {
            return Err(not_ours());
        }
        pieces.push((start, *m));
        cursor = start + m.size;
    }
    if cursor < end {
        return Err(not_ours());
    }
    Ok(pieces)
}
