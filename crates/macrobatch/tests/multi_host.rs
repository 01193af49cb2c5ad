//! Two hosts on one machine: ranks split over two network namespaces
//! joined by a veth pair (`scripts/netns`, docs/multi-host.md), started by
//! `mpirun` through an rsh agent (or by Slurm: `scripts/netns/slurm.sh`),
//! talking over TCP only. Needs root (CI runs as root); without the rights
//! each test says why it skipped, and `MACROBATCH_REQUIRE_NETNS=1` makes that
//! a failure (`MACROBATCH_REQUIRE_SLURM=1`: no Slurm installed, too).
#![cfg(feature = "mpi")]

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn netns(script: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/netns").join(script)
}

/// Two hosts (`{prefix}a`, `{prefix}b`) for one test, removed when
/// dropped — also when the test fails.
struct Hosts {
    prefix: String,
}

impl Hosts {
    /// The hosts, or `None` (after saying why) where namespaces cannot be made.
    fn up(prefix: &str) -> Option<Hosts> {
        let o = Command::new(netns("hosts.sh")).args(["up", "--prefix", prefix]).output().expect("bash runs");
        match o.status.code() {
            Some(0) => Some(Hosts { prefix: prefix.to_string() }),
            Some(77) if std::env::var("MACROBATCH_REQUIRE_NETNS").as_deref() != Ok("1") => {
                eprintln!("SKIPPED: two namespace hosts cannot be made here ({}); MACROBATCH_REQUIRE_NETNS=1 makes this a failure", stderr(&o).trim());
                None
            }
            _ => panic!("scripts/netns/hosts.sh up failed: {}", stderr(&o)),
        }
    }

    /// `macrobatch train --out out` on `np` ranks, `per_host` on each host
    /// (rank r on host a when r is even).
    fn train(&self, np: usize, out: &Path, sets: &[&str], env: &[(&str, &str)]) -> Command {
        let mut c = Command::new(netns("mpirun.sh"));
        c.args(["--prefix", &self.prefix, "--np", &np.to_string(), "--per-host", &np.div_ceil(2).to_string(), "--"])
            .arg(env!("CARGO_BIN_EXE_macrobatch"))
            .arg("train")
            .arg("--out")
            .arg(out);
        with_sets(&mut c, sets);
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }

    fn link(&self, what: &str) {
        let o = Command::new(netns("link.sh")).args(["--prefix", &self.prefix, what]).output().expect("bash runs");
        assert!(o.status.success(), "link.sh {what}: {}", stderr(&o));
    }

    /// `macrobatch` ranks still running on host b (its MPI daemon, cut off
    /// from mpirun, may linger until `down`).
    fn ranks_on_b(&self) -> Vec<String> {
        let o = Command::new("ip").args(["netns", "pids", &format!("{}b", self.prefix)]).output().expect("ip runs");
        let comm = |p: &str| std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
        String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .filter(|p| comm(p).trim() == "macrobatch")
            .map(String::from)
            .collect()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = Command::new(netns("hosts.sh")).args(["down", "--prefix", &self.prefix]).output();
    }
}

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = SMALL.to_vec();
    s.extend(["batch.global=16", "train.eval_every=0", "train.threads=1", "dist.timeout_s=20"]);
    s.extend_from_slice(extra);
    s
}

/// Ranks split over two hosts give the one-host run's losses and weights
/// bit for bit (ZeRO 1 and 3; one and two ranks per host): which
/// collective algorithm MPI runs depends on the ranks and the message
/// sizes, not on the transport, so every sum is taken in the same order.
#[test]
fn two_hosts_equal_one_host_bit_for_bit() {
    let Some(hosts) = Hosts::up("mbt1") else { return };
    for (np, stage) in [(2, 1), (2, 3), (4, 1)] {
        let zs = format!("dist.zero_stage={stage}");
        let s = sets(&["train.steps=3", "batch.accumulation_steps=2", &zs]);
        let one = tmp(&format!("mh-one-np{np}-z{stage}"));
        let o = mpirun(np, &one, &s, None);
        assert!(o.status.success(), "one host np={np}: {}", stderr(&o));
        let two = tmp(&format!("mh-two-np{np}-z{stage}"));
        let o = hosts.train(np, &two, &s, &[]).output().unwrap();
        let err = stderr(&o);
        assert!(o.status.success(), "two hosts np={np} ZeRO {stage}: {err}");
        assert!(err.contains(&format!("W {np} (Mpi({np}))")), "{err}");
        assert_eq!(losses(&two).len(), 3);
        for r in metrics(&two) {
            assert!(r["comm_s"].as_f64().unwrap() > 0.0, "collective time is measured: {r}");
        }
        let bits = |v: Vec<f64>| v.into_iter().map(f64::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(losses(&two)), bits(losses(&one)), "np={np} ZeRO {stage}: losses");
        assert!(weights(&two) == weights(&one), "np={np} ZeRO {stage}: weights differ");
        let _ = (std::fs::remove_dir_all(&one), std::fs::remove_dir_all(&two));
    }
}

