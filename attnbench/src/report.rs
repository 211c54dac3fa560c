//! Results: one record per (implementation, case, thread count), written as JSON lines, a
//! terminal table or a markdown table, and read back from JSON lines (`--from`), so that other
//! producers of the same schema (scripts/bench_torch.py) share the table and the plot.

use crate::cases::Case;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// One measured result; the JSON-lines schema, field for field.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub imp: String,
    pub case: Case,
    pub threads: usize,
    pub isa: String,
    pub median_s: f64,
    pub gflops: f64,
    /// `None` when no peak is known (no probe on this CPU and no `--peak`).
    pub pct_peak: Option<f64>,
}

impl Record {
    /// One JSON object on one line: `impl, b, h, hkv, lq, lk, d, causal, threads, isa, median_s,
    /// gflops, pct_peak`.
    pub fn json(&self) -> String {
        let c = &self.case;
        let pct = self
            .pct_peak
            .map_or("null".to_string(), |p| format!("{p:.2}"));
        format!(
            "{{\"impl\":\"{}\",\"b\":{},\"h\":{},\"hkv\":{},\"lq\":{},\"lk\":{},\"d\":{},\"causal\":{},\"threads\":{},\"isa\":\"{}\",\"median_s\":{:.6e},\"gflops\":{:.3},\"pct_peak\":{}}}",
            escape(&self.imp),
            c.b,
            c.h,
            c.hkv,
            c.lq,
            c.lk,
            c.d,
            c.causal,
            self.threads,
            escape(&self.isa),
            self.median_s,
            self.gflops,
            pct
        )
    }

