//! A dependency cannot set the final binary's rpath, so the crate that links MLX does it:
//! binaries and test executables find libmlx where mlx-sys found it at build time.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
