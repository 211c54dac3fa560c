//! Why this build script exists: the `blas` feature calls `cblas_sgemm` from the system OpenBLAS,
//! and something must find and link that library. `cblas-sys` only declares the functions, and
//! `openblas-src` is not used (see Cargo.toml), so this script finds `libopenblas` (pkg-config,
//! then the standard Debian/Ubuntu and other library directories, or `$OPENBLAS_LIB_DIR`), emits
//! the link lines, and otherwise stops the build with a message naming the package to install,
//! instead of a bare linker error at the end. Without the feature it does nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "blas")]
    blas::find_openblas();
}

#[cfg(feature = "blas")]
mod blas {
    use std::path::{Path, PathBuf};

    /// Directories where distributions install `libopenblas.so` (Debian/Ubuntu multiarch and the
    /// `openblas-pthread` alternative first), plus `$OPENBLAS_LIB_DIR` if set.
    fn candidate_dirs() -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        if let Some(dir) = std::env::var_os("OPENBLAS_LIB_DIR") {
            dirs.push(PathBuf::from(dir));
        }
        let multiarch = format!(
            "{}-linux-gnu",
            std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|_| "x86_64".into())
        );
        for base in ["/usr/lib", "/usr/local/lib", "/lib"] {
            dirs.push(Path::new(base).join(&multiarch).join("openblas-pthread"));
            dirs.push(Path::new(base).join(&multiarch));
            dirs.push(PathBuf::from(base));
        }
        dirs.push(PathBuf::from("/usr/lib64"));
        dirs.push(PathBuf::from("/usr/lib64/openblas-pthread"));
        dirs
    }

    pub fn find_openblas() {
        println!("cargo:rerun-if-env-changed=OPENBLAS_LIB_DIR");
        println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
        // pkg-config prints the link lines itself (`cargo:rustc-link-search=…`, `…-lib=openblas`).
        if pkg_config::Config::new()
            .cargo_metadata(true)
            .probe("openblas")
            .is_ok()
        {
            return;
        }
        for dir in candidate_dirs() {
            if dir.join("libopenblas.so").exists() {
                println!("cargo:rustc-link-search=native={}", dir.display());
                println!("cargo:rustc-link-lib=dylib=openblas");
                return;
            }
        }
        panic!(
            "\n\nthe `blas` feature links the system OpenBLAS, which was not found (pkg-config \
             `openblas`, libopenblas.so in the standard library directories, $OPENBLAS_LIB_DIR).\n\
             install libopenblas-dev (apt-get install libopenblas-dev), or build without \
             `--features blas`.\n\n"
        );
    }
}
