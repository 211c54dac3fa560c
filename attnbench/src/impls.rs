//! The implementations under test, behind one small trait so that new ones slot in.

use crate::cases::Case;
use attnkit::kernels::reference;
use attnkit::unfused::{sdpa_unfused_with, Backend};
use attnkit::{
    bf16, choose_kernel, f16, sdpa, sdpa_backward_vec, sdpa_ext, sdpa_int8, AlignedBuf, Causal,
    Dtype, Elem, Extras, Isa, Kernel, Operand, PagedKvCache, Precision, Saved, SdpaOptions, SeqId,
    Stored, Tensor, TensorMut,
};

/// Inputs of one case, dense `(B, H, L, D)`, filled from a fixed seed, each buffer starting on a
/// cache line (as PyTorch's allocator places tensors).
pub struct Inputs {
    pub q: AlignedBuf,
    pub k: AlignedBuf,
    pub v: AlignedBuf,
    /// Q in `--dtype`, K and V in `--kv-dtype` (default: `--dtype`), for our fused kernels; where
    /// a type is not f32, `q`, `k`, `v` hold the same values widened, so every implementation
    /// computes on the same numbers.
    pub typed: [Typed; 3],
    /// K and V in a paged cache of `--paged` tokens a page, in `--kv-dtype`, pages scattered
    /// over the pool (under `--paged`, for the cases [`Paged::suits`]).
    pub paged: Option<Paged>,
}

/// A paged cache holding one case's K and V, sequence `b` of the case being `ids[b]`.
pub struct Paged {
    cache: PagedCache,
    ids: Vec<SeqId>,
}

enum PagedCache {
    F32(PagedKvCache<f32>),
    Bf16(PagedKvCache<bf16>),
    F16(PagedKvCache<f16>),
    I8(PagedKvCache<i8>),
}

impl Paged {
    /// The case's K and V (as `typed` holds them; int8 from the dequantised values, which
    /// quantise back to the same rows) in a paged cache of `page` tokens a page. The pool's free
    /// pages are shuffled first (a fixed permutation), so a sequence's pages lie scattered as
    /// in a long-running server's pool, not in address order.
    fn new(case: &Case, k: &[f32], v: &[f32], typed: &[Typed], page: usize) -> Paged {
        fn fill<E: Operand, A: Elem>(
            case: &Case,
            k: &[A],
            v: &[A],
            page: usize,
        ) -> (PagedKvCache<E>, Vec<SeqId>) {
            let pages = case.b * case.lk.div_ceil(page);
            let mut c = PagedKvCache::<E>::new_of(case.hkv, case.d, case.d, page, pages)
                .expect("paged cache");
            // A multiplicative permutation of the pages: n coprime to a large odd step.
            let n = c.free_pages();
            let step = (0..)
                .map(|i| 0x9E37_79B9 + 2 * i)
                .find(|s| gcd(*s, n) == 1)
                .unwrap_or(1);
            let order: Vec<usize> = (0..n).map(|i| i * step % n.max(1)).collect();
            c.shuffle_free_pages(&order).expect("a permutation");
            let per = case.hkv * case.lk * case.d;
            let shape = [1, case.hkv, case.lk, case.d];
            let ids = (0..case.b)
                .map(|b| {
                    let id = c.add_sequence();
                    let (kb, vb) = (&k[b * per..][..per], &v[b * per..][..per]);
                    c.append(&[id], &Tensor::bhld(kb, shape), &Tensor::bhld(vb, shape))
                        .expect("append");
                    id
                })
                .collect();
            (c, ids)
        }
        fn gcd(a: usize, b: usize) -> usize {
            if b == 0 {
                a
            } else {
                gcd(b, a % b)
            }
        }
        let (cache, ids) = match typed {
            [Typed::Bf16(k), Typed::Bf16(v)] => {
                let (c, ids) = fill::<bf16, bf16>(case, k, v, page);
                (PagedCache::Bf16(c), ids)
            }
            [Typed::F16(k), Typed::F16(v)] => {
                let (c, ids) = fill::<f16, f16>(case, k, v, page);
                (PagedCache::F16(c), ids)
            }
            [Typed::I8(..), Typed::I8(..)] => {
                let (c, ids) = fill::<i8, f32>(case, k, v, page);
                (PagedCache::I8(c), ids)
            }
            _ => {
                let (c, ids) = fill::<f32, f32>(case, k, v, page);
                (PagedCache::F32(c), ids)
            }
        };
        Paged { cache, ids }
    }

