//! Concurrency stress: many rayon tasks, some inside a second (nested) pool, call `sdpa`,
//! `KvCache::attend` and the layers with different shapes at once. The kernels keep per-thread
//! scratch and the decode path a per-thread partials buffer, which a task that waits inside
//! rayon may find in use by another call on the same thread; every result must still be bitwise
//! the one a sequential run gives. CI also runs this file under AddressSanitizer.
#![cfg(feature = "rayon")]

mod common;

use attnkit::{
    sdpa, AdditiveAttention, AdditiveDims, AdditiveOptions, AdditiveWeights, Causal, Isa, Kernel,
    KvCache, MaskRef, MhaConfig, MhaOptions, MultiheadAttention, Par, SdpaOptions, StateDict,
    Tensor, TensorMut, Tokens, Weights,
};
use common::{isas, randn};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use rayon::prelude::*;

/// One call, as the bit patterns of everything it writes.
type Job = Box<dyn Fn(Par) -> Vec<u32> + Send + Sync>;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn rand(seed: u64, n: usize) -> Vec<f32> {
    randn(&mut SmallRng::seed_from_u64(seed), n, 1.0)
}

/// `sdpa` on dense BHLD inputs `(b, hq, hkv, lq, lk, d)` with a bias when `bias`.
fn sdpa_job(isa: Isa, dims: [usize; 6], causal: Option<Causal>, bias: bool, path: Kernel) -> Job {
    let [b, hq, hkv, lq, lk, d] = dims;
    let seed = dims.iter().sum::<usize>() as u64;
    let (q, k, v) = (
        rand(seed, b * hq * lq * d),
        rand(seed + 1, b * hkv * lk * d),
        rand(seed + 2, b * hkv * lk * d),
    );
    let m = rand(seed + 3, if bias { lq * lk } else { 0 });
    Box::new(move |par| {
        let mut opts = SdpaOptions::new().isa(isa).par(par).kernel(path);
        if let Some(c) = causal {
            opts = opts.causal(c);
        }
        if bias {
            opts = opts.bias(MaskRef::lq_lk(&m, lq, lk));
        }
        let mut out = vec![0.0f32; b * hq * lq * d];
        sdpa(
            &Tensor::bhld(&q, [b, hq, lq, d]),
            &Tensor::bhld(&k, [b, hkv, lk, d]),
            &Tensor::bhld(&v, [b, hkv, lk, d]),
            &mut TensorMut::blhd(&mut out, [b, lq, hq, d]),
            &opts,
        )
        .unwrap();
        bits(&out)
    })
}

/// `KvCache::attend` of two new queries over a ragged cache (GQA 4 over 2).
fn cache_job(isa: Isa) -> Job {
    let (b, hq, hkv, cap, d) = (2, 4, 2, 1024, 32);
    let mut cache = KvCache::new(b, hkv, cap, d, d).unwrap();
    let t = 700;
    let kv = rand(7, b * hkv * t * d);
    let kvt = Tensor::bhld(&kv, [b, hkv, t, d]);
    cache.append(&kvt, &kvt).unwrap();
    cache.truncate(1, 450).unwrap();
    let q = rand(8, b * hq * 2 * d);
    Box::new(move |par| {
        let mut out = vec![0.0f32; b * hq * 2 * d];
        cache
            .attend(
                &Tensor::bhld(&q, [b, hq, 2, d]),
                &mut TensorMut::bhld(&mut out, [b, hq, 2, d]),
                &SdpaOptions::new().isa(isa).par(par),
            )
            .unwrap();
        bits(&out)
    })
}

/// `nn.MultiheadAttention`-style self-attention, causal, with per-head weights.
fn mha_job() -> Job {
    let (e, h, b, l) = (64, 4, 2, 50);
    let mut sd = StateDict::new();
    sd.insert("in_proj_weight", &[3 * e, e], &rand(9, 3 * e * e))
        .unwrap();
    sd.insert("in_proj_bias", &[3 * e], &rand(10, 3 * e))
        .unwrap();
    sd.insert("out_proj.weight", &[e, e], &rand(11, e * e))
        .unwrap();
    sd.insert("out_proj.bias", &[e], &rand(12, e)).unwrap();
    let mha = MultiheadAttention::from_state_dict(MhaConfig::new(e, h), &sd, "").unwrap();
    let x = rand(13, b * l * e);
    Box::new(move |par| {
        let x = Tokens::ble(&x, [b, l, e]);
        let opts = MhaOptions::new()
            .causal(Causal::TopLeft)
            .weights(Weights::PerHead)
            .par(par);
        let y = mha.forward(&x, &x, &x, &opts).unwrap();
        let mut all = bits(&y.out);
        all.extend(bits(&y.weights.unwrap()));
        all
    })
}

/// Additive (Bahdanau) attention with key lengths.
fn additive_job() -> Job {
    let (a, dq, dk, dv, b, lq, lk) = (16, 12, 10, 8, 2, 30, 70);
    let layer = AdditiveAttention::new(&AdditiveWeights {
        dims: AdditiveDims {
            attn_dim: a,
            query_dim: dq,
            key_dim: dk,
        },
        w_q: &rand(14, a * dq),
        w_k: &rand(15, a * dk),
        bias: Some(&rand(16, a)),
        v: &rand(17, a),
    })
    .unwrap();
    let (q, k, v) = (
        rand(18, b * lq * dq),
        rand(19, b * lk * dk),
        rand(20, b * lk * dv),
    );
    Box::new(move |par| {
        let lens = [lk, 41];
        let opts = AdditiveOptions::new().key_lengths(&lens).par(par);
        let r = layer
            .forward(
                &Tokens::ble(&q, [b, lq, dq]),
                &Tokens::ble(&k, [b, lk, dk]),
                &Tokens::ble(&v, [b, lk, dv]),
                &opts,
            )
            .unwrap();
        bits(&r.out)
    })
}

#[test]
fn mixed_calls_in_nested_pools_agree_with_sequential_runs() {
    let mut jobs: Vec<Job> = vec![mha_job(), additive_job()];
    for isa in isas() {
        let causal = Some(Causal::TopLeft);
        jobs.push(sdpa_job(
            isa,
            [2, 4, 4, 200, 200, 64],
            causal,
            false,
            Kernel::Auto,
        ));
        jobs.push(sdpa_job(
            isa,
            [2, 8, 8, 10, 10, 16],
            None,
            true,
            Kernel::Auto,
        ));
        jobs.push(sdpa_job(
            isa,
            [1, 8, 2, 1, 3000, 64],
            None,
            false,
            Kernel::Decode,
        ));
        jobs.push(sdpa_job(
            isa,
            [1, 4, 2, 3, 900, 40],
            Some(Causal::BottomRight),
            true,
            Kernel::Decode,
        ));
        jobs.push(cache_job(isa));
    }
    let want: Vec<Vec<u32>> = jobs.iter().map(|j| j(Par::Seq)).collect();
    let outer = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let inner = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    const ROUNDS: usize = 24;
    let n = jobs.len();
    outer.install(|| {
        (0..ROUNDS * n).into_par_iter().for_each(|t| {
            let j = t % n;
            // A third of the calls run inside the nested pool, a third on the outer pool, and a
            // third sequentially on whichever outer worker picked them up.
            let got = match t / n % 3 {
                0 => inner.install(|| jobs[j](Par::Rayon)),
                1 => jobs[j](Par::Rayon),
                _ => jobs[j](Par::Seq),
            };
            assert!(
                got == want[j],
                "job {j} (task {t}) differs from its sequential run"
            );
        });
    });
}
