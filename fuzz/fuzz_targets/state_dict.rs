//! Fuzzes loading weights: `StateDict::from_safetensors` on arbitrary bytes, or on well-formed
//! files built from structured data (layer-shaped tensors, extra tensors with huge shapes that
//! have a zero dimension, sometimes corrupted), then `SelfAttention`, `MultiheadAttention`,
//! `AdditiveAttention` and `Linear` loading and, for what loads, `forward` on small inputs of
//! matching or mismatching shapes.
//!
//! Checked: nothing panics or aborts; a file written by `to_safetensors` parses back equal; a
//! well-formed layer file loads; a loaded layer's own `state_dict` reloads to the same weights;
//! `forward` accepts valid inputs, refuses invalid ones, and returns outputs of the documented
//! shape, finite for finite weights and inputs.
#![no_main]

use arbitrary::{Result, Unstructured};
use attnkit::{
    AdditiveAttention, AdditiveOptions, Causal, Fusion, Isa, KeyPadding, Linear, MhaConfig,
    MhaOptions, MultiheadAttention, Par, SelfAttention, StateDict, Tokens, Weights,
};
use attnkit_fuzz::expect::Expect;
use attnkit_fuzz::gen::{chance, inject_specials, product, size, small, wild, Rng};
use libfuzzer_sys::fuzz_target;

/// Tensor names the layers read (without prefix), for extra tensors that collide with them.
const NAMES: [&str; 16] = [
    "in_proj_weight",
    "in_proj_bias",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "out_proj.weight",
    "out_proj.bias",
    "bias_k",
    "query.weight",
    "query.bias",
    "key.weight",
    "value.weight",
    "W_q.weight",
    "W_k.weight",
    "w_v.weight",
    "W_q.bias",
];

/// Shapes with a huge dimension next to a zero one: no data, but sizes that overflow when
/// multiplied without the zero.
const HUGE_EMPTY: [&[usize]; 6] = [
    &[1 << 40, 0],
    &[0, 1 << 40],
    &[usize::MAX, 0],
    &[0, usize::MAX],
    &[1 << 62, 1 << 62, 0],
    &[1 << 33, 0, 1 << 33],
];

/// Elements the target itself allocates for one tensor or activation buffer.
const MAX_ELEMS: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});

fn run(u: &mut Unstructured) -> Result<()> {
    let mut rng = Rng::decode(u)?;
    let prefix = *u.choose(&["", "enc.attn"])?;
    let (sd, plan) = if chance(u, 1, 2)? {
        // A file of up to 64 KiB (length big-endian, as `int_in_range` reads it), then the
        // bytes that drive the layers.
        let len = u.int_in_range(0..=0xffff)?.min(u.len());
        let Ok(sd) = StateDict::from_safetensors(u.bytes(len)?) else {
            return Ok(());
        };
        check_reserialize(&sd);
        (sd, None)
    } else {
        let mut plan = Plan::decode(u)?;
        let Some(sd) = build_file(u, &mut plan, prefix, &mut rng)? else {
            return Ok(());
        };
        (sd, Some(plan))
    };
    let mut cx = Ctx {
        rng,
        special: chance(u, 1, 16)?,
        finite: plan.as_ref().is_some_and(|p| p.intact && !p.special),
    };
    cx.self_attention(u, &sd, prefix, plan.as_ref())?;
    cx.multihead(u, &sd, prefix, plan.as_ref())?;
    cx.additive(u, &sd, prefix, plan.as_ref())?;
    cx.linear(u, &sd, prefix)?;
    Ok(())
}

/// A parsed dict written back must parse to the same dict.
fn check_reserialize(sd: &StateDict) {
    if let Ok(bytes) = sd.to_safetensors() {
        let back = StateDict::from_safetensors(&bytes).expect("parsing what to_safetensors wrote");
        assert_eq!(&back, sd, "a state dict changed through to_safetensors");
    }
}

