//! Fuzzes `PagedKvCache`: a small pool of any storage type, then up to 24 of `add_sequence`,
//! `fork`, `free`, `truncate`, `append` (sequence lists with unknown or repeated ids, wrong
//! shapes, more tokens than the pool has pages for, NaN into int8) and `attend`, against a
//! shadow model holding every live sequence's tokens.
//!
//! Checked: each call refuses exactly the invalid inputs, with the error the first fault
//! names; a refused call changes nothing (lengths, page tables, free pages, attention); the
//! pool's pages are either free or used, and a sequence holds `⌈len / page_len⌉` of them;
//! `attend` equals, bit for bit, a contiguous `KvCache` of the same type holding the shadow's
//! tokens, under `Par::Seq` and `Par::Rayon`.
#![no_main]

use arbitrary::{Result, Unstructured};
use attnkit::{
    bf16, f16, AttnError, Kernel, KvCache, Operand, PagedKvCache, Par, SdpaOptions, SeqId, Tensor,
    TensorMut,
};
use attnkit_fuzz::gen::{chance, small, Rng};
use libfuzzer_sys::fuzz_target;
use std::collections::{BTreeMap, BTreeSet};

const MAX_OPS: usize = 24;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let _ = match u.int_in_range(0..=3u8) {
        Ok(0) => run::<f32>(&mut u),
        Ok(1) => run::<bf16>(&mut u),
        Ok(2) => run::<f16>(&mut u),
        Ok(_) => run::<i8>(&mut u),
        Err(_) => Ok(()),
    };
});

/// A sequence's tokens as appended (f32, before rounding: a contiguous cache of the same type
/// rounds them the same way): `k[t]` holds token `t`'s `Hkv × D` keys.
#[derive(Clone, Default)]
struct Shadow {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

struct Fx<E: Operand> {
    c: PagedKvCache<E>,
    hkv: usize,
    d: usize,
    dv: usize,
    page: usize,
    live: BTreeMap<SeqId, Shadow>,
    dead: Vec<SeqId>,
    rng: Rng,
}

/// Everything a refused call must leave as it was.
#[derive(PartialEq, Debug)]
struct State {
    free: usize,
    seqs: Vec<(SeqId, usize, Vec<u32>)>,
}

fn run<E: Operand>(u: &mut Unstructured) -> Result<()> {
    let hkv = small(u, 3)?;
    let (d, dv) = (small(u, 20)?, small(u, 20)?);
    let page = 1usize << u.int_in_range(0..=4u32)?;
    let pages = small(u, 24)?;
    let c = PagedKvCache::<E>::new_of(hkv, d, dv, page, pages).expect("a small pool");
    let mut fx = Fx {
        c,
        hkv,
        d,
        dv,
        page,
        live: BTreeMap::new(),
        dead: Vec::new(),
        rng: Rng::decode(u)?,
    };
    if chance(u, 1, 2)? {
        // Scatter the pool: a rotation of the free list.
        let n = fx.c.free_pages();
        let r = small(u, n.max(1))?;
        let order: Vec<usize> = (0..n).map(|i| (i + r) % n).collect();
        fx.c.shuffle_free_pages(&order).expect("a permutation");
    }
    for _ in 0..MAX_OPS {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=7u8)? {
            0 => {
                let id = fx.c.add_sequence();
                fx.live.insert(id, Shadow::default());
            }
            1 => fx.fork(u)?,
            2 => fx.free(u)?,
            3 => fx.truncate(u)?,
            4 | 5 => fx.append(u)?,
            _ => fx.attend(u)?,
        }
        fx.check_pool();
    }
    Ok(())
}

impl<E: Operand> Fx<E> {
    fn state(&self) -> State {
        State {
            free: self.c.free_pages(),
            seqs: self
                .live
                .keys()
                .map(|&s| {
                    (
                        s,
                        self.c.len(s).unwrap(),
                        self.c.pages_of(s).unwrap().to_vec(),
                    )
                })
                .collect(),
        }
    }

    /// A live or (sometimes, or when none lives) a freed or never-made sequence.
    fn pick(&mut self, u: &mut Unstructured) -> Result<(SeqId, bool)> {
        if !self.live.is_empty() && !chance(u, 1, 6)? {
            let i = u.choose_index(self.live.len())?;
            return Ok((*self.live.keys().nth(i).unwrap(), true));
        }
        if !self.dead.is_empty() && chance(u, 1, 2)? {
            return Ok((*u.choose(&self.dead)?, false));
        }
        // A never-made id: past every id made so far.
        let probe = self.c.add_sequence();
        self.c.free(probe).unwrap();
        self.dead.push(probe);
        Ok((probe, false))
    }

