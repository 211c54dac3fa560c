//! What is measured: attention shapes, the named presets, and the FLOP convention.

use std::fmt;

/// One attention problem: `q (B, H, Lq, D)`, `k, v (B, Hkv, Lk, D)`, dense `(B, H, L, D)` layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Case {
    pub b: usize,
    pub h: usize,
    pub hkv: usize,
    pub lq: usize,
    pub lk: usize,
    pub d: usize,
    /// Top-left causal mask (PyTorch `is_causal=True`).
    pub causal: bool,
}

impl Case {
    pub const fn new(b: usize, h: usize, lq: usize, lk: usize, d: usize, causal: bool) -> Case {
        Case {
            b,
            h,
            hkv: h,
            lq,
            lk,
            d,
            causal,
        }
    }

    /// The FLOP convention of every figure: `4·B·H·Lq·Lk·D` (two GEMMs of `2·Lq·Lk·D` per head,
    /// softmax not counted), halved for a causal mask on a square problem (`Lq = Lk`), where
    /// about half the scores are masked.
    pub fn flops(&self) -> f64 {
        let f = 4.0 * (self.b * self.h) as f64 * self.lq as f64 * self.lk as f64 * self.d as f64;
        if self.causal && self.lq == self.lk {
            f / 2.0
        } else {
            f
        }
    }

    /// Multiply-adds of one unmasked pass, `B·H·Lq·Lk·D` (for the naive implementation's limit).
    pub fn macs(&self) -> f64 {
        (self.b * self.h) as f64 * self.lq as f64 * self.lk as f64 * self.d as f64
    }

    /// Bytes of K and V in elements of `elem` bytes, read at least once by every implementation
    /// (the decode bound).
    pub fn kv_bytes(&self, elem: f64) -> f64 {
        2.0 * elem * (self.b * self.hkv * self.lk * self.d) as f64
    }

    /// Bytes of Q, K and V.
    pub fn input_bytes(&self) -> f64 {
        4.0 * (self.q_len() + 2 * self.kv_len()) as f64
    }

    /// Elements of q/out and of k/v.
    pub fn q_len(&self) -> usize {
        self.b * self.h * self.lq * self.d
    }
    pub fn kv_len(&self) -> usize {
        self.b * self.hkv * self.lk * self.d
    }

    /// Shapes that share everything but the sequence length are one line in the plot.
    pub fn family(&self) -> (usize, usize, usize, usize, bool, bool) {
        (self.b, self.h, self.hkv, self.d, self.causal, self.lq == 1)
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "B={} H={}", self.b, self.h)?;
        if self.hkv != self.h {
            write!(f, " Hkv={}", self.hkv)?;
        }
        write!(f, " Lq={} Lk={} D={}", self.lq, self.lk, self.d)?;
        if self.causal {
            write!(f, " causal")?;
        }
        Ok(())
    }
}

/// The named shape sets of `--preset`.
pub const PRESETS: &[(&str, &str)] = &[
    ("quick", "the default: (1,16,512,64), (1,16,1024,64) causal and not, and (1,4,64,32)"),
    (
        "core",
        "(1,16,512,64) (1,16,1024,64) (1,16,2048,64) (1,8,2048,128) (4,12,512,64) (1,16,4096,64), causal and not",
    ),
    ("decode", "Lq=1, Lk in {1024, 8192, 32768}, B=1, H=32, Hkv in {32, 8}, D=128"),
    ("small", "(2,8,10,16), (1,4,64,32), causal and not"),
];

/// `(B, H, L, D)` square shapes, each causal and not.
fn square(shapes: &[(usize, usize, usize, usize)]) -> Vec<Case> {
    let mut v = Vec::new();
    for &causal in &[false, true] {
        for &(b, h, l, d) in shapes {
            v.push(Case::new(b, h, l, l, d, causal));
        }
    }
    v
}

/// The cases of a preset, or `None` for an unknown name.
pub fn preset(name: &str) -> Option<Vec<Case>> {
    Some(match name {
        "quick" => {
            let mut v = square(&[(1, 16, 512, 64), (1, 16, 1024, 64)]);
            v.push(Case::new(1, 4, 64, 64, 32, false));
            v
        }
        "core" => square(&[
            (1, 16, 512, 64),
            (1, 16, 1024, 64),
            (1, 16, 2048, 64),
            (1, 8, 2048, 128),
            (4, 12, 512, 64),
            (1, 16, 4096, 64),
        ]),
        // Hkv = 32 (MHA) and Hkv = 8 (GQA, 4 query heads per KV head) at each cache length.
        "decode" => [1024, 8192, 32768]
            .iter()
            .flat_map(|&lk| {
                [32, 8].map(|hkv| Case {
                    hkv,
                    ..Case::new(1, 32, 1, lk, 128, false)
                })
            })
            .collect(),
        "small" => square(&[(2, 8, 10, 16), (1, 4, 64, 32)]),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flop_convention() {
        let c = Case::new(1, 16, 512, 512, 64, false);
        assert_eq!(c.flops(), 4.0 * 16.0 * 512.0 * 512.0 * 64.0);
        assert_eq!(Case { causal: true, ..c }.flops(), c.flops() / 2.0);
        // Not square: no halving.
        let d = Case::new(1, 16, 1, 512, 64, true);
        assert_eq!(d.flops(), 4.0 * 16.0 * 512.0 * 64.0);
    }

    #[test]
    fn presets_exist() {
        for (name, _) in PRESETS {
            assert!(preset(name).is_some(), "{name}");
        }
        assert_eq!(preset("core").unwrap().len(), 12);
        assert!(preset("nope").is_none());
    }
}