    /// `Some(reason)` for cases a paged cache's attention does not compute as the others do.
    fn suits(case: &Case) -> Option<String> {
        // The cache's attention is bottom-right causal: for one query row no mask at all, for a
        // whole prompt (Lq = Lk) the same as the others' top-left mask.
        let same = if case.causal {
            case.lq == case.lk
        } else {
            case.lq == 1
        };
        (!same).then(|| {
            "fused-paged: decode cases (Lq = 1, not causal) and causal prompts (Lq = Lk)".into()
        })
    }

    fn attend<Q: Elem>(&self, case: &Case, q: &[Q], out: &mut [f32], opts: &SdpaOptions) {
        let qt = Tensor::bhld(q, [case.b, case.h, case.lq, case.d]);
        let mut o = TensorMut::bhld(out, [case.b, case.h, case.lq, case.d]);
        let r = match &self.cache {
            PagedCache::F32(c) => c.attend(&self.ids, &qt, &mut o, opts),
            PagedCache::Bf16(c) => c.attend(&self.ids, &qt, &mut o, opts),
            PagedCache::F16(c) => c.attend(&self.ids, &qt, &mut o, opts),
            PagedCache::I8(c) => c.attend(&self.ids, &qt, &mut o, opts),
        };
        r.expect("paged attend failed");
    }
}

/// One input in the type our kernels read it in: the f32 buffer itself, a 16-bit copy, or int8
/// rows with their scales.
pub enum Typed {
    F32,
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    I8(Vec<i8>, Vec<f32>),
}

impl Typed {
    /// `x` (rows of `d` values) in `dt`, and `x` overwritten with what that type holds, widened.
    fn of(dt: Dtype, x: &mut [f32], d: usize) -> Typed {
        match dt {
            Dtype::Bf16 => Typed::Bf16(round_to(x)),
            Dtype::F16 => Typed::F16(round_to(x)),
            Dtype::I8 => {
                let (q, s) = quantise(x, d);
                Typed::I8(q, s)
            }
            _ => Typed::F32,
        }
    }
}

/// Rows of `d` values of `x` quantised to int8 with a scale each (as `KvCache<i8>` stores
/// them), and `x` overwritten with the dequantised values.
fn quantise(x: &mut [f32], d: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; x.len()];
    let mut scales = Vec::with_capacity(x.len() / d.max(1));
    if d == 0 {
        return (q, scales);
    }
    for (row, qrow) in x.chunks_exact_mut(d).zip(q.chunks_exact_mut(d)) {
        let s = i8::encode(row, qrow);
        for (v, &qv) in row.iter_mut().zip(qrow.iter()) {
            *v = s * f32::from(qv);
        }
        scales.push(s);
    }
    (q, scales)
}

/// `x` rounded to `E`, and `x` overwritten with the rounded values widened.
fn round_to<E: Elem>(x: &mut [f32]) -> Vec<E> {
    x.iter_mut()
        .map(|v| {
            let e = E::from_f32(*v);
            *v = e.to_f32();
            e
        })
        .collect()
}

