//! Pictures of runs: one or more runs' `metrics.jsonl`, runs overlaid in
//! panels (loss and validation loss, LR, grad norm, loss scale with skipped
//! steps, tokens/s, memory), as SVG or PNG — drawn by `macrobatch plot` and
//! at the end of `train`.
//!
//! Text is laid out and rasterised by `ab_glyph` from a font compiled into the
//! binary (assets/DejaVuSans-subset.ttf), so plotting needs no system fonts,
//! fontconfig or FreeType.

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// DejaVu Sans cut to Latin-1 and a few symbols (license: assets/FONT-LICENSE.txt).
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");
/// Picture size in pixels (SVG user units).
const SIZE: (u32, u32) = (1400, 1200);
/// Points per drawn series at most; longer runs keep each bucket's min and max.
const MAX_POINTS: usize = 2000;
/// One color per run (Tableau 10), in the order the runs are given.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// What the x axis counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum XAxis {
    /// Optimizer steps.
    Step,
    /// Target tokens trained on so far (all ranks).
    Tokens,
}

/// The fields of a `metrics.jsonl` line that the plot reads. Every field is
/// optional: a non-finite float is written as `null`, and older runs lack some.
#[derive(Debug, Deserialize)]
struct Record {
    step: u64,
    loss: Option<f64>,
    val_loss: Option<f64>,
    lr: Option<f64>,
    grad_norm: Option<f64>,
    tokens: Option<u64>,
    tokens_per_s: Option<f64>,
    input_tokens_per_s: Option<f64>,
    #[serde(default)]
    skipped: bool,
    loss_scale: Option<f64>,
    mem_params: Option<u64>,
    mem_grads: Option<u64>,
    mem_optimizer: Option<u64>,
    mem_master: Option<u64>,
    mem_activations: Option<u64>,
    mem_comm_buffers: Option<u64>,
    mem_peak_rss: Option<u64>,
    comm_s: Option<f64>,
    step_ms: Option<f64>,
}

impl Record {
    /// The bytes the trainer accounts for (model states, activations, buffers).
    fn mem_accounted(&self) -> Option<u64> {
        let parts = [
            self.mem_params,
            self.mem_grads,
            self.mem_optimizer,
            self.mem_master,
            self.mem_activations,
            self.mem_comm_buffers,
        ];
        parts.iter().any(Option::is_some).then(|| parts.iter().flatten().sum())
    }
}

/// One plotted quantity of a metrics line.
type Field = fn(&Record) -> Option<f64>;

/// One run folder's metrics.
struct Run {
    /// Legend name: the folder's name (its path where two names clash).
    name: String,
    records: Vec<Record>,
    /// x of each record (step, or tokens so far).
    xs: Vec<f64>,
}

/// Reads `dir/metrics.jsonl`. A torn last line (a run killed mid-write) is
/// dropped with a warning; any other bad line is an error naming it.
fn read_run(dir: &Path, x: XAxis) -> Result<Run> {
    if !dir.is_dir() {
        bail!("{}: no such run folder (give folders written by `macrobatch train --out DIR`)", dir.display());
    }
    let path = dir.join("metrics.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "{} has no metrics.jsonl: it is not a run folder, or its run has not finished a step yet",
            dir.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut records = Vec::with_capacity(lines.len());
    for (idx, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Record>(line) {
            Ok(r) => records.push(r),
            Err(_) if idx + 1 == lines.len() && !text.ends_with('\n') => {
                eprintln!("warning: {}: dropped a torn last line (line {})", path.display(), idx + 1);
            }
            Err(e) => bail!("{}:{}: not a metrics line written by `macrobatch train`: {e}", path.display(), idx + 1),
        }
    }
    if records.is_empty() {
        bail!("{} holds no steps yet: nothing to plot (train at least one step)", path.display());
    }
    let mut n_tokens = 0u64;
    let xs = records
        .iter()
        .map(|r| match x {
            XAxis::Step => r.step as f64,
            XAxis::Tokens => {
                n_tokens += r.tokens.unwrap_or(0);
                n_tokens as f64
            }
        })
        .collect();
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string());
    Ok(Run { name, records, xs })
}

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mark {
    /// A solid line of this width.
    Line(u32),
    /// A thin, faint line (a secondary quantity of the same run).
    Faint,
    /// Circles at the points, joined by a thin line.
    Dots,
    /// Red crosses (skipped steps), no line.
    Crosses,
}

