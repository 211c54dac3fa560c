//! AMX-BF16: the fused kernel's two products on tile registers (`tdpbf16ps`: a 16×16 f32 tile
//! plus a 16×32 bf16 tile times a 32×16 one whose rows are held in pairs; exact products, f32
//! sums). Rust has no stable AMX intrinsics, so each tile instruction is one `asm!` statement;
//! the compiler never allocates tile registers, so none is clobbered behind its back.
//!
//! The layouts are the bf16 pair path's (`x86_64::bf16`), transposed as the shared kernel keeps
//! its state (Sᵀ and Oᵀ, query lanes along rows):
//! * `Sᵀ = K·Q̂ᵀ`: A is K itself, 16 keys × 32 `d` per tile, loaded in place at K's row stride;
//!   B is Q̂ᵀ in pairs (`d/2` rows of query lanes), packed once per query block. A key tile that
//!   would run past the block's last key is copied into a zero-padded buffer first.
//! * `Oᵀ (+)= Vᵀ·Pᵀ`: A is Vᵀ in pairs of keys (one row per column of V), packed per key block
//!   by 8×8 transposes of 32-bit units; B is Pᵀ rounded to bf16 in pairs (the pair path's
//!   `pack_p`). The rounding of P is the path's one loss, as in the pair path and PyTorch.
//!
//! Tiles are blocked 2×2: four accumulators (`tmm0`–`tmm3`), two A tiles (`tmm4`, `tmm5`), two B
//! tiles (`tmm6`, `tmm7`): four loads per four multiplies. Every tile is configured 16 rows ×
//! 64 bytes; the edges are padded with zeros instead of reconfigured. The kernel loads the tile
//! configuration on entry and releases the tile state on return, on whichever thread runs it
//! (tile state is per thread, and a thread holding none is cheaper to switch).
//!
//! Linux grants the tile data state to a process only on request (`arch_prctl`
//! `ARCH_REQ_XCOMP_PERM`); [`granted`] asks once, and without the grant [`crate::Isa::Amx`] is
//! unsupported, so dispatch never executes a tile instruction that would fault.

use crate::flash::{forward_on, key_block, FlashArgs, Operands, Products};
use crate::gemm::{Accum, Epilogue, Scaled};
use crate::simd::Simd;
use crate::x86_64::avx512::Avx512;
use crate::x86_64::bf16::Pairs;
use crate::x86_64::transpose8_regs;
use core::arch::asm;
use core::arch::x86_64::*;
use half::bf16;
use std::sync::OnceLock;

/// Rows and bytes per row of every tile (the architectural maximum).
const ROWS: usize = 16;
const ROW_BYTES: usize = 64;
/// bf16 values, and bf16 pairs, along one tile row.
const VALS: usize = ROW_BYTES / 2;
const UNITS: usize = ROW_BYTES / 4;

/// Whether this CPU has AMX-TILE and AMX-BF16 and the OS granted this process the tile data
/// state (asked for once, on the first call).
pub(crate) fn granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        // Miri cannot run CPUID or system calls; the answer only removes a path.
        #[cfg(all(target_os = "linux", not(miri)))]
        {
            // CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE. Leaf 7 exists on
            // every CPU with AVX-512, the only ones asked (see `Isa::is_supported`).
            let leaf7 = core::arch::x86_64::__cpuid_count(7, 0);
            let has = leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0;
            has && request_tile_data()
        }
        #[cfg(any(not(target_os = "linux"), miri))]
        {
            false
        }
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: whether the kernel granted the tile
/// data state (it refuses where the CPU or its own build lacks it; older kernels reject the
/// call).
#[cfg(all(target_os = "linux", not(miri)))]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a system call that only changes this process's permitted XSAVE features; the
    // registers the x86-64 `syscall` instruction clobbers (rcx, r11) are declared.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// The tile configuration: palette 1, all eight tiles `ROWS × ROW_BYTES`.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    const FULL: TileConfig = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            // Bytes 16..32: bytes per row of tile t (u16, little-endian); 48..56: its rows.
            c[16 + 2 * t] = ROW_BYTES as u8;
            c[48 + t] = ROWS as u8;
            t += 1;
        }
        TileConfig(c)
    };
}

/// `tmm{T} = 0`.
#[inline(always)]
unsafe fn zero<const T: u8>() {
    // SAFETY: register-only; tiles configured (the caller's contract).
    unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem, preserves_flags)) }
}

/// `tmm{T}` = 16 rows of 64 bytes at `p`, `stride` bytes apart.
#[inline(always)]
unsafe fn load<const T: u8>(p: *const u8, stride: usize) {
    // SAFETY: the caller guarantees the 16 rows are readable and the tiles configured.
    unsafe {
        asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) p, s = in(reg) stride,
            options(nostack, readonly, preserves_flags))
    }
}

