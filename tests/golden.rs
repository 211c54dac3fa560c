//! PyTorch goldens (`tests/data`, copied from `shared/golden`) through the public API, on every
//! ISA this CPU has (and once on the ISA the crate detects, so `ATTNKIT_ISA` forces a path):
//! `sdpa` with BHLD views, `sdpa` with BLHD inputs and output, `sdpa` forced onto each kernel
//! (`Kernel::Prefill`, `Kernel::Decode`), and `unfused::sdpa_unfused`. Each output element must satisfy
//! `|out − golden_f64| ≤ 1e-5 + 1e-5·|golden_f64|` (the README's hint: PyTorch's own f32 lands
//! within 7e-7 of the f64 golden in every case).
//!
//! The options of each case are derived from its `meta.json` (`params` and the `attn_mask=`
//! argument of `torch_call`), so a case's inputs are always used the way PyTorch used them.
//! Cases whose mask can be expressed in several ways run once per way (key padding as
//! `key_lengths`, as a `(B,1,1,Lk)` bool mask and as the expanded `(B,H,Lq,Lk)` mask; bottom-right
//! causal as `Causal::BottomRight` and as its explicit bool mask), and the ways must agree.

mod common;

use attnkit::kernels::flash_path;
use attnkit::{
    bf16, f16, sdpa, sdpa_ext, unfused, Causal, Extras, Isa, Kernel, MaskRef, Operand, SdpaOptions,
    Tensor, TensorMut,
};
use common::{compare, from_blhd, isas, lh, to_blhd, ATOL, RTOL};
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// A minimal JSON reader for meta.json (no dependency needed for ~100 lines).

#[derive(Clone, Debug)]
enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    fn parse(text: &str) -> Json {
        let mut p = JsonParser {
            s: text.as_bytes(),
            i: 0,
        };
        let v = p.value();
        p.ws();
        assert_eq!(p.i, p.s.len(), "json: trailing characters at byte {}", p.i);
        v
    }
    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    fn at(&self, key: &str) -> &Json {
        self.get(key)
            .unwrap_or_else(|| panic!("json: missing key {key:?}"))
    }
    fn num(&self) -> f64 {
        match self {
            Json::Num(x) => *x,
            other => panic!("json: expected a number, got {other:?}"),
        }
    }
    fn usize(&self) -> usize {
        let x = self.num();
        assert!(x >= 0.0 && x.fract() == 0.0, "json: {x} is not a size");
        x as usize
    }
    fn str(&self) -> &str {
        match self {
            Json::Str(s) => s,
            other => panic!("json: expected a string, got {other:?}"),
        }
    }
    fn arr(&self) -> &[Json] {
        match self {
            Json::Arr(a) => a,
            other => panic!("json: expected an array, got {other:?}"),
        }
    }
    fn bool(&self) -> bool {
        match self {
            Json::Bool(b) => *b,
            other => panic!("json: expected a bool, got {other:?}"),
        }
    }
    fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }
    fn sizes(&self) -> Vec<usize> {
        self.arr().iter().map(Json::usize).collect()
    }
}

struct JsonParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl JsonParser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn peek(&mut self) -> u8 {
        self.ws();
        *self.s.get(self.i).expect("json: unexpected end")
    }
    fn eat(&mut self, c: u8) {
        assert_eq!(
            self.peek(),
            c,
            "json: expected {:?} at byte {}",
            c as char,
            self.i
        );
        self.i += 1;
    }
    fn lit(&mut self, word: &str, v: Json) -> Json {
        assert!(
            self.s[self.i..].starts_with(word.as_bytes()),
            "json: bad literal at byte {}",
            self.i
        );
        self.i += word.len();
        v
    }
    fn value(&mut self) -> Json {
        match self.peek() {
            b'{' => {
                self.i += 1;
                let mut kv = Vec::new();
                if self.peek() == b'}' {
                    self.i += 1;
                    return Json::Obj(kv);
                }
                loop {
                    let k = self.string();
                    self.eat(b':');
                    kv.push((k, self.value()));
                    match self.peek() {
                        b',' => self.i += 1,
                        b'}' => {
                            self.i += 1;
                            return Json::Obj(kv);
                        }
                        c => panic!(
                            "json: unexpected {:?} in object at byte {}",
                            c as char, self.i
                        ),
                    }
                }
            }
            b'[' => {
                self.i += 1;
                let mut a = Vec::new();
                if self.peek() == b']' {
                    self.i += 1;
                    return Json::Arr(a);
                }
                loop {
                    a.push(self.value());
                    match self.peek() {
                        b',' => self.i += 1,
                        b']' => {
                            self.i += 1;
                            return Json::Arr(a);
                        }
                        c => panic!(
                            "json: unexpected {:?} in array at byte {}",
                            c as char, self.i
                        ),
                    }
                }
            }
            b'"' => Json::Str(self.string()),
            b't' => self.lit("true", Json::Bool(true)),
            b'f' => self.lit("false", Json::Bool(false)),
            b'n' => self.lit("null", Json::Null),
            b'N' => self.lit("NaN", Json::Num(f64::NAN)),
            b'I' => self.lit("Infinity", Json::Num(f64::INFINITY)),
            _ if self.s[self.i..].starts_with(b"-Infinity") => {
                self.lit("-Infinity", Json::Num(f64::NEG_INFINITY))
            }
            _ => {
                let start = self.i;
                while self.i < self.s.len() && b"+-0123456789.eE".contains(&self.s[self.i]) {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).unwrap();
                Json::Num(
                    t.parse()
                        .unwrap_or_else(|_| panic!("json: bad number {t:?} at byte {start}")),
                )
            }
        }
    }
    fn hex4(&mut self) -> u32 {
        let t = std::str::from_utf8(&self.s[self.i..self.i + 4]).unwrap();
        self.i += 4;
        u32::from_str_radix(t, 16).expect("json: bad \\u escape")
    }
    fn string(&mut self) -> String {
        self.eat(b'"');
        let mut out = Vec::new();
        loop {
            let c = self.s[self.i];
            self.i += 1;
            match c {
                b'"' => return String::from_utf8(out).expect("json: invalid UTF-8"),
                b'\\' => {
                    let e = self.s[self.i];
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let mut u = self.hex4();
                            if (0xD800..0xDC00).contains(&u) && self.s[self.i..].starts_with(b"\\u")
                            {
                                self.i += 2;
                                let lo = self.hex4();
                                u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
                            }
                            char::from_u32(u).unwrap_or('\u{fffd}')
                        }
                        _ => panic!("json: bad escape at byte {}", self.i),
                    };
                    let mut b = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut b).as_bytes());
                }
                _ => out.push(c),
            }
        }
    }
}