/// One drawn series: a run's color, its points, how, and a legend label.
struct Series {
    run_idx: usize,
    points: Vec<(f64, f64)>,
    mark: Mark,
    label: Option<String>,
}

/// One panel of the picture.
struct Panel {
    title: &'static str,
    y_desc: &'static str,
    series: Vec<Series>,
    y_label: fn(&f64) -> String,
    legend: bool,
}

/// The finite points `(x, f(record))` of a run.
fn points(run: &Run, f: impl Fn(&Record) -> Option<f64>) -> Vec<(f64, f64)> {
    run.xs.iter().zip(&run.records).filter_map(|(&x, r)| f(r).filter(|y| y.is_finite()).map(|y| (x, y))).collect()
}

/// At most [`MAX_POINTS`]: each bucket of consecutive points keeps its lowest
/// and highest, in order, so spikes survive the thinning.
fn thin(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points;
    }
    let per_bucket = points.len().div_ceil(MAX_POINTS / 2);
    let mut out = Vec::with_capacity(MAX_POINTS + 2);
    for chunk in points.chunks(per_bucket) {
        let lo = chunk.iter().enumerate().min_by(|a, b| a.1 .1.total_cmp(&b.1 .1)).map_or(0, |(i, _)| i);
        let hi = chunk.iter().enumerate().max_by(|a, b| a.1 .1.total_cmp(&b.1 .1)).map_or(0, |(i, _)| i);
        out.push(chunk[lo.min(hi)]);
        if lo != hi {
            out.push(chunk[lo.max(hi)]);
        }
    }
    out
}

/// Short numbers for axis labels: 1.5k, 2.3M, 4e-4.
fn short(v: &f64) -> String {
    let a = v.abs();
    match a {
        _ if a == 0.0 => "0".into(),
        _ if a >= 1e12 => format!("{v:.1e}"),
        _ if a >= 1e9 => format!("{:.1}G", v / 1e9),
        _ if a >= 1e6 => format!("{:.1}M", v / 1e6),
        _ if a >= 1e4 => format!("{:.0}k", v / 1e3),
        _ if a >= 1e3 => format!("{:.1}k", v / 1e3),
        _ if a >= 0.01 => format!("{:.3}", v).trim_end_matches('0').trim_end_matches('.').to_string(),
        _ => format!("{v:.1e}"),
    }
}

/// Axis label of a log2 value: the power of two it stands for (`2^16`).
fn pow2(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("2^{}", v.round())
    } else {
        short(&v.exp2())
    }
}

