//! How the pool's arenas are made and given back.
//!
//! Two ways. `cuMemHostAlloc` (portable) serves every size, and took 5.7 ms per 16 MiB arena
//! on the H200's host (about 12 of them for a large transfer's pipeline: a process's first
//! 4 GiB load spends some 68 ms making them). An arena whose size is a whole number of
//! 2 MiB pages can instead be mapped anonymously, backed by transparent huge pages
//! (`MADV_HUGEPAGE`), touched once per page and registered with `cuMemHostRegister`
//! (portable, mapped for the device): 2.8 ms per 16 MiB arena on the H100's host against
//! 6.3, given back in 0.35 ms instead of 1.7, the same 54.5 GB/s over the link; a process's
//! first 4 GiB load ran at 34.6 GB/s against 28.6 (docs/runs/2026-12-07-h100-huge-pages.md).
//! That way is taken where the configuration asks for it (`Config::pinned_huge_pages`),
//! the kernel offers transparent huge pages (`always` or `madvise`), and the GPU can reach
//! registered memory at its host address (the copy kernels read and write staging there).
//! Once a registration is refused, or the system gives no such mapping, the pool makes every
//! later arena by `cuMemHostAlloc`.

use std::ptr::NonNull;

use crate::error::Result;
use crate::raw::Raw;

/// A transparent huge page on x86-64 and most 64-bit ARM kernels.
pub(super) const HUGE_PAGE: u64 = 2 << 20;

/// One arena of pinned host memory.
pub(super) struct Arena {
    pub(super) ptr: NonNull<u8>,
    pub(super) bytes: u64,
    /// Mapped and registered ([`make_huge`]), rather than from `cuMemHostAlloc`.
    pub(super) huge: bool,
}

// SAFETY: an arena is plain host memory owned by whoever holds the Arena value.
unsafe impl Send for Arena {}

/// Whether this kernel backs `MADV_HUGEPAGE` mappings with transparent huge pages: its
/// setting is `always` or `madvise`, not `never` (nor absent).
pub(crate) fn kernel_offers_huge_pages() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|mode| mode.contains("[always]") || mode.contains("[madvise]"))
}

/// An arena of `bytes` from `cuMemHostAlloc`.
pub(super) fn make_host_alloc(raw: &Raw, bytes: u64) -> Result<Arena> {
    let ptr = raw.mem_host_alloc(bytes)?;
    let ptr = NonNull::new(ptr).expect("cuMemHostAlloc returned success and null");
    Ok(Arena { ptr, bytes, huge: false })
}

/// An arena of `bytes` (a multiple of [`HUGE_PAGE`]) in huge pages, registered, kept from
/// children of `fork`: `Ok(None)` where the system gives no such mapping (the caller makes
/// it another way), `Err` where the driver refuses to register it (nothing left mapped).
#[cfg(target_os = "linux")]
pub(super) fn make_huge(raw: &Raw, bytes: u64) -> Result<Option<Arena>> {
    debug_assert!(bytes > 0 && bytes.is_multiple_of(HUGE_PAGE));
    let (Ok(len), Ok(slack)) = (usize::try_from(bytes), usize::try_from(HUGE_PAGE)) else {
        return Ok(None);
    };
    let Some(mapped) = len.checked_add(slack) else { return Ok(None) };
    // SAFETY: a new private anonymous mapping, at an address of the kernel's choosing.
    let raw_map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            mapped,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw_map == libc::MAP_FAILED {
        return Ok(None);
    }
    // A huge page must start at a multiple of its size: keep the aligned `len` bytes of the
    // mapping and give the slack on each side back.
    let start = raw_map as usize;
    let head = start.next_multiple_of(slack) - start;
    let tail = slack - head;
    // SAFETY: both ranges lie in the mapping just made, outside the part kept.
    unsafe {
        if head > 0 {
            libc::munmap(raw_map, head);
        }
        if tail > 0 {
            libc::munmap((start + head + len) as *mut libc::c_void, tail);
        }
    }
    let ptr = (start + head) as *mut u8;
    // Huge pages; and not inherited by a child of `fork`: otherwise the parent's next write
    // to a page shared copy-on-write would move it to a new page while the GPU's copies
    // still use the old one (memory from `cuMemHostAlloc` is kept from children the same
    // way).
    // SAFETY: `[ptr, ptr + len)` is the mapping kept above, unused by anyone else.
    let advised = unsafe {
        libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) == 0
            && libc::madvise(ptr.cast(), len, libc::MADV_DONTFORK) == 0
    };
    if !advised {
        // SAFETY: as above; nothing refers to it.
        unsafe { libc::munmap(ptr.cast(), len) };
        return Ok(None);
    }
    // One write per page faults each in as a whole huge page, zeroed by the kernel, before
    // the driver pins it (which would otherwise fault it in 4 KiB at a time).
    for at in (0..len).step_by(slack) {
        // SAFETY: inside the writable mapping kept above.
        unsafe { ptr.add(at).write_volatile(0) };
    }
    // SAFETY: the range stays mapped until `free` unregisters and unmaps it.
    match unsafe { raw.mem_host_register(ptr, len, cuda_sys::CU_MEMHOSTREGISTER_DEVICEMAP) } {
        Ok(()) => Ok(Some(Arena { ptr: NonNull::new(ptr).expect("mmap returned null"), bytes, huge: true })),
        Err(e) => {
            // SAFETY: as above; the driver did not keep it.
            unsafe { libc::munmap(ptr.cast(), len) };
            Err(e)
        }
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn make_huge(_raw: &Raw, _bytes: u64) -> Result<Option<Arena>> {
    Ok(None)
}

/// Gives `arena` back to the driver (and, made by [`make_huge`], to the kernel).
///
/// # Safety
/// The arena is free (no lease, so no copy uses it) and out of the pool: freed once.
pub(super) unsafe fn free(raw: &Raw, arena: &Arena) -> Result<()> {
    if !arena.huge {
        // SAFETY: as the caller promises; it came from cuMemHostAlloc.
        return unsafe { raw.mem_free_host(arena.ptr.as_ptr()) };
    }
    // SAFETY: as the caller promises; it was registered by make_huge.
    unsafe { raw.mem_host_unregister(arena.ptr.as_ptr()) }?;
    #[cfg(target_os = "linux")]
    // SAFETY: the mapping make_huge kept, now unregistered and unused.
    unsafe {
        libc::munmap(arena.ptr.as_ptr().cast(), arena.bytes as usize)
    };
    Ok(())
}