#[test]
fn json_reader_handles_what_meta_json_uses() {
    let j = Json::parse(
        r#" {"a": [1, -2.5e-3, null, true, false], "s": "x\"y\u00e9\n", "o": {}, "e": []} "#,
    );
    assert_eq!(j.at("a").arr().len(), 5);
    assert_eq!(j.at("a").arr()[1].num(), -2.5e-3);
    assert!(j.at("a").arr()[2].is_null());
    assert!(j.at("a").arr()[3].bool());
    assert_eq!(j.at("s").str(), "x\"y\u{e9}\n");
    assert!(j.get("missing").is_none());
}

// ---------------------------------------------------------------------------------------------
// Loading a case.

/// Every golden case this file checks (one `#[test]` each, below).
const CASES: &[&str] = &[
    "sdpa_basic",
    "sdpa_weights",
    "sdpa_cross",
    "sdpa_causal",
    "sdpa_causal_rect_topleft",
    "sdpa_causal_rect_bottomright",
    "sdpa_bool_mask",
    "sdpa_float_mask",
    "sdpa_key_padding",
    "sdpa_scale_custom",
    "sdpa_dot_product",
    "sdpa_large_logits",
    "sdpa_gqa",
    "long_sequence",
    "long_sequence_causal",
    "decode",
];

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("data")
}

struct Golden {
    name: String,
    dir: PathBuf,
    meta: Json,
}

impl Golden {
    fn open(name: &str) -> Golden {
        let dir = data_dir().join(name);
        let text = std::fs::read_to_string(dir.join("meta.json"))
            .unwrap_or_else(|e| panic!("{name}: cannot read meta.json: {e}"));
        Golden {
            name: name.to_string(),
            dir,
            meta: Json::parse(&text),
        }
    }
    fn param(&self, key: &str) -> &Json {
        self.meta.at("params").at(key)
    }
    fn has_input(&self, key: &str) -> bool {
        self.meta.at("inputs").get(key).is_some()
    }
    /// A file of this case, or of the case named in `inputs_from` when it shares the inputs.
    fn path(&self, file: &str) -> PathBuf {
        let p = self.dir.join(file);
        if p.exists() {
            return p;
        }
        let from = std::fs::read_to_string(self.dir.join("inputs_from"))
            .unwrap_or_else(|_| panic!("{}: {file} is missing", self.name));
        data_dir().join(from.trim()).join(file)
    }
    /// Raw bytes of `section.key`, checked against the shape and element size in meta.json.
    fn raw(&self, section: &str, key: &str, dtype: &str, size: usize) -> (Vec<u8>, Vec<usize>) {
        let e = self.meta.at(section).at(key);
        assert_eq!(
            e.at("dtype").str(),
            dtype,
            "{}: {section}.{key} dtype",
            self.name
        );
        let shape = e.at("shape").sizes();
        let path = self.path(e.at("file").str());
        let bytes =
            std::fs::read(&path).unwrap_or_else(|err| panic!("{}: {path:?}: {err}", self.name));
        let n: usize = shape.iter().product();
        assert_eq!(
            bytes.len(),
            n * size,
            "{}: {path:?} has the wrong length for shape {shape:?}",
            self.name
        );
        (bytes, shape)
    }
    fn f32(&self, key: &str) -> (Vec<f32>, Vec<usize>) {
        let (b, s) = self.raw("inputs", key, "f32", 4);
        (
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            s,
        )
    }
    fn bools(&self, key: &str) -> (Vec<bool>, Vec<usize>) {
        let (b, s) = self.raw("inputs", key, "u8", 1);
        assert!(b.iter().all(|&x| x <= 1), "{}: {key} is not 0/1", self.name);
        (b.iter().map(|&x| x == 1).collect(), s)
    }
    fn i32(&self, key: &str) -> (Vec<i32>, Vec<usize>) {
        let (b, s) = self.raw("inputs", key, "i32", 4);
        (
            b.chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            s,
        )
    }
    fn f64_out(&self, key: &str) -> Option<(Vec<f64>, Vec<usize>)> {
        self.meta.at("outputs").get(key)?;
        let (b, s) = self.raw("outputs", key, "f64", 8);
        Some((
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            s,
        ))
    }
}

/// A mask shape from meta: `(Lq, Lk)` is broadcast as `(1, 1, Lq, Lk)`.
fn mask_shape(s: &[usize]) -> [usize; 4] {
    match *s {
        [lq, lk] => [1, 1, lq, lk],
        [b, h, lq, lk] => [b, h, lq, lk],
        _ => panic!("unexpected mask shape {s:?}"),
    }
}

enum VMask {
    None,
    Bool(Vec<bool>, [usize; 4]),
    Bias(Vec<f32>, [usize; 4]),
}

/// One way of passing a case's masking to `sdpa`.
struct Variant {
    name: String,
    causal: Option<Causal>,
    mask: VMask,
    key_lengths: Option<Vec<usize>>,
}

impl Variant {
    /// Options for this variant; `isa: None` lets the crate detect it (honouring `ATTNKIT_ISA`).
    fn opts(&self, scale: Option<f32>, isa: Option<Isa>) -> SdpaOptions<'_> {
        let mut o = SdpaOptions::new();
        if let Some(isa) = isa {
            o = o.isa(isa);
        }
        if let Some(s) = scale {
            o = o.scale(s);
        }
        if let Some(c) = self.causal {
            o = o.causal(c);
        }
        match &self.mask {
            VMask::None => {}
            VMask::Bool(m, s) => o = o.bool_mask(MaskRef::new(m, *s)),
            VMask::Bias(m, s) => o = o.bias(MaskRef::new(m, *s)),
        }
        if let Some(l) = &self.key_lengths {
            o = o.key_lengths(l);
        }
        o
    }
}

