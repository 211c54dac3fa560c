//! A paged key/value cache (vLLM's block table): keys and values of many sequences live in
//! fixed-size pages of one shared pool, each sequence has a page table, and sequences can share
//! pages (a common prompt, beam-search branches) until one of them writes.

use crate::alloc::{checked_len, try_zeros};
use crate::error::{AttnError, Result};
use crate::kv_cache::{append_row, check_append, check_finite};
use crate::options::{Causal, Extras, KeyLengths, SdpaOptions};
use crate::pages::AlignedBuf;
use crate::plan::{PagedKv, Plan};
use crate::view::{Tensor, TensorMut};
use attnkit_kernels::{Dtype, Elem, Operand};
use std::collections::HashMap;

/// A sequence of a [`PagedKvCache`]. Ids are never reused: one that outlives
/// [`free`](PagedKvCache::free) is refused ([`AttnError::UnknownSequence`]), not aliased.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(u64);

impl SeqId {
    /// The id as a number (for messages and maps).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// A sequence's pages, in token order, and its length.
#[derive(Clone, Debug, Default)]
struct Seq {
    pages: Vec<u32>,
    len: usize,
}

/// One layer's paged cache: a pool of `pages` pages of `page_len` tokens each, shared by any
/// number of sequences, each with `hkv` KV heads of head dims `d` (keys) and `dv` (values).
///
/// **Layout.** A page holds `page_len` consecutive tokens of one sequence for every KV head: per
/// head its `page_len` K rows, then its `page_len` V rows, back to back (`(pages, Hkv, K rows |
/// V rows)`; int8 scales likewise, `(pages, Hkv, K scales | V scales)`), so the decode kernel
/// streams a page per head as it would a contiguous cache. K and V side by side make one run
/// of memory per page and head where separate pools made two: pages lie scattered in the pool,
/// and on the Zen 2 VM a plain read of scattered runs of 2 KiB (int8 rows, 16-token pages) ran
/// at 0.71 of a contiguous read and of 8 KiB at 0.89, of 4 and 16 KiB at 0.87 and 0.98
/// (docs/tuning-log.md, "Decode walks"). Sequence `s`'s token `j` is in its page
/// `j / page_len`. `page_len` is a power of two (the kernel finds a key's page by a shift).
///
/// **Pages.** [`append`](Self::append) takes a free page whenever a sequence's last page is
/// full; [`free`](Self::free) and [`truncate`](Self::truncate) return pages no sequence uses any
/// more. [`fork`](Self::fork) makes a sequence that shares every page of another; a shared page
/// is copied the first time either sequence appends into it (copy-on-write of the last, partial
/// page; full pages are never written again, so they stay shared). A pool without enough free
/// pages refuses the append ([`AttnError::PoolExhausted`]); nothing is ever overwritten.
///
/// **Element types.** As [`KvCache`](crate::KvCache): `PagedKvCache` stores f32,
/// `PagedKvCache::<bf16>::new_of(…)`, `f16` or `i8` (a scale per token and head, the same
/// quantisation; rows with NaN or infinity refused).
///
/// **Attention.** [`attend`](Self::attend) reads K and V through the page tables, without
/// gathering the cache: the decode kernel looks each key's page up as it streams; the prefill
/// kernel (long prompts, chosen as for contiguous K and V) reads a key block in place where it
/// lies in one page and gathers it block by block where it straddles pages (pages shorter than
/// its 128-key blocks, or 64 for `D > 128`). Its result equals bit for bit that of a contiguous
/// [`KvCache`](crate::KvCache) holding the same tokens with the same kernel, for any page
/// length and any placement of the pages in the pool. Prefill always uses the f32 products on
/// paged caches (on AMX or AVX-512 BF16 CPUs a contiguous bf16 cache may take the bf16 tile
/// products instead).
///
/// A refused call changes nothing: lengths, pages and contents stay as they were.
#[derive(Clone, Debug)]
pub struct PagedKvCache<E: Operand = f32> {
    hkv: usize,
    d: usize,
    dv: usize,
    page_len: usize,
    shift: u32,
    /// K and V rows: `page_len·(d + dv)` elements per page and head, K's rows first.
    kv: AlignedBuf<E>,
    /// int8 only (else empty): row scales, `2·page_len` per page and head, K's first; on a
    /// cache line, so a page of 16 tokens keeps one head's K scales in one line.
    scales: AlignedBuf<f32>,
    /// Sequences using each page (0: free).
    refs: Vec<u32>,
    /// Free pages, taken from the end.
    free: Vec<u32>,
    seqs: HashMap<u64, Seq>,
    next_id: u64,
}

impl PagedKvCache {
    /// An f32 pool of `pages` pages of `page_len` tokens for `hkv` KV heads of head dims `d`
    /// (keys) and `dv` (values), with no sequences.
    ///
    /// # Errors
    /// [`AttnError::BadParam`] if `page_len` is not a power of two or `pages` exceeds
    /// `u32::MAX`; [`AttnError::Overflow`] if the pool's size overflows; [`AttnError::Alloc`]
    /// if the allocator refuses it (nothing is allocated before the sizes are checked).
    pub fn new(hkv: usize, d: usize, dv: usize, page_len: usize, pages: usize) -> Result<Self> {
        Self::new_of(hkv, d, dv, page_len, pages)
    }
}

impl<E: Operand> PagedKvCache<E> {
    /// [`PagedKvCache::new`] storing `E`: `PagedKvCache::<bf16>::new_of(hkv, d, dv, page_len,
    /// pages)`.
    ///
    /// # Errors
    /// As [`PagedKvCache::new`].
    pub fn new_of(hkv: usize, d: usize, dv: usize, page_len: usize, pages: usize) -> Result<Self> {
        if !page_len.is_power_of_two() {
            return Err(AttnError::BadParam {
                arg: "page_len",
                reason: "must be a power of two (1, 2, 4, …)",
            });
        }
        if u32::try_from(pages).is_err() {
            return Err(AttnError::BadParam {
                arg: "pages",
                reason: "at most u32::MAX pages",
            });
        }
        let arg = "pages";
        // Every product the cache or the kernel forms from these sizes is checked here.
        checked_len(arg, &[pages, page_len])?;
        let rows = checked_len(arg, &[pages, hkv, page_len])?;
        checked_len(arg, &[rows, d])?;
        checked_len(arg, &[rows, dv])?;
        let dkv = d.checked_add(dv).ok_or(AttnError::Overflow { arg })?;
        let kvlen = checked_len(arg, &[rows, dkv])?;
        let nscales = if E::DTYPE == Dtype::I8 {
            checked_len(arg, &[rows, 2])?
        } else {
            0
        };
        let scales = AlignedBuf::try_zeroed_of(nscales, false)?;
        let refs = try_zeros::<u32>(arg, pages)?;
        let mut free = try_zeros::<u32>(arg, pages)?;
        // Taken from the end: page 0 first.
        for (i, p) in free.iter_mut().rev().enumerate() {
            *p = i as u32;
        }
        let kv = AlignedBuf::try_zeroed_of(kvlen, true)?;
        Ok(PagedKvCache {
            hkv,
            d,
            dv,
            page_len,
            shift: page_len.trailing_zeros(),
            kv,
            scales,
            refs,
            free,
            seqs: HashMap::new(),
            next_id: 0,
        })
    }

