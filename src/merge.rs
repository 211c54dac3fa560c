//! Exact merge of attention results computed over disjoint key ranges — the primitive of
//! split-KV decoding and of ring / sequence-parallel attention across devices.
//!
//! For parts `(Oᵢ, lseᵢ)` of the same queries over disjoint key sets, with `lse = log Σ exp(lseᵢ)`:
//! `O = Σ exp(lseᵢ − lse)·Oᵢ`. [`crate::sdpa_ext`] produces exactly such parts (its `Extras::lse`).

use crate::error::{AttnError, Result};

/// One partial result: `out` holds `rows × dv` normalised outputs (row-major), `lse` the rows'
/// natural-log logsumexp (`-inf` for a row that saw no key).
#[derive(Clone, Copy, Debug)]
pub struct Partial<'a> {
    /// `rows × dv` outputs.
    pub out: &'a [f32],
    /// `rows` logsumexps.
    pub lse: &'a [f32],
}

/// Merges `parts` into `out` (`rows × dv`) and `lse` (`rows`), where `rows = lse.len()`.
/// Rows no part saw a key for come out as zeros with lse `-inf`. Accumulates in f64.
///
/// # Errors
/// [`AttnError::BufferLength`] if a part's or the output's length disagrees with `rows`, `dv`.
///
/// ```
/// use attnkit::{merge, Partial};
/// // Two halves of one row's keys: equal mass, outputs 1 and 3 → 2.
/// let (a, b) = ([1.0f32], [3.0f32]);
/// let (la, lb) = ([0.5f32], [0.5f32]);
/// let (mut out, mut lse) = ([0.0f32], [0.0f32]);
/// merge(&[Partial { out: &a, lse: &la }, Partial { out: &b, lse: &lb }], 1, &mut out, &mut lse)?;
/// assert!((out[0] - 2.0).abs() < 1e-6 && (lse[0] - (0.5 + 2f32.ln())).abs() < 1e-6);
/// # Ok::<(), attnkit::AttnError>(())
/// ```
pub fn merge(parts: &[Partial], dv: usize, out: &mut [f32], lse: &mut [f32]) -> Result<()> {
    let rows = lse.len();
    let need = rows
        .checked_mul(dv)
        .ok_or(AttnError::Overflow { arg: "out" })?;
    if out.len() != need {
        return Err(AttnError::BufferLength {
            arg: "out",
            needed: need,
            got: out.len(),
        });
    }
    for p in parts {
        if p.out.len() != need {
            return Err(AttnError::BufferLength {
                arg: "parts.out",
                needed: need,
                got: p.out.len(),
            });
        }
        if p.lse.len() != rows {
            return Err(AttnError::BufferLength {
                arg: "parts.lse",
                needed: rows,
                got: p.lse.len(),
            });
        }
    }
    let mut acc = vec![0.0f64; dv];
    for r in 0..rows {
        let m = parts
            .iter()
            .map(|p| p.lse[r])
            .fold(
                f32::NEG_INFINITY,
                |a, x| if x > a || x.is_nan() { x } else { a },
            );
        let o = &mut out[r * dv..(r + 1) * dv];
        if m == f32::NEG_INFINITY {
            o.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
            continue;
        }
        acc.fill(0.0);
        let mut sum = 0.0f64;
        for p in parts {
            let w = ((p.lse[r] - m) as f64).exp();
            if w == 0.0 {
                continue;
            }
            sum += w;
            for (a, x) in acc.iter_mut().zip(&p.out[r * dv..(r + 1) * dv]) {
                *a += w * *x as f64;
            }
        }
        for (x, a) in o.iter_mut().zip(&acc) {
            *x = (a / sum) as f32;
        }
        lse[r] = (m as f64 + sum.ln()) as f32;
    }
    Ok(())
}
