//! Fuzzes `KvCache`: construction with small or wild sizes, then a sequence of `append`,
//! `truncate`, `truncate_all` and `attend` calls decoded from the input, against a shadow model
//! of what the cache must hold.
//!
//! Checked: construction succeeds for small caches and fails (never aborts) for sizes that
//! overflow or that the allocator refuses; each call refuses every deliberately invalid input
//! and accepts every valid one; a refused call changes nothing (lengths and the `keys()` /
//! `values()` contents); the cached rows equal the appended ones; `attend` matches the f64
//! reference over the shadow's rows, writes only its output view, and agrees bit for bit
//! between `Par::Seq` and `Par::Rayon`.
#![no_main]

use arbitrary::{Result, Unstructured};
use attnkit::{sdpa_vec, Causal, Isa, Kernel, KvCache, MaskRef, Par, SdpaOptions, Tensor};
use attnkit_fuzz::alloc::ALLOC_LIMIT;
use attnkit_fuzz::expect::Expect;
use attnkit_fuzz::gen::{chance, product, size, small, wild, Rng};
use attnkit_fuzz::operand::{assert_same_bits, assert_untouched, Budget, Operand, Role};
use attnkit_fuzz::problem::{perturb, Dims, OptSpec, ALL_DIMS, MAX_LEN, MAX_WORK};
use attnkit_fuzz::reference::Spec;
use libfuzzer_sys::fuzz_target;

/// Caches at most this large (keys, values and lengths) are built and exercised.
const SMALL_BYTES: usize = 4 << 20;
/// Calls per input.
const MAX_OPS: usize = 16;
/// Largest view (elements, and `B·H·L²·W` gather work) whose contents are compared.
const MAX_VIEW: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let _ = run(&mut u);
});

fn run(u: &mut Unstructured) -> Result<()> {
    let Some(mut fx) = Fixture::new(u)? else {
        return Ok(());
    };
    for _ in 0..MAX_OPS {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=4)? {
            0 | 1 => fx.append(u)?,
            2 => fx.truncate(u)?,
            3 => fx.truncate_all(u)?,
            _ => fx.attend(u)?,
        }
    }
    fx.verify_rows();
    Ok(())
}

/// The sizes of a cache.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    b: usize,
    hkv: usize,
    cap: usize,
    d: usize,
    dv: usize,
}

/// What constructing a cache of these sizes must do.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Small: must succeed (unless a product only a zero size hides overflows).
    Build { hidden_overflow: bool },
    /// A buffer size overflows, or the allocator refuses it: must fail.
    Refuse,
    /// Valid but big: not built (slow, and not what this target is about).
    Skip,
}

impl Sizes {
    fn decode(u: &mut Unstructured) -> Result<Self> {
        let odds = if chance(u, 1, 4)? { 3 } else { 0 };
        Ok(Sizes {
            b: size(u, 4, odds)?,
            hkv: size(u, 4, odds)?,
            cap: size(u, 48, odds)?,
            d: size(u, 40, odds)?,
            dv: size(u, 40, odds)?,
        })
    }

    fn verdict(&self) -> Verdict {
        let Sizes { b, hkv, cap, d, dv } = *self;
        let bytes = |n: Option<usize>, unit: usize| {
            n.and_then(|n| n.checked_mul(unit))
                .filter(|&x| x <= isize::MAX as usize)
        };
        let buffers = [
            bytes(product(&[b, hkv, cap, d]), 4),
            bytes(product(&[b, hkv, cap, dv]), 4),
            bytes(Some(b), 8),
        ];
        let Some(buffers) = buffers.into_iter().collect::<Option<Vec<_>>>() else {
            return Verdict::Refuse;
        };
        let total = buffers.iter().try_fold(0usize, |a, &x| a.checked_add(x));
        if total.is_some_and(|t| t <= SMALL_BYTES) {
            // Products a zero dimension hides from the buffer sizes (strides, row counts).
            let hidden: [&[usize]; 5] = [
                &[b, hkv, cap],
                &[hkv, cap, d],
                &[cap, d],
                &[hkv, cap, dv],
                &[cap, dv],
            ];
            let hidden_overflow = hidden.iter().any(|&dims| bytes(product(dims), 1).is_none());
            Verdict::Build { hidden_overflow }
        } else if buffers.iter().any(|&x| x > ALLOC_LIMIT) {
            Verdict::Refuse
        } else {
            Verdict::Skip
        }
    }
}

