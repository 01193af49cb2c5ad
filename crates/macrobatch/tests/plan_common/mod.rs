//! `macrobatch plan` as the plan tests run it: arguments with `=` are
//! `--set` overrides, the rest passed as they are.

use crate::common::{bin, stderr};

/// Llama 2 70B full fine-tuning on 8 × 80 GB, one rank per GPU, bf16, at
/// sequence length 4096 and a global batch of 128.
pub const LLAMA_70B: &[&str] = &[
    "--memory",
    "80GiB",
    "--world-size",
    "8",
    "model.family=llama",
    "model.preset=llama-70b",
    "data.seq_len=4096",
    "batch.micro=1",
    "batch.global=128",
    "train.precision=bf16",
];

/// `macrobatch plan ARGS`.
pub fn plan(args: &[&str]) -> std::process::Output {
    let mut c = bin();
    c.arg("plan");
    for a in args {
        match a.contains('=') {
            true => c.args(["--set", a]),
            false => c.arg(a),
        };
    }
    c.output().expect("binary runs")
}

/// `macrobatch plan --json ARGS`, which must succeed.
pub fn plan_json(args: &[&str]) -> serde_json::Value {
    let o = plan(&[&["--json"], args].concat());
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("JSON")
}

/// A count of the report.
pub fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}