impl Inputs {
    /// Uniform in [-1, 1), from a SplitMix64 stream seeded by `seed` and the shape, so each case
    /// sees the same data in every run and every implementation. `huge_pages`: advise
    /// transparent huge pages for the buffers before filling them (`--huge-pages`).
    pub fn new(case: &Case, seed: u64, huge_pages: bool) -> Inputs {
        let mut state = seed
            ^ (case.b as u64) << 48
            ^ (case.h as u64) << 40
            ^ (case.lq as u64) << 20
            ^ case.lk as u64;
        let mut fill = |n: usize| -> AlignedBuf {
            let mut buf = AlignedBuf::zeroed(n, huge_pages);
            for x in buf.iter_mut() {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                // 24 random bits → [-1, 1).
                *x = (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            }
            buf
        };
        let (mut q, mut k, mut v) = (fill(case.q_len()), fill(case.kv_len()), fill(case.kv_len()));
        let m = modifiers();
        let kv = m.kv_dtype.unwrap_or(m.dtype);
        let typed = [
            Typed::of(m.dtype, &mut q, case.d),
            Typed::of(kv, &mut k, case.d),
            Typed::of(kv, &mut v, case.d),
        ];
        let paged = m
            .paged
            .filter(|_| Paged::suits(case).is_none())
            .map(|page| Paged::new(case, &k, &v, &typed[1..], page));
        Inputs {
            q,
            k,
            v,
            typed,
            paged,
        }
    }
}

/// One implementation of attention that can be timed.
pub trait Impl: Sync {
    /// The `impl` field of the output.
    fn name(&self) -> &'static str;
    /// The `isa` field of the output, given the ISA the run uses (and, for ours, the kernel the
    /// case runs on: `avx512/decode`).
    fn isa_label(&self, isa: Isa, _case: &Case) -> String {
        isa.name().to_string()
    }
    /// Threads it really uses when the rayon pool has `pool` threads.
    fn threads(&self, pool: usize) -> usize {
        pool
    }
    /// `Some(reason)` when this case is out of its reach.
    fn skip(&self, _case: &Case) -> Option<String> {
        None
    }
    /// Whether `run` computes attention (and must agree with the others); false for a baseline
    /// that only measures the machine (`read-kv`).
    fn is_attention(&self) -> bool {
        true
    }
    /// One forward pass: reads `inp`, writes `out` (dense `(B, H, Lq, D)`).
    fn run(&self, case: &Case, inp: &Inputs, out: &mut [f32], isa: Isa);
    /// Its FLOPs in units of the forward's ([`Case::flops`]).
    fn flops_factor(&self) -> f64 {
        1.0
    }
}

/// What runs without `--impl`: ours on the automatic path and the baselines (the forced paths
/// `fused-prefill` / `fused-decode` are opt-in).
pub const DEFAULT: &[&str] = &["fused", "unfused-mm", "unfused-blas", "naive"];

/// Names accepted by `--impl`, in output order.
pub const NAMES: &[&str] = &[
    "fused",
    "fused-prefill",
    "fused-decode",
    "fused-paged",
    "fused-backward",
    "read-kv",
    "unfused-mm",
    "unfused-blas",
    "naive",
];
/// The attention layers: not measured here but by `examples/layers_bench.rs` (they need
/// weights and a FLOP convention of their own); `--impl` names them only to say so.
const LAYERS: &[&str] = &["mha", "additive"];

fn views<'a, Q: Elem, KV: Stored>(
    case: &Case,
    q: &'a [Q],
    kv: [&'a [KV]; 2],
    out: &'a mut [f32],
) -> (Tensor<'a, Q>, Tensor<'a, KV>, Tensor<'a, KV>, TensorMut<'a>) {
    let qs = [case.b, case.h, case.lq, case.d];
    let kvs = [case.b, case.hkv, case.lk, case.d];
    (
        Tensor::bhld(q, qs),
        Tensor::bhld(kv[0], kvs),
        Tensor::bhld(kv[1], kvs),
        TensorMut::bhld(out, qs),
    )
}

/// `sdpa` on Q in `Q` and K, V as `inp.typed` holds them (f32 output).
fn sdpa_in<Q: Elem>(case: &Case, q: &[Q], inp: &Inputs, out: &mut [f32], opts: &SdpaOptions) {
    fn go<Q: Elem, KV: Operand>(
        case: &Case,
        q: &[Q],
        kv: [&[KV]; 2],
        out: &mut [f32],
        opts: &SdpaOptions,
    ) {
        let (q, k, v, mut o) = views(case, q, kv, out);
        sdpa(&q, &k, &v, &mut o, opts).expect("sdpa failed");
    }
    match &inp.typed[1..] {
        [Typed::Bf16(k), Typed::Bf16(v)] => go(case, q, [k, v], out, opts),
        [Typed::F16(k), Typed::F16(v)] => go(case, q, [k, v], out, opts),
        [Typed::I8(k, ks), Typed::I8(v, vs)] => {
            let (q, k, v, mut o) = views(case, q, [k, v], out);
            let rows = [case.b, case.hkv, case.lk, 1];
            let (ks, vs) = (Tensor::bhld(ks, rows), Tensor::bhld(vs, rows));
            sdpa_int8(&q, &k, &ks, &v, &vs, &mut o, opts).expect("sdpa_int8 failed");
        }
        _ => go(case, q, [&inp.k[..], &inp.v[..]], out, opts),
    }
}

fn shapes(case: &Case) -> ([usize; 4], [usize; 4]) {
    (
        [case.b, case.h, case.lq, case.d],
        [case.b, case.hkv, case.lk, case.d],
    )
}

/// Score modifiers asked for on the command line (`--alibi`, `--softcap`, `--sinks`), applied to
/// our implementations only.
#[derive(Clone, Copy, Debug)]
pub struct Modifiers {
    pub alibi: bool,
    pub softcap: Option<f32>,
    pub sinks: bool,
    /// Element type of Q (and of K, V without `kv_dtype`) for our fused kernels (`--dtype`;
    /// output in f32).
    pub dtype: Dtype,
    /// Element type of K and V for our fused kernels (`--kv-dtype`).
    pub kv_dtype: Option<Dtype>,
    /// Tokens per page of `fused-paged`'s cache (`--paged`).
    pub paged: Option<usize>,
    /// Products of our prefill kernel on f32 operands (`--precision`).
    pub precision: Precision,
}

static MODIFIERS: std::sync::Mutex<Modifiers> = std::sync::Mutex::new(Modifiers {
    alibi: false,
    softcap: None,
    sinks: false,
    dtype: Dtype::F32,
    kv_dtype: None,
    paged: None,
    precision: Precision::Highest,
});

/// The modifiers, for the argument parser to set.
pub fn modifiers_mut() -> std::sync::MutexGuard<'static, Modifiers> {
    MODIFIERS.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn modifiers() -> Modifiers {
    *modifiers_mut()
}

/// `+alibi+softcap+sinks` (those in use) for implementations that apply them, else empty.
pub fn modifiers_tag(imp: &str) -> String {
    let m = modifiers();
    if !imp.starts_with("fused") && !imp.starts_with("unfused") {
        return String::new();
    }
    let mut t = String::new();
    for (on, name) in [
        (m.alibi, "+alibi"),
        (m.softcap.is_some(), "+softcap"),
        (m.sinks, "+sinks"),
        (imp.starts_with("fused") && m.dtype == Dtype::Bf16, "+bf16"),
        (imp.starts_with("fused") && m.dtype == Dtype::F16, "+f16"),
        (
            imp.starts_with("fused") && m.precision == Precision::Medium,
            "+medium",
        ),
    ] {
        if on {
            t.push_str(name);
        }
    }
    let kv = m.kv_dtype.filter(|&kv| kv != m.dtype);
    for (on, name) in [
        (kv == Some(Dtype::F32), "+kv-f32"),
        (kv == Some(Dtype::Bf16), "+kv-bf16"),
        (kv == Some(Dtype::F16), "+kv-f16"),
        (kv == Some(Dtype::I8), "+kv-int8"),
    ] {
        let on = on && imp.starts_with("fused");
        if on {
            t.push_str(name);
        }
    }
    t
}

/// Per-head slopes and sinks for `h` heads, made once per head count and kept for the process.
fn per_head(h: usize) -> (&'static [f32], &'static [f32]) {
    use std::collections::HashMap;
    type Cache = HashMap<usize, (&'static [f32], &'static [f32])>;
    static CACHE: std::sync::Mutex<Option<Cache>> = std::sync::Mutex::new(None);
    let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    *c.get_or_insert_with(HashMap::new)
        .entry(h)
        .or_insert_with(|| {
            let slopes = attnkit::alibi_slopes(h, 8.0).leak();
            let sinks: Vec<f32> = (0..h)
                .map(|i| -2.0 + 4.0 * i as f32 / h.max(2) as f32)
                .collect();
            (slopes, sinks.leak())
        })
}

fn options(case: &Case, isa: Isa) -> SdpaOptions<'static> {
    let mut o = SdpaOptions::new().isa(isa);
    if case.causal {
        o = o.causal(Causal::TopLeft);
    }
    let m = modifiers();
    let (slopes, sinks) = per_head(case.h);
    if m.alibi {
        o = o.alibi(slopes);
    }
    if let Some(cap) = m.softcap {
        o = o.softcap(cap);
    }
    if m.sinks {
        o = o.sinks(sinks);
    }
    o.precision(m.precision)
}

