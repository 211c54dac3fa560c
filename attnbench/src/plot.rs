//! `--plot FILE.svg`: GFLOP/s against sequence length, one panel per thread count, one colour per
//! implementation; solid lines without a mask, dashed with the causal mask. Shapes that differ
//! only in sequence length are joined by a line; the others are single markers. Decode shapes
//! (Lq = 1) are left out: their FLOP rate is not comparable (they are bandwidth-bound).

use crate::report::Record;
use plotters::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draws the records into an SVG file; `peaks` maps a thread count to its FMA peak (a dashed
/// grey line).
pub fn plot(
    path: &str,
    records: &[Record],
    peaks: &BTreeMap<usize, f64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let recs: Vec<&Record> = records
        .iter()
        .filter(|r| !(r.case.lq == 1 && r.case.lk > 1))
        .collect();
    if recs.is_empty() {
        return Err("nothing to plot (decode shapes are not plotted)".into());
    }
    let threads: Vec<usize> = recs
        .iter()
        .map(|r| r.threads)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut impls: Vec<String> = Vec::new();
    for r in &recs {
        if !impls.contains(&r.imp) {
            impls.push(r.imp.clone());
        }
    }
    let color = |imp: &str| COLORS[impls.iter().position(|i| i == imp).unwrap_or(0) % COLORS.len()];
    let xmin = recs.iter().map(|r| r.case.lk).min().unwrap_or(1).max(1) as f64 / 1.3;
    let xmax = recs.iter().map(|r| r.case.lk).max().unwrap_or(1).max(2) as f64 * 1.3;
    let ymax = recs
        .iter()
        .map(|r| r.gflops)
        .chain(peaks.values().copied())
        .fold(1.0f64, f64::max)
        * 1.3; // head room above the highest point for the legend
               // Ticks at the measured lengths (powers of two in the presets).
    let ticks: Vec<f64> = recs
        .iter()
        .map(|r| r.case.lk)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(|l| l as f64)
        .collect();

    let root = SVGBackend::new(path, (620 * threads.len() as u32, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    for (area, &t) in root.split_evenly((1, threads.len())).iter().zip(&threads) {
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{t} thread{}", if t == 1 { "" } else { "s" }),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(56)
            .build_cartesian_2d(
                (xmin..xmax).log_scale().with_key_points(ticks.clone()),
                0.0..ymax,
            )?;
        chart
            .configure_mesh()
            .x_desc("sequence length (Lq = Lk)")
            .y_desc("GFLOP/s = 4·B·H·Lq·Lk·D / time (½ causal)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()?;
        if let Some(&p) = peaks.get(&t) {
            chart
                .draw_series(DashedLineSeries::new(
                    [(xmin, p), (xmax, p)],
                    6,
                    4,
                    RGBColor(150, 150, 150).stroke_width(1),
                ))?
                .label(format!("FMA peak {p:.0}"))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RGBColor(150, 150, 150)));
        }
        for imp in &impls {
            for causal in [false, true] {
                let mine: Vec<&&Record> = recs
                    .iter()
                    .filter(|r| r.threads == t && r.imp == *imp && r.case.causal == causal)
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                let c = color(imp);
                let style = c.stroke_width(2);
                let families: BTreeSet<_> = mine.iter().map(|r| r.case.family()).collect();
                for fam in families {
                    let mut pts: Vec<(f64, f64)> = mine
                        .iter()
                        .filter(|r| r.case.family() == fam)
                        .map(|r| (r.case.lk as f64, r.gflops))
                        .collect();
                    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                    if pts.len() > 1 {
                        if causal {
                            chart.draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))?;
                        } else {
                            chart.draw_series(LineSeries::new(pts.clone(), style))?;
                        }
                    }
                    chart.draw_series(pts.iter().map(|&p| {
                        if causal {
                            TriangleMarker::new(p, 5, c.filled()).into_dyn()
                        } else {
                            Circle::new(p, 4, c.filled()).into_dyn()
                        }
                    }))?;
                }
                // One legend entry per (implementation, mask).
                let label = format!("{imp}{}", if causal { " causal" } else { "" });
                chart
                    .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
                    .label(label)
                    .legend(move |(x, y)| {
                        if causal {
                            TriangleMarker::new((x + 9, y), 5, c.filled()).into_dyn()
                        } else {
                            Circle::new((x + 9, y), 4, c.filled()).into_dyn()
                        }
                    });
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()?;
    }
    root.present()?;
    Ok(())
}
