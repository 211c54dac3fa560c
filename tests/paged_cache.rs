//! The paged KV cache: attention through page tables equals the contiguous cache bit for bit
//! (random page lengths, pages scattered over the pool, ragged sequences, every storage type,
//! score modifiers, every ISA, both thread modes, both kernels); fork shares pages and copies a shared
//! partial page on write; refused calls change nothing.

mod common;

use attnkit::{
    bf16, f16, AttnError, Isa, Kernel, KvCache, Operand, PagedKvCache, Par, SdpaOptions, SeqId,
    Tensor, TensorMut,
};
use common::{isas, randn};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The tokens of `b` sequences: `(Hkv, len, D)` keys and `(Hkv, len, Dv)` values each.
struct Tokens {
    lens: Vec<usize>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

fn tokens(rng: &mut SmallRng, lens: &[usize], hkv: usize, d: usize, dv: usize) -> Tokens {
    Tokens {
        lens: lens.to_vec(),
        k: lens.iter().map(|&l| randn(rng, hkv * l * d, 1.0)).collect(),
        v: lens
            .iter()
            .map(|&l| randn(rng, hkv * l * dv, 1.0))
            .collect(),
    }
}

/// Rows `[a, b)` of one sequence's `(Hkv, len, w)` data as a dense `(1, Hkv, b − a, w)` buffer.
fn rows(x: &[f32], hkv: usize, len: usize, w: usize, a: usize, b: usize) -> Vec<f32> {
    (0..hkv)
        .flat_map(|h| x[(h * len + a) * w..(h * len + b) * w].iter().copied())
        .collect()
}

/// A contiguous cache holding `t` (every sequence appended to the longest, then truncated).
fn contiguous<E: Operand>(t: &Tokens, hkv: usize, d: usize, dv: usize) -> KvCache<E> {
    let b = t.lens.len();
    let l = t.lens.iter().copied().max().unwrap_or(0);
    let mut c = KvCache::<E>::new_of(b, hkv, l.max(1), d, dv).unwrap();
    // Sequences shorter than the longest are padded with zeros, then truncated away.
    let pad = |x: &[Vec<f32>], w: usize| -> Vec<f32> {
        let mut out = vec![0.0f32; b * hkv * l * w];
        for (s, xs) in x.iter().enumerate() {
            for h in 0..hkv {
                let n = t.lens[s] * w;
                let dst = ((s * hkv + h) * l) * w;
                out[dst..dst + n].copy_from_slice(&xs[h * n..(h + 1) * n]);
            }
        }
        out
    };
    let (k, v) = (pad(&t.k, d), pad(&t.v, dv));
    c.append(
        &Tensor::bhld(&k, [b, hkv, l, d]),
        &Tensor::bhld(&v, [b, hkv, l, dv]),
    )
    .unwrap();
    for (s, &len) in t.lens.iter().enumerate() {
        c.truncate(s, len).unwrap();
    }
    c
}

/// A paged cache holding `t`, appended in random chunks interleaved across the sequences so
/// their pages mix, from a pool whose free pages were shuffled first.
fn paged<E: Operand>(
    rng: &mut SmallRng,
    t: &Tokens,
    hkv: usize,
    d: usize,
    dv: usize,
    page_len: usize,
) -> (PagedKvCache<E>, Vec<SeqId>) {
    let need: usize = t.lens.iter().map(|l| l.div_ceil(page_len)).sum();
    let spare = rng.gen_range(0..4);
    let mut c = PagedKvCache::<E>::new_of(hkv, d, dv, page_len, need + spare).unwrap();
    let mut order: Vec<usize> = (0..c.free_pages()).collect();
    order.shuffle(rng);
    c.shuffle_free_pages(&order).unwrap();
    let ids: Vec<SeqId> = t.lens.iter().map(|_| c.add_sequence()).collect();
    let mut done = vec![0usize; t.lens.len()];
    while done.iter().zip(&t.lens).any(|(a, b)| a < b) {
        let s = rng.gen_range(0..t.lens.len());
        let n = rng.gen_range(1..=7).min(t.lens[s] - done[s]);
        if n == 0 {
            continue;
        }
        let (a, z) = (done[s], done[s] + n);
        let k = rows(&t.k[s], hkv, t.lens[s], d, a, z);
        let v = rows(&t.v[s], hkv, t.lens[s], dv, a, z);
        c.append(
            &[ids[s]],
            &Tensor::bhld(&k, [1, hkv, n, d]),
            &Tensor::bhld(&v, [1, hkv, n, dv]),
        )
        .unwrap();
        done[s] = z;
    }
    (c, ids)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn equals_contiguous<E: Operand>(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for case in 0..12 {
        let hkv = rng.gen_range(1..=3);
        let hq = hkv * rng.gen_range(1..=4);
        let d = [1, 3, 8, 16, 17, 33, 64][rng.gen_range(0..7)];
        let dv = if rng.gen_bool(0.7) {
            d
        } else {
            rng.gen_range(1..40)
        };
        let page_len = [1, 2, 4, 16, 32, 64, 128][rng.gen_range(0..7)];
        let b = rng.gen_range(1..=3);
        // Prompts past the prefill kernel's query block (96 rows) too.
        let lq = [1, 1, 2, 3, 5, 8, 17, 40, 100][rng.gen_range(0..9)];
        // The first case decodes four-row groups (one token, four query heads a KV head): the
        // group size with a walk of its own for paged f32 caches on AMD cores.
        let (hq, lq) = if case == 0 { (4 * hkv, 1) } else { (hq, lq) };
        let lens: Vec<usize> = (0..b).map(|_| rng.gen_range(lq..=lq + 700)).collect();
        let t = tokens(&mut rng, &lens, hkv, d, dv);
        let cont = contiguous::<E>(&t, hkv, d, dv);
        let (pg, ids) = paged::<E>(&mut rng, &t, hkv, d, dv, page_len);
        for (s, &id) in ids.iter().enumerate() {
            assert_eq!(pg.len(id).unwrap(), lens[s]);
        }
        let q = randn(&mut rng, b * hq * lq * d, 1.0);
        let qt = Tensor::bhld(&q, [b, hq, lq, d]);
        let window = rng.gen_bool(0.3).then(|| rng.gen_range(1..300));
        let sinks = randn(&mut rng, hq, 1.0);
        let alibi = attnkit::alibi_slopes(hq, 8.0);
        let with_sinks = rng.gen_bool(0.3);
        let with_alibi = rng.gen_bool(0.3);
        let softcap = rng.gen_bool(0.3).then_some(5.0f32);
        let runs = isas().into_iter().flat_map(|isa| {
            [Par::Seq, Par::Rayon]
                .into_iter()
                .flat_map(move |par| [Kernel::Decode, Kernel::Prefill].map(|k| (isa, par, k)))
        });
        for (isa, par, kernel) in runs {
            let mut opts = SdpaOptions::new().isa(isa).par(par).kernel(kernel);
            if let Some(w) = window {
                opts = opts.window(w);
            }
            if with_sinks {
                opts = opts.sinks(&sinks);
            }
            if with_alibi {
                opts = opts.alibi(&alibi);
            }
            if let Some(c) = softcap {
                opts = opts.softcap(c);
            }
            let shape = [b, hq, lq, dv];
            // The paged cache first: a kernel that left a row's partial result unwritten would
            // otherwise read the contiguous call's, still in the reused scratch.
            let mut got = vec![f32::NAN; b * hq * lq * dv];
            pg.attend(&ids, &qt, &mut TensorMut::bhld(&mut got, shape), &opts)
                .unwrap();
            let mut want = vec![0.0f32; got.len()];
            cont.attend(&qt, &mut TensorMut::bhld(&mut want, shape), &opts)
                .unwrap();
            assert!(
                same_bits(&got, &want),
                "{:?} case {case} {isa} {par:?} {kernel:?}: b={b} hq={hq} hkv={hkv} lq={lq} \
                 d={d} dv={dv} page={page_len} lens={lens:?} window={window:?}",
                E::DTYPE
            );
        }
    }
}

#[test]
fn f32_paged_equals_contiguous_bitwise() {
    equals_contiguous::<f32>(1);
}

#[test]
fn bf16_paged_equals_contiguous_bitwise() {
    equals_contiguous::<bf16>(2);
}

#[test]
fn f16_paged_equals_contiguous_bitwise() {
    equals_contiguous::<f16>(3);
}

#[test]
fn int8_paged_equals_contiguous_bitwise() {
    equals_contiguous::<i8>(4);
}

/// Attention of sequence `id` alone, and of a contiguous cache holding `t`'s one sequence.
fn attend_one<E: Operand>(
    c: &PagedKvCache<E>,
    id: SeqId,
    q: &[f32],
    hq: usize,
    d: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; hq * d];
    let opts = SdpaOptions::new();
    c.attend(
        &[id],
        &Tensor::bhld(q, [1, hq, 1, d]),
        &mut TensorMut::bhld(&mut out, [1, hq, 1, d]),
        &opts,
    )
    .unwrap();
    out
}

fn attend_contiguous<E: Operand>(
    t: &Tokens,
    hkv: usize,
    q: &[f32],
    hq: usize,
    d: usize,
) -> Vec<f32> {
    let c = contiguous::<E>(t, hkv, d, d);
    let mut out = vec![0.0f32; hq * d];
    let opts = SdpaOptions::new().kernel(Kernel::Decode);
    c.attend(
        &Tensor::bhld(q, [1, hq, 1, d]),
        &mut TensorMut::bhld(&mut out, [1, hq, 1, d]),
        &opts,
    )
    .unwrap();
    out
}

#[test]
fn fork_shares_full_pages_and_copies_the_partial_one_on_write() {
    fork_case::<f32>();
}

/// The copy on write takes the int8 rows' scales along.
#[test]
fn int8_fork_copies_the_partial_page_with_its_scales() {
    fork_case::<i8>();
}

fn fork_case<E: Operand>() {
    let mut rng = SmallRng::seed_from_u64(5);
    let (hkv, hq, d, page) = (2, 4, 8, 4);
    let mut c = PagedKvCache::<E>::new_of(hkv, d, d, page, 16).unwrap();
    let a = c.add_sequence();
    // 10 tokens: pages 0 and 1 full, page 2 holds 2.
    let prefix = tokens(&mut rng, &[10], hkv, d, d);
    c.append(
        &[a],
        &Tensor::bhld(&prefix.k[0], [1, hkv, 10, d]),
        &Tensor::bhld(&prefix.v[0], [1, hkv, 10, d]),
    )
    .unwrap();
    assert_eq!(c.free_pages(), 13);
    let b = c.fork(a).unwrap();
    assert_eq!(c.pages_of(a).unwrap(), c.pages_of(b).unwrap());
    assert_eq!(c.free_pages(), 13, "a fork copies nothing");
    // Each branch appends its own 3 tokens.
    let ta = tokens(&mut rng, &[3], hkv, d, d);
    let tb = tokens(&mut rng, &[3], hkv, d, d);
    for (id, t) in [(a, &ta), (b, &tb)] {
        c.append(
            &[id],
            &Tensor::bhld(&t.k[0], [1, hkv, 3, d]),
            &Tensor::bhld(&t.v[0], [1, hkv, 3, d]),
        )
        .unwrap();
    }
    let (pa, pb) = (
        c.pages_of(a).unwrap().to_vec(),
        c.pages_of(b).unwrap().to_vec(),
    );
    assert_eq!(pa[..2], pb[..2], "full pages stay shared");
    assert_ne!(
        pa[2], pb[2],
        "the partial page is copied on the first write"
    );
    assert_eq!(pa.len(), 4);
    // Each branch reads the shared prefix and its own tokens.
    let join = |t: &Tokens| {
        let mut k = Vec::new();
        let mut v = Vec::new();
        for h in 0..hkv {
            k.extend_from_slice(&prefix.k[0][h * 10 * d..(h + 1) * 10 * d]);
            k.extend_from_slice(&t.k[0][h * 3 * d..(h + 1) * 3 * d]);
            v.extend_from_slice(&prefix.v[0][h * 10 * d..(h + 1) * 10 * d]);
            v.extend_from_slice(&t.v[0][h * 3 * d..(h + 1) * 3 * d]);
        }
        Tokens {
            lens: vec![13],
            k: vec![k],
            v: vec![v],
        }
    };
    let q = randn(&mut rng, hq * d, 1.0);
    for (id, t) in [(a, &ta), (b, &tb)] {
        let want = attend_contiguous::<E>(&join(t), hkv, &q, hq, d);
        assert!(same_bits(&attend_one(&c, id, &q, hq, d), &want));
    }
    // Freeing one branch keeps the shared pages for the other.
    let free_before = c.free_pages();
    c.free(a).unwrap();
    assert_eq!(
        c.free_pages(),
        free_before + 2,
        "a's own pages 2 and 3 return"
    );
    let want = attend_contiguous::<E>(&join(&tb), hkv, &q, hq, d);
    assert!(same_bits(&attend_one(&c, b, &q, hq, d), &want));
    c.free(b).unwrap();
    assert_eq!(c.free_pages(), 16);
}

#[test]
fn truncate_returns_unshared_pages_and_appends_after_it_overwrite_nothing_shared() {
    let mut rng = SmallRng::seed_from_u64(6);
    let (hkv, hq, d, page) = (1, 2, 4, 4);
    let mut c = PagedKvCache::new(hkv, d, d, page, 8).unwrap();
    let a = c.add_sequence();
    let t = tokens(&mut rng, &[8], hkv, d, d);
    c.append(
        &[a],
        &Tensor::bhld(&t.k[0], [1, hkv, 8, d]),
        &Tensor::bhld(&t.v[0], [1, hkv, 8, d]),
    )
    .unwrap();
    let b = c.fork(a).unwrap();
    // `a` rolls back into its second (shared, full) page, then writes into it.
    c.truncate(a, 5).unwrap();
    assert_eq!(c.len(a).unwrap(), 5);
    let x = tokens(&mut rng, &[2], hkv, d, d);
    c.append(
        &[a],
        &Tensor::bhld(&x.k[0], [1, hkv, 2, d]),
        &Tensor::bhld(&x.v[0], [1, hkv, 2, d]),
    )
    .unwrap();
    let q = randn(&mut rng, hq * d, 1.0);
    // `b` still sees the original 8 tokens.
    let want = attend_contiguous::<f32>(&t, hkv, &q, hq, d);
    assert!(same_bits(&attend_one(&c, b, &q, hq, d), &want));
    // Truncating `b` to 0 returns nothing shared... and freeing both empties the pool.
    c.truncate(b, 0).unwrap();
    assert_eq!(c.pages_of(b).unwrap(), &[] as &[u32]);
    c.free(a).unwrap();
    assert_eq!(c.free_pages(), 8);
}

#[test]
fn refused_calls_change_nothing() {
    let mut rng = SmallRng::seed_from_u64(7);
    let (hkv, hq, d, page) = (2, 2, 4, 4);
    let mut c = PagedKvCache::<i8>::new_of(hkv, d, d, page, 3).unwrap();
    let a = c.add_sequence();
    let t = tokens(&mut rng, &[6], hkv, d, d);
    c.append(
        &[a],
        &Tensor::bhld(&t.k[0], [1, hkv, 6, d]),
        &Tensor::bhld(&t.v[0], [1, hkv, 6, d]),
    )
    .unwrap();
    let q = randn(&mut rng, hq * d, 1.0);
    let before = attend_one(&c, a, &q, hq, d);
    let (free, pages) = (c.free_pages(), c.pages_of(a).unwrap().to_vec());
    let check = |c: &PagedKvCache<i8>| {
        assert_eq!(c.len(a).unwrap(), 6);
        assert_eq!(c.free_pages(), free);
        assert_eq!(c.pages_of(a).unwrap(), &pages[..]);
        assert!(same_bits(&attend_one(c, a, &q, hq, d), &before));
    };
    // 7 more tokens need 2 pages; 1 is free.
    let big = randn(&mut rng, hkv * 7 * d, 1.0);
    let e = c
        .append(
            &[a],
            &Tensor::bhld(&big, [1, hkv, 7, d]),
            &Tensor::bhld(&big, [1, hkv, 7, d]),
        )
        .unwrap_err();
    assert_eq!(e, AttnError::PoolExhausted { needed: 2, free: 1 });
    check(&c);
    // A NaN in int8 input.
    let mut bad = randn(&mut rng, hkv * d, 1.0);
    bad[d + 1] = f32::NAN;
    let e = c
        .append(
            &[a],
            &Tensor::bhld(&bad, [1, hkv, 1, d]),
            &Tensor::bhld(&bad, [1, hkv, 1, d]),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            AttnError::NonFinite {
                arg: "k",
                head: 1,
                ..
            }
        ),
        "{e:?}"
    );
    check(&c);
    // A sequence named twice, a wrong shape, an unknown sequence.
    let one = randn(&mut rng, 2 * hkv * d, 1.0);
    let e = c
        .append(
            &[a, a],
            &Tensor::bhld(&one, [2, hkv, 1, d]),
            &Tensor::bhld(&one, [2, hkv, 1, d]),
        )
        .unwrap_err();
    assert!(
        matches!(e, AttnError::BadParam { arg: "seqs", .. }),
        "{e:?}"
    );
    let e = c
        .append(
            &[a],
            &Tensor::bhld(&one, [1, hkv, 1, 2 * d]),
            &Tensor::bhld(&one, [1, hkv, 1, 2 * d]),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            AttnError::ShapeMismatch {
                arg: "k",
                dim: "D",
                ..
            }
        ),
        "{e:?}"
    );
    let gone = c.add_sequence();
    c.free(gone).unwrap();
    let e = c
        .append(
            &[gone],
            &Tensor::bhld(&one, [1, hkv, 1, d]),
            &Tensor::bhld(&one, [1, hkv, 1, d]),
        )
        .unwrap_err();
    assert_eq!(
        e,
        AttnError::UnknownSequence {
            arg: "seqs",
            seq: gone.get()
        }
    );
    assert!(matches!(
        c.free(gone),
        Err(AttnError::UnknownSequence { .. })
    ));
    assert!(matches!(
        c.fork(gone),
        Err(AttnError::UnknownSequence { .. })
    ));
    assert!(matches!(
        c.truncate(a, 7),
        Err(AttnError::KeyLength { len: 7, lk: 6, .. })
    ));
    check(&c);
    // Attend: a freed sequence, an output of the wrong shape.
    let mut out = vec![0.0f32; hq * d];
    let qt = Tensor::bhld(&q, [1, hq, 1, d]);
    let e = c
        .attend(
            &[gone],
            &qt,
            &mut TensorMut::bhld(&mut out, [1, hq, 1, d]),
            &SdpaOptions::new(),
        )
        .unwrap_err();
    assert_eq!(
        e,
        AttnError::UnknownSequence {
            arg: "seqs",
            seq: gone.get()
        }
    );
    let e = c
        .attend(
            &[a],
            &qt,
            &mut TensorMut::bhld(&mut out[..d], [1, 1, 1, d]),
            &SdpaOptions::new(),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            AttnError::ShapeMismatch {
                arg: "out",
                dim: "H",
                ..
            }
        ),
        "{e:?}"
    );
    check(&c);
}

