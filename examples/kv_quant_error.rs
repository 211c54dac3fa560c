//! The error int8 KV caches add, per (token, head) row scale (`KvCache<i8>`) against llama.cpp's
//! q8_0 scheme (a scale per block of 32 values, stored as f16), on the same data.
//!
//! `cargo run --release --example kv_quant_error`
//!
//! Two kinds of data, each a decode step (`Lq = 1`, Hq = 8 over Hkv = 2, Lk = 4096, D = 128):
//! - *random*: Q, K, V all N(0, 1);
//! - *outliers*: what LLM keys look like: 4 of the 128 key channels 15× larger and offset, the
//!   queries large in the same channels (so the outliers decide the scores), and heavy-tailed
//!   values (1 % of them 8× larger).
//!
//! For each scheme it prints the relative RMS error of the stored keys and values and of the
//! attention output, and the largest output error relative to the output's RMS, each against
//! the f32 cache, with attention computed in f64 from the stored values (the kernels add no
//! error of their own: `tests/kv_int8.rs`). The int8 cache's values are read back from a real
//! `KvCache<i8>`.

use attnkit::{f16, KvCache, Tensor};

const HQ: usize = 8;
const HKV: usize = 2;
const LK: usize = 4096;
const D: usize = 128;

/// SplitMix64 → N(0, 1) by Box–Muller.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// Q `(Hq, D)`, K and V `(Hkv, Lk, D)`.
fn data(outliers: bool, rng: &mut Rng) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let special = |c: usize| outliers && c % 32 == 7;
    let q = (0..HQ * D)
        .map(|i| rng.normal() * if special(i % D) { 4.0 } else { 1.0 })
        .collect();
    let k = (0..HKV * LK * D)
        .map(|i| {
            let x = rng.normal();
            if special(i % D) {
                15.0 * x + 20.0
            } else {
                x
            }
        })
        .collect();
    let v = (0..HKV * LK * D)
        .map(|_| {
            let x = rng.normal();
            if outliers && rng.uniform() < 0.01 {
                8.0 * x
            } else {
                x
            }
        })
        .collect();
    (q, k, v)
}

/// llama.cpp's q8_0 round trip: blocks of 32, `d = max|x| / 127` stored as f16,
/// `q = round(x / d)`; returns `d·q`.
fn q8_0(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for blk in x.chunks(32) {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / 127.0).to_f32();
        let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(
            blk.iter()
                .map(|&v| d * (v * inv).round().clamp(-127.0, 127.0)),
        );
    }
    out
}

/// The per-row int8 round trip through a real `KvCache<i8>`.
fn per_row(k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut c = KvCache::<i8>::new_of(1, HKV, LK, D, D).expect("cache");
    let shape = [1, HKV, LK, D];
    c.append(&Tensor::bhld(k, shape), &Tensor::bhld(v, shape))
        .expect("append");
    let read = |t: Tensor<i8>, scales: &[f32]| -> Vec<f32> {
        let st = t.strides();
        let mut out = Vec::with_capacity(HKV * LK * D);
        for h in 0..HKV {
            for j in 0..LK {
                let row = &t.data()[h * st[1] + j * st[2]..][..D];
                let s = scales[h * LK + j];
                out.extend(row.iter().map(|&q| s * f32::from(q)));
            }
        }
        out
    };
    (
        read(c.keys(), c.key_scales()),
        read(c.values(), c.value_scales()),
    )
}

/// Decode attention in f64: `(Hq, D)` outputs.
fn attend(q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
    let scale = 1.0 / (D as f64).sqrt();
    let mut out = vec![0.0f64; HQ * D];
    for h in 0..HQ {
        let kh = h / (HQ / HKV);
        let qr = &q[h * D..][..D];
        let s: Vec<f64> = (0..LK)
            .map(|j| {
                let kr = &k[(kh * LK + j) * D..][..D];
                scale
                    * qr.iter()
                        .zip(kr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for (j, sj) in s.iter().enumerate() {
            let p = (sj - m).exp() / sum;
            let vr = &v[(kh * LK + j) * D..][..D];
            for (o, &x) in out[h * D..][..D].iter_mut().zip(vr) {
                *o += p * x as f64;
            }
        }
    }
    out
}

fn rms<T: Copy + Into<f64>>(x: &[T]) -> f64 {
    (x.iter().map(|&v| v.into().powi(2)).sum::<f64>() / x.len() as f64).sqrt()
}

/// RMS of `got − want` over RMS of `want`.
fn rel_rms<T: Copy + Into<f64>, U: Copy + Into<f64>>(got: &[T], want: &[U]) -> f64 {
    let diff: Vec<f64> = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| g.into() - w.into())
        .collect();
    rms(&diff) / rms(want)
}

fn main() {
    println!("decode, Hq {HQ} / Hkv {HKV}, Lk {LK}, D {D}; errors against the f32 cache\n");
    println!(
        "| data | scheme | bytes / value | K rel. RMS | V rel. RMS | out rel. RMS | out max / RMS |"
    );
    println!("|---|---|---|---|---|---|---|");
    for outliers in [false, true] {
        let mut rng = Rng(if outliers { 2 } else { 1 });
        let (q, k, v) = data(outliers, &mut rng);
        let exact = attend(&q, &k, &v);
        let orms = rms(&exact);
        let schemes = [
            (
                "int8, scale per (token, head)",
                1.0 + 4.0 / D as f64,
                per_row(&k, &v),
            ),
            (
                "q8_0 (32-value blocks, f16 scale)",
                1.0 + 2.0 / 32.0,
                (q8_0(&k), q8_0(&v)),
            ),
        ];
        for (name, bytes, (kq, vq)) in schemes {
            let out = attend(&q, &kq, &vq);
            let max = out
                .iter()
                .zip(&exact)
                .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
            println!(
                "| {} | {name} | {bytes:.4} | {:.2e} | {:.2e} | {:.2e} | {:.2e} |",
                if outliers { "outliers" } else { "random" },
                rel_rms(&kq, &k),
                rel_rms(&vq, &v),
                rel_rms(&out, &exact),
                max / orms,
            );
        }
    }
}