/// The panels to draw and a note for each one left out.
fn panels(runs: &[Run]) -> (Vec<Panel>, Vec<String>) {
    let mut notes = Vec::new();
    let per_run = |f: &dyn Fn(usize, &Run) -> Vec<Series>| -> Vec<Series> {
        runs.iter().enumerate().flat_map(|(i, r)| f(i, r)).collect()
    };
    // Earlier runs are drawn wider, so a run that another one covers exactly
    // (K=1 vs K=8 should!) still shows at its edges.
    let line = |run_idx: usize| Mark::Line((3 - run_idx.min(2) as u32).max(1));
    // A run's series, or none where the run has no such values.
    let series = |run_idx, points: Vec<(f64, f64)>, mark, label: Option<String>| {
        (!points.is_empty()).then(|| Series { run_idx, points: thin(points), mark, label })
    };

    let loss = per_run(&|i, r| {
        let train = series(i, points(r, |x| x.loss), line(i), Some(r.name.clone()));
        let val = series(i, points(r, |x| x.val_loss), Mark::Dots, Some(format!("{} (val)", r.name)));
        train.into_iter().chain(val).collect()
    });
    if runs.iter().all(|r| r.records.iter().all(|x| x.val_loss.is_none())) {
        notes.push("no validation loss in any run: the loss panel shows training loss only".into());
    }
    let mut out = vec![Panel { title: "loss", y_desc: "loss", series: loss, y_label: short, legend: true }];
    let simple: [(&'static str, &'static str, Field); 2] =
        [("learning rate", "lr", |x| x.lr), ("gradient norm (before clipping)", "grad norm", |x| x.grad_norm)];
    for (title, y_desc, f) in simple {
        out.push(Panel {
            title,
            y_desc,
            series: per_run(&|i, r| series(i, points(r, f), line(i), None).into_iter().collect()),
            y_label: short,
            legend: false,
        });
    }
    // A loss scale that stayed 1 with nothing skipped (f32, bf16) is a flat line: left out.
    let scaled = runs.iter().flat_map(|r| &r.records).any(|x| x.skipped || x.loss_scale.is_some_and(|s| s != 1.0));
    if scaled {
        let log2 = |x: &Record| x.loss_scale.filter(|s| *s > 0.0).map(f64::log2);
        let scale = per_run(&|i, r| {
            let skipped = points(r, |x| if x.skipped { log2(x) } else { None });
            series(i, points(r, log2), line(i), None)
                .into_iter()
                .chain(series(i, skipped, Mark::Crosses, None))
                .collect()
        });
        out.push(Panel {
            title: "loss scale (× = skipped step)",
            y_desc: "loss scale",
            series: scale,
            y_label: pow2,
            legend: false,
        });
    } else {
        notes.push("every run kept loss scale 1 and skipped no step (no f16): the loss-scale panel is left out".into());
    }
    out.push(Panel {
        title: "throughput",
        y_desc: "input tokens/s",
        // Input tokens as peers count them; runs from before that field: targets.
        series: per_run(&|i, r| {
            series(i, points(r, |x| x.input_tokens_per_s.or(x.tokens_per_s)), line(i), None).into_iter().collect()
        }),
        y_label: short,
        legend: false,
    });
    // The share of each step spent in data-parallel collectives (rank 0's).
    let share = |x: &Record| match (x.comm_s, x.step_ms) {
        (Some(c), Some(ms)) if c > 0.0 && ms > 0.0 => Some(100.0 * c * 1e3 / ms),
        _ => None,
    };
    let comm = per_run(&|i, r| series(i, points(r, share), line(i), None).into_iter().collect());
    if comm.is_empty() {
        notes.push(
            "no run spent time in data-parallel collectives (one rank): the communication panel is left out".into(),
        );
    } else {
        out.push(Panel {
            title: "gradient communication",
            y_desc: "% of the step",
            series: comm,
            y_label: short,
            legend: false,
        });
    }
    let mb = |b: Option<u64>| b.map(|b| b as f64 / 1e6);
    let memory = per_run(&|i, r| {
        let rss = series(i, points(r, |x| mb(x.mem_peak_rss)), line(i), Some(format!("{} peak RSS", r.name)));
        let acc = series(i, points(r, |x| mb(x.mem_accounted())), Mark::Faint, Some(format!("{} accounted", r.name)));
        rss.into_iter().chain(acc).collect()
    });
    if memory.is_empty() {
        notes.push("no memory figures in any run: the memory panel is left out".into());
    } else {
        out.push(Panel { title: "memory (rank 0)", y_desc: "MB", series: memory, y_label: short, legend: true });
    }
    out.retain(|p| {
        let keep = p.series.iter().any(|s| !s.points.is_empty());
        if !keep {
            notes.push(format!("no finite values for `{}` in any run: panel left out", p.title));
        }
        keep
    });
    (out, notes)
}

/// `lo..hi` around the values, padded so flat series and single points show.
fn padded(values: impl Iterator<Item = f64>, pad_frac: f64) -> std::ops::Range<f64> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let pad = if hi > lo { (hi - lo) * pad_frac } else { lo.abs().max(1e-12) * 0.05 };
    (lo - pad)..(hi + pad)
}

