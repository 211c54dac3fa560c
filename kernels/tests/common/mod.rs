//! Shared by the kernels crate's test binaries (each uses a part of it).
#![allow(dead_code)]

use attnkit_kernels::{Alibi, Isa, ScoreSpec};
use rand::rngs::SmallRng;
use rand::Rng;

/// Every ISA this CPU runs. `ATTNKIT_REQUIRE_ISAS` (comma-separated names) makes a listed ISA the
/// CPU lacks a failure, so no path passes by being skipped.
pub fn isas() -> Vec<Isa> {
    if let Ok(req) = std::env::var("ATTNKIT_REQUIRE_ISAS") {
        for name in req.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let isa: Isa = name
                .parse()
                .expect("ATTNKIT_REQUIRE_ISAS names an unknown ISA");
            assert!(
                isa.is_supported(),
                "ATTNKIT_REQUIRE_ISAS: required ISA {isa} is not supported here"
            );
        }
    }
    let avail = Isa::available();
    for isa in Isa::ALL {
        if !avail.contains(&isa) {
            eprintln!("skipping ISA {isa}: not supported by this CPU");
        }
    }
    avail
}

/// A spec whose one row sees exactly keys `[lo, hi)` of `n` (a causal diagonal at `hi` and a
/// window of `hi − lo`).
pub fn range_spec(lo: usize, hi: usize, n: usize) -> ScoreSpec {
    ScoreSpec {
        causal: Some(hi as isize - 1),
        window: (lo > 0).then_some(hi - lo),
        ..ScoreSpec::new(n)
    }
}

/// A decode row's random score rule over `n` keys, chosen by `case`: a causal cut (every third
/// case sees all keys), a window (case 5 mod 6), the row's `bias` and `mask` where given, a
/// softcap (3 mod 8), ALiBi where `alibi`, a sink (4 mod 5).
pub fn decode_spec(
    rng: &mut SmallRng,
    case: usize,
    n: usize,
    bias: Option<&[f32]>,
    mask: Option<&[bool]>,
    alibi: bool,
) -> ScoreSpec {
    let hi = if case.is_multiple_of(3) {
        n
    } else {
        rng.gen_range(0..=n)
    };
    let lo = if case % 6 == 5 {
        rng.gen_range(0..=hi)
    } else {
        0
    };
    let mut spec = range_spec(lo, hi, n);
    if let Some(b) = bias {
        spec.bias = b.as_ptr();
    }
    if let Some(m) = mask {
        spec.mask = m.as_ptr().cast::<u8>();
    }
    spec.softcap = (case % 8 == 3).then(|| rng.gen_range(0.5..3.0f32));
    spec.alibi = alibi.then(|| Alibi {
        slope: rng.gen_range(-0.2..0.5f32),
        offset: rng.gen_range(-3..(n as isize + 3)),
    });
    spec.sink = (case % 5 == 4).then(|| rng.gen_range(-3.0..3.0f32));
    spec
}