/// `attnkit::sdpa`: the fused kernels on the current rayon pool, the path chosen from the shape
/// (`fused`) or forced (`fused-prefill`, `fused-decode`).
struct Fused(&'static str, Kernel);

impl Impl for Fused {
    fn name(&self) -> &'static str {
        self.0
    }
    fn isa_label(&self, isa: Isa, case: &Case) -> String {
        let (qs, ks) = shapes(case);
        let path = choose_kernel(qs, ks, &options(case, isa).kernel(self.1));
        let path = if path == Kernel::Decode {
            "decode"
        } else {
            "prefill"
        };
        format!("{}/{path}", isa.name())
    }
    fn run(&self, case: &Case, inp: &Inputs, out: &mut [f32], isa: Isa) {
        let opts = options(case, isa).kernel(self.1);
        match &inp.typed[0] {
            Typed::F32 => sdpa_in(case, &inp.q[..], inp, out, &opts),
            Typed::Bf16(q) => sdpa_in(case, q, inp, out, &opts),
            Typed::F16(q) => sdpa_in(case, q, inp, out, &opts),
            Typed::I8(..) => unreachable!("queries are never int8"),
        }
    }
}

/// A training step's attention: `sdpa_ext` with the logsumexp, then `sdpa_backward` with the
/// queries standing in for the upstream gradient (`fused-backward`, f32). FLOPs: the forward's
/// plus the backward's five products, 2.5× the forward (FlashAttention's convention; attnkit
/// recomputes up to two more, not counted), 3.5× in all.
struct FusedBackward;