/// The cache under test and its shadow: lengths and every row appended, laid out as
/// `(B, Hkv, cap, ·)`.
struct Fixture {
    cache: KvCache,
    s: Sizes,
    lens: Vec<usize>,
    k: Vec<f32>,
    v: Vec<f32>,
    rng: Rng,
    wild: bool,
}

/// What must survive a refused call.
#[derive(Debug, PartialEq)]
struct Snapshot {
    lens: Vec<usize>,
    keys: Option<Vec<f32>>,
    values: Option<Vec<f32>>,
}

impl Fixture {
    /// Builds a cache, checking the outcome; `None` unless it was built and is small.
    fn new(u: &mut Unstructured) -> Result<Option<Self>> {
        let s = Sizes::decode(u)?;
        let verdict = s.verdict();
        let mut expect = Expect::default();
        match verdict {
            Verdict::Skip => return Ok(None),
            Verdict::Refuse => expect.fault("cache buffers that overflow or cannot be allocated"),
            Verdict::Build {
                hidden_overflow: true,
            } => expect.unsure("a product hidden by a zero"),
            Verdict::Build { .. } => {}
        }
        let res = KvCache::new(s.b, s.hkv, s.cap, s.d, s.dv);
        expect.check("KvCache::new", &res);
        let Ok(cache) = res else { return Ok(None) };
        assert_eq!(cache.lens(), vec![0; s.b], "a new cache's lengths");
        assert_eq!(cache.capacity(), s.cap, "capacity()");
        let rows = s.b * s.hkv * s.cap;
        Ok(Some(Fixture {
            cache,
            s,
            lens: vec![0; s.b],
            k: vec![0.0; rows * s.d],
            v: vec![0.0; rows * s.dv],
            rng: Rng::decode(u)?,
            wild: s.b.max(s.hkv).max(s.cap).max(s.d).max(s.dv) > 64,
        }))
    }

    fn budget(&self) -> Budget {
        Budget {
            max_len: MAX_LEN,
            wild_strides: self.wild,
        }
    }

    /// Appends `T` tokens from views of maybe-wrong shapes, strides and lengths.
    fn append(&mut self, u: &mut Unstructured) -> Result<()> {
        let Sizes { b, hkv, cap, d, dv } = self.s;
        let room = self.lens.iter().map(|&l| cap - l).min().unwrap_or(cap);
        let t = if chance(u, 1, 8)? {
            wild(u)?
        } else {
            u.int_in_range(0..=room.saturating_add(1).min(64))?
        };
        let mut expect = Expect::default();
        let (budget, rng) = (self.budget(), &mut self.rng);
        let kshape = perturb(u, [b, hkv, t, d], ALL_DIMS, &mut expect)?;
        let k = Operand::decode(u, kshape, Role::Input, budget, rng, &mut expect)?;
        let vshape = perturb(u, [b, hkv, t, dv], ALL_DIMS, &mut expect)?;
        let v = Operand::decode(u, vshape, Role::Input, budget, rng, &mut expect)?;
        if t > room && b > 0 {
            expect.fault("appending past the capacity");
        }
        let before = self.snapshot();
        let res = self.cache.append(&k.tensor(), &v.tensor());
        expect.check("KvCache::append", &res);
        match res {
            Ok(()) => {
                self.record_append(&k, &v, t);
                self.verify_rows();
            }
            Err(_) => self.assert_unchanged(&before, "append"),
        }
        Ok(())
    }

    /// The shadow's side of a successful append.
    fn record_append(&mut self, k: &Operand, v: &Operand, t: usize) {
        let Sizes {
            hkv, cap, d, dv, ..
        } = self.s;
        if d != 0 || dv != 0 {
            for (b, &len) in self.lens.iter().enumerate() {
                for h in 0..hkv {
                    for i in 0..t {
                        let row = (b * hkv + h) * cap + len + i;
                        for x in 0..d {
                            self.k[row * d + x] = k.at(b, h, i, x) as f32;
                        }
                        for x in 0..dv {
                            self.v[row * dv + x] = v.at(b, h, i, x) as f32;
                        }
                    }
                }
            }
        }
        self.lens.iter_mut().for_each(|l| *l += t);
    }

