//! OpenBLAS's kernel set. OpenBLAS chooses it from the CPU model when the library loads and falls
//! back to generic SSE3 kernels (`Prescott`) on a model it does not know; Debian's 0.3.21 does
//! that on the Xeon VM of BENCHMARKS.md, and `unfused-blas` ran 7× slower there than with the
//! `SkylakeX` kernels (13 against 97 GFLOP/s at (1, 16, 512, 64), one thread). The override,
//! `OPENBLAS_CORETYPE`, is read only at load time, so attnbench sets it and restarts itself.
//! A `OPENBLAS_CORETYPE` the user set is left alone. (Built with the `blas` feature only.)

// Without x86-64 there is no vector width to ask for: only `describe` is used.
#![cfg_attr(not(all(target_arch = "x86_64", unix)), allow(dead_code))]

/// Variable through which the restarted process learns what OpenBLAS had chosen on its own.
const DETECTED_VAR: &str = "ATTNBENCH_OPENBLAS_DETECTED";

/// The kernel set to ask for on a CPU with these features, or `None` when OpenBLAS's own
/// choice cannot be improved on (no AVX2+FMA).
fn wanted(avx512: bool, avx2_fma: bool) -> Option<&'static str> {
    if avx512 {
        Some("SkylakeX")
    } else if avx2_fma {
        Some("Haswell")
    } else {
        None
    }
}

/// Whether OpenBLAS's `core` uses the widest vectors the CPU has.
fn suits(core: &str, avx512: bool, avx2_fma: bool) -> bool {
    let core = core.to_ascii_lowercase();
    let avx512_set = ["skylakex", "cooperlake", "sapphirerapids"].contains(&core.as_str());
    if avx512 {
        avx512_set
    } else if avx2_fma {
        avx512_set || ["haswell", "zen"].contains(&core.as_str())
    } else {
        true
    }
}

#[cfg(target_arch = "x86_64")]
fn features() -> (bool, bool) {
    (
        std::arch::is_x86_feature_detected!("avx512f"),
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
    )
}

/// Restarts attnbench with `OPENBLAS_CORETYPE` set when OpenBLAS picked kernels narrower than
/// the CPU's vectors; returns (does nothing) otherwise or if the restart fails.
pub fn ensure() {
    #[cfg(all(target_arch = "x86_64", unix))]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
            return;
        }
        let (avx512, avx2_fma) = features();
        let core = attnkit::unfused::blas_core();
        let Some(want) = wanted(avx512, avx2_fma).filter(|_| !suits(&core, avx512, avx2_fma))
        else {
            return;
        };
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let err = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env("OPENBLAS_CORETYPE", want)
            .env(DETECTED_VAR, &core)
            .exec();
        eprintln!("attnbench: could not restart with OPENBLAS_CORETYPE={want}: {err}");
    }
}

/// One line for the header: the kernel set OpenBLAS runs, and who chose it.
pub fn describe() -> String {
    let core = attnkit::unfused::blas_core();
    match std::env::var(DETECTED_VAR) {
        Ok(detected) => format!(
            "OpenBLAS kernels: {core} (OPENBLAS_CORETYPE set by attnbench: on its own OpenBLAS chose {detected}, narrower than this CPU's vectors)"
        ),
        Err(_) => match std::env::var("OPENBLAS_CORETYPE") {
            Ok(v) => format!("OpenBLAS kernels: {core} (OPENBLAS_CORETYPE={v})"),
            Err(_) => format!("OpenBLAS kernels: {core}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_for_the_widest_kernels_the_cpu_runs() {
        assert_eq!(wanted(true, true), Some("SkylakeX"));
        assert_eq!(wanted(false, true), Some("Haswell"));
        assert_eq!(wanted(false, false), None);
    }

    #[test]
    fn a_generic_choice_on_a_vector_cpu_is_replaced() {
        // The Xeon VM's case: AVX-512 CPU, SSE3 kernels.
        assert!(!suits("Prescott", true, true));
        assert!(!suits("Haswell", true, true));
        assert!(suits("SkylakeX", true, true));
        assert!(suits("COOPERLAKE", true, true));
        assert!(!suits("Prescott", false, true));
        assert!(suits("Haswell", false, true));
        assert!(suits("Zen", false, true));
        // Nothing better to ask for without AVX2.
        assert!(suits("Prescott", false, false));
    }
}