/// `{prefix}.{name}`.
fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The layer whose tensors a structured file holds.
#[derive(Clone, Copy, Debug)]
enum Layer {
    Mha {
        e: usize,
        heads: usize,
        kv_heads: usize,
        kdim: usize,
        vdim: usize,
        bias: bool,
    },
    SelfAttention {
        d: usize,
        dv: usize,
        e_in: [usize; 3],
        bias: [bool; 3],
    },
    Additive {
        a: usize,
        dq: usize,
        dk: usize,
        bias: [bool; 2],
        v_2d: bool,
    },
}

/// A structured file: one layer's tensors, maybe damaged.
#[derive(Clone, Copy, Debug)]
struct Plan {
    layer: Layer,
    /// The layer's tensors are all there, as written (so it must load).
    intact: bool,
    /// NaN or infinity in a weight.
    special: bool,
}

impl Plan {
    fn decode(u: &mut Unstructured) -> Result<Self> {
        let dim = |u: &mut Unstructured| Ok(1 + small(u, 11)?);
        let layer = match u.int_in_range(0..=2)? {
            0 => {
                let kv_heads = dim(u)?.min(4);
                let heads = kv_heads * u.int_in_range(1..=3)?;
                let e = heads * dim(u)?;
                let cross = chance(u, 1, 3)?;
                Layer::Mha {
                    e,
                    heads,
                    kv_heads,
                    kdim: if cross { dim(u)? } else { e },
                    vdim: if cross { dim(u)? } else { e },
                    bias: chance(u, 3, 4)?,
                }
            }
            1 => {
                // Input widths of 0 let the output widths be huge: [2^40, 0] weights are empty.
                let empty = chance(u, 1, 8)?;
                let width = |u: &mut Unstructured| {
                    if empty {
                        Ok(wild(u)?.max(1))
                    } else {
                        dim(u)
                    }
                };
                let e_in = if empty {
                    [0; 3]
                } else {
                    [dim(u)?, dim(u)?, dim(u)?]
                };
                Layer::SelfAttention {
                    d: width(u)?,
                    dv: width(u)?,
                    e_in,
                    bias: [0; 3].map(|_| !empty && chance(u, 1, 2).unwrap_or(false)),
                }
            }
            _ => Layer::Additive {
                a: dim(u)?,
                dq: dim(u)?,
                dk: dim(u)?,
                bias: [chance(u, 1, 2)?, chance(u, 1, 2)?],
                v_2d: chance(u, 1, 2)?,
            },
        };
        Ok(Plan {
            layer,
            intact: true,
            special: false,
        })
    }

    /// The layer's tensors: names (without prefix) and shapes.
    fn tensors(&self) -> Vec<(&'static str, Vec<usize>)> {
        match self.layer {
            Layer::Mha {
                e,
                heads,
                kv_heads,
                kdim,
                vdim,
                bias,
            } => {
                let ekv = kv_heads * (e / heads);
                let mut t = if kdim == e && vdim == e {
                    vec![("in_proj_weight", vec![e + 2 * ekv, e])]
                } else {
                    vec![
                        ("q_proj_weight", vec![e, e]),
                        ("k_proj_weight", vec![ekv, kdim]),
                        ("v_proj_weight", vec![ekv, vdim]),
                    ]
                };
                t.push(("out_proj.weight", vec![e, e]));
                if bias {
                    t.push(("in_proj_bias", vec![e + 2 * ekv]));
                    t.push(("out_proj.bias", vec![e]));
                }
                t
            }
            Layer::SelfAttention { d, dv, e_in, bias } => {
                let rows = [d, d, dv];
                let mut t = Vec::new();
                for (p, (w, b)) in [
                    ("query.weight", "query.bias"),
                    ("key.weight", "key.bias"),
                    ("value.weight", "value.bias"),
                ]
                .into_iter()
                .enumerate()
                {
                    t.push((w, vec![rows[p], e_in[p]]));
                    if bias[p] {
                        t.push((b, vec![rows[p]]));
                    }
                }
                t
            }
            Layer::Additive {
                a,
                dq,
                dk,
                bias,
                v_2d,
            } => {
                let mut t = vec![
                    ("W_q.weight", vec![a, dq]),
                    ("W_k.weight", vec![a, dk]),
                    ("w_v.weight", if v_2d { vec![1, a] } else { vec![a] }),
                ];
                if bias[0] {
                    t.push(("W_q.bias", vec![a]));
                }
                if bias[1] {
                    t.push(("W_k.bias", vec![a]));
                }
                t
            }
        }
    }