    fn fork(&mut self, u: &mut Unstructured) -> Result<()> {
        let (s, live) = self.pick(u)?;
        let before = self.state();
        match self.c.fork(s) {
            Ok(n) => {
                assert!(live, "fork of a dead sequence accepted");
                let shadow = self.live[&s].clone();
                assert_eq!(self.c.pages_of(n).unwrap(), self.c.pages_of(s).unwrap());
                self.live.insert(n, shadow);
            }
            Err(e) => {
                assert!(!live, "fork refused: {e}");
                assert!(matches!(e, AttnError::UnknownSequence { .. }), "{e:?}");
                assert_eq!(self.state(), before);
            }
        }
        Ok(())
    }

    fn free(&mut self, u: &mut Unstructured) -> Result<()> {
        let (s, live) = self.pick(u)?;
        let before = self.state();
        match self.c.free(s) {
            Ok(()) => {
                assert!(live, "free of a dead sequence accepted");
                self.live.remove(&s);
                self.dead.push(s);
            }
            Err(e) => {
                assert!(
                    !live && matches!(e, AttnError::UnknownSequence { .. }),
                    "{e:?}"
                );
                assert_eq!(self.state(), before);
            }
        }
        Ok(())
    }

    fn truncate(&mut self, u: &mut Unstructured) -> Result<()> {
        let (s, live) = self.pick(u)?;
        let have = self.live.get(&s).map_or(0, |x| x.k.len());
        let len = small(u, have + 2)?;
        let before = self.state();
        match self.c.truncate(s, len) {
            Ok(()) => {
                assert!(live && len <= have, "truncate of {len} of {have} accepted");
                let x = self.live.get_mut(&s).unwrap();
                x.k.truncate(len);
                x.v.truncate(len);
            }
            Err(e) => {
                let want = !live && matches!(e, AttnError::UnknownSequence { .. })
                    || live && len > have && matches!(e, AttnError::KeyLength { .. });
                assert!(want, "{e:?}");
                assert_eq!(self.state(), before);
            }
        }
        Ok(())
    }

    /// Pages an append of `t` tokens to each of `seqs` must take (all live, distinct).
    fn pages_needed(&self, seqs: &[SeqId], t: usize) -> usize {
        if t == 0 {
            return 0;
        }
        let mut users: BTreeMap<u32, usize> = BTreeMap::new();
        for &s in self.live.keys() {
            for &p in self.c.pages_of(s).unwrap() {
                *users.entry(p).or_default() += 1;
            }
        }
        seqs.iter()
            .map(|&s| {
                let len = self.live[&s].k.len();
                let pages = self.c.pages_of(s).unwrap();
                let shared_tail =
                    !len.is_multiple_of(self.page) && pages.last().is_some_and(|p| users[p] > 1);
                (len + t).div_ceil(self.page) - pages.len() + usize::from(shared_tail)
            })
            .sum()
    }

    fn append(&mut self, u: &mut Unstructured) -> Result<()> {
        let n = small(u, 3)?;
        let mut seqs = Vec::with_capacity(n);
        // The first fault in list order: an unknown id, or one named before.
        let (mut unknown, mut repeated) = (false, false);
        for _ in 0..n {
            let (s, live) = self.pick(u)?;
            if !unknown && !repeated {
                unknown = !live;
                repeated = live && seqs.contains(&s);
            }
            seqs.push(s);
        }
        let t = small(u, 9)?;
        let wrong_d = chance(u, 1, 10)?;
        let d = if wrong_d { self.d + 1 } else { self.d };
        let k = self.rng.values(n * self.hkv * t * d);
        let mut v = self.rng.values(n * self.hkv * t * self.dv);
        let nan = chance(u, 1, 10)? && !v.is_empty();
        if nan {
            let i = u.choose_index(v.len())?;
            v[i] = f32::NAN;
        }
        let (ks, vs) = ([n, self.hkv, t, d], [n, self.hkv, t, self.dv]);
        let before = self.state();
        let pool = !unknown && !repeated && !wrong_d;
        let needed = if pool { self.pages_needed(&seqs, t) } else { 0 };
        let refused_nan = nan && E::DTYPE == attnkit::Dtype::I8;
        match self
            .c
            .append(&seqs, &Tensor::bhld(&k, ks), &Tensor::bhld(&v, vs))
        {
            Ok(()) => {
                assert!(
                    pool && needed <= before.free && !refused_nan,
                    "append accepted"
                );
                for (b, s) in seqs.iter().enumerate() {
                    let x = self.live.get_mut(s).unwrap();
                    for i in 0..t {
                        let rows = |src: &[f32], w: usize| -> Vec<f32> {
                            (0..self.hkv)
                                .flat_map(|h| {
                                    let o = ((b * self.hkv + h) * t + i) * w;
                                    src[o..o + w].to_vec()
                                })
                                .collect()
                        };
                        x.k.push(rows(&k, d));
                        x.v.push(rows(&v, self.dv));
                    }
                }
            }
            Err(e) => {
                let want = if unknown {
                    matches!(e, AttnError::UnknownSequence { .. })
                } else if repeated {
                    matches!(e, AttnError::BadParam { arg: "seqs", .. })
                } else if wrong_d {
                    matches!(
                        e,
                        AttnError::ShapeMismatch {
                            arg: "k",
                            dim: "D",
                            ..
                        }
                    )
                } else if needed > before.free {
                    e == AttnError::PoolExhausted {
                        needed,
                        free: before.free,
                    }
                } else {
                    refused_nan && matches!(e, AttnError::NonFinite { arg: "v", .. })
                };
                assert!(want, "{e:?} (needed {needed}, free {})", before.free);
                assert_eq!(self.state(), before);
            }
        }
        Ok(())
    }

