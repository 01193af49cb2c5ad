//! `macrobatch plot`: two real runs (K=1 and K=8 at the same global batch)
//! drawn into one SVG and one PNG, checked by parsing both; and its errors.

mod common;

use common::*;
use std::path::Path;

/// The run colors of the plot's palette, in the order runs are given.
const BLUE: &str = "#1F77B4";
const ORANGE: &str = "#FF7F0E";

fn plot(args: &[&str]) -> std::process::Output {
    bin().arg("plot").args(args).output().expect("binary runs")
}

/// Trimmed text of every `<text>` element.
fn texts(doc: &roxmltree::Document) -> Vec<String> {
    doc.descendants().filter(|n| n.has_tag_name("text")).filter_map(|n| n.text()).map(|t| t.trim().into()).collect()
}

/// Polylines drawn in `color` (series lines and legend swatches).
fn polylines(doc: &roxmltree::Document, color: &str) -> usize {
    doc.descendants().filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some(color)).count()
}

#[test]
fn k1_and_k8_runs_plot_into_one_svg_and_one_png() {
    let dir = tmp("plot-k");
    let (k1, k8) = (dir.join("K1"), dir.join("K8"));
    for (out, micro) in [(&k1, "batch.micro=8"), (&k8, "batch.micro=1")] {
        let mut sets = SMALL.to_vec();
        sets.extend(["batch.global=8", micro, "train.steps=6", "train.eval_every=3"]);
        let o = train(out, &sets);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(out.join("plot.svg").is_file(), "train plots its run at the end");
    }
    assert_eq!(metrics(&k8)[0]["micro_steps"], 8);

    let svg_path = dir.join("cmp.svg");
    let o = plot(&[k1.to_str().unwrap(), k8.to_str().unwrap(), "--out", svg_path.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("loss-scale panel is left out"), "f32 runs: {}", stderr(&o));
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let root = doc.root_element();
    assert_eq!(
        (root.tag_name().name(), root.attribute("width"), root.attribute("height")),
        ("svg", Some("1400"), Some("1200"))
    );
    let all_text = texts(&doc);
    for want in [
        "macrobatch: K1 vs K8",
        "loss",
        "learning rate",
        "gradient norm (before clipping)",
        "throughput",
        "memory (rank 0)",
        "optimizer step",
        // Legends, named after the run folders.
        "K1",
        "K1 (val)",
        "K8",
        "K8 (val)",
        "K1 peak RSS",
        "K8 accounted",
    ] {
        assert!(all_text.iter().any(|t| t == want), "no text `{want}` in {all_text:?}");
    }
    assert!(!all_text.iter().any(|t| t.starts_with("loss scale")), "no loss-scale panel without f16");
    // Per run: 7 series lines (train loss, val loss, lr, grad norm, tokens/s,
    // peak RSS, accounted memory) and 3 legend swatches (train loss, peak RSS,
    // accounted; the val legend is a dot): 10 polylines of the run's color.
    assert_eq!((polylines(&doc, BLUE), polylines(&doc, ORANGE)), (10, 10));
    // Validation points: 2 evaluations (steps 3 and 6) + 1 legend dot per run.
    let dots =
        |c: &str| doc.descendants().filter(|n| n.has_tag_name("circle") && n.attribute("fill") == Some(c)).count();
    assert_eq!((dots(BLUE), dots(ORANGE)), (3, 3));

    // An existing --out (a file that may be the user's) is replaced only with --force.
    let plot_tokens = |extra: &[&str]| {
        let args = [
            &[k1.to_str().unwrap(), k8.to_str().unwrap(), "--x", "tokens", "--out", svg_path.to_str().unwrap()],
            extra,
        ];
        plot(&args.concat())
    };
    let o = plot_tokens(&[]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("exists") && err.contains("--force"), "{err}");
    assert_eq!(std::fs::read_to_string(&svg_path).unwrap(), svg, "left as it was");
    let o = plot_tokens(&["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(texts(&roxmltree::Document::parse(&svg).unwrap()).iter().any(|t| t == "tokens"));

    let png_path = dir.join("cmp.png");
    let o = plot(&[k1.to_str().unwrap(), k8.to_str().unwrap(), "--out", png_path.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&png_path).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR", "the first chunk is IHDR");
    let (w, h) =
        (u32::from_be_bytes(bytes[16..20].try_into().unwrap()), u32::from_be_bytes(bytes[20..24].try_into().unwrap()));
    assert_eq!((w, h), (1400, 1200));
    // The whole image decodes (every chunk's CRC, the deflate stream) and both runs' colors are drawn.
    let mut reader = png::Decoder::new(std::io::Cursor::new(&bytes)).read_info().expect("PNG header");
    let mut rgb = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut rgb).expect("PNG data");
    assert_eq!((info.width, info.height, info.color_type), (1400, 1200, png::ColorType::Rgb));
    let count = |c: [u8; 3]| rgb.chunks_exact(3).filter(|p| *p == c).count();
    let (blue, orange) = (count([31, 119, 180]), count([255, 127, 14]));
    assert!(blue > 500 && orange > 500, "run colors drawn: {blue} blue, {orange} orange pixels");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A hand-written `metrics.jsonl` of `n` steps, without validation loss.
fn fake_run(dir: &Path, n: u64, torn_tail: bool) {
    std::fs::create_dir_all(dir).unwrap();
    let mut s = String::new();
    for step in 1..=n {
        s += &format!(
            "{{\"step\":{step},\"loss\":{},\"lr\":0.001,\"grad_norm\":1.0,\"tokens\":512,\"tokens_per_s\":1000.0,\"loss_scale\":1.0,\"skipped\":false}}\n",
            5.0 - step as f64 * 0.1
        );
    }
    if torn_tail {
        s += "{\"step\":99,\"lo";
    }
    std::fs::write(dir.join("metrics.jsonl"), s).unwrap();
}

#[test]
fn plot_errors_name_the_problem_and_missing_data_leaves_panels_out() {
    let dir = tmp("plot-errors");
    let no_val = dir.join("no-val");
    fake_run(&no_val, 5, true);
    let o = plot(&[no_val.to_str().unwrap()]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(no_val.join("plot.svg").is_file(), "default output: <first run>/plot.svg");
    assert!(err.contains("dropped a torn last line"), "{err}");
    assert!(err.contains("no validation loss"), "{err}");
    assert!(err.contains("memory panel is left out"), "{err}");

    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let not_a_run = dir.join("not-a-run");
    std::fs::create_dir_all(&not_a_run).unwrap();
    std::fs::write(empty.join("metrics.jsonl"), "").unwrap();
    let garbage = dir.join("garbage");
    std::fs::create_dir_all(&garbage).unwrap();
    std::fs::write(garbage.join("metrics.jsonl"), "not json\n{\"step\":1}\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["/no/such/run".into()], "/no/such/run: no such run folder"),
        (vec![not_a_run.display().to_string()], "has no metrics.jsonl"),
        (vec![empty.display().to_string()], "holds no steps yet"),
        (vec![garbage.display().to_string()], "metrics.jsonl:1: not a metrics line"),
        (
            vec![no_val.display().to_string(), "--out".into(), dir.join("x.pdf").display().to_string()],
            "ending in .svg or .png",
        ),
    ];
    for (args, needle) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = plot(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle) && !err.contains("panicked"), "{args:?}: expected `{needle}` in {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
