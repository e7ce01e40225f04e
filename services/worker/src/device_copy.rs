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
//!
//! The other way, KV imported from the cache is written into fresh managed memory on the host
//! and would migrate to the device one GPU page fault at a time during the next pass (a
//! 64-token pass after an 8K-token hit took 87 ms on an H100, about 10 ms of it compute):
//! `prefetch_to_device` asks the driver to move those pages in bulk first.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

type CuResult = i32;
type CuMemcpy = unsafe extern "C" fn(dst: u64, src: u64, bytes: usize) -> CuResult;
type CuCtxGetCurrent = unsafe extern "C" fn(ctx: *mut *mut libc::c_void) -> CuResult;
type CuDevicePrimaryCtxRetain =
    unsafe extern "C" fn(ctx: *mut *mut libc::c_void, device: i32) -> CuResult;
type CuCtxSetCurrent = unsafe extern "C" fn(ctx: *mut libc::c_void) -> CuResult;
type CuCtxSynchronize = unsafe extern "C" fn() -> CuResult;
/// `cuMemPrefetchAsync_v2` (CUDA 12.2+; plain `cuMemPrefetchAsync` in CUDA 13 headers, with
/// the old four-argument entry point kept under its own name in the driver library).
type CuMemPrefetchAsyncV2 = unsafe extern "C" fn(
    ptr: u64,
    bytes: usize,
    location: CuMemLocation,
    flags: u32,
    stream: *mut libc::c_void,
) -> CuResult;

type CuStreamCreate = unsafe extern "C" fn(stream: *mut *mut libc::c_void, flags: u32) -> CuResult;
type CuMemcpyAsync =
    unsafe extern "C" fn(dst: u64, src: u64, bytes: usize, stream: *mut libc::c_void) -> CuResult;
type CuStreamSynchronize = unsafe extern "C" fn(stream: *mut libc::c_void) -> CuResult;
type CuStreamDestroy = unsafe extern "C" fn(stream: *mut libc::c_void) -> CuResult;
type CuMemAllocHost = unsafe extern "C" fn(pp: *mut *mut libc::c_void, bytes: usize) -> CuResult;

/// `CU_STREAM_NON_BLOCKING`: a stream that does not wait for the legacy default stream.
const STREAM_NON_BLOCKING: u32 = 1;

/// A copy on a stream of the calling thread's own.
#[derive(Clone, Copy)]
struct SideStream {
    create: CuStreamCreate,
    memcpy_async: CuMemcpyAsync,
    synchronize: CuStreamSynchronize,
    /// For the streams of short-lived threads (`write_runs`); absent: those use the default
    /// path.
    destroy: Option<CuStreamDestroy>,
    /// Page-locked staging buffers for `write_runs`; absent: copies from pageable memory.
    alloc_host: Option<CuMemAllocHost>,
}

/// `CUmemLocation`: where memory should live.
#[repr(C)]
#[derive(Clone, Copy)]
struct CuMemLocation {
    kind: i32,
    id: i32,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: i32 = 1;

struct Driver {
    memcpy: CuMemcpy,
    get_current: CuCtxGetCurrent,
    retain_primary: CuDevicePrimaryCtxRetain,
    set_current: CuCtxSetCurrent,
    /// Absent from drivers before CUDA 12.2: imports then migrate on demand, as before.
    prefetch: Option<CuMemPrefetchAsyncV2>,
    synchronize: Option<CuCtxSynchronize>,
    side: Option<SideStream>,
}

/// Copies that went through the driver, and those that fell back to a direct read.
pub static DRIVER_COPIES: AtomicU64 = AtomicU64::new(0);
pub static FALLBACK_COPIES: AtomicU64 = AtomicU64::new(0);
/// Imported buffers moved to the device in bulk, and prefetches the driver refused.
pub static PREFETCHES: AtomicU64 = AtomicU64::new(0);
pub static FAILED_PREFETCHES: AtomicU64 = AtomicU64::new(0);

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
                    prefetch: sym(c"cuMemPrefetchAsync_v2")
                        .map(|p| std::mem::transmute::<*mut libc::c_void, CuMemPrefetchAsyncV2>(p)),
                    synchronize: sym(c"cuCtxSynchronize")
                        .map(|p| std::mem::transmute::<*mut libc::c_void, CuCtxSynchronize>(p)),
                    side: match (
                        sym(c"cuStreamCreate"),
                        sym(c"cuMemcpyAsync"),
                        sym(c"cuStreamSynchronize"),
                    ) {
                        (Some(c), Some(m), Some(s)) => Some(SideStream {
                            create: std::mem::transmute::<*mut libc::c_void, CuStreamCreate>(c),
                            memcpy_async: std::mem::transmute::<*mut libc::c_void, CuMemcpyAsync>(
                                m,
                            ),
                            synchronize: std::mem::transmute::<
                                *mut libc::c_void,
                                CuStreamSynchronize,
                            >(s),
                            destroy: sym(c"cuStreamDestroy_v2")
                                .or_else(|| sym(c"cuStreamDestroy"))
                                .map(|p| {
                                    std::mem::transmute::<*mut libc::c_void, CuStreamDestroy>(p)
                                }),
                            alloc_host: sym(c"cuMemAllocHost_v2")
                                .or_else(|| sym(c"cuMemAllocHost"))
                                .map(|p| {
                                    std::mem::transmute::<*mut libc::c_void, CuMemAllocHost>(p)
                                }),
                        }),
                        _ => None,
                    },
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
    let at = out.len();
    out.reserve(src.len());
    // SAFETY: `out` has room for `src.len()` bytes past `at`, and its length is set only once
    // the driver reports that it wrote them.
    if unsafe { driver_copy(out.as_mut_ptr().add(at), src) } {
        unsafe { out.set_len(at + src.len()) };
        return;
    }
    out.extend_from_slice(src);
}