#[test]
fn construction_refuses_bad_sizes() {
    for page in [0, 3, 24] {
        let e = PagedKvCache::new(1, 4, 4, page, 4).unwrap_err();
        assert!(
            matches!(
                e,
                AttnError::BadParam {
                    arg: "page_len",
                    ..
                }
            ),
            "{page}: {e:?}"
        );
    }
    assert!(matches!(
        PagedKvCache::new(8, 128, 128, 1 << 40, 1 << 30),
        Err(AttnError::Overflow { .. } | AttnError::Alloc { .. })
    ));
    assert!(matches!(
        PagedKvCache::new(0, 0, 0, 1 << 62, 1 << 20),
        Err(AttnError::Overflow { .. })
    ));
    assert!(matches!(
        PagedKvCache::new(1, 1, 1, 1, 1 << 33),
        Err(AttnError::BadParam { arg: "pages", .. })
    ));
    // Empty rows: T is bounded by the pool, not looped over.
    let mut c = PagedKvCache::new(2, 0, 0, 1 << 20, 4).unwrap();
    let s = c.add_sequence();
    let empty: [f32; 0] = [];
    c.append(
        &[s],
        &Tensor::bhld(&empty, [1, 2, 3 << 20, 0]),
        &Tensor::bhld(&empty, [1, 2, 3 << 20, 0]),
    )
    .unwrap();
    assert_eq!(c.len(s).unwrap(), 3 << 20);
    let e = c
        .append(
            &[s],
            &Tensor::bhld(&empty, [1, 2, 2 << 20, 0]),
            &Tensor::bhld(&empty, [1, 2, 2 << 20, 0]),
        )
        .unwrap_err();
    assert_eq!(e, AttnError::PoolExhausted { needed: 2, free: 1 });
}

