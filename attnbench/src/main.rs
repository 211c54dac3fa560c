//! `attnbench`: attention implementations side by side, in one process, on the same inputs.
//!
//! ```text
//! cargo run --release                                   # short preset, readable table (< 1 min)
//! cargo run --release --bin attnbench -- --preset core --json --threads 1,2
//! cargo run --release --features blas --bin attnbench -- --preset core --plot core.svg
//! cargo run --release --bin attnbench -- --b 1 --h 32 --hkv 8 --lq 1 --lk 8192 --d 128
//! cargo run --release --bin attnbench -- --from results.jsonl --markdown --plot all.svg
//! ```
//!
//! Every figure: median wall time of several calls after warm-up, GFLOP/s under the convention
//! `4·B·H·Lq·Lk·D / time` (halved for a causal mask when `Lq = Lk`), and that as a percentage of
//! the FMA peak probed at start for the same thread count. `--help` lists the options.

#[cfg(feature = "blas")]
mod blas_core;
mod cases;
mod impls;
mod peak;
mod plot;
mod report;

use attnkit::{Isa, Precision};
use cases::Case;
use impls::{Impl, Inputs};
use indicatif::{ProgressBar, ProgressStyle};
use report::Record;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::{Duration, Instant};

const HELP: &str = "\
attnbench: attention implementations side by side (fused, unfused-mm, unfused-blas, naive).

USAGE: attnbench [OPTIONS]            (no options: --preset quick, a table, under a minute)

SHAPES
  --preset NAME       quick | core | decode | small   (see --list; the attention layers are
                      measured by `cargo run --release --example layers_bench`)
  --b N --h N --hkv N --lq N --lk N --d N
                      one explicit shape instead (defaults B=1 H=16 Hkv=H Lq=1024 Lk=Lq D=64)
  --causal [yes|no|both]
                      top-left causal mask; with a preset, keeps only the cases that match
                      (default for an explicit shape: no; `--causal` alone means yes)
