//! Builds mlx-c against a prebuilt libmlx (from the `mlx-cpu`, `mlx-metal` or `mlx-cuda-13`
//! wheels), instead of building MLX itself as the published crate does.
//!
//! Inputs (environment, all optional):
//! - `STRATA_MLX_DIR`: the wheel's `mlx` folder, holding `include/` and `lib/libmlx.{so,dylib}`
//!   (on macOS `mlx.metallib` sits beside `libmlx.dylib`, where MLX looks for it).
//! - `STRATA_MLXC_DIR`: the mlx-c 0.7.0 sources (`scripts/setup` fetches them with cargo vendor).
//! - `STRATA_CACHE`: where `scripts/setup` put both (default `~/.cache/strata`).
//!
//! Outputs: `cargo:libdir` (read by dependents as `DEP_MLX_LIBDIR` to set their rpath).
use std::env;
use std::path::{Path, PathBuf};

const MLX_VERSION: &str = "0.32.2";
const MLXC_VERSION: &str = "0.7.0";

fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("STRATA_CACHE") {
        return PathBuf::from(dir);
    }
    let home = env::var_os("HOME").unwrap_or_else(|| "/".into());
    PathBuf::from(home).join(".cache").join("strata")
}

fn dir_from_env(var: &str, default: PathBuf) -> PathBuf {
    println!("cargo:rerun-if-env-changed={var}");
    env::var_os(var).map(PathBuf::from).unwrap_or(default)
}

fn require(path: &Path, what: &str) {
    if !path.exists() {
        panic!(
            "{what} not found at {}. Run scripts/setup (or `make setup`), or point the \
             environment variable at it (see services/mlx-sys/build.rs).",
            path.display()
        );
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=STRATA_CACHE");
    println!("cargo:rerun-if-changed=src/compat.h");
    let cache = cache_dir();
    // Same defaults as scripts/paths.sh: the Metal wheel on macOS, the CPU wheel elsewhere
    // (CUDA machines build against the CPU wheel and load the CUDA libmlx at run time).
    let wheel = match env::var("CARGO_CFG_TARGET_OS").as_deref() {
        Ok("macos") => "mlx-metal",
        _ => "mlx-cpu",
    };
    let mlx_dir = dir_from_env(
        "STRATA_MLX_DIR",
        cache.join(format!("{wheel}-{MLX_VERSION}")).join("mlx"),
    );
    let mlxc_dir = dir_from_env(
        "STRATA_MLXC_DIR",
        cache.join(format!("mlx-c-{MLXC_VERSION}")),
    );
    let include_dir = mlx_dir.join("include");
    let lib_dir = mlx_dir.join("lib");
    require(
        &include_dir.join("mlx/mlx.h"),
        "MLX headers (STRATA_MLX_DIR)",
    );
    require(
        &mlxc_dir.join("mlx/c/mlx.h"),
        "mlx-c sources (STRATA_MLXC_DIR)",
    );

    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let sources = sorted_files(&mlxc_dir.join("mlx/c"), "cpp");
    let headers = sorted_files(&mlxc_dir.join("mlx/c"), "h");
    for file in sources.iter().chain(&headers) {
        println!("cargo:rerun-if-changed={}", file.display());
    }

    // One unity translation unit: about 25 s on 2 cores instead of ~3.5 min for 25 files.
    let unity = out_dir.join("mlx_c_unity.cpp");
    let body: String = sources
        .iter()
        .map(|s| format!("#include \"{}\"\n", s.display()))
        .collect();
    std::fs::write(&unity, body).expect("write the unity source into OUT_DIR");

    let compat =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("src/compat.h");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include(&mlxc_dir)
        .include(&include_dir)
        .file(&unity)
        .flag("-include")
        .flag(compat.to_str().expect("utf-8 path"))
        .warnings(false);
    if target_arch != "aarch64" {
        build
            .define("HAS_FLOAT16", None)
            .define("HAS_BFLOAT16", None);
    }
    build.compile("mlxc");

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:libdir={}", lib_dir.display());

    // Bindings as mlx-rs expects them from the upstream crate: one header per sorted file.
    let mut bindgen = bindgen::Builder::default()
        .rust_target("1.73.0".parse().expect("valid rust target"))
        .clang_arg(format!("-I{}", mlxc_dir.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc");
    if target_arch != "aarch64" {
        // Off aarch64 clang has no arm_fp16.h: name the 16-bit types in a force-included prelude.
        let prelude = out_dir.join("strata_half_prelude.h");
        std::fs::write(
            &prelude,
            "#include <stdint.h>\ntypedef __fp16 float16_t;\ntypedef uint16_t bfloat16_t;\n",
        )
        .expect("write the bindgen prelude into OUT_DIR");
        bindgen = bindgen
            .clang_arg("-DHAS_FLOAT16")
            .clang_arg("-DHAS_BFLOAT16")
            .clang_arg("-include")
            .clang_arg(prelude.to_string_lossy());
    }
    for header in &headers {
        bindgen = bindgen.header(header.to_string_lossy());
    }
    bindgen
        .generate()
        .expect("generate mlx-c bindings")
        .write_to_file(out_dir.join("bindings.rs"))
        .expect("write bindings.rs");
}

fn sorted_files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}
