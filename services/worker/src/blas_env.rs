//! OpenBLAS, which MLX's CPU backend calls for f32 GEMM, reads `OPENBLAS_CORETYPE` and
//! `OPENBLAS_NUM_THREADS` once, when `libmlx` is loaded at process start. Setting them from
//! `main` is too late, so the one mechanism is: compute them here and re-execute the binary
//! with them in its environment (`reexec_with_blas_env`). Test executables get the same
//! variables from the cargo runner `scripts/mlx-env`, which implements this same policy; the
//! test `runner_script_agrees_with_this_policy` keeps the two in step.
//!
//! A value the environment already sets is never overridden.

use std::collections::HashSet;
use std::ffi::OsString;

/// Set in the re-executed process so that it does not re-execute again.
pub const APPLIED_MARKER: &str = "STRATA_BLAS_ENV";

/// One OpenBLAS thread per core this process may run on. Measured on 2 cores
/// (`cargo bench --bench blas_threads`, table in the README): 2 threads beat 1 on every shape
/// the engine meets, about 1.5x on prefill GEMMs and 2x on decode's x @ W.T.
pub fn default_threads() -> String {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .to_string()
}

/// The OpenBLAS kernel family for a CPU with these `/proc/cpuinfo` flags, if it needs naming.
/// Debian's OpenBLAS 0.3.21 does not recognise recent Intel CPUs and falls back to SSE3
/// kernels (about 5x slower); naming the family explicitly fixes that. We only name a family
/// whose instructions the CPU reports, so the choice is never wrong.
pub fn coretype_for(flags: &HashSet<&str>) -> Option<&'static str> {
    let has = |f: &str| flags.contains(f);
    if ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"]
        .iter()
        .all(|f| has(f))
    {
        Some("SkylakeX")
    } else if has("avx2") && has("fma") {
        Some("Haswell")
    } else {
        None
    }
}

/// The variables to add to an environment read through `get`, for a CPU with `cpu_flags`.
pub fn missing_vars(
    get: impl Fn(&str) -> Option<OsString>,
    cpu_flags: &str,
) -> Vec<(&'static str, String)> {
    let mut vars = Vec::new();
    if !cfg!(target_os = "linux") {
        return vars; // macOS uses Accelerate; OpenBLAS is a Linux CPU matter.
    }
    if get("OPENBLAS_CORETYPE").is_none() {
        let flags: HashSet<&str> = cpu_flags.split_whitespace().collect();
        if let Some(core) = coretype_for(&flags) {
            vars.push(("OPENBLAS_CORETYPE", core.to_string()));
        }
    }
    if get("OPENBLAS_NUM_THREADS").is_none() {
        vars.push(("OPENBLAS_NUM_THREADS", default_threads()));
    }
    vars
}

/// What to tell the operator when the environment names an OpenBLAS kernel family other than
/// the one this policy would pick for the CPU (a machine image that pins `Haswell` on a CPU with
/// AVX-512 left prefill at 52-53 tokens/s on Qwen2.5-1.5B where `SkylakeX` gave 64-76, on 2
/// cores). The setting is kept, as any the environment makes; it is only reported.
pub fn coretype_notice(set: Option<&str>, cpu_flags: &str) -> Option<String> {
    let set = set?;
    let flags: HashSet<&str> = cpu_flags.split_whitespace().collect();
    let best = coretype_for(&flags)?;
    (!set.eq_ignore_ascii_case(best)).then(|| {
        format!(
            "OPENBLAS_CORETYPE={set} is set in the environment; this CPU runs OpenBLAS's {best} \
             kernels, which prefill faster: unset it to use them"
        )
    })
}

/// The `flags` line of `/proc/cpuinfo` (empty where there is none).
pub fn cpu_flags() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("flags"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default()
}

/// Re-executes the current binary with the OpenBLAS variables it lacks. Returns only when
/// nothing needs to change (or the variables were already applied); an error means the exec
/// failed, in which case the process carries on with OpenBLAS's own defaults.
pub fn reexec_with_blas_env() -> std::io::Result<()> {
    if std::env::var_os(APPLIED_MARKER).is_some() {
        return Ok(());
    }
    let vars = missing_vars(|k| std::env::var_os(k), &cpu_flags());
    if vars.is_empty() {
        return Ok(());
    }
    use std::os::unix::process::CommandExt;
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_default();
    let err = std::process::Command::new("/proc/self/exe")
        .arg0(arg0)
        .args(args)
        .envs(vars)
        .env(APPLIED_MARKER, "1")
        .exec();
    Err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAPPHIRE: &str = "fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl";

    #[test]
    fn names_the_widest_family_the_cpu_reports() {
        let set = |s: &'static str| s.split_whitespace().collect::<HashSet<_>>();
        assert_eq!(coretype_for(&set(SAPPHIRE)), Some("SkylakeX"));
        assert_eq!(coretype_for(&set("sse2 avx avx2 fma")), Some("Haswell"));
        assert_eq!(coretype_for(&set("sse2 avx avx512f")), None);
        assert_eq!(coretype_for(&set("sse2 sse3")), None);
    }

    #[test]
    fn a_narrower_family_in_the_environment_is_reported() {
        let notice = coretype_notice(Some("Haswell"), SAPPHIRE).unwrap();
        assert!(notice.contains("OPENBLAS_CORETYPE=Haswell") && notice.contains("SkylakeX"));
        assert_eq!(coretype_notice(Some("skylakex"), SAPPHIRE), None);
        assert_eq!(coretype_notice(None, SAPPHIRE), None);
        assert_eq!(coretype_notice(Some("Haswell"), "sse2 sse3"), None);
    }

    #[test]
    fn never_overrides_what_the_environment_sets() {
        let vars = missing_vars(
            |k| (k == "OPENBLAS_CORETYPE").then(|| "Haswell".into()),
            SAPPHIRE,
        );
        assert_eq!(vars, vec![("OPENBLAS_NUM_THREADS", default_threads())]);
        assert!(missing_vars(|_| Some("x".into()), SAPPHIRE).is_empty());
    }

    /// The cargo runner must apply the same policy as the binaries' re-exec.
    #[test]
    fn runner_script_agrees_with_this_policy() {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/mlx-env");
        for flags in [SAPPHIRE, "sse2 avx avx2 fma", "sse2 sse3"] {
            let out = std::process::Command::new("sh")
                .arg(script)
                .arg("env")
                .env_clear()
                .env("PATH", "/usr/bin:/bin")
                .env("STRATA_CPU_FLAGS", flags)
                .output()
                .expect("run scripts/mlx-env");
            assert!(out.status.success());
            let text = String::from_utf8_lossy(&out.stdout);
            let got: Vec<(&str, String)> = ["OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS"]
                .into_iter()
                .filter_map(|k| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(&format!("{k}=")))
                        .map(|v| (k, v.to_string()))
                })
                .collect();
            assert_eq!(got, missing_vars(|_| None, flags), "flags: {flags}");
            assert!(text.lines().any(|l| l == format!("{APPLIED_MARKER}=1")));
        }
    }
}