RUN
  --impl LIST         comma-separated from fused, fused-prefill, fused-decode (the kernel forced),
                      read-kv, unfused-mm, unfused-blas, naive (default: fused and the baselines
                      this build has; unfused-blas needs --features blas; naive only on small
                      shapes; read-kv, decode shapes only, reads K and V once and computes
                      nothing: the memory ceiling, measured in the same run)
  --threads LIST      rayon threads, e.g. 1,2 (default: all cores)
  --isa NAME          scalar | avx2 | avx512 for our kernels (default: best, or $ATTNKIT_ISA)
  --warmup N          untimed calls first (default 1)
  --reps N            at least N timed calls (default 5) ...
  --min-time SECS     ... and at least this long in all (default 0.3) ...
  --max-time SECS     ... but stop after this long once 3 calls are done (default 5)
  --seed N            input seed (default 42; inputs are uniform in [-1, 1))
  --cold              each timed call reads its own copy of the inputs, as many copies as make
                      ≥ 1 GiB (at most 64), so K and V come from memory, not from the last-level
                      cache the previous call filled (as in a model, where each layer's KV cache
                      is read once per token); for decode shapes on a CPU with a large L3
  --huge-pages        ask for transparent huge pages for Q, K, V (Linux madvise; what KvCache
                      does for its own buffers; matters for decode, see BENCHMARKS.md); the
                      implementations are reported as NAME+thp
  --alibi             ALiBi with the standard slopes (max bias 8) on our implementations
  --softcap CAP       softcap CAP on our implementations
  --sinks             one attention-sink logit per head (uniform in [-2, 2]) on ours
                      (each modifier tags the implementation: fused+alibi+softcap+sinks)
  --dtype T           f32 | bf16 | f16: Q, K, V of our fused kernels in T (output f32); the
                      inputs are rounded to T for every implementation, so all compute on the
                      same values (tags fused+bf16 / fused+f16)
  --precision P       highest | medium: with medium, f32 Q, K, V of our prefill kernel are
                      rounded to bf16 and multiplied as bf16 pairs where the ISA has them
                      (avx512bf16, amx; PyTorch's set_float32_matmul_precision); tag +medium
  --kv-dtype T        K and V of our fused kernels in T (f32 | bf16 | f16 | int8), Q staying
                      in --dtype (a 16-bit KV cache with f32 queries: --kv-dtype bf16; tag
                      fused+kv-bf16); int8 quantises each (token, head) row with its own f32
                      scale, as KvCache<i8> does (sdpa_int8), and every implementation then
                      computes on the dequantised values; KV GB/s counts T's bytes (int8: the
                      values plus 4 bytes of scale a row)
  --paged PAGE        K and V of fused-paged (opt-in: --impl fused,fused-paged,read-kv) in a
                      PagedKvCache of PAGE tokens a page (a power of two), in --kv-dtype, its
                      pages scattered over the pool; decode cases (Lq = 1, not causal) and
                      causal prompts (Lq = Lk: the cache's bottom-right mask is top-left there)
  --naive-max M       largest case for naive, in millions of multiply-adds (default 32)
  --peak GFLOPS       one thread's FMA peak, instead of the probe (scaled by the thread count)
OUTPUT
  --json              JSON lines: impl, b, h, hkv, lq, lk, d, causal, threads, isa, median_s,
                      gflops, pct_peak
  --markdown          markdown tables (one per thread count) instead of the terminal table
  --plot FILE.svg     GFLOP/s against sequence length, per implementation and thread count
  --from FILE         read JSON lines (ours, scripts/bench_torch.py's) instead of measuring;
                      repeatable; combine with --markdown / --plot
  --list              list the presets and implementations
  -h, --help          this text

FLOPs = 4*B*H*Lq*Lk*D per call (halved for causal when Lq = Lk); pct_peak = GFLOP/s / peak.
";

#[derive(Debug)]
struct Config {
    cases: Vec<Case>,
    impls: Vec<String>,
    threads: Vec<usize>,
    isa: Isa,
    warmup: usize,
    reps: usize,
    min_time: f64,
    max_time: f64,
    seed: u64,
    huge_pages: bool,
    cold: bool,
    naive_max: f64,
    peak: Option<f64>,
    json: bool,
    markdown: bool,
    plot: Option<String>,
    from: Vec<String>,
    preset: Option<String>,
}

/// The element type named by the value of `opt` (`int8` only where `int8` is true: K and V).
fn dtype(opt: &str, t: &str, int8: bool) -> Result<attnkit::Dtype, String> {
    match t {
        "f32" => Ok(attnkit::Dtype::F32),
        "bf16" => Ok(attnkit::Dtype::Bf16),
        "f16" => Ok(attnkit::Dtype::F16),
        "int8" if int8 => Ok(attnkit::Dtype::I8),
        t if int8 => Err(format!("{opt}: expected f32, bf16, f16 or int8, got {t:?}")),
        t => Err(format!("{opt}: expected f32, bf16 or f16, got {t:?}")),
    }
}

fn parse_args(args: Vec<String>) -> Result<Option<Config>, String> {
    let mut it = args.into_iter().peekable();
    let mut preset: Option<String> = None;
    let mut shape: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut causal: Option<String> = None;
    let mut cfg = Config {
        cases: Vec::new(),
        impls: impls::DEFAULT.iter().map(|s| s.to_string()).collect(),
        threads: vec![rayon::current_num_threads()],
        isa: Isa::detect().map_err(|e| e.to_string())?,
        warmup: 1,
        reps: 5,
        min_time: 0.3,
        max_time: 5.0,
        seed: 42,
        huge_pages: false,
        cold: false,
        naive_max: 32e6,
        peak: None,
        json: false,
        markdown: false,
        plot: None,
        from: Vec::new(),
        preset: None,
    };
    let mut explicit_impls = false;
    while let Some(arg) = it.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let value =
            |it: &mut std::iter::Peekable<std::vec::IntoIter<String>>| -> Result<String, String> {
                match inline.clone() {
                    Some(v) => Ok(v),
                    None => it.next().ok_or_else(|| format!("{key} needs a value")),
                }
            };
        let num = |s: String| -> Result<f64, String> {
            s.parse::<f64>()
                .map_err(|_| format!("{key}: not a number: {s:?}"))
        };
        let int = |s: String| -> Result<usize, String> {
            s.parse::<usize>()
                .map_err(|_| format!("{key}: not a count: {s:?}"))
        };
        match key.as_str() {
            "-h" | "--help" => {
                print!("{HELP}");
                return Ok(None);
            }
            "--list" => {
                println!("presets:");
                for (name, what) in cases::PRESETS {
                    println!("  {name:<8} {what}");
                }
                println!("implementations: {}", impls::NAMES.join(", "));
                println!(
                    "the layers (mha, additive): `cargo run --release --example layers_bench`"
                );
                return Ok(None);
            }
            "--preset" => preset = Some(value(&mut it)?),
            "--b" | "--h" | "--hkv" | "--lq" | "--lk" | "--d" => {
                let name: &'static str = match key.as_str() {
                    "--b" => "b",
                    "--h" => "h",
                    "--hkv" => "hkv",
                    "--lq" => "lq",
                    "--lk" => "lk",
                    _ => "d",
                };
                shape.insert(name, int(value(&mut it)?)?);
            }
            "--causal" => {
                causal = Some(match inline.clone() {
                    Some(v) => v,
                    None if it.peek().is_some_and(|v| !v.starts_with("--")) => {
                        it.next().unwrap_or_default()
                    }
                    None => "yes".into(),
                })
            }
            "--impl" => {
                cfg.impls = value(&mut it)?
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect();
                explicit_impls = true;
            }
            "--threads" => {
                cfg.threads = value(&mut it)?
                    .split(',')
                    .map(|s| int(s.trim().to_string()))
                    .collect::<Result<_, _>>()?;
                if cfg.threads.contains(&0) {
                    return Err("--threads: counts must be ≥ 1".into());
                }
            }
            "--isa" => {
                let isa: Isa = value(&mut it)?
                    .parse()
                    .map_err(|e: attnkit::IsaError| e.to_string())?;
                cfg.isa = isa.check().map_err(|e| e.to_string())?;
            }
            "--warmup" => cfg.warmup = int(value(&mut it)?)?,
            "--reps" => cfg.reps = int(value(&mut it)?)?.max(1),
            "--min-time" => cfg.min_time = num(value(&mut it)?)?,
            "--max-time" => cfg.max_time = num(value(&mut it)?)?,
            "--seed" => cfg.seed = int(value(&mut it)?)? as u64,
            "--huge-pages" => cfg.huge_pages = true,
            "--alibi" => impls::modifiers_mut().alibi = true,
            "--softcap" => impls::modifiers_mut().softcap = Some(num(value(&mut it)?)? as f32),
            "--sinks" => impls::modifiers_mut().sinks = true,
            "--precision" => {
                impls::modifiers_mut().precision = match value(&mut it)?.as_str() {
                    "highest" => Precision::Highest,
                    "medium" => Precision::Medium,
                    p => {
                        return Err(format!(
                            "--precision: expected highest or medium, got {p:?}"
                        ))
                    }
                }
            }
            "--dtype" => impls::modifiers_mut().dtype = dtype("--dtype", &value(&mut it)?, false)?,
            "--kv-dtype" => {
                impls::modifiers_mut().kv_dtype = Some(dtype("--kv-dtype", &value(&mut it)?, true)?)
            }
            "--paged" => {
                let page = int(value(&mut it)?)?;
                if !page.is_power_of_two() {
                    return Err(format!(
                        "--paged {page}: the page length must be a power of two"
                    ));
                }
                impls::modifiers_mut().paged = Some(page);
            }
            "--cold" => cfg.cold = true,
            "--naive-max" => cfg.naive_max = num(value(&mut it)?)? * 1e6,
            "--peak" => cfg.peak = Some(num(value(&mut it)?)?),
            "--json" => cfg.json = true,
            "--markdown" => cfg.markdown = true,
            "--plot" => cfg.plot = Some(value(&mut it)?),
            "--from" => cfg.from.push(value(&mut it)?),
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    if !explicit_impls && !cfg!(feature = "blas") {
        // Not asked for by name: leave it out quietly (the header says how to get it).
        cfg.impls.retain(|n| n != "unfused-blas");
    }
    let keep = |c: &Case| -> Result<bool, String> {
        Ok(match causal.as_deref() {
            None | Some("both") => true,
            Some("yes" | "true" | "1") => c.causal,
            Some("no" | "false" | "0") => !c.causal,
            Some(v) => return Err(format!("--causal: expected yes, no or both, got {v:?}")),
        })
    };
    if !shape.is_empty() {
        if preset.is_some() {
            return Err(
                "give either --preset or an explicit shape (--b/--h/--lq/…), not both".into(),
            );
        }
        let h = *shape.get("h").unwrap_or(&16);
        let lq = *shape.get("lq").or(shape.get("lk")).unwrap_or(&1024);
        let base = Case {
            b: *shape.get("b").unwrap_or(&1),
            h,
            hkv: *shape.get("hkv").unwrap_or(&h),
            lq,
            lk: *shape.get("lk").unwrap_or(&lq),
            d: *shape.get("d").unwrap_or(&64),
            causal: false,
        };
        if base.hkv == 0 || !base.h.is_multiple_of(base.hkv) {
            return Err(format!(
                "--h {} must be a multiple of --hkv {}",
                base.h, base.hkv
            ));
        }
        let variants: &[bool] = match causal.as_deref() {
            None => &[false],
            Some("both") => &[false, true],
            _ => &[false, true],
        };
        for &c in variants {
            let case = Case { causal: c, ..base };
            if keep(&case)? {
                cfg.cases.push(case);
            }
        }
    } else if cfg.from.is_empty() {
        let name = preset.unwrap_or_else(|| "quick".into());
        let all = cases::preset(&name).ok_or_else(|| {
            format!(
                "unknown preset {name:?}; known: {}",
                cases::PRESETS
                    .iter()
                    .map(|p| p.0)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        for c in all {
            if keep(&c)? {
                cfg.cases.push(c);
            }
        }
        cfg.preset = Some(name);
    }
    Ok(Some(cfg))
}

/// Bytes of input copies `--cold` cycles through: several times any last-level cache here.
const COLD_BYTES: f64 = (1u64 << 30) as f64;

/// Median seconds of `f` after `warmup` untimed calls: at least `reps` calls and `min_time`
/// seconds, stopping after `max_time` once 3 calls are done.
fn measure(cfg: &Config, mut f: impl FnMut()) -> f64 {
    for _ in 0..cfg.warmup {
        f();
    }
    let mut times = Vec::new();
    let start = Instant::now();
    loop {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
        let total = start.elapsed().as_secs_f64();
        let enough = times.len() >= cfg.reps && total >= cfg.min_time;
        if enough || (times.len() >= 3 && total >= cfg.max_time) || times.len() >= 10_000 {
            break;
        }
    }
    times.sort_by(f64::total_cmp);
    let n = times.len();
    if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    }
}

/// FMA peak of `threads` threads: `--peak` × threads, or the probe.
fn peak_for(cfg: &Config, threads: usize, cache: &mut BTreeMap<usize, Option<f64>>) -> Option<f64> {
    if let Some(p) = cfg.peak {
        return Some(p * threads as f64);
    }
    *cache
        .entry(threads)
        .or_insert_with(|| peak::probe(threads, cfg.isa))
}

fn main() {
    // Before anything is measured: may restart the process with OpenBLAS's kernels chosen.
    #[cfg(feature = "blas")]
    blas_core::ensure();
    let cfg = match parse_args(std::env::args().skip(1).collect()) {
        Ok(Some(cfg)) => cfg,
        Ok(None) => return,
        Err(e) => {
            eprintln!("attnbench: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&cfg) {
        eprintln!("attnbench: {e}");
        std::process::exit(1);
    }
}

fn run(cfg: &Config) -> Result<(), Box<dyn std::error::Error>> {
    let mut records: Vec<Record> = Vec::new();
    let mut peaks: BTreeMap<usize, f64> = BTreeMap::new();
    if !cfg.from.is_empty() {
        for path in &cfg.from {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
            for (i, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                records.push(Record::parse(line).map_err(|e| format!("{path}:{}: {e}", i + 1))?);
            }
        }
        // Peaks implied by the records (gflops / pct_peak), for the plot's peak line.
        for r in &records {
            if let Some(p) = r.pct_peak.filter(|&p| p > 0.0) {
                peaks.entry(r.threads).or_insert(r.gflops / (p / 100.0));
            }
        }
        return output(cfg, &records, &peaks, false);
    }

    // Every implementation in the list runs or the run fails: one asked for by name that this
    // build lacks is an error, not a silent omission (the default list holds only built ones).
    let chosen = cfg
        .impls
        .iter()
        .map(|name| impls::by_name(name, cfg.naive_max))
        .collect::<Result<Vec<_>, _>>()?;
    if cfg.cases.is_empty() || chosen.is_empty() {
        return Err(
            "nothing to run: no shape or no implementation left (see --causal, --impl)".into(),
        );
    }

    let mut probe_cache = BTreeMap::new();
    let total = cfg.threads.len() * cfg.cases.len() * chosen.len();
    let pb = if total > 1 {
        ProgressBar::new(total as u64)
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} [{elapsed_precise}] {msg}",
    )?);
    pb.enable_steady_tick(Duration::from_millis(200));
    if !cfg.json {
        pb.suspend(|| header(cfg, &chosen));
    }
    // (implementation, reason) → cases.
    let mut skipped: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut naive_done = false;
    for &t in &cfg.threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        pb.set_message(format!("probing the FMA peak on {t} thread(s)"));
        let peak_t = peak_for(cfg, t, &mut probe_cache);
        if let Some(p) = peak_t {
            peaks.insert(t, p);
        }
        for case in &cfg.cases {
            // Identical copies (same seed), one per call in turn under --cold: enough that the
            // smallest form any implementation reads (an int8 cache is a quarter of the f32
            // buffers) adds up to COLD_BYTES.
            let copies = if cfg.cold {
                let m = impls::modifiers();
                let kv = m.kv_dtype.unwrap_or(m.dtype).size().min(m.dtype.size()) as f64;
                (COLD_BYTES / (case.input_bytes() * kv / 4.0).max(1.0)).clamp(1.0, 64.0) as usize
            } else {
                1
            };
            let inputs: Vec<Inputs> = (0..copies)
                .map(|_| Inputs::new(case, cfg.seed, cfg.huge_pages))
                .collect();
            let mut reference: Option<Vec<f32>> = None;
            for imp in &chosen {
                pb.set_message(format!("{} {case} on {t} thread(s)", imp.name()));
                let threads = imp.threads(t);
                // A single-threaded implementation is measured once, not per pool size.
                if threads != t && (naive_done || cfg.threads.contains(&threads)) {
                    pb.inc(1);
                    continue;
                }
                if let Some(why) = imp.skip(case) {
                    if t == cfg.threads[0] {
                        skipped
                            .entry((imp.name().to_string(), why))
                            .or_default()
                            .push(format!("({case})"));
                    }
                    pb.inc(1);
                    continue;
                }
                let mut out = vec![0.0f32; case.q_len()];
                let mut call = 0;
                let median = pool.install(|| {
                    measure(cfg, || {
                        imp.run(case, &inputs[call % copies], &mut out, cfg.isa);
                        call += 1;
                    })
                });
                // Same inputs, so every implementation must agree with the first one.
                match &reference {
                    _ if !imp.is_attention() => {}
                    None => reference = Some(out.clone()),
                    Some(want) => {
                        let err = out
                            .iter()
                            .zip(want)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0.0f32, f32::max);
                        if err.is_nan() || err > 1e-3 {
                            pb.suspend(|| eprintln!("attnbench: WARNING {} differs from {} on {case}: max |Δ| = {err:e}", imp.name(), chosen[0].name()));
                        }
                    }
                }
                let gflops = imp.flops_factor() * case.flops() / median / 1e9;
                let peak = if threads == t {
                    peak_t
                } else {
                    peak_for(cfg, threads, &mut probe_cache)
                };
                if let Some(p) = peak {
                    peaks.entry(threads).or_insert(p);
                }
                let rec = Record {
                    // Huge-page runs get their own rows in the tables.
                    imp: format!(
                        "{}{}{}",
                        imp.name(),
                        impls::modifiers_tag(imp.name()),
                        if cfg.huge_pages { "+thp" } else { "" }
                    ),
                    case: *case,
                    threads,
                    isa: imp.isa_label(cfg.isa, case),
                    median_s: median,
                    gflops,
                    pct_peak: peak.map(|p| 100.0 * gflops / p),
                };
                if cfg.json {
                    pb.suspend(|| {
                        let mut so = std::io::stdout().lock();
                        let _ = writeln!(so, "{}", rec.json());
                        let _ = so.flush();
                    });
                }
                records.push(rec);
                pb.inc(1);
            }
        }
        if chosen.iter().any(|i| i.threads(t) != t) {
            naive_done = true;
        }
    }
    pb.finish_and_clear();
    for ((name, why), cases) in &skipped {
        let list = if cases.len() <= 3 {
            format!(": {}", cases.join(" "))
        } else {
            String::new()
        };
        eprintln!(
            "attnbench: skipped {name} on {} case(s), {why}{list}",
            cases.len()
        );
    }

    output(cfg, &records, &peaks, cfg.json)
}

/// What the numbers mean, printed above the table.
fn header(cfg: &Config, chosen: &[Box<dyn Impl>]) {
    let names: Vec<&str> = chosen.iter().map(|i| i.name()).collect();
    println!(
        "attnbench {}: {} on {} case(s), threads {:?}, ISA {}{}",
        cfg.preset
            .as_deref()
            .map_or("explicit shape".to_string(), |p| format!("preset {p}")),
        names.join(", "),
        cfg.cases.len(),
        cfg.threads,
        cfg.isa,
        if cfg!(feature = "blas") {
            ""
        } else {
            " (unfused-blas: build with --features blas)"
        }
    );
    println!(
        "median of ≥{} calls and ≥{}s after {} warm-up call(s){}; GFLOP/s = 4·B·H·Lq·Lk·D / median (½ if causal and Lq = Lk; 3.5× for fused-backward, forward + backward); \
         % peak vs the {} FMA peak of the same thread count; KV GB/s = bytes of K and V / median",
        cfg.reps,
        cfg.min_time,
        cfg.warmup,
        if cfg.cold {
            ", each on its own copy of the inputs (--cold)"
        } else {
            ""
        },
        if cfg.peak.is_some() { "given (--peak)" } else { "probed" }
    );
    #[cfg(feature = "blas")]
    if names.contains(&"unfused-blas") {
        println!("{}", blas_core::describe());
    }
}

fn output(
    cfg: &Config,
    records: &[Record],
    peaks: &BTreeMap<usize, f64>,
    json_done: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    if cfg.json && !json_done {
        for r in records {
            println!("{}", r.json());
        }
    }
    // A share over 100 % means the peak under-read (a noisy probe), not a kernel past the
    // hardware: say so rather than print it silently.
    for r in records {
        if let Some(p) = r.pct_peak.filter(|&p| p > 100.0) {
            let c = &r.case;
            eprintln!(
                "attnbench: warning: {} at (B, H, Lq, Lk, D) = ({}, {}, {}, {}, {}) on {} thread(s) \
                 reads {p:.0} % of the peak: the probe under-read it (a busy host?); \
                 give the peak with --peak GFLOPS",
                r.imp, c.b, c.h, c.lq, c.lk, c.d, r.threads
            );
        }
    }
    if cfg.markdown {
        print!("{}", report::markdown(records));
    } else if !cfg.json {
        if !peaks.is_empty() {
            let p: Vec<String> = peaks
                .iter()
                .map(|(t, g)| format!("{t} thread(s) {g:.0} GFLOP/s"))
                .collect();
            let how = if cfg.peak.is_some() || !cfg.from.is_empty() {
                "given".to_string()
            } else {
                format!(
                    "probe: {}, {} independent chains per thread, best of {}",
                    peak::describe(cfg.isa),
                    peak::CHAINS,
                    peak::TRIALS
                )
            };
            println!("FMA peak ({how}): {}", p.join(", "));
        }
        print!("{}", report::table(records));
    }
    if let Some(path) = &cfg.plot {
        plot::plot(path, records, peaks)?;
        eprintln!("attnbench: wrote {path}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn default_is_the_quick_preset() {
        let cfg = parse_args(vec![]).unwrap().unwrap();
        assert_eq!(cfg.cases, cases::preset("quick").unwrap());
        assert!(!cfg.json);
    }

    #[test]
    fn explicit_shape() {
        let cfg = parse_args(args(
            "--b 2 --h 8 --hkv 2 --lq 1 --lk 4096 --d 128 --threads 1,2 --json",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(
            cfg.cases,
            vec![Case {
                b: 2,
                h: 8,
                hkv: 2,
                lq: 1,
                lk: 4096,
                d: 128,
                causal: false
            }]
        );
        assert_eq!(cfg.threads, vec![1, 2]);
        assert!(!cfg.cold);
        assert!(
            parse_args(args("--lq 1 --lk 64 --cold"))
                .unwrap()
                .unwrap()
                .cold
        );
        let cfg = parse_args(args("--lq 64 --causal")).unwrap().unwrap();
        assert!(cfg.cases.len() == 1 && cfg.cases[0].causal && cfg.cases[0].lk == 64);
        let cfg = parse_args(args("--lq=64 --causal=both")).unwrap().unwrap();
        assert_eq!(cfg.cases.len(), 2);
    }

    #[test]
    fn preset_filter_and_errors() {
        let cfg = parse_args(args("--preset core --causal no"))
            .unwrap()
            .unwrap();
        assert_eq!(cfg.cases.len(), 6);
        assert!(parse_args(args("--preset nope")).is_err());
        assert!(parse_args(args("--preset core --lq 5")).is_err());
        assert!(parse_args(args("--h 6 --hkv 4")).is_err());
        assert!(parse_args(args("--threads 0")).is_err());
        assert!(parse_args(args("--frobnicate")).is_err());
    }
}
