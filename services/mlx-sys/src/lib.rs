//! Raw bindings to mlx-c, built against a prebuilt `libmlx` (see `build.rs`).
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// mlx-rs seeds its PRNG with `mach_approximate_time()` from `mach-sys`, which exists only on
/// Apple platforms. Off Apple we provide the symbol: monotonic-enough wall-clock nanoseconds.
#[cfg(not(target_vendor = "apple"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