/// Rank 1 (host b) killed mid-run: the job exits non-zero naming it well
/// within the timeout, and the surviving host alone (one rank, the same global batch) resumes from it
/// and continues the two-host curve (tolerance 1e-6 relative, as
/// tests/mpi.rs: one rank sums the gradient in another order than two).
#[test]
fn a_killed_rank_on_the_other_host_is_named_and_one_host_resumes() {
    let Some(hosts) = Hosts::up("mbt2") else { return };
    let s = sets(&["train.steps=6", "train.checkpoint_every=2", "optim.name=sgd", "optim.lr=0.1"]);
    let straight = tmp("mh-straight");
    let o = hosts.train(2, &straight, &s, &[]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = tmp("mh-kill");
    let t0 = Instant::now();
    let o = hosts.train(2, &out, &s, &[("MACROBATCH_FAULT", "rank=1,step=3,kind=kill")]).output().unwrap();
    let took = t0.elapsed();
    let all = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert!(!o.status.success(), "{all}");
    assert!(all.contains("rank 1"), "the dead rank must be named: {all}");
    eprintln!("exit {} after {took:?}:\n{all}", o.status);
    assert!(took < Duration::from_secs(20), "took {took:?}, past dist.timeout_s");
    // Host a alone: one process, no mpirun.
    let mut c = Command::new("ip");
    c.args(["netns", "exec", "mbt2a", env!("CARGO_BIN_EXE_macrobatch"), "train", "--resume"]).arg(&out);
    with_sets(&mut c, &["dist.world_size=1"]);
    let o = c.output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("resuming from") && err.contains("step-00000002"), "{err}");
    let (a, b) = (losses(&out), losses(&straight));
    assert_eq!(a.len(), 6, "the curve goes on to the last step");
    assert_close_rel("resumed on one host vs two hosts", &a, &b, 1e-6);
    let _ = (std::fs::remove_dir_all(&out), std::fs::remove_dir_all(&straight));
}

/// Slurm on the two hosts (`scripts/netns/slurm.sh`), stopped when dropped.
struct Slurm {
    prefix: String,
}

impl Slurm {
    /// The cluster, or `None` (after saying why) where Slurm is not
    /// installed; `MACROBATCH_REQUIRE_SLURM=1` makes that a failure.
    fn up(hosts: &Hosts) -> Option<Slurm> {
        let o = Command::new(netns("slurm.sh")).args(["up", "--prefix", &hosts.prefix]).output().expect("bash runs");
        match o.status.code() {
            Some(0) => Some(Slurm { prefix: hosts.prefix.clone() }),
            Some(77) if std::env::var("MACROBATCH_REQUIRE_SLURM").as_deref() != Ok("1") => {
                eprintln!(
                    "SKIPPED: no Slurm here ({}); MACROBATCH_REQUIRE_SLURM=1 makes this a failure",
                    stderr(&o).trim()
                );
                None
            }
            _ => panic!("scripts/netns/slurm.sh up failed: {}", stderr(&o)),
        }
    }

    /// `sbatch --wait SCRIPT` on host a: its exit status and what it
    /// printed; a job still running after `limit` fails the test.
    fn sbatch(&self, script: &Path, limit: Duration) -> (std::process::ExitStatus, String) {
        let mut c = Command::new(netns("slurm.sh"));
        c.args(["run", "--prefix", &self.prefix, "sbatch", "--wait"]).arg(script);
        let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("bash runs");
        let status =
            wait_for(&mut child, limit).unwrap_or_else(|| panic!("sbatch --wait still running after {limit:?}"));
        let mut said = String::new();
        for pipe in [
            child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read>),
            child.stderr.take().map(|p| Box::new(p) as _),
        ] {
            std::io::Read::read_to_string(&mut pipe.unwrap(), &mut said).unwrap();
        }
        (status, said)
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = Command::new(netns("slurm.sh")).args(["down", "--prefix", &self.prefix]).output();
    }
}

