//! Shared by the kernels crate's test binaries.

use attnkit_kernels::Isa;

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
