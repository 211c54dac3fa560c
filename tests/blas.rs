//! The `blas` feature: the unfused path really calls `cblas_sgemm`, and gives the same results as
//! the `matrixmultiply` path, over layouts (BHLD, BLHD, strided), GQA, masks and odd sizes.
#![cfg(feature = "blas")]

use attnkit::unfused::{blas_calls, sdpa_unfused_with, Backend};
use attnkit::{sdpa, Causal, Layout, SdpaOptions, Tensor, TensorMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn random(n: usize, rng: &mut SmallRng) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs both backends (and the fused kernel) on one problem; returns the BLAS calls it made.
#[allow(clippy::too_many_arguments)]
fn check(
    b: usize,
    hq: usize,
    hkv: usize,
    lq: usize,
    lk: usize,
    d: usize,
    blhd: bool,
    opts: &SdpaOptions,
) -> u64 {
    let mut rng = SmallRng::seed_from_u64((b * 131 + hq * 17 + lq * 7 + lk * 3 + d) as u64);
    let q = random(b * hq * lq * d, &mut rng);
    let k = random(b * hkv * lk * d, &mut rng);
    let v = random(b * hkv * lk * d, &mut rng);
    let (qs, kvs) = ([b, hq, lq, d], [b, hkv, lk, d]);
    let layout = if blhd { Layout::Blhd } else { Layout::Bhld };
    let (tq, tk, tv) = (
        Tensor::new(&q, layout.sizes(qs), layout),
        Tensor::new(&k, layout.sizes(kvs), layout),
        Tensor::new(&v, layout.sizes(kvs), layout),
    );
    let run = |backend: Option<Backend>| -> Vec<f32> {
        let mut out = vec![f32::NAN; b * hq * lq * d];
        let mut o = TensorMut::new(&mut out, layout.sizes(qs), layout);
        match backend {
            Some(be) => sdpa_unfused_with(&tq, &tk, &tv, &mut o, opts, be).unwrap(),
            None => sdpa(&tq, &tk, &tv, &mut o, opts).unwrap(),
        }
        out
    };
    let mm = run(Some(Backend::MatrixMultiply));
    let before = blas_calls();
    let bl = run(Some(Backend::Blas));
    let calls = blas_calls() - before;
    let fused = run(None);
    let shape = format!("b={b} hq={hq} hkv={hkv} lq={lq} lk={lk} d={d} blhd={blhd}");
    assert!(
        bl.iter().all(|x| x.is_finite()),
        "{shape}: BLAS output has non-finite values"
    );
    assert!(
        max_diff(&mm, &bl) < 1e-5,
        "{shape}: blas vs matrixmultiply {}",
        max_diff(&mm, &bl)
    );
    assert!(
        max_diff(&fused, &bl) < 1e-4,
        "{shape}: blas vs fused {}",
        max_diff(&fused, &bl)
    );
    calls
}

#[test]
fn blas_path_is_taken_and_matches_matrixmultiply() {
    let opts = SdpaOptions::new();
    // Two GEMMs per (batch, head); other tests may run concurrently, so "at least".
    let calls = check(2, 4, 4, 33, 47, 16, false, &opts);
    assert!(
        calls >= 2 * 2 * 4,
        "expected ≥ 16 cblas_sgemm calls, saw {calls}"
    );
}

#[test]
fn layouts_gqa_causal_and_odd_sizes() {
    for &(b, hq, hkv, lq, lk, d) in &[
        (1, 1, 1, 1, 1, 1),
        (1, 8, 2, 65, 129, 64),
        (2, 6, 3, 17, 5, 7),
        (1, 2, 1, 1, 300, 128),
    ] {
        for blhd in [false, true] {
            check(b, hq, hkv, lq, lk, d, blhd, &SdpaOptions::new());
            check(
                b,
                hq,
                hkv,
                lq,
                lk,
                d,
                blhd,
                &SdpaOptions::new().causal(Causal::TopLeft),
            );
            check(
                b,
                hq,
                hkv,
                lq,
                lk,
                d,
                blhd,
                &SdpaOptions::new().causal(Causal::BottomRight).scale(0.3),
            );
        }
    }
}

#[test]
fn default_backend_is_blas() {
    assert_eq!(Backend::default(), Backend::Blas);
    assert_eq!(Backend::ALL, &[Backend::MatrixMultiply, Backend::Blas]);
    // `sdpa_unfused` uses the default backend, so it reaches BLAS too.
    let x = vec![0.5f32; 2 * 3 * 8];
    let mut out = vec![0.0f32; 2 * 3 * 8];
    let before = blas_calls();
    attnkit::unfused::sdpa_unfused(
        &Tensor::bhld(&x, [1, 2, 3, 8]),
        &Tensor::bhld(&x, [1, 2, 3, 8]),
        &Tensor::bhld(&x, [1, 2, 3, 8]),
        &mut TensorMut::bhld(&mut out, [1, 2, 3, 8]),
        &SdpaOptions::new(),
    )
    .unwrap();
    assert!(blas_calls() - before >= 4);
    assert!(out.iter().all(|&o| (o - 0.5).abs() < 1e-6));
}

#[test]
fn openblas_names_its_kernel_set() {
    // attnbench decides from this name whether to restart with OPENBLAS_CORETYPE.
    let core = attnkit::unfused::blas_core();
    assert!(
        !core.is_empty() && core.chars().all(|c| c.is_ascii_graphic()),
        "{core:?}"
    );
}
