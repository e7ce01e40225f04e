//! Reading evaluated arrays back to the host in bulk on MLX's CUDA backend.
//!
//! MLX's CUDA allocator hands out managed memory, and a host read of it migrates the pages
//! one fault at a time: reading the finished KV of an 8K-token prompt (241 MB) back for the
//! cache took 391 ms on an H100 (0.6 GB/s), more than twice the prefill itself. The driver's
//! `cuMemcpy` moves the same bytes in one DMA. MLX has no device-to-host copy of its own and no
//! crate wraps this for an MLX buffer, so the driver entry point is looked up at run time in
//! the `libcuda.so.1` that a CUDA libmlx has already loaded (never loaded by us: on the CPU
//! backend, or on Metal, it is absent and the bytes are read directly). A failed driver copy
//! also falls back to the direct read, logged once and counted.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

type CuResult = i32;
type CuMemcpy = unsafe extern "C" fn(dst: u64, src: u64, bytes: usize) -> CuResult;
type CuCtxGetCurrent = unsafe extern "C" fn(ctx: *mut *mut libc::c_void) -> CuResult;
type CuDevicePrimaryCtxRetain =
    unsafe extern "C" fn(ctx: *mut *mut libc::c_void, device: i32) -> CuResult;
type CuCtxSetCurrent = unsafe extern "C" fn(ctx: *mut libc::c_void) -> CuResult;

struct Driver {
    memcpy: CuMemcpy,
    get_current: CuCtxGetCurrent,
    retain_primary: CuDevicePrimaryCtxRetain,
    set_current: CuCtxSetCurrent,
}

/// Copies that went through the driver, and those that fell back to a direct read.
pub static DRIVER_COPIES: AtomicU64 = AtomicU64::new(0);
pub static FALLBACK_COPIES: AtomicU64 = AtomicU64::new(0);

fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: RTLD_NOLOAD only returns a handle to a library already in the process;
            // the symbols are the CUDA driver API's, with the signatures declared above.
            unsafe {
                let lib =
                    libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
                if lib.is_null() {
                    return None;
                }
                let sym = |name: &std::ffi::CStr| {
                    let p = libc::dlsym(lib, name.as_ptr());
                    (!p.is_null()).then_some(p)
                };
                Some(Driver {
                    memcpy: std::mem::transmute::<*mut libc::c_void, CuMemcpy>(sym(c"cuMemcpy")?),
                    get_current: std::mem::transmute::<*mut libc::c_void, CuCtxGetCurrent>(sym(
                        c"cuCtxGetCurrent",
                    )?),
                    retain_primary: std::mem::transmute::<
                        *mut libc::c_void,
                        CuDevicePrimaryCtxRetain,
                    >(sym(c"cuDevicePrimaryCtxRetain")?),
                    set_current: std::mem::transmute::<*mut libc::c_void, CuCtxSetCurrent>(
                        sym(c"cuCtxSetCurrent_v2").or_else(|| sym(c"cuCtxSetCurrent"))?,
                    ),
                })
            }
        })
        .as_ref()
}

/// Whether reads go through the CUDA driver (a CUDA libmlx is loaded).
pub fn uses_driver() -> bool {
    driver().is_some()
}

/// Appends `src` (the bytes of an evaluated MLX array) to `out`.
pub fn append(out: &mut Vec<u8>, src: &[u8]) {
    if let Some(d) = driver()
        && !src.is_empty()
    {
        let at = out.len();
        out.reserve(src.len());
        // SAFETY: `out` has room for `src.len()` bytes past `at`; cuMemcpy writes exactly
        // that many (unified addressing: managed source, pageable host destination), and
        // the length is set only once it reports success.
        let ok = unsafe {
            let dst = out.as_mut_ptr().add(at) as u64;
            let src_ptr = src.as_ptr() as u64;
            let mut r = (d.memcpy)(dst, src_ptr, src.len());
            if r != 0 && ensure_context(d) {
                r = (d.memcpy)(dst, src_ptr, src.len());
            }
            if r == 0 {
                out.set_len(at + src.len());
            } else if FALLBACK_COPIES.load(Ordering::Relaxed) == 0 {
                tracing::warn!(
                    cuda_error = r,
                    "the CUDA driver's copy failed; reading device memory directly (slower)"
                );
            }
            r == 0
        };
        if ok {
            DRIVER_COPIES.fetch_add(1, Ordering::Relaxed);
            return;
        }
        FALLBACK_COPIES.fetch_add(1, Ordering::Relaxed);
    }
    out.extend_from_slice(src);
}

/// Makes the device's primary context (the one MLX's runtime calls use) current on this
/// thread; false if it already was or cannot be.
fn ensure_context(d: &Driver) -> bool {
    // SAFETY: plain driver API calls with out-pointers to locals.
    unsafe {
        let mut ctx = std::ptr::null_mut();
        if (d.get_current)(&mut ctx) == 0 && !ctx.is_null() {
            return false;
        }
        let mut primary = std::ptr::null_mut();
        (d.retain_primary)(&mut primary, 0) == 0
            && !primary.is_null()
            && (d.set_current)(primary) == 0
    }
}