/// Draws the whole picture on `root`.
fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, runs: &[Run], x: XAxis, panels: &[Panel]) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let root = root.titled(&format!("macrobatch: {}", names.join(" vs ")), ("sans-serif", 26))?;
    let n_cols = if panels.len() > 1 { 2 } else { 1 };
    let areas = root.split_evenly((panels.len().div_ceil(n_cols), n_cols));
    let x_desc = match x {
        XAxis::Step => "optimizer step",
        XAxis::Tokens => "tokens",
    };
    for (panel, area) in panels.iter().zip(&areas) {
        let x_range = padded(panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)), 0.0);
        // Steps are whole: a short run gets one label per step, not 1.5, 2.5.
        let n_x_labels = match x {
            XAxis::Step => ((x_range.end - x_range.start).round() as usize + 1).clamp(2, 10),
            XAxis::Tokens => 10,
        };
        let y_range = padded(panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.1)), 0.05);
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x_range, y_range)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .x_labels(n_x_labels)
            .y_desc(panel.y_desc)
            .x_label_formatter(&short)
            .y_label_formatter(&panel.y_label)
            .label_style(("sans-serif", 14))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        for s in &panel.series {
            let color = PALETTE[s.run_idx % PALETTE.len()];
            let drawn = match s.mark {
                Mark::Line(w) => chart.draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(w)))?,
                Mark::Faint => {
                    chart.draw_series(LineSeries::new(s.points.iter().copied(), color.mix(0.5).stroke_width(1)))?
                }
                Mark::Dots => {
                    chart.draw_series(LineSeries::new(s.points.iter().copied(), color.mix(0.6).stroke_width(1)))?;
                    chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))?
                }
                Mark::Crosses => chart.draw_series(s.points.iter().map(|&p| Cross::new(p, 6, RED.stroke_width(2))))?,
            };
            if let Some(label) = &s.label {
                let mark = s.mark;
                drawn.label(label).legend(move |(lx, ly)| -> DynElement<'static, DB, (i32, i32)> {
                    match mark {
                        Mark::Dots => Circle::new((lx + 10, ly), 4, color.filled()).into_dyn(),
                        Mark::Faint => PathElement::new(vec![(lx, ly), (lx + 20, ly)], color.mix(0.5)).into_dyn(),
                        _ => PathElement::new(vec![(lx, ly), (lx + 20, ly)], color.stroke_width(2)).into_dyn(),
                    }
                });
            }
        }
        if panel.legend {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font(("sans-serif", 14))
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(180, 180, 180))
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

/// Registers the embedded font once (ab_glyph knows no system fonts).
fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded plot font does not load (a broken build?)"))
    }
}

/// The picture format, from the output file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Svg,
    Png,
}

fn format_of(out: &Path) -> Result<Format> {
    match out.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("svg") => Ok(Format::Svg),
        Some("png") => Ok(Format::Png),
        _ => bail!("--out {}: give a file ending in .svg or .png (the picture's format)", out.display()),
    }
}

/// Plots `dirs` into `out` (SVG or PNG, by extension); returns notes on
/// panels left out.
pub fn plot(dirs: &[PathBuf], out: &Path, x: XAxis) -> Result<Vec<String>> {
    let format = format_of(out)?;
    if dirs.is_empty() {
        bail!("give at least one run folder to plot");
    }
    let mut runs = dirs.iter().map(|d| read_run(d, x)).collect::<Result<Vec<_>>>()?;
    // Two folders of the same name (a/run, b/run) are told apart by their paths.
    for i in 0..runs.len() {
        if runs.iter().enumerate().any(|(j, r)| j != i && r.name == runs[i].name) {
            runs[i].name = dirs[i].display().to_string();
        }
    }
    register_font()?;
    let (panels, notes) = panels(&runs);
    let bytes = match format {
        Format::Svg => {
            let mut svg = String::new();
            draw(&SVGBackend::with_string(&mut svg, SIZE).into_drawing_area(), &runs, x, &panels)?;
            svg.into_bytes()
        }
        Format::Png => {
            let (w, h) = SIZE;
            let mut rgb = vec![0u8; w as usize * h as usize * 3];
            draw(&BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area(), &runs, x, &panels)?;
            let mut png_bytes = Vec::new();
            let mut encoder = png::Encoder::new(&mut png_bytes, w, h);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            let mut writer = encoder.write_header().context("cannot encode the PNG")?;
            writer.write_image_data(&rgb).context("cannot encode the PNG")?;
            writer.finish().context("cannot encode the PNG")?;
            png_bytes
        }
    };
    nn::io::write_atomic(out, &bytes).with_context(|| format!("cannot write {}", out.display()))?;
    Ok(notes)
}

/// The end of `train`: `DIR/plot.svg` of the run. A failure is a warning;
/// it never fails the run.
pub fn after_train(dir: &Path) {
    if let Err(e) = plot(&[dir.to_path_buf()], &dir.join("plot.svg"), XAxis::Step) {
        eprintln!("warning: could not plot the run ({e:#}); try `macrobatch plot {}`", dir.display());
    }
}
