//! PyTorch's MHA masks (`key_padding_mask`, `attn_mask`, both polarities) converted to SDPA's:
//! key lengths where the padding is a suffix, else a mask, materialised only when the two meet.

use super::options::{KeyPadding, KpData, MaskData, MhaOptions};
use crate::error::{AttnError, Result};
use crate::layers::product;
use crate::options::{KeyLengths, MaskRef, SdpaOptions};

/// Masks converted to SDPA's forms; owns what had to be materialised.
#[derive(Default)]
pub(super) struct SdpaMasks<'a> {
    key_lengths: Option<Vec<usize>>,
    bool_mask: Option<(Vec<bool>, [usize; 4])>,
    owned_bias: Option<(Vec<f32>, [usize; 4])>,
    borrowed_bias: Option<(&'a [f32], [usize; 4])>,
}

impl<'a> SdpaMasks<'a> {
    pub(super) fn apply<'s>(&'s self, o: &mut SdpaOptions<'s>) {
        o.key_lengths = self.key_lengths.as_deref().map(KeyLengths::Usize);
        o.bool_mask = self
            .bool_mask
            .as_ref()
            .map(|(m, s)| MaskRef::new(m.as_slice(), *s).as_bytes());
        o.bias = match (&self.owned_bias, self.borrowed_bias) {
            (Some((m, s)), _) => Some(MaskRef::new(m, *s)),
            (None, Some((m, s))) => Some(MaskRef::new(m, s)),
            (None, None) => None,
        };
    }
}

