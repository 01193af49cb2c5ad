//! The MPI backend under a real `mpirun` (feature `mpi`; CI installs OpenMPI).
#![cfg(feature = "mpi")]

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn mpirun(np: usize, out: &Path, sets: &[&str], fault: Option<&str>) -> Output {
    let mut c = Command::new("mpirun");
    c.args(["-np", &np.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_btl", "self,vader")
        .arg(env!("CARGO_BIN_EXE_macrobatch"))
        .arg("train")
        .arg("--out")
        .arg(out);
    if let Some(f) = fault {
        c.env("MACROBATCH_FAULT", f);
    }
    with_sets(&mut c, sets);
    c.output().expect("mpirun runs (apt-get install openmpi-bin)")
}

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = SMALL.to_vec();
    s.extend(["batch.global=16", "train.steps=3", "train.eval_every=0", "train.threads=1"]);
    s.extend(["optim.name=sgd", "optim.lr=0.1"]);
    s.extend_from_slice(extra);
    s
}

/// -np 2 and -np 4 with K ∈ {1, 2, 4} against one process with the whole
/// batch: same losses and weights (tolerance as in tests/dist.rs: SGD, 1e-6).
#[test]
fn mpi_ranks_match_one_process() {
    let base = tmp("mpi-base");
    let o = train(&base, &sets(&["batch.micro=16"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let (l1, p1) = (losses(&base), weights(&base));
    for (np, k) in [(2, 1), (2, 4), (4, 2)] {
        let out = tmp(&format!("mpi-np{np}-k{k}"));
        let ks = format!("batch.accumulation_steps={k}");
        let o = mpirun(np, &out, &sets(&[&ks]), None);
        assert!(o.status.success(), "np={np}: {}", stderr(&o));
        let m = metrics(&out);
        assert_eq!(m.len(), 3);
        assert!(stderr(&o).contains(&format!("W {np} (Mpi({np}))")), "{}", stderr(&o));
        for (a, b) in losses(&out).iter().zip(&l1) {
            assert!((a - b).abs() <= 1e-6 * b, "np={np} K={k}: loss {a} vs {b}");
        }
        let d = max_diff(&weights(&out), &p1);
        assert!(d <= 1e-6 * max_abs(&p1), "np={np} K={k}: weights differ by {d}");
        let _ = std::fs::remove_dir_all(&out);
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_killed_rank_stops_the_job_with_its_rank_named() {
    let out = tmp("mpi-kill");
    let t0 = Instant::now();
    let o = mpirun(2, &out, &sets(&["train.steps=5", "dist.timeout_s=10"]), Some("rank=1,step=2,kind=kill"));
    let (err, all) = (stderr(&o), format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o)));
    assert!(!o.status.success(), "{err}");
    assert!(all.contains("rank 1"), "mpirun must name the dead rank: {all}");
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_stalled_rank_makes_the_others_abort_within_the_timeout() {
    let out = tmp("mpi-stall");
    let t0 = Instant::now();
    let o = mpirun(2, &out, &sets(&["train.steps=5", "dist.timeout_s=3"]), Some("rank=1,step=2,kind=stall"));
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("rank 0 waited 3.0s"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
    let _ = std::fs::remove_dir_all(&out);
}
