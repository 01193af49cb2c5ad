//! Data parallelism through the CLI (thread ranks): ranks agree with one
//! process, failures are named instead of hanging, and `verify` passes.

mod common;

use common::*;
use std::time::{Duration, Instant};

fn dist_sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = SMALL.to_vec();
    s.extend(["batch.global=16", "train.steps=3", "train.eval_every=0", "optim.name=sgd", "optim.lr=0.1"]);
    s.extend_from_slice(extra);
    s
}

/// Same global batch, W = 1 vs 2 vs 4 thread ranks with different K: the
/// logged losses and final weights agree. SGD, so a parameter moves by
/// lr·(summed gradient) and f32 summation-order differences (~1e-7 relative)
/// stay ~1e-8; we allow 1e-6 · max|p|.
#[test]
fn thread_ranks_match_one_process() {
    let base = tmp("w1");
    let o = train(&base, &dist_sets(&["batch.micro=16"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let (l1, p1) = (losses(&base), weights(&base));
    for (w, k) in [(2, 2), (4, 1), (4, 4)] {
        let out = tmp(&format!("w{w}k{k}"));
        let (ws, ks) = (format!("dist.world_size={w}"), format!("batch.accumulation_steps={k}"));
        let o = train(&out, &dist_sets(&[&ws, &ks]));
        assert!(o.status.success(), "{}", stderr(&o));
        let m = metrics(&out);
        assert!(m.iter().all(|r| r["micro_steps"] == k as u64));
        for (a, b) in losses(&out).iter().zip(&l1) {
            assert!((a - b).abs() <= 1e-6 * b, "W={w} K={k}: loss {a} vs {b}");
        }
        let d = max_diff(&weights(&out), &p1);
        assert!(d <= 1e-6 * max_abs(&p1), "W={w} K={k}: weights differ by {d}");
        let _ = std::fs::remove_dir_all(&out);
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn comm_bytes_per_step_do_not_depend_on_k() {
    let mut bytes = Vec::new();
    for k in [1, 8] {
        let out = tmp(&format!("bytes-k{k}"));
        let ks = format!("batch.accumulation_steps={k}");
        let o = train(&out, &dist_sets(&["dist.world_size=2", &ks]));
        assert!(o.status.success(), "{}", stderr(&o));
        for r in metrics(&out) {
            assert_eq!(r["comm_calls"], 2, "stats + one gradient bucket per step, whatever K");
            bytes.push(r["comm_bytes"].as_u64().unwrap());
            // Time inside the collectives is measured, and is part of the step.
            let (comm_s, step_ms) = (r["comm_s"].as_f64().unwrap(), r["step_ms"].as_f64().unwrap());
            assert!(comm_s > 0.0 && comm_s * 1e3 <= step_ms, "{r}");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
    assert!(bytes.iter().all(|&b| b == bytes[0] && b > 0), "{bytes:?}");
}

#[test]
fn a_failing_rank_is_named_and_nobody_hangs() {
    for (kind, needle) in [("panic", "rank 1 panicked"), ("error", "injected fault"), ("stall", "rank(s) [1]")] {
        let out = tmp(&format!("fault-{kind}"));
        let mut c = bin();
        c.arg("train").arg("--out").arg(&out).env("MACROBATCH_FAULT", format!("rank=1,step=2,kind={kind}"));
        with_sets(&mut c, &dist_sets(&["dist.world_size=2", "dist.timeout_s=2"]));
        let t0 = Instant::now();
        let o = c.output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{kind}: {err}");
        assert!(err.contains(needle), "{kind}: expected `{needle}` in: {err}");
        assert!(err.contains("rank 0:"), "{kind}: rank 0 must report why it stopped: {err}");
        // Panics and errors are seen at once; a stall after the 2 s timeout.
        assert!(t0.elapsed() < Duration::from_secs(15), "{kind}: took {:?}", t0.elapsed());
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn verify_passes_for_ranks_and_accumulation() {
    for sets in [vec!["dist.world_size=2", "batch.accumulation_steps=4"], vec!["dist.world_size=4", "batch.micro=1"]] {
        let mut c = bin();
        c.arg("verify");
        let mut all = SMALL.to_vec();
        all.push("batch.global=16");
        all.extend(sets.iter());
        with_sets(&mut c, &all);
        let o = c.output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{text}{}", stderr(&o));
        assert!(text.contains("gradient") && text.trim_end().ends_with("PASS"), "{text}");
    }
}

#[cfg(not(feature = "mpi"))]
#[test]
fn a_binary_without_mpi_refuses_to_run_under_mpirun() {
    let out = tmp("no-mpi");
    let mut c = bin();
    c.arg("train").arg("--out").arg(&out).env("OMPI_COMM_WORLD_SIZE", "2");
    let o = c.output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("built without MPI support"), "{}", stderr(&o));
}