/// 16 rows of 64 bytes at `p`, `stride` bytes apart, = `tmm{T}`.
#[inline(always)]
unsafe fn store<const T: u8>(p: *mut u8, stride: usize) {
    // SAFETY: the caller guarantees the 16 rows are writable and the tiles configured.
    unsafe {
        asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) p, s = in(reg) stride,
            options(nostack, preserves_flags))
    }
}

/// `tmm{C} += tmm{A}·tmm{B}` on bf16 pairs.
#[inline(always)]
unsafe fn dot<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: register-only; tiles configured; AMX-BF16 present (the caller's contract).
    unsafe {
        asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
            options(nostack, nomem, preserves_flags))
    }
}

/// One operand of a 2×2 block of tiles: up to two tiles, `step` bytes apart, each advancing
/// `adv` bytes per reduction step, rows `stride` bytes apart.
#[derive(Clone, Copy)]
struct Pair {
    p: [*const u8; 2],
    two: bool,
    stride: usize,
    adv: usize,
}

/// `C (+)= A·B` for a 2×2 (or smaller) block of tiles over `steps` reduction steps: C tiles at
/// `c[i][j]` (`ldc` bytes per row), loaded first when `add`.
///
/// # Safety
/// Tiles configured; every tile the operands describe is readable (writable for C) for
/// `steps` steps.
#[inline(always)]
unsafe fn block(a: Pair, b: Pair, steps: usize, c: [[*mut u8; 2]; 2], ldc: usize, add: bool) {
    // SAFETY: per the contract; the `two` flags guard the second tiles.
    unsafe {
        if add {
            load::<0>(c[0][0], ldc);
            if b.two {
                load::<1>(c[0][1], ldc);
            }
            if a.two {
                load::<2>(c[1][0], ldc);
                if b.two {
                    load::<3>(c[1][1], ldc);
                }
            }
        } else {
            zero::<0>();
            zero::<1>();
            zero::<2>();
            zero::<3>();
        }
        for s in 0..steps {
            let (ao, bo) = (s * a.adv, s * b.adv);
            load::<4>(a.p[0].add(ao), a.stride);
            load::<6>(b.p[0].add(bo), b.stride);
            dot::<0, 4, 6>();
            if b.two {
                load::<7>(b.p[1].add(bo), b.stride);
                dot::<1, 4, 7>();
            }
            if a.two {
                load::<5>(a.p[1].add(ao), a.stride);
                dot::<2, 5, 6>();
                if b.two {
                    dot::<3, 5, 7>();
                }
            }
        }
        store::<0>(c[0][0], ldc);
        if b.two {
            store::<1>(c[0][1], ldc);
        }
        if a.two {
            store::<2>(c[1][0], ldc);
            if b.two {
                store::<3>(c[1][1], ldc);
            }
        }
    }
}