/// `append` for a thread other than the engine's (the block finisher): the copy runs on a
/// non-blocking stream of this thread's own, so it neither waits for the engine's next pass
/// nor holds it up, wherever MLX queues its work; the legacy stream's `cuMemcpy` would order
/// itself with every blocking stream of the context.
pub fn append_beside(out: &mut Vec<u8>, src: &[u8]) {
    let at = out.len();
    out.reserve(src.len());
    // SAFETY: `out` has room for `src.len()` bytes past `at`, and its length is set only once
    // the driver reports that it wrote them.
    if unsafe { side_copy(out.as_mut_ptr().add(at), src) } {
        unsafe { out.set_len(at + src.len()) };
        return;
    }
    append(out, src);
}

/// Copies `src` to `dst` on this thread's side stream and waits for it; false if there is no
/// such stream or the copy failed (the caller then copies another way).
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes.
unsafe fn side_copy(dst: *mut u8, src: &[u8]) -> bool {
    let Some(d) = driver() else {
        return false;
    };
    let (Some(side), false) = (d.side, src.is_empty()) else {
        return false;
    };
    let Some(stream) = side_stream(d, side) else {
        return false;
    };
    // SAFETY: as `driver_copy`, on a stream this thread created; the synchronisation makes the
    // copy complete before `dst` is used.
    let r = unsafe {
        match (side.memcpy_async)(dst as u64, src.as_ptr() as u64, src.len(), stream) {
            0 => (side.synchronize)(stream),
            e => e,
        }
    };
    copied(
        r,
        &FAILED_SIDE_COPIES,
        "a copy on the finisher's own CUDA stream failed; copying on the default stream",
    )
}

/// Copies on a side stream that failed (then made on the default stream).
pub static FAILED_SIDE_COPIES: AtomicU64 = AtomicU64::new(0);

/// Imports written straight into device memory (`write_runs`), and those that fell back to
/// host writes.
pub static DEVICE_WRITES: AtomicU64 = AtomicU64::new(0);
pub static FAILED_DEVICE_WRITES: AtomicU64 = AtomicU64::new(0);

/// Writes each `(offset, bytes)` run into the buffer at `dst` (an evaluated MLX array's, on
/// the device), on a non-blocking stream made for the call (the importing threads live for
/// one import: a thread-local stream would leak with each), through a page-locked staging
/// buffer (`staged_copies`). Where a copy fails, every run is written again through host
/// pointers (managed memory is host-writable, only slower), so the buffer always ends up
/// written. Returns whether the driver wrote it.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes, every run must lie inside them, and nothing
/// may read or write that memory until this returns.
pub unsafe fn write_runs(dst: *mut u8, len: usize, runs: &[(usize, &[u8])]) -> bool {
    debug_assert!(runs.iter().all(|(at, b)| at + b.len() <= len));
    // SAFETY: the caller's promises, passed on.
    let queued = driver()
        .and_then(|d| Some((d.side?, d)))
        .map(|(side, d)| unsafe { copy_on_own_stream(d, side, dst, runs) });
    if queued == Some(true) {
        DEVICE_WRITES.fetch_add(1, Ordering::Relaxed);
        return true;
    }
    if queued.is_some() && FAILED_DEVICE_WRITES.fetch_add(1, Ordering::Relaxed) == 0 {
        tracing::warn!(
            "the CUDA driver could not write imported KV to the device; writing it through host pointers (slower)"
        );
    }
    for (at, bytes) in runs {
        // SAFETY: inside `dst`'s `len` bytes (the caller's promise), from borrowed memory
        // that cannot overlap a fresh MLX buffer.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.add(*at), bytes.len()) };
    }
    false
}