/// Slurm for real: Debian's slurmctld and a slurmd on each of the two
/// hosts, `sbatch --wait` of docs/multi-host.md's job script — `srun
/// --mpi=pmix` starting one rank on each node, PMIx wiring up MPI, no
/// hostfile — trains what `mpirun` on one host trains, bit for bit. The job
/// script and its output are printed (docs/multi-host.md quotes them).
#[test]
fn sbatch_runs_the_docs_job_script_across_two_hosts() {
    let Some(hosts) = Hosts::up("mbt5") else { return };
    let Some(slurm) = Slurm::up(&hosts) else { return };
    let s = sets(&["train.steps=3", "batch.accumulation_steps=2", "dist.zero_stage=1"]);
    let one = tmp("slurm-one");
    let o = mpirun(2, &one, &s, None);
    assert!(o.status.success(), "one host: {}", stderr(&o));
    let dir = tmp("slurm-job");
    std::fs::create_dir_all(&dir).unwrap();
    let set_args: String = s.iter().map(|kv| format!(" \\\n  --set '{kv}'")).collect();
    let script = format!(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --time=5\n#SBATCH --output={dir}/slurm-%j.out\nexport RAYON_NUM_THREADS=$SLURM_CPUS_PER_TASK\nexport OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=10.231.0.0/24\nsrun --mpi=pmix {bin} train --out {dir}/run-$SLURM_JOB_ID{set_args}\n",
        dir = dir.display(),
        bin = env!("CARGO_BIN_EXE_macrobatch"),
    );
    let job = dir.join("job.sh");
    std::fs::write(&job, &script).unwrap();
    let (status, said) = slurm.sbatch(&job, Duration::from_secs(300));
    assert!(status.success(), "sbatch: {said}");
    let id = said.lines().find_map(|l| l.strip_prefix("Submitted batch job ")).expect("a job id").trim().to_string();
    let output = std::fs::read_to_string(dir.join(format!("slurm-{id}.out"))).unwrap();
    eprintln!("job script:\n{script}\n{said}slurm-{id}.out:\n{output}");
    assert!(output.contains("W 2 (Mpi(2))"), "{output}");
    let run = dir.join(format!("run-{id}"));
    let bits = |v: Vec<f64>| v.into_iter().map(f64::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(losses(&run)), bits(losses(&one)), "losses");
    assert!(weights(&run) == weights(&one), "weights");
    let _ = (std::fs::remove_dir_all(&one), std::fs::remove_dir_all(&dir));
}

/// Waits for `child` up to `limit`; kills it past that.
fn wait_for(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    None
}

/// The cable pulled mid-run: rank 0 (host a) reports what it waited for
/// and the job exits non-zero within `dist.timeout_s` plus the abort; the
/// rank on host b, cut off from mpirun, stops by its own timeout; and the
/// checkpoints written before are whole: host a resumes from the newest.
#[test]
fn a_cut_link_stops_every_rank_within_the_timeout() {
    let Some(hosts) = Hosts::up("mbt3") else { return };
    let out = tmp("mh-cut");
    let s = sets(&["train.steps=100000", "train.checkpoint_every=2", "dist.timeout_s=5"]);
    let mut c = hosts.train(2, &out, &s, &[]);
    let mut child = c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    // After the first checkpoint.
    let t0 = Instant::now();
    while !out.join("checkpoints").join("step-00000002").exists() {
        assert!(t0.elapsed() < Duration::from_secs(60), "no checkpoint after 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    hosts.link("cut");
    let cut = Instant::now();
    let status = wait_for(&mut child, Duration::from_secs(60));
    let took = cut.elapsed();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    let status = status.unwrap_or_else(|| panic!("still running 60 s after the cut: {err}"));
    eprintln!("exit {status} {took:?} after the cut:\n{err}");
    assert!(!status.success(), "{err}");
    assert!(err.contains("waited 5.0s") || err.contains("mbt3b"), "the lost rank or host is named: {err}");
    assert!(took < Duration::from_secs(20), "exited {took:?} after the cut (dist.timeout_s = 5)");
    let t1 = Instant::now();
    while !hosts.ranks_on_b().is_empty() && t1.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(hosts.ranks_on_b().is_empty(), "host b still runs ranks {:?}", hosts.ranks_on_b());
    let mut c = Command::new("ip");
    c.args(["netns", "exec", "mbt3a", env!("CARGO_BIN_EXE_macrobatch"), "train", "--stop-after", "1", "--resume"])
        .arg(&out);
    with_sets(&mut c, &["dist.world_size=1"]);
    let o = c.output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success() && err.contains("resuming from"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}
