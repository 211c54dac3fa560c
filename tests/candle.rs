//! The `candle` feature: attention on `candle_core::Tensor`s read in place, through
//! `attnkit::candle::sdpa` and the `Sdpa` custom op. Each case is checked against candle's own
//! attention, written with candle ops in f64 (`softmax(Q·Kᵀ·scale + mask)·V`, the softmax as
//! `exp(x − max) / sum`, KV heads repeated for GQA, the causal mask built as a tensor), within
//! 1e-5 absolute plus 1e-5 relative for f32.
#![cfg(feature = "candle")]

use attnkit::candle::{sdpa, Sdpa};
use attnkit::{Causal, SdpaOptions};
use candle_core::{DType, Device, Result, Tensor, D};

/// A deterministic f32 tensor of values in [-1, 1).
fn tensor(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (1..=n as u32)
        .map(|i| {
            ((i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 2000) as f32 / 1000.0
                - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Candle's matmul-softmax-matmul attention in f64: `q (B, Hq, Lq, D)`, `k (B, Hkv, Lk, D)`,
/// `v (B, Hkv, Lk, Dv)`, KV heads repeated `Hq/Hkv` times, TopLeft causal mask if asked.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let (q, k, v) = (
        q.to_dtype(DType::F64)?,
        k.to_dtype(DType::F64)?,
        v.to_dtype(DType::F64)?,
    );
    let (b, hq, lq, d) = q.dims4()?;
    let (_, hkv, lk, _) = k.dims4()?;
    let dv = v.dim(3)?;
    let repeat = |x: &Tensor, e: usize| -> Result<Tensor> {
        x.unsqueeze(2)?
            .broadcast_as((b, hkv, hq / hkv, lk, e))?
            .reshape((b, hq, lk, e))
    };
    let (k, v) = (repeat(&k, d)?, repeat(&v, dv)?);
    let mut scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?;
    if causal {
        let mask: Vec<f64> = (0..lq * lk)
            .map(|x| {
                if x % lk > x / lk {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        scores = scores.broadcast_add(&Tensor::from_vec(mask, (lq, lk), &Device::Cpu)?)?;
    }
    let e = scores
        .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
        .exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v.contiguous()?)
}

/// Every element of `got` within `tol` absolute plus `tol` relative of `want`.
fn assert_close(got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims());
    let g = got
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let w = want.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        assert!(
            (g - w).abs() <= tol + tol * w.abs(),
            "element {i}: got {g}, want {w}"
        );
    }
}

/// The message of a refused call, which must name `arg`.
fn refused(r: Result<Tensor>, arg: &str) -> String {
    let msg = r.expect_err("expected a refusal").to_string();
    assert!(
        msg.contains(&format!("`{arg}`")),
        "{msg:?} should name `{arg}`"
    );
    msg
}

#[test]
fn contiguous_f32() -> Result<()> {
    let (q, k, v) = (
        tensor(&[2, 3, 5, 8], 1),
        tensor(&[2, 3, 7, 8], 2),
        tensor(&[2, 3, 7, 4], 3),
    );
    let got = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    assert_eq!((got.dims(), got.dtype()), (&[2, 3, 5, 4][..], DType::F32));
    assert!(got.is_contiguous());
    assert_close(&got, &reference(&q, &k, &v, false)?, 1e-5);
    Ok(())
}

/// `.transpose(1, 2)` of `(B, L, H, D)` tensors, and Q, K, V narrowed out of one packed
/// `(B, L, 3, H, D)` projection (a start offset and strides): read in place, not copied.
#[test]
fn strided_views() -> Result<()> {
    let (b, lq, lk, h, d) = (2, 5, 6, 3, 8);
    let (q, k, v) = (
        tensor(&[b, lq, h, d], 4).transpose(1, 2)?,
        tensor(&[b, lk, h, d], 5).transpose(1, 2)?,
        tensor(&[b, lk, h, d], 6).transpose(1, 2)?,
    );
    assert!(!q.is_contiguous());
    let got = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    assert_close(&got, &reference(&q, &k, &v, false)?, 1e-5);

    let qkv = tensor(&[b, lq, 3, h, d], 7);
    let part = |w: usize| qkv.narrow(2, w, 1)?.squeeze(2)?.transpose(1, 2);
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    assert!(k.layout().start_offset() > 0);
    let got = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    assert_close(&got, &reference(&q, &k, &v, false)?, 1e-5);

    // K and V of one batch broadcast over two (stride 0).
    let (k1, v1) = (tensor(&[1, h, lk, d], 8), tensor(&[1, h, lk, d], 9));
    let (k, v) = (
        k1.broadcast_as((b, h, lk, d))?,
        v1.broadcast_as((b, h, lk, d))?,
    );
    let got = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    assert_close(&got, &reference(&q, &k, &v, false)?, 1e-5);
    Ok(())
}

/// Grouped-query attention (6 query heads over 2 KV heads, no repeat) and causal masking.
#[test]
fn gqa_and_causal() -> Result<()> {
    let (b, hq, hkv, l, d) = (2, 6, 2, 9, 16);
    let (q, k, v) = (
        tensor(&[b, hq, l, d], 10),
        tensor(&[b, hkv, l, d], 11),
        tensor(&[b, hkv, l, d], 12),
    );
    let got = sdpa(&q, &k, &v, &SdpaOptions::new())?;
    assert_close(&got, &reference(&q, &k, &v, false)?, 1e-5);
    let got = sdpa(&q, &k, &v, &SdpaOptions::new().causal(Causal::TopLeft))?;
    assert_close(&got, &reference(&q, &k, &v, true)?, 1e-5);
    Ok(())
}

/// The custom op gives what `sdpa` gives, bitwise, with and without backprop tracking.
#[test]
fn custom_op3() -> Result<()> {
    let (b, h, l, d) = (2, 4, 7, 8);
    let (q, k, v) = (
        tensor(&[b, l, h, d], 13).transpose(1, 2)?,
        tensor(&[b, h, l, d], 14),
        tensor(&[b, h, l, d], 15),
    );
    let op = Sdpa {
        causal: Some(Causal::TopLeft),
        ..Default::default()
    };
    let got = q.apply_op3(&k, &v, op)?;
    assert_close(&got, &reference(&q, &k, &v, true)?, 1e-5);
    let direct = sdpa(&q, &k, &v, &op.options())?;
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(bits(&got), bits(&direct));
    assert_eq!(bits(&q.apply_op3_no_bwd(&k, &v, &op)?), bits(&direct));
    // The scale is the op's.
    let half = Sdpa {
        scale: Some(0.5),
        ..Default::default()
    };
    assert_eq!(
        bits(&q.apply_op3(&k, &v, half)?),
        bits(&sdpa(&q, &k, &v, &SdpaOptions::new().scale(0.5))?)
    );
    // Errors come through the op too, named.
    refused(q.apply_op3(&k.t()?, &v, op), "k");
    Ok(())
}

/// bf16 and f16 tensors: the output has their dtype; computed in f32 on the widened values
/// (bf16 may round the softmax weights on CPUs with bf16 dot products, see `attnkit::sdpa`).
#[test]
fn half_precision() -> Result<()> {
    let (q, k, v) = (
        tensor(&[1, 2, 5, 32], 16),
        tensor(&[1, 2, 6, 32], 17),
        tensor(&[1, 2, 6, 32], 18),
    );
    for (dt, tol) in [(DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        let (q, k, v) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
        let got = sdpa(&q, &k, &v, &SdpaOptions::new())?;
        assert_eq!(got.dtype(), dt);
        assert_close(&got, &reference(&q, &k, &v, false)?, tol);
    }
    Ok(())
}

/// A last dimension that is not contiguous is refused (not copied): `.contiguous()` is the fix.
/// Other refusals name the argument: dtypes, ranks, shapes.
#[test]
fn refusals() -> Result<()> {
    let (q, k, v) = (
        tensor(&[1, 2, 5, 8], 19),
        tensor(&[1, 2, 8, 6], 20),
        tensor(&[1, 2, 6, 8], 21),
    );
    let kt = k.t()?; // (1, 2, 6, 8) with D of stride 6
    let msg = refused(sdpa(&q, &kt, &v, &SdpaOptions::new()), "k");
    assert!(msg.contains("last dimension (D) has stride 6"), "{msg}");
    assert!(msg.contains(".contiguous()"), "{msg}");
    let got = sdpa(&q, &kt.contiguous()?, &v, &SdpaOptions::new())?;
    assert_close(&got, &reference(&q, &kt, &v, false)?, 1e-5);

    let msg = refused(
        sdpa(&q.to_dtype(DType::F64)?, &kt, &v, &SdpaOptions::new()),
        "q",
    );
    assert!(msg.contains("dtype f64"), "{msg}");
    let msg = refused(
        sdpa(
            &q,
            &kt.contiguous()?.to_dtype(DType::BF16)?,
            &v,
            &SdpaOptions::new(),
        ),
        "k",
    );
    assert!(msg.contains("bf16 differs from q's f32"), "{msg}");
    let msg = refused(sdpa(&q.squeeze(0)?, &q, &q, &SdpaOptions::new()), "q");
    assert!(msg.contains("4-D"), "{msg}");
    // The core API's shape checks, with its messages.
    let msg = refused(
        sdpa(&q, &tensor(&[1, 2, 6, 7], 22), &v, &SdpaOptions::new()),
        "k",
    );
    assert!(msg.contains("dimension D is 7, expected 8"), "{msg}");
    let r = sdpa(&tensor(&[1, 3, 5, 8], 23), &q, &q, &SdpaOptions::new());
    let msg = r.expect_err("3 query heads over 2").to_string();
    assert!(msg.contains("query heads (3)"), "{msg}");
    Ok(())
}