/// The identifier passed as `attn_mask=` in `torch_call` (`None`, `mask`, `bias`, `key_valid`).
fn torch_attn_mask(call: &str) -> &str {
    let rest = &call[call
        .find("attn_mask=")
        .expect("torch_call without attn_mask=")
        + "attn_mask=".len()..];
    let end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    &rest[..end]
}

fn variants(g: &Golden) -> Vec<Variant> {
    let is_causal = g.param("is_causal").bool();
    let alignment = g.param("causal_alignment");
    let bottom_right = !alignment.is_null() && alignment.str().starts_with("bottom-right");
    let plain = |name: &str, causal| Variant {
        name: name.into(),
        causal,
        mask: VMask::None,
        key_lengths: None,
    };
    let bool_input = |key: &str| {
        let (m, s) = g.bools(key);
        VMask::Bool(m, mask_shape(&s))
    };
    let mut v = Vec::new();
    match torch_attn_mask(g.meta.at("torch_call").str()) {
        "None" => {
            v.push(plain(
                if is_causal {
                    "causal=TopLeft"
                } else {
                    "no mask"
                },
                is_causal.then_some(Causal::TopLeft),
            ));
            if is_causal && g.has_input("mask") {
                // The documented (not passed) causal mask must give the same result.
                v.push(Variant {
                    name: "bool mask.u8".into(),
                    causal: None,
                    mask: bool_input("mask"),
                    key_lengths: None,
                });
            }
        }
        "mask" => {
            assert!(
                !is_causal,
                "{}: mask and is_causal together are not mapped",
                g.name
            );
            v.push(Variant {
                name: "bool mask.u8".into(),
                causal: None,
                mask: bool_input("mask"),
                key_lengths: None,
            });
            if bottom_right {
                v.push(plain("causal=BottomRight", Some(Causal::BottomRight)));
            }
        }
        "bias" => {
            let (b, s) = g.f32("bias");
            v.push(Variant {
                name: "bias.f32".into(),
                causal: None,
                mask: VMask::Bias(b, mask_shape(&s)),
                key_lengths: None,
            });
        }
        "key_valid" => {
            let (lens, _) = g.i32("key_lengths");
            let lens: Vec<usize> = lens.iter().map(|&l| usize::try_from(l).unwrap()).collect();
            let (valid, s) = g.bools("key_valid");
            let [b, lk] = s[..] else {
                panic!("key_valid shape {s:?}")
            };
            v.push(Variant {
                name: "key_lengths".into(),
                causal: None,
                mask: VMask::None,
                key_lengths: Some(lens),
            });
            v.push(Variant {
                name: "bool (B,1,1,Lk)".into(),
                causal: None,
                mask: VMask::Bool(valid, [b, 1, 1, lk]),
                key_lengths: None,
            });
            v.push(Variant {
                name: "bool mask.u8 (B,H,Lq,Lk)".into(),
                causal: None,
                mask: bool_input("mask"),
                key_lengths: None,
            });
        }
        other => panic!("{}: attn_mask={other} is not mapped", g.name),
    }
    v
}

/// How a golden is run: the fused kernel with `Kernel::Auto` on BHLD views and on BLHD views, the
/// fused kernel forced onto each of its two kernels (BHLD), and the unfused baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Run {
    AutoBhld,
    AutoBlhd,
    Prefill,
    Decode,
    Unfused,
}

const RUNS: [Run; 5] = [
    Run::AutoBhld,
    Run::AutoBlhd,
    Run::Prefill,
    Run::Decode,
    Run::Unfused,
];

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    qs: [usize; 4],
    ks: [usize; 4],
    vs: [usize; 4],
    os: [usize; 4],
}

/// Runs one path; returns the output as dense `(B, H, Lq, Dv)`. The output starts as NaN, so an
/// element left unwritten fails the comparison.
fn run(x: &Inputs, opts: &SdpaOptions, how: Run) -> Vec<f32> {
    let n: usize = x.os.iter().product();
    let mut out = vec![f32::NAN; n];
    let forced = match how {
        Run::Prefill => opts.kernel(Kernel::Prefill),
        Run::Decode => opts.kernel(Kernel::Decode),
        _ => *opts,
    };
    let r = match how {
        Run::AutoBhld | Run::Prefill | Run::Decode => sdpa(
            &Tensor::bhld(&x.q, x.qs),
            &Tensor::bhld(&x.k, x.ks),
            &Tensor::bhld(&x.v, x.vs),
            &mut TensorMut::bhld(&mut out, x.os),
            &forced,
        ),
        Run::AutoBlhd => {
            let (q, k, v) = (
                to_blhd(&x.q, x.qs),
                to_blhd(&x.k, x.ks),
                to_blhd(&x.v, x.vs),
            );
            let r = sdpa(
                &Tensor::blhd(&q, lh(x.qs)),
                &Tensor::blhd(&k, lh(x.ks)),
                &Tensor::blhd(&v, lh(x.vs)),
                &mut TensorMut::blhd(&mut out, lh(x.os)),
                opts,
            );
            out = from_blhd(&out, x.os);
            r
        }
        Run::Unfused => unfused::sdpa_unfused(
            &Tensor::bhld(&x.q, x.qs),
            &Tensor::bhld(&x.k, x.ks),
            &Tensor::bhld(&x.v, x.vs),
            &mut TensorMut::bhld(&mut out, x.os),
            opts,
        ),
    };
    r.unwrap_or_else(|e| panic!("{how:?}: unexpected error {e}"));
    out
}

/// `(b, h, i, c)` of a flat index into `(B, H, L, C)`.
fn unflatten(idx: usize, s: [usize; 4]) -> [usize; 4] {
    [
        idx / (s[1] * s[2] * s[3]),
        idx / (s[2] * s[3]) % s[1],
        idx / s[3] % s[2],
        idx % s[3],
    ]
}

