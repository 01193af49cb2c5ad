//! Adafactor's updates against transformers' `Adafactor` on fixed
//! parameters and gradients (scripts/adafactor_reference.py): a 2-D tensor
//! (factored second moment), a 1-D one, and a 1×6 and a 4×1 matrix (which
//! transformers factors and we keep per element: the same update in exact
//! arithmetic), four steps each, in three
//! settings — transformers' defaults (relative step, parameter scale),
//! `warmup_init`, and an explicit learning rate with a first moment,
//! weight decay and an active clip threshold. Skipped with a note when
//! python3 cannot import torch and transformers, unless
//! MACROBATCH_REQUIRE_PYTHON=1.

use engine::{Adafactor, AdafactorConfig, Optimizer, ParamLayout};
use std::collections::BTreeMap;
use std::process::Command;

/// One case of the script's output.
#[derive(Default)]
struct Case {
    header: Vec<String>,
    shapes: Vec<(String, Vec<usize>)>,
    init: BTreeMap<String, Vec<f32>>,
    grads: BTreeMap<(usize, String), Vec<f32>>,
    after: BTreeMap<(usize, String), Vec<f32>>,
}

fn floats(words: &[&str]) -> Vec<f32> {
    words.iter().map(|w| w.parse::<f64>().expect("a number") as f32).collect()
}

fn reference() -> Option<Vec<Case>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/adafactor_reference.py");
    let out = Command::new("python3").arg(script).output();
    let ok = out.as_ref().is_ok_and(|o| o.status.success());
    if !ok {
        let why = match &out {
            Ok(o) => String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_string(),
            Err(e) => e.to_string(),
        };
        assert!(
            std::env::var("MACROBATCH_REQUIRE_PYTHON").as_deref() != Ok("1"),
            "MACROBATCH_REQUIRE_PYTHON=1 but the Adafactor reference failed: {why}"
        );
        eprintln!("skipped: python3 with torch and transformers is needed for the reference ({why})");
        return None;
    }
    let text = String::from_utf8(out.ok()?.stdout).expect("utf-8");
    let mut cases: Vec<Case> = Vec::new();
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.first().copied() {
            Some("case") => {
                cases.push(Case { header: w[1..].iter().map(|s| s.to_string()).collect(), ..Default::default() })
            }
            Some("shape") => {
                let dims = w[2..].iter().map(|d| d.parse().ok()).collect::<Option<Vec<usize>>>()?;
                cases.last_mut()?.shapes.push((w[1].into(), dims));
            }
            Some("init") => {
                cases.last_mut()?.init.insert(w[1].into(), floats(&w[2..]));
            }
            Some("grad") => {
                cases.last_mut()?.grads.insert((w[1].parse().ok()?, w[2].into()), floats(&w[3..]));
            }
            Some("after") => {
                cases.last_mut()?.after.insert((w[1].parse().ok()?, w[2].into()), floats(&w[3..]));
            }
            _ => {}
        }
    }
    Some(cases)
}

/// Tolerance: transformers reduces (row and column means, the two RMS
/// values) in f32 in torch's order, we sum exactly and round once to f64
/// (and keep a matrix with a dimension of 1 per element), so the
/// statistics differ by a few f32 ulp; through rsqrt, the clip divisor and
/// the step size that is ≈ 1e-6 relative of an update of at most ~1e-2
/// (the step size; the parameters are O(1)). 2e-6 absolute on the
/// parameters (≈ 16 ulp at |p| ≈ 1) bounds that with margin while a wrong
/// formula (a missing eps, a mean over the wrong axis, decay applied with
/// the wrong lr) moves them by 1e-4 or more.
const TOL: f32 = 2e-6;

#[test]
fn updates_equal_transformers_adafactor_on_fixed_gradients() {
    let Some(cases) = reference() else { return };
    assert_eq!(cases.len(), 3, "the script's three cases");
    for case in &cases {
        let h = &case.header;
        let (name, lr) = (&h[0], h[1].parse::<f32>().unwrap());
        let flag = |i: usize| h[i] == "1";
        let config = AdafactorConfig {
            relative_step: flag(2),
            scale_parameter: flag(3),
            warmup_init: flag(4),
            beta1: (h[5] != "none").then(|| h[5].parse().unwrap()),
            clip_threshold: h[7].parse().unwrap(),
            ..AdafactorConfig::default()
        };
        let weight_decay: f32 = h[6].parse().unwrap();
        assert_eq!(case.shapes.len(), 4, "the script's four tensors");
        let mut layout = ParamLayout::new();
        for (name, dims) in &case.shapes {
            layout.push(name.clone(), dims, true);
        }
        let opt = Optimizer::Adafactor(Adafactor::new(config, weight_decay).unwrap());
        let mut opt = opt.for_layout(&layout).unwrap();
        let all = |m: &BTreeMap<(usize, String), Vec<f32>>, step: usize| -> Vec<f32> {
            case.shapes.iter().flat_map(|(n, _)| m[&(step, n.clone())].clone()).collect()
        };
        let mut p: Vec<f32> = case.shapes.iter().flat_map(|(n, _)| case.init[n].clone()).collect();
        for step in 1..=4 {
            let g = all(&case.grads, step);
            opt.update(&layout, &mut p, &g, lr, 1.0).unwrap();
            let want = all(&case.after, step);
            for (i, (a, b)) in p.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= TOL, "{name} step {step} element {i}: ours {a}, transformers {b}");
            }
        }
    }
}