    fn truncate(&mut self, u: &mut Unstructured) -> Result<()> {
        let batch = if chance(u, 1, 8)? {
            wild(u)?
        } else {
            u.int_in_range(0..=self.s.b)?
        };
        let cur = self.lens.get(batch).copied();
        let len = if chance(u, 1, 8)? {
            wild(u)?
        } else {
            u.int_in_range(0..=cur.unwrap_or(0).saturating_add(1))?
        };
        let mut expect = Expect::default();
        if cur.is_none_or(|c| len > c) {
            expect.fault("a batch index or length out of range");
        }
        let before = self.snapshot();
        let res = self.cache.truncate(batch, len);
        expect.check("KvCache::truncate", &res);
        match res {
            Ok(()) => self.lens[batch] = len,
            Err(_) => self.assert_unchanged(&before, "truncate"),
        }
        assert_eq!(self.cache.lens(), self.lens, "lens() after truncate");
        Ok(())
    }

    fn truncate_all(&mut self, u: &mut Unstructured) -> Result<()> {
        let len = if chance(u, 1, 8)? {
            wild(u)?
        } else {
            small(u, 64)?
        };
        self.cache.truncate_all(len);
        self.lens.iter_mut().for_each(|l| *l = (*l).min(len));
        assert_eq!(self.cache.lens(), self.lens, "lens() after truncate_all");
        Ok(())
    }

    /// Attention of new queries over the cache.
    fn attend(&mut self, u: &mut Unstructured) -> Result<()> {
        let Sizes { b, hkv, d, dv, .. } = self.s;
        let hq = if chance(u, 7, 8)? {
            hkv.saturating_mul(u.int_in_range(1..=4)?)
        } else {
            small(u, 16)?
        };
        let lk = self.lens.iter().copied().max().unwrap_or(0);
        let dims = Dims {
            b,
            hq,
            hkv,
            lq: small(u, 12)?,
            lk,
            d,
            dv,
        };
        let work = dims.work().filter(|&w| w <= MAX_WORK);
        if work.is_none() && (d != 0 || dv != 0) {
            return Ok(()); // valid but slow
        }
        let mut expect = Expect::default();
        dims.check_heads(&mut expect);
        // The cache's B and Hkv may be wild (its buffers are empty when D = Dv = 0): counts of
        // heads, rows and tasks past `isize::MAX` are refused even though no buffer is that
        // large (attnkit bounds every size product by `isize::MAX`).
        let counts = [
            &[b, hq][..],
            &[b, hq, dims.lq],
            &[b, hkv, lk],
            &[dims.lq, lk],
        ];
        if counts
            .iter()
            .any(|c| product(c).is_none_or(|n| n > isize::MAX as usize))
        {
            expect.fault("head, row or task counts past isize::MAX");
        }
        let (budget, rng) = (self.budget(), &mut self.rng);
        let qshape = perturb(u, dims.q(), ALL_DIMS, &mut expect)?;
        let q = Operand::decode(u, qshape, Role::Input, budget, rng, &mut expect)?;
        let oshape = perturb(u, dims.out(), ALL_DIMS, &mut expect)?;
        let out = Operand::decode_output(u, oshape, budget, rng, &mut expect)?;
        let opts = OptSpec::decode(u, &dims, true, rng, &mut expect, budget.max_len)?;

        let (res, got) = self.call_attend(&q, &out, &opts, opts.par);
        expect.check("KvCache::attend", &res);
        if res.is_err() {
            assert_untouched("out", &got);
            return Ok(());
        }
        out.assert_written(&got);
        if work.is_some() && opts.reference_applies(d) {
            let spec = Spec {
                dims,
                scale: opts.scale_for(d),
                causal: Some(Causal::BottomRight),
                window: opts.window,
                key_lengths: Some(&self.lens),
                mask: opts.mask.as_ref(),
                alibi: opts.alibi.as_deref(),
                softcap: opts.softcap,
                sinks: opts.sinks.as_deref(),
            };
            let row = |b: usize, h: usize, j: usize| (b * hkv + h) * self.s.cap + j;
            let want = spec.attention(
                |b, h, i, x| q.at(b, h, i, x),
                |b, h, j, x| f64::from(self.k[row(b, h, j) * d + x]),
                |b, h, j, x| f64::from(self.v[row(b, h, j) * dv + x]),
            );
            want.check_out("attend", |b, h, i, x| got[out.row(b, h, i) + x]);
        }
        let other = if opts.par == Par::Seq {
            Par::Rayon
        } else {
            Par::Seq
        };
        let (res, again) = self.call_attend(&q, &out, &opts, other);
        assert!(res.is_ok(), "attend with Par::{other:?} refused: {res:?}");
        assert_same_bits("attend: Par::Seq vs Par::Rayon", &got, &again);
        Ok(())
    }

