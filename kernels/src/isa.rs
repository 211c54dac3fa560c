//! Instruction-set selection: detected once, cached, overridable with `ATTNKIT_ISA`.

use core::fmt;
use core::str::FromStr;
use std::sync::OnceLock;

/// A SIMD code path. Every kernel entry point takes one explicitly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Portable blocked code (8-wide arrays the compiler vectorises for the baseline target).
    Scalar,
    /// x86-64 AVX2 + FMA (and F16C, for f16 operands), 256-bit registers.
    Avx2,
    /// x86-64 AVX-512F, 512-bit registers.
    Avx512,
    /// [`Isa::Avx512`] plus AVX-512 BF16 (`vdpbf16ps`), BW and VL: the fused kernel multiplies bf16
    /// operands in pairs into f32 sums, rounding the softmax weights `P` to bf16 for `P·V` (as
    /// PyTorch's bf16 attention does; see `FlashPath::Bf16Pairs`). Every other kernel, and every
    /// other operand type, runs the [`Isa::Avx512`] code.
    ///
    /// [`Isa::best`] picks it on AMD CPUs only; elsewhere it is opt-in (`ATTNKIT_ISA=avx512bf16`
    /// or an explicit choice). On Intel cores `vdpbf16ps` retires one per two cycles against
    /// two f32 FMAs per cycle (measured on an Emerald Rapids Xeon: 32 against 64 flops per
    /// cycle), so bf16 attention runs faster widened to f32 (0.57–0.69×); on AMD Zen 4 the
    /// pairs run at 1.8–1.9× the widened kernel (medians, bf16 (1,16,2048,64) and
    /// (1,8,2048,128), one thread; BENCHMARKS.md).
    Avx512Bf16,
    /// [`Isa::Avx512Bf16`] plus AMX-BF16 tiles, with the tile state granted by the OS: bf16
    /// attention (Q, K, V bf16, `d` a multiple of 32) multiplies on tiles (`tdpbf16ps`), with
    /// the weights rounded to bf16 as on [`Isa::Avx512Bf16`] (see `FlashPath::AmxTiles`);
    /// everything else runs the [`Isa::Avx512`] code. [`Isa::best`] picks it where it is
    /// supported.
    Amx,
}

/// `ATTNKIT_ISA` named a path that is unknown or that this CPU lacks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IsaError {
    /// The variable's value is not `scalar`, `avx2`, `avx512`, `avx512bf16` or `amx`.
    Unknown(String),
    /// The named path exists but this CPU (or target) cannot run it.
    Unsupported(Isa),
}

impl fmt::Display for IsaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IsaError::Unknown(s) => {
                write!(
                    f,
                    "ATTNKIT_ISA={s:?} is not one of scalar, avx2, avx512, avx512bf16, amx"
                )
            }
            IsaError::Unsupported(isa) => {
                write!(
                    f,
                    "ISA {isa} was requested but this CPU does not support it"
                )
            }
        }
    }
}

impl std::error::Error for IsaError {}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Isa {
    type Err = IsaError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "portable" => Ok(Isa::Scalar),
            "avx2" => Ok(Isa::Avx2),
            "avx512" | "avx512f" => Ok(Isa::Avx512),
            "avx512bf16" | "avx512_bf16" => Ok(Isa::Avx512Bf16),
            "amx" | "amx_bf16" | "amx-bf16" => Ok(Isa::Amx),
            _ => Err(IsaError::Unknown(s.to_string())),
        }
    }
}

impl Isa {
    /// Every path this crate knows, slowest first.
    pub const ALL: [Isa; 5] = [
        Isa::Scalar,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Avx512Bf16,
        Isa::Amx,
    ];

    /// Lower-case name, as `ATTNKIT_ISA` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }

    /// Whether this CPU can run the path (queried at run time).
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512Bf16.is_supported() && crate::x86_64::amx::granted(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The paths this CPU supports, slowest first (what tests loop over).
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The fastest supported path for every operand type, ignoring `ATTNKIT_ISA`: the widest
    /// vectors the CPU has, and AMX where the OS grants it; [`Isa::Avx512Bf16`] on AMD CPUs
    /// only (see there why).
    pub fn best() -> Isa {
        let amd = is_amd();
        Isa::available()
            .into_iter()
            .rfind(|&i| i != Isa::Avx512Bf16 || amd)
            .unwrap_or(Isa::Scalar)
    }

    /// The path to use: `ATTNKIT_ISA` if set (an error if unknown or unsupported), else
    /// [`Isa::best`]. Read once per process and cached.
    pub fn detect() -> Result<Isa, IsaError> {
        static CACHE: OnceLock<Result<Isa, IsaError>> = OnceLock::new();
        CACHE
            .get_or_init(|| match std::env::var("ATTNKIT_ISA") {
                Ok(s) if !s.trim().is_empty() => {
                    let isa: Isa = s.parse()?;
                    if isa.is_supported() {
                        Ok(isa)
                    } else {
                        Err(IsaError::Unsupported(isa))
                    }
                }
                _ => Ok(Isa::best()),
            })
            .clone()
    }

    /// `Ok(self)` if the CPU supports it, else [`IsaError::Unsupported`].
    pub fn check(self) -> Result<Isa, IsaError> {
        if self.is_supported() {
            Ok(self)
        } else {
            Err(IsaError::Unsupported(self))
        }
    }

    /// f32 lanes of one register on this path.
    pub fn lanes(self) -> usize {
        match self {
            Isa::Scalar | Isa::Avx2 => 8,
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => 16,
        }
    }
}

/// Whether the CPU is an AMD one (by the CPUID vendor string; cached). Some kernels walk memory
/// differently on AMD and Intel cores, because their prefetchers reward different patterns
/// (see [`crate::DecodeWalk`]), and [`Isa::best`] picks the bf16 pair products on AMD only.
pub(crate) fn is_amd() -> bool {
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(|| {
        // Miri cannot execute CPUID. The answer only picks between two equivalent walks.
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            // Leaf 0 (the vendor string) exists on every x86-64 CPU.
            let r = core::arch::x86_64::__cpuid(0);
            let mut vendor = [0u8; 12];
            vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
            vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
            vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
            &vendor == b"AuthenticAMD"
        }
        #[cfg(any(not(target_arch = "x86_64"), miri))]
        {
            false
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatch rule, with the vendor read from the OS rather than from `is_amd`'s CPUID.
    #[test]
    fn best_takes_the_bf16_pairs_on_amd_only() {
        let best = Isa::best();
        assert!(best.is_supported(), "{best}");
        let amd = std::fs::read_to_string("/proc/cpuinfo")
            .map(|s| s.contains("AuthenticAMD"))
            .unwrap_or_else(|_| is_amd());
        let want = Isa::available()
            .into_iter()
            .rfind(|&i| i != Isa::Avx512Bf16 || amd)
            .unwrap();
        assert_eq!(best, want);
        if Isa::Amx.is_supported() {
            assert_eq!(best, Isa::Amx);
        } else if Isa::Avx512Bf16.is_supported() {
            assert_eq!(best == Isa::Avx512Bf16, amd, "vendor AMD: {amd}");
        }
    }
}