impl Impl for FusedBackward {
    fn name(&self) -> &'static str {
        "fused-backward"
    }
    fn flops_factor(&self) -> f64 {
        3.5
    }
    fn run(&self, case: &Case, inp: &Inputs, out: &mut [f32], isa: Isa) {
        let opts = options(case, isa);
        let (qs, kvs) = (
            [case.b, case.h, case.lq, case.d],
            [case.b, case.hkv, case.lk, case.d],
        );
        let (q, k, v) = (
            Tensor::bhld(&inp.q[..], qs),
            Tensor::bhld(&inp.k[..], kvs),
            Tensor::bhld(&inp.v[..], kvs),
        );
        let mut lse = vec![0.0f32; case.b * case.h * case.lq];
        let extras = Extras {
            lse: Some(&mut lse),
            weights: None,
        };
        sdpa_ext(&q, &k, &v, &mut TensorMut::bhld(out, qs), &opts, extras).expect("sdpa failed");
        let saved = Saved {
            q,
            k,
            v,
            out: Tensor::bhld(out, qs),
            lse: &lse,
        };
        let g = sdpa_backward_vec(&saved, &q, &opts).expect("backward failed");
        std::hint::black_box(g);
    }
}

/// `PagedKvCache::attend`: the kernel `Kernel::Auto` picks, reading K and V through page
/// tables (`fused-paged`; `--paged PAGE` sets the page length).
struct FusedPaged;

impl Impl for FusedPaged {
    fn name(&self) -> &'static str {
        "fused-paged"
    }
    fn isa_label(&self, isa: Isa, case: &Case) -> String {
        Fused("fused", Kernel::Auto).isa_label(isa, case)
    }
    fn skip(&self, case: &Case) -> Option<String> {
        Paged::suits(case)
    }
    fn run(&self, case: &Case, inp: &Inputs, out: &mut [f32], isa: Isa) {
        let paged = inp
            .paged
            .as_ref()
            .expect("--paged builds the cache of decode cases");
        let opts = options(case, isa);
        match &inp.typed[0] {
            Typed::F32 => paged.attend(case, &inp.q[..], out, &opts),
            Typed::Bf16(q) => paged.attend(case, q, out, &opts),
            Typed::F16(q) => paged.attend(case, q, out, &opts),
            Typed::I8(..) => unreachable!("queries are never int8"),
        }
    }
}

/// `attnkit::unfused::sdpa_unfused_with`: GEMM, softmax, GEMM, per head.
struct Unfused(&'static str, Backend);

impl Impl for Unfused {
    fn name(&self) -> &'static str {
        self.0
    }
    fn run(&self, case: &Case, inp: &Inputs, out: &mut [f32], isa: Isa) {
        let (q, k, v, mut o) = views(case, &inp.q[..], [&inp.k[..], &inp.v[..]], out);
        sdpa_unfused_with(&q, &k, &v, &mut o, &options(case, isa), self.1)
            .expect("sdpa_unfused failed");
    }
}