    /// Whether the layer must load: its tensors are intact and its sizes sane (a
    /// self-attention layer whose projections total more than `isize::MAX` rows may be refused).
    fn must_load(&self) -> bool {
        let sane = match self.layer {
            Layer::SelfAttention { d, dv, .. } => d
                .checked_mul(2)
                .and_then(|x| x.checked_add(dv))
                .is_some_and(|rows| rows <= isize::MAX as usize),
            _ => true,
        };
        self.intact && sane
    }

    /// The configuration an MHA file was written for.
    fn mha_config(&self) -> Option<MhaConfig> {
        let Layer::Mha {
            e,
            heads,
            kv_heads,
            kdim,
            vdim,
            bias,
        } = self.layer
        else {
            return None;
        };
        Some(
            MhaConfig::new(e, heads)
                .kv_heads(kv_heads)
                .kdim(kdim)
                .vdim(vdim)
                .bias(bias),
        )
    }
}

/// Writes the plan's tensors (sometimes one dropped, plus extra tensors that may replace
/// them) with `StateDict::insert`, round-trips them through `to_safetensors`, and sometimes
/// corrupts the bytes before parsing them again; `plan` records the damage. `None` if the
/// corrupted file does not parse.
fn build_file(
    u: &mut Unstructured,
    plan: &mut Plan,
    prefix: &str,
    rng: &mut Rng,
) -> Result<Option<StateDict>> {
    let mut sd = StateDict::new();
    let tensors = plan.tensors();
    let drop = chance(u, 1, 8)?
        .then(|| u.choose_index(tensors.len()))
        .transpose()?;
    plan.intact = drop.is_none();
    for (i, (name, shape)) in tensors.into_iter().enumerate() {
        if drop != Some(i) {
            plan.special |= insert(u, &mut sd, &join(prefix, name), &shape, rng)?;
        }
    }
    for _ in 0..u.int_in_range(0..=3)? {
        plan.intact = false;
        let name = if chance(u, 3, 4)? {
            join(prefix, u.choose(&NAMES)?)
        } else {
            u.arbitrary::<String>()?
        };
        let shape = decode_shape(u)?;
        plan.special |= insert(u, &mut sd, &name, &shape, rng)?;
    }
    let bytes = sd.to_safetensors();
    let Ok(mut bytes) = bytes else {
        return Ok(None);
    };
    let back = StateDict::from_safetensors(&bytes).expect("parsing what to_safetensors wrote");
    assert_eq!(back, sd, "a state dict changed through to_safetensors");
    if !chance(u, 1, 4)? {
        return Ok(Some(sd));
    }
    plan.intact = false;
    for _ in 0..u.int_in_range(1..=4)? {
        if bytes.is_empty() {
            break;
        }
        let i = u.choose_index(bytes.len())?;
        if chance(u, 1, 4)? {
            bytes.truncate(i);
        } else {
            bytes[i] = u.arbitrary()?;
        }
    }
    Ok(StateDict::from_safetensors(&bytes).ok())
}

/// A tensor shape of rank 0 to 3: small sizes, or a huge one next to a zero.
fn decode_shape(u: &mut Unstructured) -> Result<Vec<usize>> {
    if chance(u, 1, 4)? {
        return Ok(u.choose(&HUGE_EMPTY)?.to_vec());
    }
    let rank = u.int_in_range(0..=3)?;
    (0..rank).map(|_| size(u, 16, 1)).collect()
}