    /// `attend` into a copy of `out`'s buffer.
    fn call_attend(
        &self,
        q: &Operand,
        out: &Operand,
        opts: &OptSpec,
        par: Par,
    ) -> (attnkit::Result<()>, Vec<f32>) {
        let mut out = out.clone();
        let res = self
            .cache
            .attend(&q.tensor(), &mut out.tensor_mut(), &opts.options(par));
        (res, out.data)
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            lens: self.cache.lens().to_vec(),
            keys: read_view(&self.cache.keys()),
            values: read_view(&self.cache.values()),
        }
    }

    fn assert_unchanged(&self, before: &Snapshot, what: &str) {
        let after = self.snapshot();
        assert_eq!(before.lens, after.lens, "a refused {what} changed lens()");
        for (name, a, b) in [
            ("keys()", &before.keys, &after.keys),
            ("values()", &before.values, &after.values),
        ] {
            if let (Some(a), Some(b)) = (a, b) {
                assert_same_bits(&format!("a refused {what} changed {name}"), a, b);
            }
        }
    }

    /// The cached rows of every sequence equal the shadow's.
    fn verify_rows(&self) {
        assert_eq!(self.cache.lens(), self.lens, "lens()");
        let Sizes { hkv, cap, .. } = self.s;
        let views = [
            (self.cache.keys(), &self.k, self.s.d, "keys()"),
            (self.cache.values(), &self.v, self.s.dv, "values()"),
        ];
        for (view, shadow, w, name) in views {
            let Some(got) = read_view(&view).filter(|g| !g.is_empty()) else {
                continue; // too large to read, or empty (B, Hkv, L or W = 0, however large the rest)
            };
            let l = view.shape()[2];
            for (b, &len) in self.lens.iter().enumerate() {
                for h in 0..hkv {
                    for j in 0..len {
                        let (g, s) = (((b * hkv + h) * l + j) * w, ((b * hkv + h) * cap + j) * w);
                        for x in 0..w {
                            let (got, want) = (got[g + x], shadow[s + x]);
                            let ok = (got - want).abs() <= 1e-6 * (1.0 + want.abs());
                            assert!(ok, "{name}[{b}, {h}, {j}, {x}] = {got}, appended {want}");
                        }
                    }
                }
            }
        }
    }
}

/// The contents of a `(B, H, L, W)` view, dense, if small. The view's fields are private, so
/// they are read through attention itself: empty queries and keys (D = 0) with an identity
/// mask give each query row exactly one visible key, whose value row is the output.
fn read_view(view: &Tensor) -> Option<Vec<f32>> {
    let [b, h, l, w] = view.shape();
    let gather = product(&[b, h, l, l, w]).filter(|&n| n <= MAX_VIEW)?;
    if gather == 0 {
        return Some(Vec::new());
    }
    let eye: Vec<bool> = (0..l * l).map(|n| n / l == n % l).collect();
    let empty = Tensor::bhld(&[0.0f32; 0], [b, h, l, 0]);
    let opts = SdpaOptions::new()
        .bool_mask(MaskRef::new(&eye, [1, 1, l, l]))
        .kernel(Kernel::Prefill)
        .isa(Isa::Scalar)
        .par(Par::Seq);
    Some(sdpa_vec(&empty, &empty, view, &opts).expect("reading a cache view through sdpa"))
}
