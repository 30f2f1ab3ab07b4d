//! Host memory behind the double's device memory: a `memfd` mapped shared,
//! so that another process given the descriptor (CUDA IPC through
//! `pidfd_getfd`, or an exported handle) maps the same bytes.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use hbmalloc_cuda::ffi::{CUresult, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY};

/// `len` bytes of a memory file, mapped read-write and shared.
pub(crate) struct HostBytes {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain memory owned by this value; the double only
// reaches it with its global lock held.
unsafe impl Send for HostBytes {}

impl HostBytes {
    /// A fresh, zeroed memory file of `len` bytes (committed only when
    /// written).
    pub(crate) fn new(len: usize) -> Result<HostBytes, CUresult> {
        // SAFETY: the name is a NUL-terminated string; flags are valid.
        let raw = unsafe { libc::memfd_create(c"hbm-double".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: a descriptor just made for us and owned by no one else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: a valid descriptor of a memory file and a non-negative size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        HostBytes::map(fd, len)
    }

    /// Maps memory file `fd` (a duplicate is kept), which must hold at
    /// least `len` bytes.
    pub(crate) fn open(fd: BorrowedFd<'_>, len: usize) -> Result<HostBytes, CUresult> {
        let fd = fd
            .try_clone_to_owned()
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        HostBytes::map(fd, len)
    }

    /// The size of the file behind `fd`.
    pub(crate) fn file_len(fd: BorrowedFd<'_>) -> Result<u64, CUresult> {
        let file = std::fs::File::from(
            fd.try_clone_to_owned()
                .map_err(|_| CUDA_ERROR_INVALID_VALUE)?,
        );
        file.metadata()
            .map(|m| m.len())
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<HostBytes, CUresult> {
        if len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a fresh mapping anywhere (null hint) of `len` bytes of a
        // valid descriptor; the result is checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(HostBytes {
            ptr: ptr.cast(),
            len,
            fd,
        })
    }

    /// The memory file.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
}

impl std::ops::Deref for HostBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` mapped, readable bytes at `ptr`, live until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for HostBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and writable; `&mut self` makes it exclusive here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping `map` made; nothing refers to it after
        // drop. The descriptor closes with `fd`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
