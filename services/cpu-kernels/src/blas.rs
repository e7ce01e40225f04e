//! The BLAS `sgemm` that the process already holds, found at run time.
//!
//! Why by symbol lookup and not by linking: the worker gets its BLAS through libmlx (OpenBLAS
//! on Linux, swapped in by `scripts/swap-blas`; Accelerate on a Mac), and MLX's own products
//! go through it. Long products against a weight matrix kept only as codes (`packed`) need
//! the same GEMM on panels dequantised a few at a time, and linking a BLAS of our own could
//! load a second, different one into the process. When no `cblas_sgemm` is loaded, the caller
//! keeps the f32 expansion instead (and says so).

use std::ffi::c_void;
use std::sync::OnceLock;

/// `cblas_sgemm`'s signature (CBLAS's enums as `i32`).
pub type Sgemm = unsafe extern "C" fn(
    layout: i32,
    trans_a: i32,
    trans_b: i32,
    m: i32,
    n: i32,
    k: i32,
    alpha: f32,
    a: *const f32,
    lda: i32,
    b: *const f32,
    ldb: i32,
    beta: f32,
    c: *mut f32,
    ldc: i32,
) -> ();

pub const ROW_MAJOR: i32 = 101;
pub const NO_TRANS: i32 = 111;
pub const TRANS: i32 = 112;

/// The loaded `cblas_sgemm`, if any.
pub fn sgemm() -> Option<Sgemm> {
    static FOUND: OnceLock<Option<usize>> = OnceLock::new();
    let address = *FOUND.get_or_init(|| {
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads the loaded
        // objects' symbol tables.
        let symbol: *mut c_void =
            unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cblas_sgemm".as_ptr()) };
        (!symbol.is_null()).then_some(symbol as usize)
    });
    // SAFETY: the symbol is CBLAS's `cblas_sgemm`, whose C signature `Sgemm` spells out.
    address.map(|a| unsafe { std::mem::transmute::<usize, Sgemm>(a) })
}