/// Validates the PyTorch-polarity masks and converts them to SDPA's: key lengths where the
/// padding is a suffix, the attention mask as is (float) or inverted (bool), and a materialised
/// `(B, 1|H, Lq, Lk)` combination only when a non-suffix key padding mask meets an attention
/// mask.
pub(super) fn sdpa_masks<'a>(
    opts: &MhaOptions<'a>,
    b: usize,
    h: usize,
    lq: usize,
    lk: usize,
) -> Result<SdpaMasks<'a>> {
    let mut out = SdpaMasks::default();
    // The attention mask: (1 or B·H, Lq, Lk) → [1|B, 1|H, Lq, Lk].
    let am = match opts.attn_mask {
        None => None,
        Some(m) => {
            let bh = product("attn_mask", &[b, h])?;
            let ok = m.shape[1] == lq && m.shape[2] == lk && (m.dims == 2 || m.shape[0] == bh);
            if !ok {
                let expected = if m.dims == 2 {
                    vec![lq, lk]
                } else {
                    vec![bh, lq, lk]
                };
                return Err(AttnError::InputShape {
                    arg: "attn_mask",
                    expected,
                    got: m.shape_vec(),
                });
            }
            let needed = product("attn_mask", &m.shape)?;
            let got = match m.data {
                MaskData::Bool(d) => d.len(),
                MaskData::Float(d) => d.len(),
            };
            if got != needed {
                return Err(AttnError::BufferLength {
                    arg: "attn_mask",
                    needed,
                    got,
                });
            }
            let shape4 = if m.dims == 2 {
                [1, 1, lq, lk]
            } else {
                [b, h, lq, lk]
            };
            Some((m.data, shape4))
        }
    };
    // The key padding mask: lengths, or a (B, Lk) mask that is not a suffix pattern.
    let mut kp: Option<KpData<'a>> = None;
    if let Some(KeyPadding(k)) = opts.key_padding_mask {
        let check_shape = |shape: [usize; 2], len: usize| -> Result<()> {
            if shape != [b, lk] {
                return Err(AttnError::InputShape {
                    arg: "key_padding_mask",
                    expected: vec![b, lk],
                    got: shape.to_vec(),
                });
            }
            let needed = product("key_padding_mask", &[b, lk])?;
            if len != needed {
                return Err(AttnError::BufferLength {
                    arg: "key_padding_mask",
                    needed,
                    got: len,
                });
            }
            Ok(())
        };
        match k {
            KpData::Lengths(l) => {
                if l.len() != b {
                    return Err(AttnError::InputShape {
                        arg: "key_padding_mask",
                        expected: vec![b],
                        got: vec![l.len()],
                    });
                }
                if let Some((batch, &len)) = l.iter().enumerate().find(|(_, &x)| x > lk) {
                    return Err(AttnError::KeyLength { batch, len, lk });
                }
                out.key_lengths = Some(l.to_vec());
            }
            KpData::Bool(d, s) => {
                check_shape(s, d.len())?;
                match suffix_lengths(d, b, lk) {
                    Some(l) => out.key_lengths = Some(l),
                    None => kp = Some(k),
                }
            }
            KpData::Float(d, s) => {
                check_shape(s, d.len())?;
                kp = Some(k);
            }
        }
    }
    match (kp, am) {
        (None, None) => {}
        (None, Some((MaskData::Bool(d), s))) => {
            out.bool_mask = Some((d.iter().map(|&x| !x).collect(), s))
        }
        (None, Some((MaskData::Float(d), s))) => out.borrowed_bias = Some((d, s)),
        (Some(KpData::Bool(d, _)), None) => {
            out.bool_mask = Some((d.iter().map(|&x| !x).collect(), [b, 1, 1, lk]))
        }
        (Some(KpData::Float(d, _)), None) => out.borrowed_bias = Some((d, [b, 1, 1, lk])),
        (Some(k), Some((a, s))) => {
            // Both: materialise [B, 1|H, Lq, Lk].
            let mh = s[1];
            let shape = [b, mh, lq, lk];
            let n = product("attn_mask", &shape)?;
            // 2-D masks are [1, 1, Lq, Lk]; 3-D ones [B, H, Lq, Lk] (the same when B = H = 1).
            let am_index = |bi: usize, hi: usize, i: usize, j: usize| {
                if s[0] == 1 && s[1] == 1 {
                    i * lk + j
                } else {
                    ((bi * h + hi) * lq + i) * lk + j
                }
            };
            let idx = |t: usize| {
                let (j, r) = (t % lk, t / lk);
                let (i, r) = (r % lq, r / lq);
                (r / mh, r % mh, i, j)
            };
            match (k, a) {
                (KpData::Bool(kd, _), MaskData::Bool(ad)) => {
                    let m = (0..n)
                        .map(|t| {
                            let (bi, hi, i, j) = idx(t);
                            !kd[bi * lk + j] && !ad[am_index(bi, hi, i, j)]
                        })
                        .collect();
                    out.bool_mask = Some((m, shape));
                }
                (k, a) => {
                    let kval = |bi: usize, j: usize| match k {
                        KpData::Bool(kd, _) => {
                            if kd[bi * lk + j] {
                                f32::NEG_INFINITY
                            } else {
                                0.0
                            }
                        }
                        KpData::Float(kd, _) => kd[bi * lk + j],
                        KpData::Lengths(_) => 0.0,
                    };
                    let aval = |x: usize| match a {
                        MaskData::Bool(ad) => {
                            if ad[x] {
                                f32::NEG_INFINITY
                            } else {
                                0.0
                            }
                        }
                        MaskData::Float(ad) => ad[x],
                    };
                    let m = (0..n)
                        .map(|t| {
                            let (bi, hi, i, j) = idx(t);
                            aval(am_index(bi, hi, i, j)) + kval(bi, j)
                        })
                        .collect();
                    out.owned_bias = Some((m, shape));
                }
            }
        }
        (Some(KpData::Lengths(_)), _) => unreachable!("lengths are never kept as a mask"),
    }
    Ok(out)
}

/// Per-row valid lengths if every row of the `(B, Lk)` padding mask is `false…false true…true`.
fn suffix_lengths(m: &[bool], b: usize, lk: usize) -> Option<Vec<usize>> {
    (0..b)
        .map(|bi| {
            let row = &m[bi * lk..(bi + 1) * lk];
            let len = row.iter().position(|&x| x).unwrap_or(lk);
            row[len..].iter().all(|&x| x).then_some(len)
        })
        .collect()
}