/// `StateDict::insert` with data of the shape's length when it is small (values from `rng`,
/// rarely special), else with a short buffer, which must be refused. Returns whether NaN or
/// infinities went in.
fn insert(
    u: &mut Unstructured,
    sd: &mut StateDict,
    name: &str,
    shape: &[usize],
    rng: &mut Rng,
) -> Result<bool> {
    let n = product(shape).filter(|&n| n <= MAX_ELEMS);
    let mut data = rng.values(n.unwrap_or(1));
    let special = chance(u, 1, 32)?;
    if special {
        inject_specials(u, &mut data)?;
    }
    let res = sd.insert(name, shape, &data);
    assert_eq!(
        res.is_ok(),
        n == Some(data.len()),
        "StateDict::insert({name:?}, {shape:?}, {} elements): {res:?}",
        data.len()
    );
    Ok(special)
}

/// A `Tokens` buffer: shape `(B, L, E)`, batch- or sequence-first.
struct Input {
    data: Vec<f32>,
    shape: [usize; 3],
    seq_first: bool,
}

impl Input {
    /// `B × L` tokens of width `e`; rarely a wrong width (unless the layer takes `any_width`),
    /// a wild B or L, or a short buffer (faults in `expect`).
    fn decode(
        u: &mut Unstructured,
        [b, l, e]: [usize; 3],
        any_width: bool,
        cx: &mut Ctx,
        expect: &mut Expect,
    ) -> Result<Self> {
        let mut shape = [b, l, e];
        if !any_width && chance(u, 1, 16)? {
            shape[2] = e.wrapping_add(1);
            expect.fault("a width the layer does not take");
        }
        if shape[2] > 0 && chance(u, 1, 16)? {
            // A huge B or L, the other at least 1: the buffer below stays small, so this is
            // always too short.
            let i = u.choose_index(2)?;
            shape[i] = wild(u)?.max(MAX_ELEMS + 1);
            shape[1 - i] = shape[1 - i].max(1);
        }
        let len = match product(&shape).filter(|&n| n <= MAX_ELEMS) {
            Some(n) if n > 0 && chance(u, 1, 16)? => n - 1,
            Some(n) => n,
            None => small(u, 16)?,
        };
        if product(&shape) != Some(len) {
            expect.fault("a token buffer shorter than its shape");
        }
        let mut data = cx.rng.values(len);
        if cx.special {
            inject_specials(u, &mut data)?;
        }
        let seq_first = chance(u, 1, 2)?;
        Ok(Input {
            data,
            shape,
            seq_first,
        })
    }

    fn tokens(&self) -> Tokens<'_> {
        let [b, l, e] = self.shape;
        if self.seq_first {
            Tokens::lbe(&self.data, [l, b, e])
        } else {
            Tokens::ble(&self.data, [b, l, e])
        }
    }

    /// The output shape in this input's memory order, `width` wide.
    fn out_shape(&self, width: usize) -> [usize; 3] {
        let [b, l, _] = self.shape;
        if self.tokens().is_seq_first() {
            [l, b, width]
        } else {
            [b, l, width]
        }
    }
}

/// State shared by the layer checks.
struct Ctx {
    rng: Rng,
    /// Inputs get NaN or infinities.
    special: bool,
    /// The file's weights are finite and complete.
    finite: bool,
}

impl Ctx {
    /// Batch and sequence lengths: small, smaller for wide layers, whose outputs the
    /// allocator may refuse (either outcome then).
    fn lengths(
        &self,
        u: &mut Unstructured,
        widths: &[usize],
        expect: &mut Expect,
    ) -> Result<[usize; 2]> {
        let max = if widths.iter().any(|&w| w > 4096) {
            2
        } else {
            5
        };
        if widths.iter().any(|&w| w > 1 << 16) {
            expect.unsure("outputs of huge widths");
        }
        Ok([small(u, max)?, small(u, max)?])
    }

    /// Outputs of finite weights and inputs are finite.
    fn assert_finite(&self, what: &str, out: &[f32]) {
        if self.finite && !self.special {
            assert!(
                out.iter().all(|x| x.is_finite()),
                "{what}: non-finite output"
            );
        }
    }