    /// A new, empty sequence (it takes no page until something is appended).
    pub fn add_sequence(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, Seq::default());
        SeqId(id)
    }

    /// A new sequence holding the same tokens as `seq`, sharing its pages (no copy; see the
    /// type's docs for copy-on-write).
    ///
    /// # Errors
    /// [`AttnError::UnknownSequence`] if `seq` does not exist.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let s = self.seq("seq", seq)?.clone();
        if s.pages.iter().any(|&p| self.refs[p as usize] == u32::MAX) {
            return Err(AttnError::BadParam {
                arg: "seq",
                reason: "a page is already shared by u32::MAX sequences",
            });
        }
        for &p in &s.pages {
            self.refs[p as usize] += 1;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, s);
        Ok(SeqId(id))
    }

    /// Removes `seq`, returning the pages no other sequence shares to the pool.
    ///
    /// # Errors
    /// [`AttnError::UnknownSequence`] if `seq` does not exist (already freed, say).
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        self.seq("seq", seq)?;
        let s = self.seqs.remove(&seq.0).unwrap_or_default();
        self.release(&s.pages);
        Ok(())
    }

    /// Shortens `seq` to `len` tokens (rollback), returning pages past the new end that no other
    /// sequence shares.
    ///
    /// # Errors
    /// [`AttnError::UnknownSequence`]; [`AttnError::KeyLength`] if `len` is longer than the
    /// sequence (`batch` is 0).
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let have = self.seq("seq", seq)?.len;
        if len > have {
            return Err(AttnError::KeyLength {
                batch: 0,
                len,
                lk: have,
            });
        }
        let keep = len.div_ceil(self.page_len);
        let s = self.seqs.get_mut(&seq.0).expect("checked above");
        s.len = len;
        let dropped = s.pages.split_off(keep);
        self.release(&dropped);
        Ok(())
    }

    /// Tokens `seq` holds.
    ///
    /// # Errors
    /// [`AttnError::UnknownSequence`].
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq("seq", seq)?.len)
    }

    /// The pages of `seq`, in token order (indices into the pool; for inspection and tests).
    ///
    /// # Errors
    /// [`AttnError::UnknownSequence`].
    pub fn pages_of(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.seq("seq", seq)?.pages)
    }

    /// Pages not used by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.refs.len()
    }

    /// Tokens per page.
    pub fn page_len(&self) -> usize {
        self.page_len
    }

    /// The storage type.
    pub fn dtype(&self) -> Dtype {
        E::DTYPE
    }

    /// Takes every free page out of the pool and hands them back in the order `order` gives
    /// (a permutation of `0..free_pages()`, applied to the free list as it stands): later
    /// appends then take pages in that order. Placement never changes a result; this exists so
    /// that tests and benchmarks can scatter sequences over the pool as a long-running server's
    /// would be.
    ///
    /// # Errors
    /// [`AttnError::BadParam`] if `order` is not a permutation of `0..free_pages()`.
    pub fn shuffle_free_pages(&mut self, order: &[usize]) -> Result<()> {
        let n = self.free.len();
        let mut seen = vec![false; n];
        if order.len() != n
            || order
                .iter()
                .any(|&i| i >= n || std::mem::replace(&mut seen[i], true))
        {
            return Err(AttnError::BadParam {
                arg: "order",
                reason: "must be a permutation of 0..free_pages()",
            });
        }
        self.free = order.iter().map(|&i| self.free[i]).collect();
        Ok(())
    }

    fn seq(&self, arg: &'static str, seq: SeqId) -> Result<&Seq> {
        self.seqs
            .get(&seq.0)
            .ok_or(AttnError::UnknownSequence { arg, seq: seq.0 })
    }

    /// Drops one reference to each of `pages`; those left unused go back to the pool.
    fn release(&mut self, pages: &[u32]) {
        for &p in pages.iter().rev() {
            let r = &mut self.refs[p as usize];
            *r -= 1;
            if *r == 0 {
                self.free.push(p);
            }
        }
    }

    /// Takes a free page for one more user.
    fn take_page(&mut self) -> u32 {
        let p = self.free.pop().expect("pages counted before any is taken");
        self.refs[p as usize] = 1;
        p
    }

    /// Pages an append of `t` tokens to `s` takes from the pool: new pages past its last, plus
    /// one to copy a shared last page it writes into.
    fn pages_needed(&self, s: &Seq, t: usize) -> usize {
        if t == 0 {
            return 0;
        }
        // `len + t` cannot wrap: `t` rows were validated against a buffer, or the caller's
        // sizes against `isize::MAX` — but saturate anyway, the pool refuses such a length.
        let total = s.len.saturating_add(t).div_ceil(self.page_len);
        let fresh = total - s.pages.len();
        let shared_tail = !s.len.is_multiple_of(self.page_len)
            && s.pages.last().is_some_and(|&p| self.refs[p as usize] > 1);
        fresh + usize::from(shared_tail)
    }

    /// Appends `T` tokens to each sequence of `seqs`: `k (B, Hkv, T, D)`, `v (B, Hkv, T, Dv)`
    /// with `B = seqs.len()`, in any layout and element type, rounded (or quantised) to the
    /// cache's. Nothing is written unless the whole append is accepted.
    ///
    /// # Errors
    /// [`AttnError::UnknownSequence`]; [`AttnError::BadParam`] if a sequence is named twice; a
    /// shape mismatch naming `k`/`v` and the dimension; [`AttnError::PoolExhausted`] if the
    /// pool has too few free pages for the whole append; for int8, [`AttnError::NonFinite`].
    pub fn append<A: Elem>(&mut self, seqs: &[SeqId], k: &Tensor<A>, v: &Tensor<A>) -> Result<()> {
        for (i, &s) in seqs.iter().enumerate() {
            self.seq("seqs", s)?;
            if seqs[..i].contains(&s) {
                return Err(AttnError::BadParam {
                    arg: "seqs",
                    reason: "a sequence appears twice",
                });
            }
        }
        let sizes = [seqs.len(), self.hkv, self.d, self.dv];
        let t = check_append(k, v, sizes)?;
        // With empty rows no buffer bounds T: keep token counts addressable.
        checked_len("k", &[seqs.len(), self.hkv, t])?;
        let needed = seqs
            .iter()
            .map(|s| self.pages_needed(&self.seqs[&s.0], t))
            .fold(0usize, usize::saturating_add);
        if needed > self.free.len() {
            return Err(AttnError::PoolExhausted {
                needed,
                free: self.free.len(),
            });
        }
        if E::DTYPE == Dtype::I8 {
            check_finite(k, v, sizes)?;
        }
        // Accepted: from here on nothing fails.
        if t == 0 {
            return Ok(());
        }
        for (b, &sid) in seqs.iter().enumerate() {
            let mut s = self.seqs.remove(&sid.0).expect("checked above");
            self.unshare_tail(&mut s);
            while s.pages.len() < (s.len + t).div_ceil(self.page_len) {
                let p = self.take_page();
                s.pages.push(p);
            }
            // Empty rows have nothing to write (and then nothing bounds T).
            for i in (0..t).take_while(|_| self.d > 0 || self.dv > 0) {
                let tok = s.len + i;
                let page = s.pages[tok >> self.shift] as usize;
                let slot = tok & (self.page_len - 1);
                for h in 0..self.hkv {
                    // Block (page, h) of the pool: its K rows, then its V rows.
                    let blk = page * self.hkv + h;
                    let base = blk * self.page_len * (self.d + self.dv);
                    let sbase = blk * 2 * self.page_len;
                    if self.d > 0 {
                        let sc = E::encode(
                            append_row(k, self.d, b, h, i),
                            &mut self.kv[base + slot * self.d..][..self.d],
                        );
                        if let Some(x) = self.scales.get_mut(sbase + slot) {
                            *x = sc;
                        }
                    }
                    if self.dv > 0 {
                        let vb = base + self.page_len * self.d;
                        let sc = E::encode(
                            append_row(v, self.dv, b, h, i),
                            &mut self.kv[vb + slot * self.dv..][..self.dv],
                        );
                        if let Some(x) = self.scales.get_mut(sbase + self.page_len + slot) {
                            *x = sc;
                        }
                    }
                }
            }
            s.len += t;
            self.seqs.insert(sid.0, s);
        }
        Ok(())
    }

    /// Gives `s` its own copy of its last page if that page is partly filled and shared (the
    /// append is about to write into it).
    fn unshare_tail(&mut self, s: &mut Seq) {
        let used = s.len % self.page_len;
        let Some(&old) = s.pages.last() else { return };
        if used == 0 || self.refs[old as usize] <= 1 {
            return;
        }
        let new = self.take_page();
        let (old, newu) = (old as usize, new as usize);
        let (p, dkv) = (self.page_len, self.d + self.dv);
        for h in 0..self.hkv {
            let (bo, bn) = (old * self.hkv + h, newu * self.hkv + h);
            // The used K rows, then the used V rows (after the block's `p` K rows).
            let (ko, kn) = (bo * p * dkv, bn * p * dkv);
            self.kv.copy_within(ko..ko + used * self.d, kn);
            let (vo, vn) = (ko + p * self.d, kn + p * self.d);
            self.kv.copy_within(vo..vo + used * self.dv, vn);
            if !self.scales.is_empty() {
                let (so, sn) = (bo * 2 * p, bn * 2 * p);
                self.scales.copy_within(so..so + used, sn);
                self.scales.copy_within(so + p..so + p + used, sn + p);
            }
        }
        self.refs[old] -= 1;
        *s.pages.last_mut().expect("has a last page") = new;
    }

    /// Attention of `q (B, Hq, Lq, D)` for the sequences `seqs` (`B = seqs.len()`; the newest
    /// `Lq` tokens of each, already appended) over their cached tokens: bottom-right causal per
    /// sequence, plus whatever else `opts` sets (window, masks, ALiBi, softcap, sinks, ISA).
    /// Writes `out (B, Hq, Lq, Dv)`, in f32 or the 16-bit types. A sequence may appear more
    /// than once. See the type's docs for how pages are read.
    ///
    /// # Errors
    /// [`AttnError::UnknownSequence`]; otherwise as [`crate::sdpa`].
    pub fn attend<Q: Elem, O: Elem>(
        &self,
        seqs: &[SeqId],
        q: &Tensor<Q>,
        out: &mut TensorMut<O>,
        opts: &SdpaOptions,
    ) -> Result<()> {
        let mut lens = try_zeros::<usize>("seqs", seqs.len())?;
        for (l, &s) in lens.iter_mut().zip(seqs) {
            *l = self.seq("seqs", s)?.len;
        }
        let lk = lens.iter().copied().max().unwrap_or(0);
        let per_seq = lk.div_ceil(self.page_len);
        // Every sequence's table padded to the longest with a page of the pool, so the kernel's
        // lookups for any key < Lk stay in the pool (keys past a sequence's length are masked,
        // never read for their values).
        let table_len = checked_len("seqs", &[seqs.len(), per_seq])?;
        let mut table = try_zeros::<u32>("seqs", table_len)?;
        for (row, &s) in table.chunks_exact_mut(per_seq.max(1)).zip(seqs) {
            let pages = &self.seqs[&s.0].pages;
            let pad = pages.first().copied().unwrap_or(0);
            for (i, x) in row.iter_mut().enumerate() {
                *x = pages.get(i).copied().unwrap_or(pad);
            }
        }
        // The kernel trusts the table: check it here (it holds by construction).
        if table.iter().any(|&p| p as usize >= self.refs.len()) {
            return Err(AttnError::BadParam {
                arg: "seqs",
                reason: "page table names a page outside the pool",
            });
        }
        let opts = SdpaOptions {
            causal: Some(Causal::BottomRight),
            key_lengths: Some(KeyLengths::Usize(&lens)),
            ..*opts
        };
        let kv = PagedKv {
            k: &self.kv,
            v: self.kv.get(self.page_len * self.d..).unwrap_or(&[]),
            k_scales: &self.scales,
            v_scales: self.scales.get(self.page_len..).unwrap_or(&[]),
            hkv: self.hkv,
            d: self.d,
            dv: self.dv,
            lk,
            shift: self.shift,
            table: &table,
            per_seq,
        };
        let mut extras = Extras::default();
        let plan = Plan::new_paged(q, &kv, out, &opts, &mut extras)?;
        crate::sdpa::execute(&plan, opts.par)
    }
}