    fn attend(&mut self, u: &mut Unstructured) -> Result<()> {
        let n = small(u, 3)?;
        let mut seqs = Vec::with_capacity(n);
        let mut unknown = false;
        for _ in 0..n {
            let (s, live) = self.pick(u)?;
            unknown |= !live;
            seqs.push(s);
        }
        let hq = self.hkv * (1 + small(u, 2)?);
        let lq = 1 + small(u, 2)?;
        let window = chance(u, 1, 4)?.then(|| 1 + small(u, 20).unwrap_or(0));
        let q = self.rng.values(n * hq * lq * self.d);
        let (qs, os) = ([n, hq, lq, self.d], [n, hq, lq, self.dv]);
        let mut opts = SdpaOptions::new();
        if let Some(w) = window {
            opts = opts.window(w);
        }
        // Both kernels read pages; each run is compared with the same kernel on a contiguous
        // cache (the kernel is not drawn from the input, so the corpus keeps its meaning).
        const KERNELS: [Kernel; 2] = [Kernel::Decode, Kernel::Prefill];
        let mut outs = Vec::new();
        for (kernel, par) in KERNELS
            .into_iter()
            .flat_map(|k| [Par::Seq, Par::Rayon].map(|p| (k, p)))
        {
            let mut out = vec![f32::NAN; n * hq * lq * self.dv];
            let r = self.c.attend(
                &seqs,
                &Tensor::bhld(&q, qs),
                &mut TensorMut::bhld(&mut out, os),
                &opts.par(par).kernel(kernel),
            );
            match r {
                Ok(()) => assert!(!unknown, "attend of a dead sequence accepted"),
                Err(e) => {
                    assert!(
                        unknown && matches!(e, AttnError::UnknownSequence { .. }),
                        "{e:?}"
                    );
                    assert!(out.iter().all(|x| x.is_nan()), "a refused attend wrote");
                    return Ok(());
                }
            }
            outs.push((kernel, out));
        }
        // The same tokens in a contiguous cache of the same type.
        let lens: Vec<usize> = seqs.iter().map(|s| self.live[s].k.len()).collect();
        let l = lens.iter().copied().max().unwrap_or(0);
        let mut flat = KvCache::<E>::new_of(n, self.hkv, l.max(1), self.d, self.dv).unwrap();
        let dense = |w: usize, pick: &dyn Fn(&Shadow) -> &Vec<Vec<f32>>| -> Vec<f32> {
            let mut x = vec![0.0f32; n * self.hkv * l * w];
            for (b, s) in seqs.iter().enumerate() {
                for (j, row) in pick(&self.live[s]).iter().enumerate() {
                    for h in 0..self.hkv {
                        let o = ((b * self.hkv + h) * l + j) * w;
                        x[o..o + w].copy_from_slice(&row[h * w..(h + 1) * w]);
                    }
                }
            }
            x
        };
        let (k, v) = (dense(self.d, &|x| &x.k), dense(self.dv, &|x| &x.v));
        flat.append(
            &Tensor::bhld(&k, [n, self.hkv, l, self.d]),
            &Tensor::bhld(&v, [n, self.hkv, l, self.dv]),
        )
        .unwrap();
        for (b, &len) in lens.iter().enumerate() {
            flat.truncate(b, len).unwrap();
        }
        for kernel in KERNELS {
            let mut want = vec![f32::NAN; n * hq * lq * self.dv];
            flat.attend(
                &Tensor::bhld(&q, qs),
                &mut TensorMut::bhld(&mut want, os),
                &opts.kernel(kernel),
            )
            .unwrap();
            for (_, out) in outs.iter().filter(|(k, _)| *k == kernel) {
                let same = out
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "paged attend ({kernel:?}) differs from the contiguous cache: lens {lens:?}"
                );
            }
        }
        Ok(())
    }

    /// Pages are free or used; each live sequence holds exactly the pages its length needs.
    fn check_pool(&self) {
        let mut used = BTreeSet::new();
        for (&s, x) in &self.live {
            let pages = self.c.pages_of(s).unwrap();
            assert_eq!(self.c.len(s).unwrap(), x.k.len());
            assert_eq!(pages.len(), x.k.len().div_ceil(self.page));
            used.extend(pages.iter().copied());
        }
        assert_eq!(used.len() + self.c.free_pages(), self.c.total_pages());
    }
}