    fn isa(u: &mut Unstructured, expect: &mut Expect) -> Result<Option<Isa>> {
        if !chance(u, 1, 4)? {
            return Ok(None);
        }
        let isa = *u.choose(&Isa::ALL)?;
        if !isa.is_supported() {
            expect.fault("an ISA this CPU lacks");
        }
        Ok(Some(isa))
    }

    fn self_attention(
        &mut self,
        u: &mut Unstructured,
        sd: &StateDict,
        prefix: &str,
        plan: Option<&Plan>,
    ) -> Result<()> {
        let res = SelfAttention::from_state_dict(sd, prefix);
        assert_loaded(plan, |l| matches!(l, Layer::SelfAttention { .. }), &res);
        let Ok(layer) = res else { return Ok(()) };
        let sd2 = layer.state_dict("x");
        let again = SelfAttention::from_state_dict(&sd2, "x").expect("reloading a state_dict");
        assert_eq!(
            again.state_dict("x"),
            sd2,
            "SelfAttention through its state_dict"
        );
        let width = |name| sd.shape(&join(prefix, name)).map_or(0, |s| s[1]);
        let e_in = [
            width("query.weight"),
            width("key.weight"),
            width("value.weight"),
        ];
        let mut expect = Expect::default();
        let [b, lq] = self.lengths(u, &[layer.head_dim(), layer.out_dim()], &mut expect)?;
        let lk = small(u, 5)?;
        let q = Input::decode(u, [b, lq, e_in[0]], false, self, &mut expect)?;
        let k = Input::decode(u, [b, lk, e_in[1]], false, self, &mut expect)?;
        let v = Input::decode(u, [b, lk, e_in[2]], false, self, &mut expect)?;
        let opts = mha_options(u, b, lk, &mut expect)?;
        let res = layer.forward_qkv(&q.tokens(), &k.tokens(), &v.tokens(), &opts.options());
        expect.check("SelfAttention::forward_qkv", &res);
        if let Ok(y) = res {
            assert_eq!(
                y.shape,
                q.out_shape(layer.out_dim()),
                "SelfAttention output shape"
            );
            assert_eq!(
                Some(y.out.len()),
                product(&y.shape),
                "SelfAttention output length"
            );
            self.assert_finite("SelfAttention", &y.out);
        }
        Ok(())
    }

    fn multihead(
        &mut self,
        u: &mut Unstructured,
        sd: &StateDict,
        prefix: &str,
        plan: Option<&Plan>,
    ) -> Result<()> {
        let cfg = match plan.and_then(Plan::mha_config) {
            Some(cfg) if chance(u, 7, 8)? => cfg,
            _ => decode_config(u)?,
        };
        let res = MultiheadAttention::from_state_dict(cfg, sd, prefix);
        let written_for = plan.filter(|p| p.mha_config() == Some(cfg));
        assert_loaded(written_for, |l| matches!(l, Layer::Mha { .. }), &res);
        let Ok(mha) = res else { return Ok(()) };
        let sd2 = mha.state_dict("x");
        let again = MultiheadAttention::from_state_dict(cfg, &sd2, "x").expect("reloading");
        assert_eq!(
            again.state_dict("x"),
            sd2,
            "MultiheadAttention through its state_dict"
        );
        // The layer's own configuration: `kdim` / `vdim` left unset are read from a checkpoint
        // with separate projections.
        let run_cfg = *mha.config();
        let (e, kdim, vdim) = (
            run_cfg.embed_dim,
            run_cfg.kdim.unwrap_or(run_cfg.embed_dim),
            run_cfg.vdim.unwrap_or(run_cfg.embed_dim),
        );
        let mut expect = Expect::default();
        let [b, lq] = self.lengths(u, &[e, kdim, vdim], &mut expect)?;
        let q = Input::decode(u, [b, lq, e], false, self, &mut expect)?;
        // Self-attention: one input for query, key and value.
        let same = kdim == e && vdim == e && chance(u, 1, 2)?;
        let lk = if same { lq } else { small(u, 5)? };
        let (k, v) = if same {
            (None, None)
        } else {
            let k = Input::decode(u, [b, lk, kdim], false, self, &mut expect)?;
            let v = Input::decode(u, [b, lk, vdim], false, self, &mut expect)?;
            (Some(k), Some(v))
        };
        let opts = mha_options(u, b, lk, &mut expect)?;
        let (qt, kt, vt) = (
            q.tokens(),
            k.as_ref().map(Input::tokens),
            v.as_ref().map(Input::tokens),
        );
        let res = mha.forward(
            &qt,
            kt.as_ref().unwrap_or(&qt),
            vt.as_ref().unwrap_or(&qt),
            &opts.options(),
        );
        expect.check("MultiheadAttention::forward", &res);
        if let Ok(y) = res {
            assert_eq!(y.shape, q.out_shape(e), "MultiheadAttention output shape");
            assert_eq!(
                Some(y.out.len()),
                product(&y.shape),
                "MultiheadAttention output length"
            );
            if let Some(w) = &y.weights {
                assert_eq!(Some(w.len()), product(&y.weights_shape), "weights length");
            }
            self.assert_finite("MultiheadAttention", &y.out);
        }
        Ok(())
    }