fn check_case(name: &str) {
    let g = Golden::open(name);
    let p = |k: &str| g.param(k).usize();
    let (b, h, hkv, lq, lk, d) = (p("B"), p("H"), p("H_kv"), p("Lq"), p("Lk"), p("D"));
    let (q, qs) = g.f32("q");
    let (k, ks) = g.f32("k");
    let (v, vs) = g.f32("v");
    let dv = vs[3];
    assert_eq!(qs, [b, h, lq, d], "{name}: q shape vs params");
    assert_eq!(ks, [b, hkv, lk, d], "{name}: k shape vs params");
    assert_eq!(vs[..3], [b, hkv, lk], "{name}: v shape vs params");
    let (want, out_shape) = g.f64_out("out_f64").expect("out_f64");
    let os = [b, h, lq, dv];
    assert_eq!(out_shape, os, "{name}: out shape");
    let x = Inputs {
        q,
        k,
        v,
        qs: [b, h, lq, d],
        ks: [b, hkv, lk, d],
        vs: [b, hkv, lk, dv],
        os,
    };
    let scale = match g.param("scale") {
        Json::Null => None,
        s => Some(s.num() as f32),
    };
    if scale.is_none() {
        let sv = g.param("scale_value").num();
        assert!(
            (sv - 1.0 / (d as f64).sqrt()).abs() < 1e-12,
            "{name}: default scale is 1/sqrt(D)"
        );
    }
    let vars = variants(&g);
    let weights_golden = g.f64_out("weights_f64");
    let fully_masked: Option<Vec<[usize; 3]>> = g
        .meta
        .at("params")
        .get("fully_masked_rows_bhi")
        .map(|rows| {
            rows.arr()
                .iter()
                .map(|r| <[usize; 3]>::try_from(r.sizes()).expect("(b, h, i) triple"))
                .collect()
        });

    let check = |got: &[f32], what: &str| -> f64 {
        let (max, bad, first) = compare(got, &want);
        if let Some(i) = first {
            panic!(
                "{name} {what}: {bad} elements outside {ATOL:e} + {RTOL:e}·|golden|, max err {max:e}; \
                 first at (b,h,i,c) = {:?}: got {}, golden {}",
                unflatten(i, os),
                got[i],
                want[i]
            );
        }
        max
    };

    let mut report = Vec::new();
    for isa in isas() {
        let mut worst = [0.0f64; RUNS.len()];
        let mut per_variant: Vec<Vec<f32>> = Vec::new();
        let mut prefill0 = Vec::new();
        for var in &vars {
            let opts = var.opts(scale, Some(isa));
            for (ri, &how) in RUNS.iter().enumerate() {
                let got = run(&x, &opts, how);
                worst[ri] = worst[ri].max(check(&got, &format!("[{}] {isa} {how:?}", var.name)));
                if how == Run::AutoBhld {
                    per_variant.push(got);
                } else if how == Run::Prefill && prefill0.is_empty() {
                    prefill0 = got;
                }
            }
        }
        // Every way of passing the same masking computes the same thing.
        for (i, other) in per_variant.iter().enumerate().skip(1) {
            let diff = per_variant[0]
                .iter()
                .zip(other)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                diff <= 1e-6,
                "{name} {isa}: variant [{}] differs from [{}] by {diff:e}",
                vars[i].name,
                vars[0].name
            );
        }

        // Weights and logsumexp through `sdpa_ext` (first variant), then lse alone on each
        // kernel (asking for weights selects the prefill kernel; lse alone keeps `Kernel::Auto`'s
        // choice). Fully masked rows are exactly 0 with lse = −inf on every kernel, the others
        // have a finite lse, the same on every kernel.
        let n_rows = b * h * lq;
        let mut werr = f64::NAN;
        let mut lse0: Vec<f32> = Vec::new();
        for (kernel, with_w) in [
            (Kernel::Auto, true),
            (Kernel::Auto, false),
            (Kernel::Prefill, false),
            (Kernel::Decode, false),
        ] {
            let mut lse = vec![f32::NAN; n_rows];
            let mut w = vec![f32::NAN; n_rows * lk];
            let mut out = vec![f32::NAN; os.iter().product()];
            sdpa_ext(
                &Tensor::bhld(&x.q, x.qs),
                &Tensor::bhld(&x.k, x.ks),
                &Tensor::bhld(&x.v, x.vs),
                &mut TensorMut::bhld(&mut out, os),
                &vars[0].opts(scale, Some(isa)).kernel(kernel),
                Extras {
                    lse: Some(&mut lse),
                    weights: with_w.then_some(&mut w[..]),
                },
            )
            .unwrap();
            let what = format!(
                "{name} {isa} {kernel:?}{}",
                if with_w { " with weights" } else { "" }
            );
            if with_w {
                // Weights are only produced by the prefill kernel.
                assert!(
                    out == prefill0,
                    "{what}: asking for extras changed the prefill output"
                );
                if let Some((wg, ws)) = &weights_golden {
                    assert_eq!(ws[..], [b, h, lq, lk], "{name}: weights shape");
                    let (max, bad, first) = compare(&w, wg);
                    if let Some(i) = first {
                        panic!(
                            "{what}: {bad} weights outside tolerance, max err {max:e}; first at {:?}: got {}, golden {}",
                            unflatten(i, [b, h, lq, lk]),
                            w[i],
                            wg[i]
                        );
                    }
                    werr = max;
                }
            } else {
                check(&out, &what);
            }
            for r in 0..n_rows {
                let masked = fully_masked
                    .as_ref()
                    .is_some_and(|rows| rows.contains(&[r / (h * lq), r / lq % h, r % lq]));
                if masked {
                    let row_o = &out[r * dv..(r + 1) * dv];
                    assert!(
                        row_o.iter().all(|&o| o == 0.0),
                        "{what}: fully masked row {r} must be 0, got {row_o:?}"
                    );
                    assert_eq!(
                        lse[r],
                        f32::NEG_INFINITY,
                        "{what}: lse of fully masked row {r}"
                    );
                } else {
                    assert!(lse[r].is_finite(), "{what}: lse of row {r} is {}", lse[r]);
                }
                if with_w {
                    let row_w = &w[r * lk..(r + 1) * lk];
                    let sum: f64 = row_w.iter().map(|&x| x as f64).sum();
                    if masked {
                        assert!(
                            row_w.iter().all(|&x| x == 0.0),
                            "{what}: weights of fully masked row {r}"
                        );
                    } else {
                        assert!(
                            (sum - 1.0).abs() <= 1e-5,
                            "{what}: weights of row {r} sum to {sum}"
                        );
                    }
                }
            }
            if lse0.is_empty() {
                lse0 = lse;
            } else {
                for (r, (a, b)) in lse.iter().zip(&lse0).enumerate() {
                    let same = a == b || (a - b).abs() <= 1e-5 * (1.0 + b.abs());
                    assert!(
                        same,
                        "{what}: lse of row {r} is {a}, the prefill kernel gives {b}"
                    );
                }
            }
        }
        let cols: Vec<String> = RUNS
            .iter()
            .zip(&worst)
            .map(|(r, e)| format!("{r:?} {e:8.2e}"))
            .collect();
        report.push(format!(
            "golden {name:<29} {:<7} {}{}",
            isa.name(),
            cols.join("  "),
            if werr.is_nan() {
                String::new()
            } else {
                format!("  weights {werr:8.2e}")
            }
        ));
    }
    // The ISA the crate picks itself (`ATTNKIT_ISA` when set, else the best one): CI forces
    // each path through this entry once.
    let detected = Isa::detect().expect("ATTNKIT_ISA names an unsupported ISA");
    let mut e = 0.0f64;
    for var in &vars {
        e = e.max(check(
            &run(&x, &var.opts(scale, None), Run::AutoBhld),
            &format!("[{}] detected {detected}", var.name),
        ));
    }
    report.push(format!(
        "golden {name:<29} detected ISA {detected}: AutoBhld {e:8.2e}"
    ));
    if let Some(rows) = &fully_masked {
        assert!(!rows.is_empty(), "{name}: fully_masked_rows_bhi is empty");
    }
    eprintln!("\n{}", report.join("\n"));
}