#[test]
fn empty_and_unused_sequences_attend_to_nothing() {
    // A sequence with no tokens beside one with tokens: its rows see no key (zeros, as the
    // contiguous cache gives), and the longer one is unaffected.
    let mut rng = SmallRng::seed_from_u64(8);
    let (hkv, hq, d) = (1, 1, 8);
    let t = tokens(&mut rng, &[0, 9], hkv, d, d);
    let cont = contiguous::<f32>(&t, hkv, d, d);
    let (pg, ids) = paged::<f32>(&mut rng, &t, hkv, d, d, 4);
    let q = randn(&mut rng, 2 * hq * d, 1.0);
    let qt = Tensor::bhld(&q, [2, hq, 1, d]);
    let opts = SdpaOptions::new().kernel(Kernel::Decode).isa(Isa::Scalar);
    let mut want = vec![0.0f32; 2 * hq * d];
    cont.attend(&qt, &mut TensorMut::bhld(&mut want, [2, hq, 1, d]), &opts)
        .unwrap();
    let mut got = vec![f32::NAN; want.len()];
    pg.attend(
        &ids,
        &qt,
        &mut TensorMut::bhld(&mut got, [2, hq, 1, d]),
        &opts,
    )
    .unwrap();
    assert!(same_bits(&got, &want));
}

/// Found by the fuzzer: with no KV heads the pool's buffers are empty while sequences hold
/// tokens; attend refused that as a broken pool instead of computing its (empty) answer.
#[test]
fn zero_kv_heads_attend_to_an_empty_answer() {
    let mut c = PagedKvCache::new(0, 4, 4, 2, 4).unwrap();
    let s = c.add_sequence();
    let empty: [f32; 0] = [];
    c.append(
        &[s],
        &Tensor::bhld(&empty, [1, 0, 3, 4]),
        &Tensor::bhld(&empty, [1, 0, 3, 4]),
    )
    .unwrap();
    assert_eq!(c.len(s).unwrap(), 3);
    let mut out: [f32; 0] = [];
    c.attend(
        &[s],
        &Tensor::bhld(&empty, [1, 0, 1, 4]),
        &mut TensorMut::bhld(&mut out, [1, 0, 1, 4]),
        &SdpaOptions::new(),
    )
    .unwrap();
}