    fn additive(
        &mut self,
        u: &mut Unstructured,
        sd: &StateDict,
        prefix: &str,
        plan: Option<&Plan>,
    ) -> Result<()> {
        let res = AdditiveAttention::from_state_dict(sd, prefix);
        assert_loaded(plan, |l| matches!(l, Layer::Additive { .. }), &res);
        let Ok(layer) = res else { return Ok(()) };
        let sd2 = layer.state_dict("x");
        let again = AdditiveAttention::from_state_dict(&sd2, "x").expect("reloading a state_dict");
        assert_eq!(
            again.state_dict("x"),
            sd2,
            "AdditiveAttention through its state_dict"
        );
        let (a, dq, dk) = layer.dims();
        let mut expect = Expect::default();
        let [b, lq] = self.lengths(u, &[a, dq, dk], &mut expect)?;
        let (lk, dv) = (small(u, 5)?, small(u, 5)?);
        let q = Input::decode(u, [b, lq, dq], false, self, &mut expect)?;
        let k = Input::decode(u, [b, lk, dk], false, self, &mut expect)?;
        let v = Input::decode(u, [b, lk, dv], true, self, &mut expect)?;
        let lens = key_lengths(u, b, lk, &mut expect)?;
        let mut opts = AdditiveOptions::new()
            .outputs(chance(u, 1, 2)?, chance(u, 1, 2)?)
            .par(*u.choose(&[Par::Rayon, Par::Seq])?);
        if let Some(l) = &lens {
            opts = opts.key_lengths(l);
        }
        if let Some(isa) = Ctx::isa(u, &mut expect)? {
            opts = opts.isa(isa);
        }
        let res = layer.forward(&q.tokens(), &k.tokens(), &v.tokens(), &opts);
        expect.check("AdditiveAttention::forward", &res);
        if let Ok(y) = res {
            assert_eq!(y.shape, q.out_shape(dv), "AdditiveAttention output shape");
            assert_eq!(
                Some(y.out.len()),
                product(&y.shape),
                "AdditiveAttention output length"
            );
            self.assert_finite("AdditiveAttention", &y.out);
        }
        Ok(())
    }

    fn linear(&mut self, u: &mut Unstructured, sd: &StateDict, prefix: &str) -> Result<()> {
        let name = join(prefix, u.choose(&["query", "out_proj", "W_q", "key"])?);
        let Ok(lin) = Linear::from_state_dict(sd, &name) else {
            return Ok(());
        };
        let (inf, outf) = (lin.in_features(), lin.out_features());
        let mut expect = Expect::default();
        let [b, l] = self.lengths(u, &[inf, outf], &mut expect)?;
        let x = Input::decode(u, [b, l, inf], false, self, &mut expect)?;
        let res = lin.forward(&x.tokens(), *u.choose(&[Par::Rayon, Par::Seq])?);
        expect.check("Linear::forward", &res);
        if let Ok(y) = res {
            assert_eq!(
                Some(y.len()),
                product(&[b, l, outf]),
                "Linear output length"
            );
        }
        Ok(())
    }
}