macro_rules! golden_tests {
    ($($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                check_case(stringify!($case));
            }
        )*
        #[test]
        fn the_test_list_matches_cases() {
            let tests = [$(stringify!($case)),*];
            assert_eq!(tests[..], CASES[..]);
        }
    };
}

golden_tests!(
    sdpa_basic,
    sdpa_weights,
    sdpa_cross,
    sdpa_causal,
    sdpa_causal_rect_topleft,
    sdpa_causal_rect_bottomright,
    sdpa_bool_mask,
    sdpa_float_mask,
    sdpa_key_padding,
    sdpa_scale_custom,
    sdpa_dot_product,
    sdpa_large_logits,
    sdpa_gqa,
    long_sequence,
    long_sequence_causal,
    decode,
);

// ---------------------------------------------------------------------------------------------
// Score modifiers: ALiBi, softcap, attention sinks (kinds `sdpa_alibi`, `sdpa_softcap`,
// `sdpa_sinks`). Their masking is given by `params` (`causal_semantics`, `causal_alignment`,
// `sliding_window`) rather than by `torch_call`, which spells the whole computation out.

const MODIFIER_KINDS: [&str; 3] = ["sdpa_alibi", "sdpa_softcap", "sdpa_sinks"];

const MODIFIER_CASES: [&str; 7] = [
    "sdpa_alibi",
    "sdpa_alibi_causal",
    "sdpa_alibi_decode",
    "sdpa_softcap",
    "sdpa_softcap_causal_gqa",
    "sdpa_sinks",
    "sdpa_sinks_window",
];

/// Runs a modifier case on every ISA, every `Run` and each way of passing its masking (the
/// causal option with its window; the stored `mask.u8` where there is one), and its logsumexp on
/// the prefill and decode kernels, all against the f64 golden.
fn check_modifier_case(name: &str) {
    let g = Golden::open(name);
    let p = |k: &str| g.param(k).usize();
    let (b, h, hkv, lq, lk, d) = (p("B"), p("H"), p("H_kv"), p("Lq"), p("Lk"), p("D"));
    let (q, _) = g.f32("q");
    let (k, _) = g.f32("k");
    let (v, vs) = g.f32("v");
    let dv = vs[3];
    let os = [b, h, lq, dv];
    let x = Inputs {
        q,
        k,
        v,
        qs: [b, h, lq, d],
        ks: [b, hkv, lk, d],
        vs: [b, hkv, lk, dv],
        os,
    };
    let (want, _) = g.f64_out("out_f64").expect("out_f64");
    let (want_lse, _) = g.f64_out("lse_f64").expect("lse_f64");
    assert!(
        g.param("scale").is_null(),
        "{name}: custom scales not mapped"
    );
    let slopes = g.has_input("slopes").then(|| g.f32("slopes").0);
    let sinks = g.has_input("sinks").then(|| g.f32("sinks").0);
    let softcap = g.meta.at("params").get("softcap").map(|c| c.num() as f32);
    let causal = g.param("causal_semantics").bool().then(|| {
        if g.param("causal_alignment")
            .str()
            .starts_with("bottom-right")
        {
            Causal::BottomRight
        } else {
            Causal::TopLeft
        }
    });
    let window = match g.meta.at("params").get("sliding_window") {
        Some(w) if !w.is_null() => Some(w.usize()),
        _ => None,
    };
    let base = |isa: Option<Isa>| {
        let mut o = SdpaOptions::new();
        if let Some(isa) = isa {
            o = o.isa(isa);
        }
        if let Some(s) = &slopes {
            o = o.alibi(s);
        }
        if let Some(s) = &sinks {
            o = o.sinks(s);
        }
        if let Some(c) = softcap {
            o = o.softcap(c);
        }
        o
    };
    let mask = g.has_input("mask").then(|| {
        let (m, s) = g.bools("mask");
        (m, mask_shape(&s))
    });
    let ways = |isa: Option<Isa>| {
        let mut w = Vec::new();
        let mut o = base(isa);
        if let Some(c) = causal {
            o = o.causal(c);
        }
        if let Some(win) = window {
            o = o.window(win);
        }
        w.push(("options", o));
        if let Some((m, s)) = &mask {
            // Without a causal option, ALiBi is bottom-right aligned, as the golden's bias is.
            w.push(("mask.u8", base(isa).bool_mask(MaskRef::new(m, *s))));
        }
        w
    };
    let check = |got: &[f32], want: &[f64], what: &str| -> f64 {
        let (max, bad, first) = compare(got, want);
        if let Some(i) = first {
            panic!(
                "{name} {what}: {bad} elements outside {ATOL:e} + {RTOL:e}·|golden|, max err {max:e}; \
                 first at flat index {i}: got {}, golden {}",
                got[i], want[i]
            );
        }
        max
    };
    let mut report = Vec::new();
    for isa in isas() {
        let (mut worst, mut worst_lse) = (0.0f64, 0.0f64);
        for (way, opts) in ways(Some(isa)) {
            for how in RUNS {
                let got = run(&x, &opts, how);
                worst = worst.max(check(&got, &want, &format!("[{way}] {isa} {how:?}")));
            }
            for kernel in [Kernel::Prefill, Kernel::Decode] {
                let mut lse = vec![f32::NAN; b * h * lq];
                let mut out = vec![f32::NAN; os.iter().product()];
                sdpa_ext(
                    &Tensor::bhld(&x.q, x.qs),
                    &Tensor::bhld(&x.k, x.ks),
                    &Tensor::bhld(&x.v, x.vs),
                    &mut TensorMut::bhld(&mut out, os),
                    &opts.kernel(kernel),
                    Extras {
                        lse: Some(&mut lse),
                        weights: None,
                    },
                )
                .unwrap();
                let what = format!("[{way}] {isa} {kernel:?}");
                worst = worst.max(check(&out, &want, &what));
                worst_lse = worst_lse.max(check(&lse, &want_lse, &format!("{what} lse")));
            }
        }
        report.push(format!(
            "golden {name:<29} {:<7} max err: out {worst:8.2e}, lse {worst_lse:8.2e}",
            isa.name()
        ));
    }
    let detected = Isa::detect().expect("ATTNKIT_ISA names an unsupported ISA");
    for (way, opts) in ways(None) {
        check(
            &run(&x, &opts, Run::AutoBhld),
            &want,
            &format!("[{way}] detected {detected}"),
        );
    }
    eprintln!("\n{}", report.join("\n"));
}

