//! The machine's read bandwidth, to put the decode kernel's KV bandwidth in context: each thread
//! sums its share of a 1 GiB buffer with several independent vector accumulators; best of 5.
//! Measured twice: on ordinary 4 KiB pages and on transparent huge pages
//! ([`attnkit::advise_huge_pages`], what `KvCache` asks for), since on a VM the two differ a lot.
//!
//! `cargo run --release --example read_bandwidth`

use std::time::Instant;

/// Sum with 8 × 16 independent lanes, so the loop is bound by loads, not by add latency.
fn sum(v: &[f32]) -> f32 {
    let mut acc = [[0f32; 16]; 8];
    for c in v.chunks_exact(128) {
        for (k, a) in acc.iter_mut().enumerate() {
            for (l, x) in a.iter_mut().enumerate() {
                *x += c[k * 16 + l];
            }
        }
    }
    acc.iter().flatten().sum()
}

fn main() {
    let n = 256 << 20;
    for huge in [false, true] {
        let mut v = vec![0.0f32; n];
        if huge && !attnkit::advise_huge_pages(&mut v) {
            println!("(huge pages not available here)");
            continue;
        }
        v.fill(1.0);
        measure(&v, if huge { "huge pages" } else { "4 KiB pages" });
    }
}

fn measure(v: &[f32], pages: &str) {
    let n = v.len();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    for threads in 1..=cores.min(16) {
        let mut best = 0f64;
        for _ in 0..5 {
            let t = Instant::now();
            let total: f32 = std::thread::scope(|s| {
                let hs: Vec<_> = v
                    .chunks(n / threads)
                    .map(|c| s.spawn(move || sum(c)))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).sum()
            });
            assert!(total > 0.0);
            best = best.max((n * 4) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        println!("read bandwidth, {pages}, {threads} thread(s): {best:.1} GB/s");
    }
}