/// Panics if `plan` is a layer of the kind `is_kind` accepts that must load, and `res` failed.
fn assert_loaded<T>(plan: Option<&Plan>, is_kind: fn(&Layer) -> bool, res: &attnkit::Result<T>) {
    if let (Some(p), Err(e)) = (plan, res) {
        if is_kind(&p.layer) && p.must_load() {
            panic!("an intact file of {p:?} did not load: {e:?}");
        }
    }
}

/// A configuration of small or wild sizes (the file decides whether it loads).
fn decode_config(u: &mut Unstructured) -> Result<MhaConfig> {
    let mut cfg = MhaConfig::new(size(u, 16, 1)?, size(u, 4, 1)?);
    if chance(u, 1, 4)? {
        cfg = cfg.kv_heads(size(u, 4, 1)?);
    }
    if chance(u, 1, 4)? {
        cfg = cfg.kdim(size(u, 16, 1)?).vdim(size(u, 16, 1)?);
    }
    Ok(cfg.bias(chance(u, 3, 4)?))
}

/// Optional key lengths for `b` sequences of `lk` keys; rarely a wrong count or a length past
/// `lk` (faults).
fn key_lengths(
    u: &mut Unstructured,
    b: usize,
    lk: usize,
    expect: &mut Expect,
) -> Result<Option<Vec<usize>>> {
    if !chance(u, 1, 3)? {
        return Ok(None);
    }
    let n = if chance(u, 1, 16)? { small(u, 6)? } else { b };
    if n != b {
        expect.fault("key lengths of the wrong count");
    }
    let lens: Vec<usize> = (0..n)
        .map(|_| u.int_in_range(0..=lk + 1))
        .collect::<Result<_>>()?;
    if lens.iter().any(|&l| l > lk) {
        expect.fault("a key length past Lk");
    }
    Ok(Some(lens))
}

/// Options of an MHA forward pass (built by `options()` over borrowed key lengths).
struct MhaOpts {
    lens: Option<Vec<usize>>,
    causal: Option<Causal>,
    weights: Weights,
    isa: Option<Isa>,
    par: Par,
    path: Fusion,
}

impl MhaOpts {
    fn options(&self) -> MhaOptions<'_> {
        let mut o = MhaOptions::new()
            .weights(self.weights)
            .par(self.par)
            .fusion(self.path);
        if let Some(c) = self.causal {
            o = o.causal(c);
        }
        if let Some(l) = &self.lens {
            o = o.key_padding_mask(KeyPadding::lengths(l));
        }
        if let Some(isa) = self.isa {
            o = o.isa(isa);
        }
        o
    }
}

/// MHA options for `b` sequences of `lk` keys; asking the unfused path for weights must fail.
fn mha_options(u: &mut Unstructured, b: usize, lk: usize, expect: &mut Expect) -> Result<MhaOpts> {
    let lens = key_lengths(u, b, lk, expect)?;
    let weights = *u.choose(&[
        Weights::None,
        Weights::None,
        Weights::Averaged,
        Weights::PerHead,
    ])?;
    let path = *u.choose(&[Fusion::Fused, Fusion::Unfused])?;
    if path == Fusion::Unfused && weights != Weights::None {
        expect.fault("weights from the unfused path");
    }
    let opts = MhaOpts {
        lens,
        causal: *u.choose(&[
            None,
            Some(Causal::TopLeft),
            Some(Causal::BottomRight),
            Some(Causal::BottomRightAtLk),
        ])?,
        weights,
        isa: Ctx::isa(u, expect)?,
        par: *u.choose(&[Par::Rayon, Par::Seq])?,
        path,
    };
    Ok(opts)
}