/// The fused kernel on tiles.
///
/// # Safety
/// As `flash::forward`; [`crate::flash_path`] is `AmxTiles` for these operands (Q, K, V bf16,
/// `d` a multiple of 32) and [`crate::Isa::Amx`] is supported (so is AVX-512 BF16).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn forward(a: &FlashArgs, ops: Operands, scratch: &mut [f32]) {
    debug_assert_eq!(
        crate::flash_path(crate::Isa::Amx, ops.q, ops.kv, a.d),
        crate::FlashPath::AmxTiles
    );
    let cfg = TileConfig::FULL;
    // SAFETY: the tile state is granted (`Isa::Amx` supported); `cfg` is a valid palette-1
    // configuration. The kernel uses only configured tiles; the state is released after it.
    unsafe {
        asm!("ldtilecfg [{c}]", c = in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        forward_on::<Avx512, Tiles<'_>>(a, ops, scratch, Tiles::new);
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// The tile products: the pair path's Q̂ᵀ and Pᵀ buffers, its V buffer holding Vᵀ instead, and
/// one zero-padded key tile.
struct Tiles<'s> {
    pairs: Pairs<'s>,
    /// Vᵀ in pairs of keys: `dvp` rows of `kb2` units (`kb2` pairs of keys per key block).
    kb2: usize,
    /// The last, partial key tile of a block: 16 rows of `d` bf16, zero past the block.
    ktail: &'s mut [f32],
}

impl<'s> Tiles<'s> {
    fn new(a: &FlashArgs, ops: Operands, mp: usize, rest: &'s mut [f32]) -> Self {
        let (pairs, ktail) = Pairs::new_with_tail(a, ops, mp, rest);
        Tiles {
            pairs,
            kb2: key_block(a.d) / 2,
            ktail,
        }
    }

    /// Keys `[j0, j0 + nb)` of V into `vp` as Vᵀ in pairs: row `c` holds `(v[2i][c],
    /// v[2i+1][c])` for pairs `i < ⌈nb/2⌉`, zero on to the next multiple of 16 pairs.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL enabled; V rows `< j0 + nb` readable at `dv` columns; `nb ≤
    /// key_block(d)`.
    #[inline(always)]
    unsafe fn pack_vt(&mut self, a: &FlashArgs, j0: usize, nb: usize) {
        let v = a.v.cast::<bf16>();
        let vt = self.pairs.vp.as_mut_ptr();
        let (np, kb2) = (nb.div_ceil(2), self.kb2);
        let npad = np.div_ceil(UNITS) * UNITS;
        // SAFETY: loads are masked to the `dv` columns of rows `< j0 + nb`; stores write rows
        // `< ⌈dv/8⌉·8 ≤ dvp` and units `< npad ≤ kb2` of `vp` (`dvp × kb2`).
        unsafe {
            for c0 in (0..a.dv).step_by(8) {
                let k = (1u32 << (a.dv - c0).min(8)).wrapping_sub(1) as u8;
                for p0 in (0..npad).step_by(8) {
                    let rows: [__m256; 8] = core::array::from_fn(|i| {
                        let p = p0 + i;
                        if p >= np {
                            return _mm256_setzero_ps();
                        }
                        let even = v.add((j0 + 2 * p) * a.ldv + c0);
                        let lo = _mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(k, even.cast()));
                        let pair = if 2 * p + 1 < nb {
                            let odd = _mm_maskz_loadu_epi16(k, even.add(a.ldv).cast());
                            _mm256_or_si256(lo, _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(odd)))
                        } else {
                            lo
                        };
                        _mm256_castsi256_ps(pair)
                    });
                    for (i, col) in transpose8_regs(&rows).iter().enumerate() {
                        _mm256_storeu_ps(vt.add((c0 + i) * kb2 + p0), *col);
                    }
                }
            }
        }
    }

    /// Zeroes rows `[⌈nb/2⌉, npad)` of Pᵀ on lanes `[lanes, mp)`, so padding pairs multiply
    /// zeros whatever the scratch held.
    #[inline(always)]
    fn pad_p(&mut self, nb: usize, lanes: usize, mp: usize) {
        let np = nb.div_ceil(2);
        for r in np..np.div_ceil(UNITS) * UNITS {
            self.pairs.pp[r * mp + lanes..(r + 1) * mp].fill(0.0);
        }
    }
}