    /// Parses one line of the schema (a flat object; other fields are ignored).
    pub fn parse(line: &str) -> Result<Record, String> {
        let fields = parse_flat_object(line)?;
        let get = |k: &str| fields.get(k).ok_or_else(|| format!("missing field {k:?}"));
        let num = |k: &str| -> Result<f64, String> {
            match get(k)? {
                Value::Num(x) => Ok(*x),
                v => Err(format!("field {k:?} is not a number: {v:?}")),
            }
        };
        let int = |k: &str| num(k).map(|x| x as usize);
        let text = |k: &str| match get(k)? {
            Value::Str(s) => Ok(s.clone()),
            v => Err(format!("field {k:?} is not a string: {v:?}")),
        };
        let causal = match get("causal")? {
            Value::Bool(b) => *b,
            v => return Err(format!("field \"causal\" is not a boolean: {v:?}")),
        };
        let pct_peak = match fields.get("pct_peak") {
            Some(Value::Num(x)) => Some(*x),
            _ => None,
        };
        Ok(Record {
            imp: text("impl")?,
            case: Case {
                b: int("b")?,
                h: int("h")?,
                hkv: int("hkv")?,
                lq: int("lq")?,
                lk: int("lk")?,
                d: int("d")?,
                causal,
            },
            threads: int("threads")?,
            isa: text("isa")?,
            median_s: num("median_s")?,
            gflops: num("gflops")?,
            pct_peak,
        })
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

#[derive(Clone, Debug, PartialEq)]
enum Value {
    Num(f64),
    Str(String),
    Bool(bool),
    Null,
}

/// A minimal parser for one flat JSON object of strings, numbers, booleans and nulls (what the
/// schema has); nested values are an error.
fn parse_flat_object(s: &str) -> Result<BTreeMap<String, Value>, String> {
    let mut it = s.trim().chars().peekable();
    let mut out = BTreeMap::new();
    let skip_ws = |it: &mut std::iter::Peekable<std::str::Chars>| {
        while it.peek().is_some_and(|c| c.is_whitespace()) {
            it.next();
        }
    };
    fn string(it: &mut std::iter::Peekable<std::str::Chars>) -> Result<String, String> {
        let mut s = String::new();
        loop {
            match it.next() {
                Some('"') => return Ok(s),
                Some('\\') => match it.next() {
                    Some('n') => s.push('\n'),
                    Some('t') => s.push('\t'),
                    Some(c @ ('"' | '\\' | '/')) => s.push(c),
                    other => return Err(format!("unsupported escape {other:?}")),
                },
                Some(c) => s.push(c),
                None => return Err("unterminated string".into()),
            }
        }
    }
    if it.next() != Some('{') {
        return Err("expected '{'".into());
    }
    loop {
        skip_ws(&mut it);
        match it.next() {
            Some('}') => break,
            Some('"') => {}
            other => return Err(format!("expected a key, found {other:?}")),
        }
        let key = string(&mut it)?;
        skip_ws(&mut it);
        if it.next() != Some(':') {
            return Err(format!("expected ':' after {key:?}"));
        }
        skip_ws(&mut it);
        let value = match it.peek() {
            Some('"') => {
                it.next();
                Value::Str(string(&mut it)?)
            }
            Some(_) => {
                let mut tok = String::new();
                while it
                    .peek()
                    .is_some_and(|&c| c != ',' && c != '}' && !c.is_whitespace())
                {
                    tok.push(it.next().unwrap_or_default());
                }
                match tok.as_str() {
                    "true" => Value::Bool(true),
                    "false" => Value::Bool(false),
                    "null" => Value::Null,
                    t => Value::Num(
                        t.parse()
                            .map_err(|_| format!("bad value {t:?} for {key:?}"))?,
                    ),
                }
            }
            None => return Err("unexpected end".into()),
        };
        out.insert(key, value);
        skip_ws(&mut it);
        match it.next() {
            Some(',') => continue,
            Some('}') => break,
            other => return Err(format!("expected ',' or '}}', found {other:?}")),
        }
    }
    Ok(out)
}

/// Implementation order of the tables: ours first, then the peers, then anything else.
fn impl_order(records: &[Record]) -> Vec<String> {
    let known = [
        "fused",
        "fused-prefill",
        "fused-decode",
        "read-kv",
        "unfused-mm",
        "unfused-blas",
        "torch-sdpa",
        "naive",
    ];
    let mut names: Vec<String> = known
        .iter()
        .filter(|k| records.iter().any(|r| r.imp == **k))
        .map(|s| s.to_string())
        .collect();
    for r in records {
        if !names.contains(&r.imp) {
            names.push(r.imp.clone());
        }
    }
    names
}

fn fmt_time(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

/// The terminal table: one block per thread count, one line per case and implementation, with
/// the speed-up over `fused`.
pub fn table(records: &[Record]) -> String {
    let mut s = String::new();
    // Blocks are the pool sizes of the multi-threaded implementations; a single-threaded one
    // (naive) measured once joins the 1-thread block, or the first block if there is none.
    let pools: BTreeSet<usize> = records
        .iter()
        .filter(|r| r.imp != "naive")
        .map(|r| r.threads)
        .collect();
    let threads: BTreeSet<usize> = if pools.is_empty() {
        records.iter().map(|r| r.threads).collect()
    } else {
        pools
    };
    let first = threads.iter().next().copied().unwrap_or(1);
    let block = |r: &Record| {
        if threads.contains(&r.threads) {
            r.threads
        } else {
            first
        }
    };
    let names = impl_order(records);
    let _ = writeln!(
        s,
        "{:>3} {:>3} {:>3} {:>6} {:>6} {:>4} {:>6} | {:<13} {:>7} {:>10} {:>9} {:>7} {:>8} {:>9}",
        "B",
        "H",
        "Hkv",
        "Lq",
        "Lk",
        "D",
        "causal",
        "impl",
        "threads",
        "median",
        "GFLOP/s",
        "% peak",
        "KV GB/s",
        "vs fused"
    );
    for &t in &threads {
        let cases: BTreeSet<Case> = records
            .iter()
            .filter(|r| block(r) == t)
            .map(|r| r.case)
            .collect();
        let _ = writeln!(s, "{}", "-".repeat(118));
        for case in &cases {
            // `fused` of the same page setting (`fused+thp` for `+thp` rows).
            let fused = |imp: &str| {
                let want = format!("fused{}", suffix(imp));
                records
                    .iter()
                    .find(|r| r.case == *case && r.threads == t && r.imp == want)
            };
            let mut first = true;
            for name in &names {
                let Some(r) = records
                    .iter()
                    .find(|r| r.case == *case && r.imp == *name && block(r) == t)
                else {
                    continue;
                };
                let c = &r.case;
                let lead = if first {
                    format!(
                        "{:>3} {:>3} {:>3} {:>6} {:>6} {:>4} {:>6}",
                        c.b,
                        c.h,
                        c.hkv,
                        c.lq,
                        c.lk,
                        c.d,
                        if c.causal { "yes" } else { "no" }
                    )
                } else {
                    " ".repeat(36)
                };
                first = false;
                let pct = r.pct_peak.map_or("-".to_string(), |p| format!("{p:.1}"));
                let vs = fused(&r.imp).map_or("-".to_string(), |f| {
                    format!("{:.2}x", f.median_s / r.median_s)
                });
                let _ = writeln!(
                    s,
                    "{lead} | {:<13} {:>7} {:>10} {:>9.1} {:>7} {:>8.1} {:>9}",
                    r.imp,
                    r.threads,
                    fmt_time(r.median_s),
                    r.gflops,
                    pct,
                    kv_gbs(r),
                    vs
                );
            }
        }
    }
    s
}

/// The variant part of an implementation name: `+thp` of `fused+thp`, `@avx2` of `fused@avx2`.
fn suffix(imp: &str) -> &str {
    imp.find(['+', '@']).map_or("", |i| &imp[i..])
}

/// ` (87 % of read-kv)` (of its GB/s) when the same run measured `read-kv` on `r`'s case with
/// the same page setting (`+thp` rows against `read-kv+thp`), else nothing.
fn read_share(rows: &[&Record], r: &Record) -> String {
    if r.imp.starts_with("read-kv") {
        return String::new();
    }
    // The same pages and forced ISA; the element types do not matter (shares are of GB/s).
    let thp = if r.imp.contains("+thp") { "+thp" } else { "" };
    let at = r.imp.find('@').map_or("", |i| &r.imp[i..]);
    let want = format!("read-kv{thp}{at}");
    rows.iter()
        .find(|x| x.case == r.case && x.imp == want)
        .map_or(String::new(), |x| {
            format!(" ({:.0} % of read-kv)", 100.0 * kv_gbs(r) / kv_gbs(x))
        })
}

/// Bytes per K/V element of the implementation tagged `imp`, rows `d` wide: 2 for our kernels
/// on a 16-bit cache (`+kv-bf16`, `+kv-f16`, or `+bf16` / `+f16` without a `+kv-` tag),
/// `1 + 4/d` on an int8 one (a scale per row), else 4 (read-kv reads the f32 buffers).
fn kv_elem_bytes(imp: &str, d: usize) -> f64 {
    if imp.contains("+kv-int8") {
        1.0 + 4.0 / d.max(1) as f64
    } else if imp.contains("+kv-bf16") || imp.contains("+kv-f16") {
        2.0
    } else if imp.contains("+kv-f32") {
        4.0
    } else if imp.contains("+bf16") || imp.contains("+f16") {
        2.0
    } else {
        4.0
    }
}

/// GB/s of K and V bytes (in the implementation's element size) over the median time.
fn kv_gbs(r: &Record) -> f64 {
    r.case.kv_bytes(kv_elem_bytes(&r.imp, r.case.d)) / r.median_s / 1e9
}

/// Markdown: one table per thread count, one row per case, one column per implementation with
/// `GFLOP/s (% of peak)`; decode rows (Lq = 1) show time, tokens/s and K+V bandwidth instead,
/// with the share of `read-kv` measured in the same run.
pub fn markdown(records: &[Record]) -> String {
    let mut s = String::new();
    let names = impl_order(records);
    let threads: BTreeSet<usize> = records.iter().map(|r| r.threads).collect();
    for &t in &threads {
        let rows: Vec<&Record> = records.iter().filter(|r| r.threads == t).collect();
        if rows.is_empty() {
            continue;
        }
        let cols: Vec<&String> = names
            .iter()
            .filter(|n| rows.iter().any(|r| r.imp == **n))
            .collect();
        let _ = writeln!(s, "\n**{t} thread{}**\n", if t == 1 { "" } else { "s" });
        let _ = write!(s, "| B, H, Lq, Lk, D | causal |");
        for c in &cols {
            let _ = write!(s, " {c} |");
        }
        let _ = write!(s, "\n|---|---|");
        for _ in &cols {
            let _ = write!(s, "---|");
        }
        s.push('\n');
        let cases: BTreeSet<Case> = rows.iter().map(|r| r.case).collect();
        let mut cases: Vec<Case> = cases.into_iter().collect();
        // Small shapes, then families of one (B, H, D) by length, then decode (Lq = 1); causal
        // after unmasked within each group.
        cases.sort_by_key(|c| {
            let group = if c.lq == 1 && c.lk > 1 {
                2
            } else if c.macs() < 1e7 {
                0
            } else {
                1
            };
            (group, c.causal, c.b * c.h * c.d, c.d, c.lk, c.b, c.h)
        });
        for c in &cases {
            let shape = if c.hkv == c.h {
                format!("{}, {}, {}, {}, {}", c.b, c.h, c.lq, c.lk, c.d)
            } else {
                format!(
                    "{}, {} (kv {}), {}, {}, {}",
                    c.b, c.h, c.hkv, c.lq, c.lk, c.d
                )
            };
            let _ = write!(s, "| {shape} | {} |", if c.causal { "yes" } else { "no" });
            for name in &cols {
                match rows.iter().find(|r| r.case == *c && r.imp == **name) {
                    None => s.push_str(" – |"),
                    Some(r) if c.lq == 1 && c.lk > 1 => {
                        // Tokens: one per sequence per call (every query row is a new token).
                        let tokens = (c.b * c.lq) as f64 / r.median_s;
                        let _ = write!(
                            s,
                            " {} · {:.0} tok/s · {:.1} GB/s{} |",
                            fmt_time(r.median_s),
                            tokens,
                            kv_gbs(r),
                            read_share(&rows, r)
                        );
                    }
                    Some(r) if c.macs() < 1e7 => {
                        let _ = write!(s, " {} · {:.1} GFLOP/s |", fmt_time(r.median_s), r.gflops);
                    }
                    Some(r) => match r.pct_peak {
                        Some(p) => {
                            let _ = write!(s, " {:.0} ({:.0} %) |", r.gflops, p);
                        }
                        None => {
                            let _ = write!(s, " {:.0} |", r.gflops);
                        }
                    },
                }
            }
            s.push('\n');
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(imp: &str, threads: usize) -> Record {
        Record {
            imp: imp.into(),
            case: Case::new(1, 16, 512, 512, 64, true),
            threads,
            isa: "avx512".into(),
            median_s: 1.25e-3,
            gflops: 107.4,
            pct_peak: Some(51.2),
        }
    }

    /// K/V bytes follow the tag; the read share compares bandwidths, so a 16-bit row against the
    /// f32 read-kv of the same case and pages is its GB/s over read-kv's.
    #[test]
    fn kv_bandwidth_counts_the_cache_type() {
        assert_eq!(kv_elem_bytes("fused", 64), 4.0);
        assert_eq!(kv_elem_bytes("fused+bf16", 64), 2.0);
        assert_eq!(kv_elem_bytes("fused+alibi+kv-f16", 64), 2.0);
        assert_eq!(kv_elem_bytes("fused+bf16+kv-f32", 64), 4.0);
        assert_eq!(kv_elem_bytes("read-kv+thp", 64), 4.0);
        assert_eq!(kv_elem_bytes("fused+kv-int8", 64), 1.0625);
        let read = Record {
            median_s: 2.0e-3,
            ..rec("read-kv+thp", 1)
        };
        let half = Record {
            median_s: 1.25e-3,
            ..rec("fused+kv-bf16+thp", 1)
        };
        // 2 bytes in 1.25 ms against 4 bytes in 2 ms: 80 % of the read bandwidth.
        assert_eq!(read_share(&[&read, &half], &half), " (80 % of read-kv)");
        assert_eq!(read_share(&[&read], &rec("fused", 1)), "");
    }

    #[test]
    fn json_round_trip() {
        let r = rec("fused", 2);
        let line = r.json();
        assert!(
            line.starts_with("{\"impl\":\"fused\",\"b\":1,\"h\":16,\"hkv\":16,\"lq\":512"),
            "{line}"
        );
        assert_eq!(Record::parse(&line).unwrap(), r);
        let none = Record {
            pct_peak: None,
            ..r
        };
        assert_eq!(Record::parse(&none.json()).unwrap(), none);
    }

    #[test]
    fn parses_python_json() {
        // `json.dumps` spacing, as scripts/bench_torch.py prints it.
        let line = r#"{"impl": "torch-sdpa", "b": 1, "h": 16, "hkv": 16, "lq": 512, "lk": 512, "d": 64, "causal": false, "threads": 1, "isa": "avx512", "median_s": 0.00123, "gflops": 109.1, "pct_peak": null}"#;
        let r = Record::parse(line).unwrap();
        assert_eq!(r.imp, "torch-sdpa");
        assert!(!r.case.causal);
        assert_eq!(r.pct_peak, None);
        assert!(Record::parse("{\"impl\": 3}").is_err());
        assert!(Record::parse("not json").is_err());
    }

    #[test]
    fn tables_mention_every_impl() {
        let rs = vec![rec("fused", 1), rec("unfused-mm", 1), rec("fused", 2)];
        let t = table(&rs);
        assert!(t.contains("unfused-mm") && t.contains("1.00x"), "{t}");
        let m = markdown(&rs);
        assert!(
            m.contains("| fused | unfused-mm |") && m.contains("107 (51 %)"),
            "{m}"
        );
        assert!(m.contains("**2 threads**"), "{m}");
    }

    #[test]
    fn decode_cells_show_the_share_of_read_kv() {
        let case = Case {
            hkv: 8,
            ..Case::new(1, 32, 1, 8192, 128, false)
        };
        let mk = |imp: &str, t: f64| Record {
            imp: imp.into(),
            case,
            median_s: t,
            ..rec("x", 1)
        };
        let rs = vec![
            mk("fused", 4e-3),
            mk("read-kv", 3e-3),
            mk("fused+thp", 5e-3),
            mk("read-kv+thp", 4e-3),
        ];
        let m = markdown(&rs);
        assert!(m.contains("(75 % of read-kv)"), "{m}");
        assert!(m.contains("(80 % of read-kv)"), "{m}");
        assert_eq!(m.matches("% of read-kv").count(), 2, "{m}");
    }
}
