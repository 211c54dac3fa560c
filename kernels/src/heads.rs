//! Multi-head split and concat: `(B, L, H·D)` ⇄ `(B, H, L, D)`.
//!
//! The attention entry points read either order through strides, so these copies are only for
//! callers that need the other layout materialised (e.g. to hand it to another library).

/// `(B, L, H·D)` → `(B, H, L, D)`.
///
/// # Panics
/// If `src` or `dst` is not exactly `b·l·h·d` long (the safe `attnkit::split_heads` checks first).
pub fn split_heads(src: &[f32], dst: &mut [f32], b: usize, l: usize, h: usize, d: usize) {
    assert_eq!(src.len(), b * l * h * d, "split_heads: src length");
    assert_eq!(dst.len(), b * l * h * d, "split_heads: dst length");
    for bi in 0..b {
        for li in 0..l {
            for hi in 0..h {
                let s = ((bi * l + li) * h + hi) * d;
                let t = ((bi * h + hi) * l + li) * d;
                dst[t..t + d].copy_from_slice(&src[s..s + d]);
            }
        }
    }
}

/// `(B, H, L, D)` → `(B, L, H·D)` (the concat of heads).
///
/// # Panics
/// If `src` or `dst` is not exactly `b·l·h·d` long (the safe `attnkit::merge_heads` checks first).
pub fn merge_heads(src: &[f32], dst: &mut [f32], b: usize, l: usize, h: usize, d: usize) {
    assert_eq!(src.len(), b * l * h * d, "merge_heads: src length");
    assert_eq!(dst.len(), b * l * h * d, "merge_heads: dst length");
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                let s = ((bi * h + hi) * l + li) * d;
                let t = ((bi * l + li) * h + hi) * d;
                dst[t..t + d].copy_from_slice(&src[s..s + d]);
            }
        }
    }
}