impl Products<Avx512> for Tiles<'_> {
    /// One key block writes Oᵀ through the tiles like any other (no direct form).
    const DIRECT: bool = false;

    #[inline(always)]
    unsafe fn queries(&mut self, a: &FlashArgs, qscale: f32, mp: usize) {
        // SAFETY: forwarded contract.
        unsafe { self.pairs.queries(a, qscale, mp) }
    }

    #[inline(always)]
    unsafe fn scores<F: Epilogue>(
        &mut self,
        a: &FlashArgs,
        j0: usize,
        nb: usize,
        lanes: usize,
        nv: usize,
        s: &mut [f32],
        mp: usize,
        epi: F,
    ) {
        debug_assert!(nb <= key_block(a.d) && a.d.is_multiple_of(VALS) && mp.is_multiple_of(UNITS));
        let k = a.k.cast::<bf16>();
        let (ldk, d) = (a.ldk * 2, a.d);
        let nkt = nb.div_ceil(ROWS);
        let full = nb / ROWS;
        // SAFETY: keys `< j0 + nb ≤ n` of K at `d` columns, a partial tile read from the padded
        // copy; the tiles store Sᵀ rows `< nkt·16 ≤ key_block(d)` (the kernel's Sᵀ buffer holds
        // that many) on lanes `< mp`. Pointers to second tiles that do not exist are formed
        // with wrapping arithmetic and never read. The tiles are configured (`forward`).
        unsafe {
            if full < nkt {
                let tail = self.ktail.as_mut_ptr().cast::<bf16>();
                let rows = nb - full * ROWS;
                for r in 0..ROWS {
                    let dst = core::slice::from_raw_parts_mut(tail.add(r * d), d);
                    if r < rows {
                        let src = k.add((j0 + full * ROWS + r) * a.ldk);
                        dst.copy_from_slice(core::slice::from_raw_parts(src, d));
                    } else {
                        dst.fill(bf16::ZERO);
                    }
                }
            }
            let key_tile = |t: usize| -> (*const u8, usize) {
                if t < full {
                    (k.add((j0 + t * ROWS) * a.ldk).cast(), ldk)
                } else {
                    (self.ktail.as_ptr().cast(), 2 * d)
                }
            };
            let qp = self.pairs.qp.as_ptr().cast::<u8>();
            let sp = s.as_mut_ptr().cast::<u8>();
            let ldq = mp * 4;
            let nlt = nv;
            for kt in (0..nkt).step_by(2) {
                let (k0, stride0) = key_tile(kt);
                let two_k = kt + 1 < nkt;
                let (k1, stride1) = if two_k {
                    key_tile(kt + 1)
                } else {
                    (k0, stride0)
                };
                // The two key tiles may differ in stride (one padded): run them apart then.
                let split = stride0 != stride1;
                for lt in (0..nlt).step_by(2) {
                    let two_l = lt + 1 < nlt;
                    let lane = |t: usize| (lanes + t * UNITS) * 4;
                    let b = Pair {
                        p: [qp.add(lane(lt)), qp.wrapping_add(lane(lt + 1))],
                        two: two_l,
                        stride: ldq,
                        adv: UNITS * ldq,
                    };
                    let c = |kt: usize| -> [*mut u8; 2] {
                        let row = sp.wrapping_add(kt * ROWS * ldq);
                        [row.wrapping_add(lane(lt)), row.wrapping_add(lane(lt + 1))]
                    };
                    let steps = d / VALS;
                    if split {
                        for (t, (kp, st)) in [(kt, (k0, stride0)), (kt + 1, (k1, stride1))] {
                            let a = Pair {
                                p: [kp, kp],
                                two: false,
                                stride: st,
                                adv: ROW_BYTES,
                            };
                            block(a, b, steps, [c(t), c(t)], ldq, false);
                        }
                    } else {
                        let a = Pair {
                            p: [k0, k1],
                            two: two_k,
                            stride: stride0,
                            adv: ROW_BYTES,
                        };
                        block(a, b, steps, [c(kt), c(kt + 1)], ldq, false);
                    }
                }
            }
            // The scores' factor and the epilogue, on the lanes the tiles wrote.
            let f = Scaled(self.pairs.qscale, epi);
            for j in 0..nb {
                let row = s.as_mut_ptr().add(j * mp);
                for l in (lanes..mp).step_by(16) {
                    let x = Avx512::load(row.add(l));
                    Avx512::store(row.add(l), f.apply::<Avx512>(x));
                }
            }
            self.pack_vt(a, j0, nb);
        }
    }

    #[inline(always)]
    unsafe fn values(
        &mut self,
        a: &FlashArgs,
        nb: usize,
        lanes: usize,
        nv: usize,
        s: &mut [f32],
        ot: &mut [f32],
        mp: usize,
        acc: Accum,
    ) {
        let steps = nb.div_ceil(2).div_ceil(UNITS);
        let ndt = a.dv.div_ceil(ROWS);
        // SAFETY: `pack_vt` wrote this block's Vᵀ (`ndt·16` rows, `steps·16` units); `pp` holds
        // `steps·16` rows on these lanes after `pack_p` and `pad_p`; Oᵀ holds `ndt·16` rows of
        // `mp` (the kernel rounds its rows up to 16). Pointers to second tiles that do not
        // exist are formed with wrapping arithmetic and never read. Tiles configured.
        unsafe {
            self.pairs.pack_p(s, nb, lanes, mp);
            self.pad_p(nb, lanes, mp);
            let vt = self.pairs.vp.as_ptr().cast::<u8>();
            let pp = self.pairs.pp.as_ptr().cast::<u8>();
            let op = ot.as_mut_ptr().cast::<u8>();
            let (ldv, ldp) = (self.kb2 * 4, mp * 4);
            let lane = |t: usize| (lanes + t * UNITS) * 4;
            for dt in (0..ndt).step_by(2) {
                let two_d = dt + 1 < ndt;
                let a = Pair {
                    p: [
                        vt.add(dt * ROWS * ldv),
                        vt.wrapping_add((dt + 1) * ROWS * ldv),
                    ],
                    two: two_d,
                    stride: ldv,
                    adv: ROW_BYTES,
                };
                for lt in (0..nv).step_by(2) {
                    let b = Pair {
                        p: [pp.add(lane(lt)), pp.wrapping_add(lane(lt + 1))],
                        two: lt + 1 < nv,
                        stride: ldp,
                        adv: UNITS * ldp,
                    };
                    let c = |t: usize| -> [*mut u8; 2] {
                        let row = op.wrapping_add(t * ROWS * ldp);
                        [row.wrapping_add(lane(lt)), row.wrapping_add(lane(lt + 1))]
                    };
                    block(
                        a,
                        b,
                        steps,
                        [c(dt), c(dt + 1)],
                        ldp,
                        matches!(acc, Accum::Add),
                    );
                }
            }
        }
    }

    unsafe fn direct(&mut self, _: &FlashArgs, _: usize, _: &mut [f32], _: usize, _: &[f32]) {
        unreachable!("the tile products have no direct form (DIRECT is false)")
    }
}