macro_rules! modifier_golden_tests {
    ($($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                check_modifier_case(stringify!($case));
            }
        )*
        #[test]
        fn the_modifier_test_list_matches_cases() {
            let tests = [$(stringify!($case)),*];
            assert_eq!(tests[..], MODIFIER_CASES[..]);
        }
    };
}

modifier_golden_tests!(
    sdpa_alibi,
    sdpa_alibi_causal,
    sdpa_alibi_decode,
    sdpa_softcap,
    sdpa_softcap_causal_gqa,
    sdpa_sinks,
    sdpa_sinks_window,
);

/// The golden cases of `kinds` in `tests/data`, and (when `shared/golden` is present) in the
/// shared set.
fn cases_of_kinds(kinds: &[&str]) -> (Vec<String>, Option<Vec<String>>) {
    let of = |dir: &Path| -> Option<Vec<String>> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .ok()?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let meta = std::fs::read_to_string(e.path().join("meta.json")).ok()?;
                let kind = Json::parse(&meta).at("kind").str().to_string();
                kinds
                    .contains(&kind.as_str())
                    .then(|| e.file_name().to_string_lossy().into_owned())
            })
            .collect();
        v.sort();
        Some(v)
    };
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/golden");
    (of(&data_dir()).expect("tests/data"), of(&shared))
}

/// Every modifier case in `tests/data` is tested, and every one of the shared set was copied.
#[test]
fn every_modifier_case_is_copied_and_tested() {
    let (ours, shared) = cases_of_kinds(&MODIFIER_KINDS);
    let mut cases: Vec<String> = MODIFIER_CASES.iter().map(|s| s.to_string()).collect();
    cases.sort();
    assert_eq!(
        ours, cases,
        "the modifier cases in tests/data and MODIFIER_CASES disagree"
    );
    if let Some(shared) = shared {
        assert_eq!(
            shared, cases,
            "shared modifier cases not all copied into tests/data"
        );
    }
}