/// `write_runs`'s driver path: a stream made for the call, the runs copied through a
/// page-locked staging buffer where one can be had (else straight from their pageable
/// memory), one wait, the stream destroyed. Whether every copy was made.
///
/// # Safety
/// As `write_runs`.
unsafe fn copy_on_own_stream(
    d: &Driver,
    side: SideStream,
    dst: *mut u8,
    runs: &[(usize, &[u8])],
) -> bool {
    let Some(destroy) = side.destroy else {
        return false;
    };
    let mut stream = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local, the primary context made current first.
    let made = unsafe {
        ensure_context(d);
        (side.create)(&mut stream, STREAM_NON_BLOCKING) == 0 && !stream.is_null()
    };
    if !made {
        return false;
    }
    let staging = side.alloc_host.and_then(Staging::take);
    let done = match &staging {
        // SAFETY: the caller's promises; the buffer is this thread's until given back.
        Some(buffer) => unsafe { staged_copies(side, stream, buffer, dst, runs) },
        None => {
            // SAFETY: every run lies inside `dst` (the caller's promise); the sources are
            // borrowed host memory alive for the call; the wait completes every copy before
            // the stream is destroyed.
            let queued = runs.iter().all(|(at, bytes)| unsafe {
                (side.memcpy_async)(
                    dst.add(*at) as u64,
                    bytes.as_ptr() as u64,
                    bytes.len(),
                    stream,
                ) == 0
            });
            // SAFETY: waits for this call's stream.
            let waited = unsafe { (side.synchronize)(stream) } == 0;
            queued && waited
        }
    };
    if let Some(buffer) = staging {
        buffer.give_back();
    }
    // SAFETY: the stream is this call's, idle after its last wait (or failed).
    unsafe { destroy(stream) };
    done
}

/// Bytes of one page-locked staging buffer.
const STAGING_BYTES: usize = 16 << 20;

/// A page-locked host buffer of `STAGING_BYTES`, from a pool the process keeps (one per
/// importing thread at most; never freed: page-locking memory costs more than copying
/// through it). Why staging: the driver copies from pageable memory through small buffers of
/// its own, one copy at a time; a 64K-token hit's 1.4 GB of KV went to an H200 at ~3.5 GB/s
/// that way.
struct Staging(usize);

static STAGING_POOL: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

impl Staging {
    fn take(alloc: CuMemAllocHost) -> Option<Self> {
        let pooled = STAGING_POOL.lock().ok().and_then(|mut pool| pool.pop());
        if let Some(p) = pooled {
            return Some(Self(p));
        }
        let mut p = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; the caller made the primary context current.
        let r = unsafe { alloc(&mut p, STAGING_BYTES) };
        (r == 0 && !p.is_null()).then_some(Self(p as usize))
    }

    fn give_back(self) {
        if let Ok(mut pool) = STAGING_POOL.lock() {
            pool.push(self.0);
        }
    }
}

/// The runs copied through `buffer`: filled with as many runs (or pieces of one) as it
/// holds, their copies to the device queued and waited for, then filled again. Whether every
/// copy was made.
///
/// # Safety
/// As `write_runs`; `buffer` is held by this thread alone.
unsafe fn staged_copies(
    side: SideStream,
    stream: *mut libc::c_void,
    buffer: &Staging,
    dst: *mut u8,
    runs: &[(usize, &[u8])],
) -> bool {
    let base = buffer.0 as *mut u8;
    // (offset in dst, offset in the buffer, bytes) of the pieces in the buffer.
    let mut queued: Vec<(usize, usize, usize)> = Vec::new();
    let flush = |queued: &mut Vec<(usize, usize, usize)>| -> bool {
        // SAFETY: each piece lies inside `dst` (the caller's promise) and inside the buffer;
        // the wait ends the copies before the buffer is refilled.
        let ok = queued.iter().all(|&(at, from, n)| unsafe {
            (side.memcpy_async)(dst.add(at) as u64, base.add(from) as u64, n, stream) == 0
        });
        queued.clear();
        // SAFETY: waits for this call's stream.
        ok && unsafe { (side.synchronize)(stream) } == 0
    };
    let mut fill = 0;
    for (at, bytes) in runs {
        let mut done = 0;
        while done < bytes.len() {
            if fill == STAGING_BYTES {
                if !flush(&mut queued) {
                    return false;
                }
                fill = 0;
            }
            let n = (bytes.len() - done).min(STAGING_BYTES - fill);
            // SAFETY: `fill + n <= STAGING_BYTES`; the source is borrowed, the buffer idle
            // since the last wait.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().add(done), base.add(fill), n) };
            queued.push((at + done, fill, n));
            fill += n;
            done += n;
        }
    }
    flush(&mut queued)
}

