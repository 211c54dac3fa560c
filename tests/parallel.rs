//! `Par::Seq` and `Par::Rayon` give bitwise identical results, whatever the rayon pool size
//! (1, 2, 3, 4 threads), for shapes large enough to be split into tasks: the task plan depends on
//! the shape only, never on the thread count.
#![cfg(feature = "rayon")]

mod common;

use attnkit::{
    sdpa_ext, unfused, Causal, Extras, Isa, Kernel, MaskRef, Par, SdpaOptions, Tensor, TensorMut,
};
use common::{isas, lh, randn, Dims};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

struct Setup {
    name: &'static str,
    dims: Dims,
    causal: Option<Causal>,
    bias: bool,
    key_lengths: Option<Vec<usize>>,
    /// Output (and inputs) in BLHD order, so tasks write interleaved rows.
    blhd: bool,
    path: Kernel,
    /// Ask for the weights (which selects the prefill kernel).
    weights: bool,
}

/// Output, lse and weights of one call, as bit patterns.
#[derive(PartialEq, Eq, Debug)]
struct Bits {
    out: Vec<u32>,
    lse: Vec<u32>,
    w: Vec<u32>,
}

struct Data {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    bias: Vec<f32>,
}

fn data(s: &Setup) -> Data {
    let mut rng = SmallRng::seed_from_u64(s.dims.lq as u64);
    let d = s.dims;
    Data {
        q: randn(&mut rng, d.q().iter().product(), 1.0),
        k: randn(&mut rng, d.k().iter().product(), 1.0),
        v: randn(&mut rng, d.v().iter().product(), 1.0),
        bias: (0..d.b * d.hq * d.lq * d.lk)
            .map(|_| rng.gen_range(-2.0..2.0))
            .collect(),
    }
}

fn tensor<'a>(s: &Setup, x: &'a [f32], shape: [usize; 4]) -> Tensor<'a> {
    if s.blhd {
        Tensor::blhd(x, lh(shape))
    } else {
        Tensor::bhld(x, shape)
    }
}

fn run(s: &Setup, x: &Data, isa: Isa, par: Par, fused: bool) -> Bits {
    let d = s.dims;
    let mut opts = SdpaOptions::new().isa(isa).par(par).kernel(s.path);
    if let Some(c) = s.causal {
        opts = opts.causal(c);
    }
    if s.bias {
        opts = opts.bias(MaskRef::new(&x.bias, [d.b, d.hq, d.lq, d.lk]));
    }
    if let Some(l) = &s.key_lengths {
        opts = opts.key_lengths(l);
    }
    let mut out = vec![f32::NAN; d.out().iter().product()];
    let rows = d.b * d.hq * d.lq;
    let (mut lse, mut w) = (vec![f32::NAN; rows], vec![f32::NAN; rows * d.lk]);
    let (q, k, v) = (
        tensor(s, &x.q, d.q()),
        tensor(s, &x.k, d.k()),
        tensor(s, &x.v, d.v()),
    );
    let mut o = if s.blhd {
        TensorMut::blhd(&mut out, lh(d.out()))
    } else {
        TensorMut::bhld(&mut out, d.out())
    };
    if fused {
        if !s.weights {
            w.clear();
        }
        let weights = s.weights.then_some(&mut w[..]);
        sdpa_ext(
            &q,
            &k,
            &v,
            &mut o,
            &opts,
            Extras {
                lse: Some(&mut lse),
                weights,
            },
        )
        .unwrap();
    } else {
        unfused::sdpa_unfused(&q, &k, &v, &mut o, &opts).unwrap();
        lse.clear();
        w.clear();
    }
    assert!(
        out.iter().all(|x| x.is_finite()),
        "{}: non-finite output",
        s.name
    );
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect();
    Bits {
        out: bits(out),
        lse: bits(lse),
        w: bits(w),
    }
}