/// The f64 scalar reference (`attnkit::kernels::reference::attention_head`), one thread.
struct Naive {
    max_macs: f64,
}

impl Impl for Naive {
    fn name(&self) -> &'static str {
        "naive"
    }
    fn isa_label(&self, _isa: Isa, _case: &Case) -> String {
        "reference".into()
    }
    fn threads(&self, _pool: usize) -> usize {
        1
    }
    fn skip(&self, case: &Case) -> Option<String> {
        (case.macs() > self.max_macs).then(|| {
            format!(
                "larger than --naive-max ({:.0}M multiply-adds)",
                self.max_macs / 1e6
            )
        })
    }
    fn run(&self, c: &Case, inp: &Inputs, out: &mut [f32], _isa: Isa) {
        let (lq, lk, d) = (c.lq, c.lk, c.d);
        let scale = 1.0 / (d as f64).sqrt();
        for b in 0..c.b {
            for h in 0..c.h {
                let hk = h / (c.h / c.hkv);
                let q = &inp.q[(b * c.h + h) * lq * d..][..lq * d];
                let k = &inp.k[(b * c.hkv + hk) * lk * d..][..lk * d];
                let v = &inp.v[(b * c.hkv + hk) * lk * d..][..lk * d];
                let logit = |i: usize, j: usize| {
                    if c.causal && j > i {
                        return None;
                    }
                    let dot: f64 = (0..d)
                        .map(|x| q[i * d + x] as f64 * k[j * d + x] as f64)
                        .sum();
                    Some(dot * scale)
                };
                let (o, _, _) =
                    reference::attention_head(lq, lk, d, logit, |j, x| v[j * d + x] as f64);
                for (dst, src) in out[(b * c.h + h) * lq * d..][..lq * d].iter_mut().zip(o) {
                    *dst = src as f32;
                }
            }
        }
    }
}

/// `read-kv`: every float of K and V read once (summed, in equal contiguous shares over the rayon
/// pool), nothing computed: the memory ceiling of decode, on the same buffers and pages, with the
/// same threads, measured right after `fused` (so `fused`'s share of it is a side-by-side ratio;
/// on this shared host the bandwidth moves by 2x over minutes). Decode shapes only.
struct ReadKv;