/// This thread's non-blocking stream, made at its first use (None if it cannot be).
fn side_stream(d: &Driver, side: SideStream) -> Option<*mut libc::c_void> {
    thread_local! {
        /// 0: not made yet; 1: could not be made; else the stream.
        static STREAM: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }
    let held = STREAM.get();
    if held > 1 {
        return Some(held as *mut libc::c_void);
    }
    if held == 1 {
        return None;
    }
    let mut stream = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local; the primary context is made current first.
    let made = unsafe {
        ensure_context(d);
        (side.create)(&mut stream, STREAM_NON_BLOCKING) == 0 && stream as usize > 1
    };
    STREAM.set(if made { stream as usize } else { 1 });
    made.then_some(stream)
}

/// `src` (an evaluated MLX array's floats) in a host vector: a decode step's logits, one row
/// per sequence (8 sequences of a 152K-token vocabulary are 4.9 MB, ~8 ms read page by page
/// from managed memory on an H100).
pub fn to_host_f32(src: &[f32]) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(src.len());
    // SAFETY: `out` has room for `src.len()` floats; its length is set only once the driver
    // reports that it wrote all of their bytes (any bit pattern is a valid f32).
    let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), size_of_val(src)) };
    if unsafe { driver_copy(out.as_mut_ptr().cast::<u8>(), bytes) } {
        unsafe { out.set_len(src.len()) };
        return out;
    }
    out.extend_from_slice(src);
    out
}

/// Copies `src` to `dst` with the driver's `cuMemcpy` where a CUDA libmlx is loaded; false
/// (nothing written, or to be overwritten) where it is not or the copy failed, and the caller
/// reads `src` directly.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes.
unsafe fn driver_copy(dst: *mut u8, src: &[u8]) -> bool {
    let Some(d) = driver() else {
        return false;
    };
    if src.is_empty() {
        return false;
    }
    // SAFETY: unified addressing (managed source, pageable host destination); cuMemcpy writes
    // exactly `src.len()` bytes, for which the caller vouches.
    let r = unsafe {
        let mut r = (d.memcpy)(dst as u64, src.as_ptr() as u64, src.len());
        if r != 0 && ensure_context(d) {
            r = (d.memcpy)(dst as u64, src.as_ptr() as u64, src.len());
        }
        r
    };
    copied(
        r,
        &FALLBACK_COPIES,
        "the CUDA driver's copy failed; reading device memory directly (slower)",
    )
}

/// Counts a driver copy's result `r` (0: done) in `DRIVER_COPIES` or in `failures`, warning at
/// the first failure; whether it was done.
fn copied(r: CuResult, failures: &AtomicU64, warning: &str) -> bool {
    if r == 0 {
        DRIVER_COPIES.fetch_add(1, Ordering::Relaxed);
        return true;
    }
    if failures.fetch_add(1, Ordering::Relaxed) == 0 {
        tracing::warn!(cuda_error = r, "{warning}");
    }
    false
}

/// Moves the pages of freshly written buffers (imported KV) to the device in bulk, and waits
/// for it, so that the next pass does not fault them in one by one. Does nothing on the CPU
/// and Metal, without the driver entry point, or with `STRATA_KV_PREFETCH=0` (to measure it).
pub fn prefetch_to_device(buffers: &[&[u8]]) {
    static OFF: OnceLock<bool> = OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("STRATA_KV_PREFETCH").is_ok_and(|v| v == "0")) {
        return;
    }
    let Some(d) = driver() else {
        return;
    };
    let (Some(prefetch), Some(synchronize)) = (d.prefetch, d.synchronize) else {
        return;
    };
    let device = CuMemLocation {
        kind: LOCATION_DEVICE,
        id: 0,
    };
    let mut failed = 0;
    for b in buffers.iter().filter(|b| !b.is_empty()) {
        // SAFETY: the range is one evaluated MLX buffer (managed memory on CUDA); a prefetch
        // only moves its pages and reads or writes nothing; the null stream is the legacy one.
        let mut r =
            unsafe { prefetch(b.as_ptr() as u64, b.len(), device, 0, std::ptr::null_mut()) };
        if r != 0 && ensure_context(d) {
            // SAFETY: as above.
            r = unsafe { prefetch(b.as_ptr() as u64, b.len(), device, 0, std::ptr::null_mut()) };
        }
        if r == 0 {
            PREFETCHES.fetch_add(1, Ordering::Relaxed);
        } else {
            if FAILED_PREFETCHES.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    cuda_error = r,
                    "the CUDA driver refused to prefetch imported KV; it migrates on first use (slower)"
                );
            }
            failed += 1;
        }
    }
    if failed < buffers.len() {
        // SAFETY: waits for the context's work, the prefetches included.
        unsafe { synchronize() };
    }
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