fn setups() -> Vec<Setup> {
    vec![
        Setup {
            name: "B2 H4 L300 D64",
            dims: Dims {
                b: 2,
                hq: 4,
                hkv: 4,
                lq: 300,
                lk: 300,
                d: 64,
                dv: 64,
            },
            causal: None,
            bias: false,
            key_lengths: None,
            blhd: false,
            path: Kernel::Auto,
            weights: true,
        },
        Setup {
            name: "causal B2 H4 L300 D64, BLHD",
            dims: Dims {
                b: 2,
                hq: 4,
                hkv: 4,
                lq: 300,
                lk: 300,
                d: 64,
                dv: 64,
            },
            causal: Some(Causal::TopLeft),
            bias: false,
            key_lengths: None,
            blhd: true,
            path: Kernel::Auto,
            weights: true,
        },
        Setup {
            name: "GQA bottom-right Lq<Lk with bias and key lengths",
            dims: Dims {
                b: 2,
                hq: 6,
                hkv: 2,
                lq: 200,
                lk: 333,
                d: 80,
                dv: 48,
            },
            causal: Some(Causal::BottomRight),
            bias: true,
            key_lengths: Some(vec![333, 150]),
            blhd: false,
            path: Kernel::Auto,
            weights: true,
        },
        Setup {
            name: "decode kernel (split-KV): B2 Hq8 Hkv2 Lq2 Lk5000 D128, bottom-right, ragged",
            dims: Dims {
                b: 2,
                hq: 8,
                hkv: 2,
                lq: 2,
                lk: 5000,
                d: 128,
                dv: 128,
            },
            causal: Some(Causal::BottomRight),
            bias: false,
            key_lengths: Some(vec![5000, 3333]),
            blhd: true,
            path: Kernel::Auto,
            weights: false,
        },
        Setup {
            name: "decode kernel forced on a prefill shape with bias",
            dims: Dims {
                b: 1,
                hq: 4,
                hkv: 4,
                lq: 40,
                lk: 1500,
                d: 64,
                dv: 32,
            },
            causal: None,
            bias: true,
            key_lengths: None,
            blhd: false,
            path: Kernel::Decode,
            weights: false,
        },
    ]
}

#[test]
fn sequential_equals_parallel_bitwise_for_every_pool_size() {
    for s in setups() {
        let d = s.dims;
        // Large enough that the crate splits it (its cutoff is ~1M multiply-adds).
        assert!(
            d.b * d.hq * d.lq * d.lk * (d.d + d.dv) >= 8 << 20,
            "{}: too small to go parallel",
            s.name
        );
        let x = data(&s);
        for isa in isas() {
            for fused in [true, false] {
                let seq = run(&s, &x, isa, Par::Seq, fused);
                for threads in 1..=4 {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let par = pool.install(|| run(&s, &x, isa, Par::Rayon, fused));
                    let what = if fused { "sdpa_ext" } else { "sdpa_unfused" };
                    assert!(
                        par.out == seq.out,
                        "{} {isa} {what}: output differs with {threads} threads",
                        s.name
                    );
                    assert!(
                        par.lse == seq.lse,
                        "{} {isa} {what}: lse differs with {threads} threads",
                        s.name
                    );
                    assert!(
                        par.w == seq.w,
                        "{} {isa} {what}: weights differ with {threads} threads",
                        s.name
                    );
                }
            }
        }
    }
}

/// Calls from several threads at once (each with its own per-thread scratch) give the same result
/// as one call alone.
#[test]
fn concurrent_calls_agree() {
    let s = &setups()[2];
    let x = data(s);
    let isa = Isa::best();
    let want = run(s, &x, isa, Par::Seq, true);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let x = &x;
                scope.spawn(move || {
                    run(
                        s,
                        x,
                        isa,
                        if i % 2 == 0 { Par::Seq } else { Par::Rayon },
                        true,
                    )
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().unwrap() == want, "a concurrent call differs");
        }
    });
}