/// Sum of `x` with 4 × 16 independent lanes, so the loop waits on loads, not on add latency;
/// compiled for the widest vectors the CPU has (the baseline x86-64 build only has 16-byte
/// loads, which understate the read ceiling: see BENCHMARKS.md).
fn stream_sum(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was just detected.
            return unsafe { stream_sum_avx512(x) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was just detected.
            return unsafe { stream_sum_avx2(x) };
        }
    }
    stream_sum_lanes(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_sum_avx512(x: &[f32]) -> f32 {
    stream_sum_lanes(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_sum_avx2(x: &[f32]) -> f32 {
    stream_sum_lanes(x)
}

/// [`stream_sum`]'s loop, vectorised by the compiler for the caller's features.
#[inline(always)]
fn stream_sum_lanes(x: &[f32]) -> f32 {
    let mut acc = [[0f32; 16]; 4];
    let mut blocks = x.chunks_exact(64);
    for blk in &mut blocks {
        for (a, part) in acc.iter_mut().zip(blk.chunks_exact(16)) {
            for (s, v) in a.iter_mut().zip(part) {
                *s += v;
            }
        }
    }
    blocks.remainder().iter().sum::<f32>() + acc.iter().flatten().sum::<f32>()
}

impl Impl for ReadKv {
    fn name(&self) -> &'static str {
        "read-kv"
    }
    fn isa_label(&self, _isa: Isa, _case: &Case) -> String {
        "stream".into()
    }
    fn is_attention(&self) -> bool {
        false
    }
    fn skip(&self, case: &Case) -> Option<String> {
        (case.lq > 16).then(|| "only for decode shapes (Lq ≤ 16)".to_string())
    }
    fn run(&self, _case: &Case, inp: &Inputs, out: &mut [f32], _isa: Isa) {
        use rayon::prelude::*;
        let share = |n: usize| n.div_ceil(rayon::current_num_threads()).max(64);
        let total: f32 = inp
            .k
            .par_chunks(share(inp.k.len()))
            .chain(inp.v.par_chunks(share(inp.v.len())))
            .map(stream_sum)
            .sum();
        if let Some(o) = out.first_mut() {
            *o = total;
        }
    }
}

/// The implementation called `name`, `Err(reason)` when this build or this crate cannot run it.
pub fn by_name(name: &str, naive_max_macs: f64) -> Result<Box<dyn Impl>, String> {
    match name {
        "fused" => Ok(Box::new(Fused("fused", Kernel::Auto))),
        "fused-prefill" => Ok(Box::new(Fused("fused-prefill", Kernel::Prefill))),
        "fused-decode" => Ok(Box::new(Fused("fused-decode", Kernel::Decode))),
        "fused-paged" if modifiers().paged.is_none() => {
            Err("fused-paged: give the page length with --paged PAGE".into())
        }
        "fused-paged" => Ok(Box::new(FusedPaged)),
        "fused-backward" => Ok(Box::new(FusedBackward)),
        "read-kv" => Ok(Box::new(ReadKv)),
        "unfused-mm" => Ok(Box::new(Unfused("unfused-mm", Backend::MatrixMultiply))),
        #[cfg(feature = "blas")]
        "unfused-blas" => Ok(Box::new(Unfused("unfused-blas", Backend::Blas))),
        #[cfg(not(feature = "blas"))]
        "unfused-blas" => {
            Err("unfused-blas: this binary was built without `--features blas`".into())
        }
        "naive" => Ok(Box::new(Naive {
            max_macs: naive_max_macs,
        })),
        n if LAYERS.contains(&n) => Err(format!(
            "{n}: the layers are measured by `cargo run --release --example layers_bench`"
        )),
        n => Err(format!(
            "unknown implementation {n:?}; known: {}",
            NAMES.join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names this build cannot run are errors that say why (main turns them into a failed run).
    #[test]
    fn unavailable_implementations_are_errors() {
        for name in LAYERS {
            let e = by_name(name, 0.0).err().expect(name);
            assert!(e.contains("layers_bench"), "{e}");
        }
        assert_eq!(by_name("unfused-blas", 0.0).is_ok(), cfg!(feature = "blas"));
        assert!(by_name("fast", 0.0).err().unwrap().contains("unknown"));
    }

    /// Every implementation agrees with the others on a small case, causal and not.
    #[test]
    fn implementations_agree() {
        let isa = Isa::detect().unwrap();
        for causal in [false, true] {
            let case = Case::new(2, 4, 33, 33, 16, causal);
            let inp = Inputs::new(&case, 7, false);
            let mut want = vec![0.0; case.q_len()];
            Naive {
                max_macs: f64::INFINITY,
            }
            .run(&case, &inp, &mut want, isa);
            for name in NAMES {
                let Ok(imp) = by_name(name, f64::INFINITY) else {
                    continue;
                };
                if !imp.is_attention() {
                    continue;
                }
                let mut got = vec![f32::NAN; case.q_len()];
                imp.run(&case, &inp, &mut got, isa);
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(err < 1e-4, "{name} causal={causal}: max error {err}");
            }
        }
    }

    /// `read-kv` reads every float of K and V, whatever the pool size.
    #[test]
    fn read_kv_sums_everything() {
        let case = Case {
            hkv: 2,
            ..Case::new(1, 4, 1, 1000, 16, false)
        };
        let inp = Inputs::new(&case, 3, false);
        let want: f64 = inp.k.iter().chain(inp.v.iter()).map(|&x| x as f64).sum();
        for t in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap();
            let mut out = vec![0.0; case.q_len()];
            pool.install(|| ReadKv.run(&case, &inp, &mut out, Isa::Scalar));
            assert!(
                (out[0] as f64 - want).abs() < 1e-2,
                "{t}: {} vs {want}",
                out[0]
            );
        }
        assert!(ReadKv.skip(&Case::new(1, 4, 64, 64, 16, false)).is_some());
    }

    #[test]
    fn inputs_are_deterministic() {
        let case = Case::new(1, 2, 8, 8, 4, false);
        let (a, b) = (Inputs::new(&case, 1, false), Inputs::new(&case, 1, true));
        assert_eq!(a.q[..], b.q[..]);
        assert_eq!(a.k.as_ptr() as usize % 64, 0);
        assert!(a.q.iter().all(|x| (-1.0..1.0).contains(x)));
        assert_ne!(a.q[..], Inputs::new(&case, 2, false).q[..]);
    }
}