/// Every SDPA case in `tests/data` (`"kind": "sdpa"` in its meta.json; other kinds belong to
/// other test files) is checked by a test here, so a copied case cannot be forgotten, and every
/// SDPA case of the shared golden set was copied when that set is present. (The shared set also
/// holds kinds this crate does not implement yet — `sdpa_lowp`, `sdpa_backward`, … — which the
/// issues that add them copy.)
#[test]
fn every_sdpa_case_in_tests_data_is_tested() {
    let mut dirs: Vec<String> = std::fs::read_dir(data_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("meta.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| Golden::open(n).meta.at("kind").str() == "sdpa")
        .collect();
    dirs.sort();
    let mut cases: Vec<String> = CASES.iter().map(|s| s.to_string()).collect();
    cases.sort();
    assert_eq!(
        dirs, cases,
        "the SDPA cases in tests/data and CASES disagree"
    );
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/golden");
    if let Ok(rd) = std::fs::read_dir(&shared) {
        for e in rd.filter_map(|e| e.ok()) {
            let n = e.file_name().to_string_lossy().into_owned();
            let Ok(meta) = std::fs::read_to_string(e.path().join("meta.json")) else {
                continue;
            };
            if Json::parse(&meta).at("kind").str() == "sdpa" {
                assert!(
                    cases.contains(&n),
                    "shared golden case {n} is not copied into tests/data"
                );
            }
        }
    }
}

// Low precision (kind `sdpa_lowp`): bf16 / f16 inputs drawn in f32 and rounded, the f64 output
// of exactly those inputs, and PyTorch's own bf16 / f16 SDPA output. With f32 output ours is the
// f32 kernel on the widened inputs (within the f32 tolerance of the f64 golden); with 16-bit
// output its max and mean errors must each stay within 1.5× PyTorch's, measured the same way
// (against out.f64, from the copied PyTorch output), on every ISA and both kernels. The bf16
// pair and tile paths (`FlashPath::Bf16Pairs`, `AmxTiles`) round the weights to bf16 as
// PyTorch does, so there the f32 output meets PyTorch's bar too (and the logsumexp f32's).

const LOWP_CASES: [&str; 5] = [
    "sdpa_bf16_basic",
    "sdpa_bf16_causal_gqa",
    "sdpa_bf16_decode",
    "sdpa_f16_basic",
    "sdpa_f16_causal",
];

impl Golden {
    /// 16-bit values of `section.key` (dtype `tag`: bf16 or f16), read by `from_bits`.
    fn halves<E>(&self, section: &str, key: &str, tag: &str, from_bits: fn(u16) -> E) -> Vec<E> {
        let (b, _) = self.raw(section, key, tag, 2);
        b.chunks_exact(2)
            .map(|c| from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect()
    }
}

/// Max and mean |got − want|.
fn abs_errs(got: impl Iterator<Item = f64>, want: &[f64]) -> (f64, f64) {
    let (mut max, mut sum) = (0.0f64, 0.0f64);
    for (g, w) in got.zip(want) {
        let e = (g - w).abs();
        assert!(!e.is_nan(), "NaN in a low-precision result");
        max = max.max(e);
        sum += e;
    }
    (max, sum / want.len() as f64)
}

fn check_lowp_case<E: Operand + attnkit::Elem>(name: &str, tag: &str, from_bits: fn(u16) -> E) {
    let g = Golden::open(name);
    assert_eq!(g.meta.at("kind").str(), "sdpa_lowp", "{name}: kind");
    assert_eq!(g.param("input_dtype").str(), tag, "{name}: input dtype");
    assert!(g.param("scale").is_null(), "{name}: custom scale");
    let p = |k: &str| g.param(k).usize();
    let (b, h, hkv, lq, lk, d) = (p("B"), p("H"), p("H_kv"), p("Lq"), p("Lk"), p("D"));
    let input = |key: &str| g.halves("inputs", &format!("{key}_{tag}"), tag, from_bits);
    let (q, k, v) = (input("q"), input("k"), input("v"));
    let (qs, ks) = ([b, h, lq, d], [b, hkv, lk, d]);
    let dv = v.len() / (b * hkv * lk);
    let (vs, os) = ([b, hkv, lk, dv], [b, h, lq, dv]);
    let (want, _) = g.f64_out("out_f64").expect("out_f64");
    let (want_lse, _) = g.f64_out("lse_f64").expect("lse_f64");
    let torch = g.halves("outputs", &format!("out_torch_{tag}"), tag, from_bits);
    let (torch_max, torch_mean) = abs_errs(torch.iter().map(|x| x.to_f32() as f64), &want);
    let mut opts = SdpaOptions::new();
    if g.param("is_causal").bool() {
        // The cases are square, where both alignments agree.
        assert_eq!(lq, lk, "{name}: causal cases are square");
        opts = opts.causal(Causal::TopLeft);
    }
    let mut report = vec![format!(
        "golden {name:<22} PyTorch {tag}: max {torch_max:8.2e} mean {torch_mean:8.2e}"
    )];
    for isa in isas() {
        for kernel in [Kernel::Prefill, Kernel::Decode] {
            let o = opts.isa(isa).kernel(kernel);
            let (tq, tk, tv) = (
                Tensor::bhld(&q, qs),
                Tensor::bhld(&k, ks),
                Tensor::bhld(&v, vs),
            );
            let at = format!("{name} {isa} {kernel:?}");
            // f32 output, and the logsumexp.
            let mut out = vec![f32::NAN; os.iter().product()];
            let mut lse = vec![f32::NAN; b * h * lq];
            let extras = Extras {
                lse: Some(&mut lse),
                weights: None,
            };
            sdpa_ext(
                &tq,
                &tk,
                &tv,
                &mut TensorMut::bhld(&mut out, os),
                &o,
                extras,
            )
            .unwrap();
            // The pair path rounds the weights to bf16, as PyTorch does: its f32 output meets
            // PyTorch's bar rather than f32's.
            let pairs = kernel == Kernel::Prefill
                && flash_path(isa, E::DTYPE, E::DTYPE, d).rounds_weights();
            let mut checks = vec![(&lse, &want_lse, "lse")];
            if pairs {
                let (max, mean) = abs_errs(out.iter().map(|&x| x as f64), &want);
                report.push(format!(
                    "golden {name:<22} {:<10} {kernel:<8?} f32 out: max {max:8.2e} mean {mean:8.2e}",
                    isa.name()
                ));
                assert!(
                    max <= 1.5 * torch_max && mean <= 1.5 * torch_mean,
                    "{at}: f32 output error max {max:e} / mean {mean:e} against PyTorch's \
                     {torch_max:e} / {torch_mean:e} (bar: 1.5×)"
                );
            } else {
                checks.push((&out, &want, "out (f32)"));
            }
            for (got, want, what) in checks {
                let (max, bad, first) = compare(got, want);
                assert!(
                    first.is_none(),
                    "{at} {what}: {bad} elements outside {ATOL:e} + {RTOL:e}·|golden|, max {max:e}"
                );
            }
            // Output in the input's type.
            let mut half = vec![from_bits(0x7e00); os.iter().product()];
            sdpa(&tq, &tk, &tv, &mut TensorMut::bhld(&mut half, os), &o).unwrap();
            let (max, mean) = abs_errs(half.iter().map(|x| x.to_f32() as f64), &want);
            report.push(format!(
                "golden {name:<22} {:<10} {kernel:<8?} {tag} out: max {max:8.2e} mean {mean:8.2e}",
                isa.name()
            ));
            assert!(
                max <= 1.5 * torch_max && mean <= 1.5 * torch_mean,
                "{at}: {tag} output error max {max:e} / mean {mean:e} against PyTorch's \
                 {torch_max:e} / {torch_mean:e} (bar: 1.5×)"
            );
            for (x, y) in half.iter().zip(&out) {
                assert_eq!(
                    x.to_f32().to_bits(),
                    E::from_f32(*y).to_f32().to_bits(),
                    "{at}: {tag} output is the f32 one rounded"
                );
            }
        }
    }
    eprintln!("\n{}", report.join("\n"));
}

macro_rules! lowp_golden_tests {
    ($($case:ident: $t:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                check_lowp_case(stringify!($case), stringify!($t), $t::from_bits);
            }
        )*
        #[test]
        fn the_lowp_test_list_matches_cases() {
            assert_eq!([$(stringify!($case)),*], LOWP_CASES);
        }
    };
}

lowp_golden_tests!(
    sdpa_bf16_basic: bf16,
    sdpa_bf16_causal_gqa: bf16,
    sdpa_bf16_decode: bf16,
    sdpa_f16_basic: f16,
    sdpa_f16_causal: f16,
);

/// Every low-precision case in `tests/data` is in [`LOWP_CASES`] (each has its test above), and
/// every one of the shared set was copied.
#[test]
fn every_lowp_case_is_copied_and_tested() {
    let (ours, shared) = cases_of_kinds(&["sdpa_lowp"]);
    let mut cases: Vec<String> = LOWP_CASES.iter().map(|s| s.to_string()).collect();
    cases.sort();
    assert_eq!(
        ours, cases,
        "the sdpa_lowp cases in tests/data and LOWP_CASES disagree"
    );
    if let Some(shared) = shared {
        assert_eq!(
            shared, cases,
            "shared sdpa_lowp cases not all copied into tests/data"
        );
    }
}

// Backward (kind `sdpa_backward`): the forward through `sdpa_ext_vec` (for O and the
// logsumexp), then `sdpa_backward`; dQ, dK and dV within 1e-5 (abs + rel) of the f64 autograd
// golden — PyTorch's own f32 lands within 1.1e-6 (the cases' tolerance hints). The explicit
// masks run once as given and once as the option they spell (`Causal::BottomRight`; key
// lengths read as the file's `i32` next to the bias), and both must pass.

const BACKWARD_CASES: [&str; 4] = [
    "sdpa_backward_basic",
    "sdpa_backward_causal",
    "sdpa_backward_gqa",
    "sdpa_backward_mask",
];

fn check_backward_case(name: &str) {
    use attnkit::{bias_gradient, sdpa_backward_vec, sdpa_ext_vec, Returns, Saved};
    let g = Golden::open(name);
    let (q, qs) = g.f32("q");
    let (k, ks) = g.f32("k");
    let (v, vs) = g.f32("v");
    let (dout, os) = g.f32("dout");
    let shape = |s: &[usize]| -> [usize; 4] { s.try_into().expect("4-D") };
    let (qs, ks, vs, os) = (shape(&qs), shape(&ks), shape(&vs), shape(&os));
    let mask = g.has_input("mask").then(|| g.bools("mask"));
    let bias = g.has_input("bias").then(|| g.f32("bias"));
    let lens = g.has_input("key_lengths").then(|| g.i32("key_lengths").0);
    let mut ways: Vec<(&str, SdpaOptions)> = Vec::new();
    let mut base = SdpaOptions::new();
    if g.param("is_causal").bool() {
        base = base.causal(Causal::TopLeft);
    }
    if let Some((b, s)) = &bias {
        base = base.bias(MaskRef::new(b, shape(s)));
    }
    if let Some(l) = &lens {
        base = base.key_lengths(l);
    }
    match &mask {
        Some((m, s)) => {
            ways.push((
                "as given",
                base.bool_mask(MaskRef::new(m, [1, 1, s[0], s[1]])),
            ));
            assert!(g.param("causal_semantics").bool(), "{name}: mask is causal");
            ways.push(("as Causal::BottomRight", base.causal(Causal::BottomRight)));
        }
        None => ways.push(("as given", base)),
    }
    let want: Vec<Vec<f64>> = ["dq_f64", "dk_f64", "dv_f64"]
        .iter()
        .map(|k| g.f64_out(k).expect(k).0)
        .collect();
    for isa in isas() {
        for (how, opts) in &ways {
            let opts = opts.isa(isa);
            let (qt, kt, vt) = (
                Tensor::bhld(&q, qs),
                Tensor::bhld(&k, ks),
                Tensor::bhld(&v, vs),
            );
            let fwd = sdpa_ext_vec(
                &qt,
                &kt,
                &vt,
                &opts,
                Returns {
                    lse: true,
                    weights: false,
                },
            )
            .unwrap();
            let lse = fwd.lse.unwrap();
            let saved = Saved {
                q: qt,
                k: kt,
                v: vt,
                out: Tensor::bhld(&fwd.out, os),
                lse: &lse,
            };
            let got = sdpa_backward_vec(&saved, &Tensor::bhld(&dout, os), &opts).unwrap();
            if let Some((want, _)) = g.f64_out("dbias_f64") {
                let dbias = bias_gradient(&saved, &Tensor::bhld(&dout, os), &opts).unwrap();
                let (max, bad, first) = compare(&dbias, &want);
                assert_eq!(bad, 0, "{name} {how} {isa}: dbias {max:e} at {first:?}");
            }
            for (grad, (got, want)) in ["dq", "dk", "dv"]
                .iter()
                .zip([&got.dq, &got.dk, &got.dv].into_iter().zip(&want))
            {
                let (max, bad, first) = compare(got, want);
                assert_eq!(
                    bad, 0,
                    "{name} {how} {isa}: {grad} max error {max:e}, first bad at {first:?}"
                );
            }
        }
    }
}

macro_rules! backward_cases {
    ($($case:ident),*) => {
        mod backward {
            $(
            #[test]
            fn $case() {
                super::check_backward_case(stringify!($case));
            }
            )*
            #[test]
            fn the_backward_test_list_matches_cases() {
                let mut listed = vec![$(stringify!($case)),*];
                listed.sort();
                assert_eq!(listed, super::BACKWARD_CASES);
            }
        }
    };
}
backward_cases!(
    sdpa_backward_basic,
    sdpa_backward_causal,
    sdpa_backward_gqa,
    sdpa_backward_mask
);

/// Every backward case in `tests/data` is tested, and every one of the shared set was copied.
#[test]
fn every_backward_case_is_copied_and_tested() {
    let (ours, shared) = cases_of_kinds(&["sdpa_backward"]);
    assert_eq!(
        ours, BACKWARD_CASES,
        "tests/data and BACKWARD_CASES disagree"
    );
    if let Some(shared) = shared {
        assert_eq!(
            shared, BACKWARD_CASES,
            "shared backward cases not all copied"
        );
    }
}
