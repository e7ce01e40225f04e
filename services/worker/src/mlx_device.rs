//! What MLX runs on in this process: which library was loaded and whether it has a GPU.

use mlx_rs::{Device, Stream};

/// The MLX library's own version string (from the libmlx actually loaded at run time).
pub fn mlx_version() -> String {
    // SAFETY: mlx_version fills a string handle that we own and free here.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let text = if mlx_sys::mlx_version(&mut s) == 0 {
            let ptr = mlx_sys::mlx_string_data(s);
            if ptr.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(ptr).to_string_lossy().into_owned()
            }
        } else {
            String::new()
        };
        mlx_sys::mlx_string_free(s);
        text
    }
}

/// "gpu" when the loaded libmlx has a usable GPU backend (Metal or CUDA), else "cpu".
/// `Device::gpu()` inside `with_device` panics on a CPU-only libmlx, so we probe for a stream.
pub fn default_device_kind() -> &'static str {
    if Stream::try_default_on_device(&Device::gpu()).is_ok() {
        "gpu"
    } else {
        "cpu"
    }
}

/// Makes the CPU the default device when no GPU backend is present, so that every later op
/// lands on a device that exists.
pub fn select_default_device() -> &'static str {
    let kind = default_device_kind();
    if kind == "cpu" {
        Device::set_default(&Device::cpu());
    }
    kind
}

/// Keeps memory that MLX frees mapped in this process, so the next buffer of a similar size
/// does not page-fault in (and get zeroed by the kernel) again. MLX's CPU allocator is plain
/// `malloc`, and glibc by default serves blocks above 128 KiB-ish with fresh `mmap`s and
/// returns freed heap tops to the OS. Measured with `cargo bench --bench kv_import`: importing
/// 4K tokens of SmolLM2 KV (189 MB) took 137 ms by default and 50 ms with these settings.
/// Memory is still reused, only not handed back until more than `TRIM` bytes are free at the
/// top of the heap. glibc only; other platforms' allocators keep their own policies.
pub fn keep_freed_memory_mapped() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// glibc's largest allowed mmap threshold on 64-bit (HEAP_MAX_SIZE / 2).
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        const TRIM: libc::c_int = 512 << 20;
        // SAFETY: mallopt only changes allocator tunables; called before threads start.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM);
        }
    }
}

/// Hands memory that is free right now back to the OS (glibc; elsewhere a no-op). Called once
/// the model is loaded: loading frees large temporary buffers (dequantisation), which
/// `keep_freed_memory_mapped` would otherwise keep resident for good.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages to the OS.
    unsafe {
        libc::malloc_trim(0);
    }
}
