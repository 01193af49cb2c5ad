//! The MPI backend under a real `mpirun` (feature `mpi`; CI installs OpenMPI).
#![cfg(feature = "mpi")]

mod common;

use common::*;
use std::time::{Duration, Instant};

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

/// `-np 4` as 2 pipeline stages × 2 data ranks equals the same run on 4
/// thread ranks (losses within 1e-6 relative, as tests/pipeline_cli.rs).
#[test]
fn mpi_pipeline_matches_thread_ranks() {
    let pipe = ["dist.pipeline_parallel=2", "model.n_layer=2", "batch.micro=2", "batch.accumulation_steps=4"];
    let threads = tmp("mpi-pipe-threads");
    let o = train(&threads, &sets(&[&pipe[..], &["dist.world_size=4"]].concat()));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = tmp("mpi-pipe");
    let o = mpirun(4, &out, &sets(&pipe), None);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("pipeline: P=2 (1f1b, layers 0 | 1), data parallel D=2"), "{err}");
    let (a, b) = (losses(&out), losses(&threads));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * y, "MPI {x} vs threads {y}");
    }
    let _ = (std::fs::remove_dir_all(&out), std::fs::remove_dir_all(&threads));
}

/// `-np 4` as 2 tensor ranks × 2 pipeline stages (one data rank) equals
/// one rank, with the vocabulary whole and split over the tensor ranks,
/// and with the sequence split too (MPI's all-gather and reduce-scatter):
/// the split only reorders sums (tests/tensor_cli.rs explains the
/// tolerance; MPI adds the partial products in its own order).
#[test]
fn mpi_tensor_by_pipeline_matches_one_rank() {
    let one = tmp("mpi-tp-one");
    let o = train(&one, &sets(&["batch.micro=4"]));
    assert!(o.status.success(), "{}", stderr(&o));
    for (vocab, seq, what) in [
        (false, false, ""),
        (true, false, " (the vocabulary split too)"),
        (true, true, " (the vocabulary and the sequence split too)"),
    ] {
        let (v, s) = (format!("dist.vocab_parallel={vocab}"), format!("dist.sequence_parallel={seq}"));
        let grid = ["dist.tensor_parallel=2", "dist.pipeline_parallel=2", "batch.micro=4", &v, &s];
        tensor_by_pipeline(&one, &grid, what);
    }
    let _ = std::fs::remove_dir_all(&one);
}

/// `-np 4` with `grid` against the one-rank run in `one`.
fn tensor_by_pipeline(one: &std::path::Path, grid: &[&str], vocab: &str) {
    let out = tmp("mpi-tp");
    let o = mpirun(4, &out, &sets(grid), None);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains(&format!("3D: P=2 × T=2{vocab} × D=1; rank r = stage·2 + tensor")), "{err}");
    let (a, b) = (losses(&out), losses(one));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * y, "MPI T=2{vocab} × P=2 {x} vs one rank {y}");
    }
    let d = max_diff(&weights(&out), &weights(one));
    assert!(d <= 1e-5 * max_abs(&weights(one)), "{vocab}: weights differ by {d}");
    for r in metrics(&out) {
        assert!(r["tp_bytes"].as_u64().unwrap() > 0, "{r}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// `-np 4` as 2 context ranks × 2 tensor ranks (one data rank), the
/// sequence split too, equals one rank, attention around the ring (MPI's
/// buffered sends between the context ranks) and all-gathered (MPI's
/// all-gather of the keys and values and reduce-scatter of their
/// gradients); tolerance as above.
#[test]
fn mpi_context_by_tensor_matches_one_rank() {
    let one = tmp("mpi-cp-one");
    let o = train(&one, &sets(&["batch.micro=4"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = tmp("mpi-cp");
    for (attention, how) in [("ring", "around a ring"), ("all_gather", "all-gathered")] {
        let set = format!("dist.context_attention=\"{attention}\"");
        let grid =
            ["dist.context_parallel=2", "dist.tensor_parallel=2", "dist.sequence_parallel=true", "batch.micro=4", &set];
        let o = mpirun(4, &out, &sets(&grid), None);
        let err = stderr(&o);
        assert!(o.status.success(), "{err}");
        let header =
            format!("context parallel: C=2 (two chunks of each sequence per rank, keys and values {how}) × P=1 × T=2");
        assert!(err.contains(&header), "{err}");
        let (a, b) = (losses(&out), losses(&one));
        assert_eq!(a.len(), 3);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * y, "MPI C=2 × T=2, {attention}: {x} vs one rank {y}");
        }
        let d = max_diff(&weights(&out), &weights(&one));
        assert!(d <= 1e-5 * max_abs(&weights(&one)), "{attention}: weights differ by {d}");
        for r in metrics(&out) {
            assert!(r["cp_bytes"].as_u64().unwrap() > 0 && r["tp_bytes"].as_u64().unwrap() > 0, "{r}");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
    let _ = (std::fs::remove_dir_all(&out), std::fs::remove_dir_all(&one));
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

/// Rank 1 killed in each phase of a step (its start, the step's gradient
/// collective with rank 0 inside it, the checkpoint's gather, the final
/// save's gather): the job ends, naming rank 1, within
/// the timeout; the folder keeps its last whole checkpoint and no model;
/// `train --resume` under mpirun ends with the uninterrupted job's weights.
/// ZeRO-3, so a checkpoint's gather needs rank 1's shard (with replicated
/// parameters rank 0 writes a whole checkpoint alone, and does).
#[test]
fn a_rank_killed_in_any_phase_leaves_a_checkpoint_that_resumes_to_the_same_weights() {
    let s = sets(&["train.steps=5", "train.checkpoint_every=2", "dist.timeout_s=10", "dist.zero_stage=3"]);
    let whole = tmp("mpi-kill-whole");
    let o = mpirun(2, &whole, &s, None);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = weights(&whole);
    let phases = [
        ("step", "step-00000002"),
        ("collective", "step-00000002"),
        ("checkpoint", "step-00000002"),
        ("save", "step-00000005"),
    ];
    for (phase, kept) in phases {
        let out = tmp(&format!("mpi-kill-{phase}"));
        let t0 = Instant::now();
        let fault = format!("rank=1,step=4,kind=kill,phase={phase}");
        let o = mpirun(2, &out, &s, Some(&fault));
        let all = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
        assert!(!o.status.success() && all.contains("rank 1"), "{phase}: mpirun must name the dead rank: {all}");
        assert!(t0.elapsed() < Duration::from_secs(30), "{phase}: took {:?}", t0.elapsed());
        if phase == "collective" {
            assert!(all.contains("injected fault: rank 1 in step 4's gradient collective"), "{all}");
        }
        assert!(!out.join("model.safetensors").exists(), "{phase}");
        let ck: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .max()
            .into_iter()
            .collect();
        assert_eq!(ck, [kept], "{phase}: the newest whole checkpoint");
        let o = mpirun_train(2, &[std::ffi::OsStr::new("--resume"), out.as_os_str()], &[], None);
        assert!(o.status.success(), "{phase}: {}", stderr(&o));
        assert!(weights(&out) == want, "{phase}: the resumed job's weights are the uninterrupted job's");
        let _ = std::fs::remove_dir_all(&out);
    }
    let _ = std::fs::remove_dir_all(&whole);
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

/// ZeRO stages 0–3 under mpirun give the same weights after 5 AdamW steps,
/// -np 2 and 4, K ∈ {1, 4}. Tolerance 1e-6 · max|p|: stages differ in the
/// collectives that sum the gradient (all-reduce vs reduce-scatter, whose
/// summation orders MPI chooses) and in how the norm's squares are summed.
#[test]
fn zero_stages_match_under_mpirun() {
    for np in [2usize, 4] {
        for k in [1usize, 4] {
            let ks = format!("batch.accumulation_steps={k}");
            let mut reference: Option<Vec<f32>> = None;
            for stage in 0..4 {
                let out = tmp(&format!("mpi-zero-np{np}-k{k}-s{stage}"));
                let zs = format!("dist.zero_stage={stage}");
                let mut s = SMALL.to_vec();
                s.extend(["batch.global=16", "train.steps=5", "train.eval_every=0", "train.threads=1", &ks, &zs]);
                let o = mpirun(np, &out, &s, None);
                assert!(o.status.success(), "np={np} K={k} stage {stage}: {}", stderr(&o));
                let w = weights(&out);
                match &reference {
                    None => reference = Some(w),
                    Some(r) => {
                        let d = max_diff(&w, r);
                        assert!(d <= 1e-6 * max_abs(r), "np={np} K={k} stage {stage}: weights differ by {d}");
                    }
                }
                let _ = std::fs::remove_dir_all(&out);
            }
        }
    }
}

/// `dist.overlap_comm` under mpirun (`MPI_THREAD_MULTIPLE`, the gradient
/// collectives on an `MPI_Comm_dup` owned by a second thread): -np 2 and
/// -np 3 (where the order of a sum over ranks matters), ZeRO 0, 2 and 3,
/// buckets of 0.05 MiB (several per block): the losses and the saved
/// weights are the bits of the same run reducing at the boundary, and the
/// metrics show collectives handed over before the backward ended.
#[test]
fn overlap_comm_under_mpirun_gives_the_bits_of_the_boundary_reduction() {
    for (np, k, stage) in [(2usize, 4usize, 0u8), (3, 2, 0), (3, 1, 2), (3, 2, 3)] {
        let (ks, zs) = (format!("batch.accumulation_steps={k}"), format!("dist.zero_stage={stage}"));
        let mut s = SMALL.to_vec();
        s.extend(["batch.global=24", "train.steps=3", "train.eval_every=0", "train.threads=1", "dist.bucket_mb=0.05"]);
        s.extend([ks.as_str(), zs.as_str()]);
        let run = |overlap: bool| {
            let out = tmp(&format!("mpi-overlap-np{np}-k{k}-s{stage}-{overlap}"));
            let ov = format!("dist.overlap_comm={overlap}");
            let o = mpirun(np, &out, &[s.as_slice(), &[ov.as_str()]].concat(), None);
            assert!(o.status.success(), "np={np} K={k} stage {stage} overlap {overlap}: {}", stderr(&o));
            let bytes = std::fs::read(out.join("model.safetensors")).expect("the saved model");
            let m = metrics(&out);
            let _ = std::fs::remove_dir_all(&out);
            (losses_of(&m), bytes, m)
        };
        let (plain, over) = (run(false), run(true));
        let what = format!("np={np} K={k} stage {stage}");
        assert_eq!(plain.0, over.0, "{what}: losses");
        assert!(plain.1 == over.1, "{what}: the saved weights differ with overlap");
        assert!(plain.2.iter().all(|r| r.get("comm_timeline").is_none()), "{what}: no timeline without overlap");
        for r in &over.2 {
            let t = &r["comm_timeline"];
            let end = t["backward_end_s"].as_f64().expect("backward_end_s");
            let early = t["collectives"].as_array().expect("collectives").iter().filter(|c| c[0].as_f64() < Some(end));
            assert!(early.count() > 0, "{what}: nothing handed over under the backward: {t}");
            let ranks = r["overlap_ranks"].as_array().expect("every rank's timeline");
            assert_eq!(ranks.len(), np, "{what}: one timeline per rank");
            assert!(
                ranks.iter().all(|t| t[1].as_f64() > Some(0.0) && t[1].as_f64() < t[0].as_f64()),
                "{what}: {ranks:?}"
            );
        }
    }
}

fn losses_of(m: &[serde_json::Value]) -> Vec<u64> {
    m.iter().map(|r| r["loss"].as_f64().expect("loss").to_bits()).collect()
}

/// A 10.7M-parameter model (`mini`) at -np 4: per-rank model-state bytes
/// match the contract's (docs/contract.md, Memory) formulas (in f32) within 10%, by the accounting and by the
/// resident-set growth each rank measured (less its accounted activations and
/// collective buffers); at stage 3 the parameter residency stays below the
/// largest segment plus 1/W of all parameters.
#[test]
fn zero_memory_matches_the_formulas_under_mpirun() {
    // Stage 2 twice: accumulating locally (full gradient buffer, 8Ψ + 8Ψ/N)
    // and reducing every micro-step (4Ψ + 12Ψ/N, docs/contract.md).
    for (stage, every) in [(0, false), (1, false), (2, false), (2, true), (3, false)] {
        let out = tmp(&format!("mpi-mem-s{stage}-{every}"));
        let zs = format!("dist.zero_stage={stage}");
        let es = format!("dist.reduce_every_micro_step={every}");
        let s = [
            &es,
            "model.preset=mini",
            "data.seq_len=64",
            "batch.micro=1",
            "batch.global=4",
            "train.steps=2",
            "train.threads=1",
            "train.eval_batches=1",
            &zs,
        ];
        let o = mpirun(4, &out, &s, None);
        assert!(o.status.success(), "stage {stage}: {}", stderr(&o));
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("memory.json")).unwrap()).unwrap();
        let n = m["n_params"].as_f64().unwrap();
        assert!(n >= 10e6, "a model of at least 10M parameters");
        let formula = m["formula_model_states"].as_f64().unwrap();
        if every {
            assert_eq!(formula, 4.0 * n + 12.0 * n / 4.0, "the contract's stage-2 formula in f32: 4Ψ + 12Ψ/N bytes");
        }
        let a = &m["accounting"];
        let accounted: f64 = ["params", "grads", "optimizer", "master"].iter().map(|k| a[*k].as_f64().unwrap()).sum();
        assert!((accounted - formula).abs() <= 0.10 * formula, "stage {stage}: accounted {accounted} vs {formula}");
        for (rank, measured) in m["measured_model_states"].as_array().unwrap().iter().enumerate() {
            let measured = measured.as_f64().unwrap();
            assert!(
                (measured - formula).abs() <= 0.10 * formula,
                "stage {stage} rank {rank}: measured {measured} vs formula {formula}"
            );
        }
        if stage == 3 {
            // mini: the largest segment is a block, 12·384² + 13·384 parameters.
            let largest_block = 4.0 * (12.0 * 384.0 * 384.0 + 13.0 * 384.0);
            let residency = a["peak_param_residency"].as_f64().unwrap();
            assert!(residency <= largest_block * 1.01 + 4.0 * n / 4.0 * 1.01, "stage 3 residency {residency}");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// The final weights of a run folder: its `model.safetensors`, or a
/// sharded run's last checkpoint exported to one.
fn final_weights(out: &std::path::Path) -> Vec<f32> {
    if out.join("model.safetensors").exists() {
        return weights(out);
    }
    let hf = out.join("exported");
    let o = bin().arg("export").arg(out).args(["--format", "hf", "--out"]).arg(&hf).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    weights(&hf)
}

/// Sharded checkpoints under mpirun: each process writes its own pieces
/// into the run folder and rank 0's publishes them; a rank killed in the
/// checkpoint phase leaves the previous checkpoint, which resumes to the
/// uninterrupted job's weights; a job stopped at -np 2 resumes at -np 4
/// to the weights of the whole checkpoint's resume there.
#[test]
fn sharded_checkpoints_under_mpirun_resume_after_a_kill_and_at_another_process_count() {
    let s = sets(&["train.steps=5", "train.checkpoint_every=2", "dist.timeout_s=10", "dist.zero_stage=3"]);
    let sharded = [&s[..], &["train.checkpoint_sharded=true"]].concat();
    let straight = tmp("mpi-sharded-straight");
    let o = mpirun(2, &straight, &sharded, None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(straight.join("checkpoints/step-00000004/rank-00001.bin").exists());
    let want = final_weights(&straight);
    let killed = tmp("mpi-sharded-killed");
    let o = mpirun(2, &killed, &sharded, Some("rank=1,step=4,kind=kill,phase=checkpoint"));
    assert!(!o.status.success());
    // Rank 1 died with its pieces written, before every rank agreed.
    assert!(killed.join("checkpoints/.tmp-step-00000004-sharded/rank-00001.bin").exists());
    assert!(!killed.join("checkpoints/step-00000004").exists(), "a checkpoint a rank died writing is published");
    let o = mpirun_train(2, &[std::ffi::OsStr::new("--resume"), killed.as_os_str()], &[], None);
    assert!(o.status.success() && stderr(&o).contains("step-00000002"), "{}", stderr(&o));
    assert!(final_weights(&killed) == want, "the resumed job's weights are the uninterrupted job's");
    // Stopped at step 2 on two processes, continued on four.
    let mut resumed = Vec::new();
    for (tag, set) in [("sharded", &sharded[..]), ("whole", &s[..])] {
        let out = tmp(&format!("mpi-np2-np4-{tag}"));
        // micro 4 × K 2 × 2 ranks; resumed on 4, K becomes 1.
        let set = [set, &["batch.micro=4"]].concat();
        let args = [std::ffi::OsStr::new("--out"), out.as_os_str(), "--stop-after".as_ref(), "2".as_ref()];
        let o = mpirun_train(2, &args, &set, None);
        assert!(o.status.success(), "{tag}: {}", stderr(&o));
        let o = mpirun_train(4, &[std::ffi::OsStr::new("--resume"), out.as_os_str()], &[], None);
        assert!(o.status.success(), "{tag}: {}", stderr(&o));
        resumed.push(final_weights(&out));
        let _ = std::fs::remove_dir_all(&out);
    }
    assert!(resumed[0] == resumed[1], "-np 4 from the sharded checkpoint and from the whole one differ");
    let _ = std::fs::remove_dir_all(&straight);
    let _ = std::fs::remove_dir_all(&killed);
}

/// A mixture of experts (Qwen2-MoE's block: shared expert, q/k/v biases)
/// with the global-batch load-balancing loss under `mpirun -np 4`, K = 2:
/// the routing pass's counts are all-reduced over MPI before each step's
/// first backward, so the losses (cross-entropy and router losses) and
/// weights are one process's on the whole batch (SGD; 1e-6 relative, as
/// above: only summation orders differ).
#[test]
fn mpi_mixture_of_experts_matches_one_process() {
    let moe = ["model.family=qwen2_moe", "model.preset=tiny", "model.n_kv_head=2", "model.router_aux_loss_coef=0.02"];
    let one = tmp("mpi-moe-one");
    let o = train(&one, &sets(&[&moe[..], &["batch.micro=16"]].concat()));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = tmp("mpi-moe");
    let o = mpirun(4, &out, &sets(&[&moe[..], &["batch.accumulation_steps=2"]].concat()), None);
    assert!(o.status.success(), "{}", stderr(&o));
    let total = |dir: &std::path::Path| -> Vec<f64> {
        metrics(dir).iter().map(|r| r["loss_total"].as_f64().expect("loss_total")).collect()
    };
    assert_eq!((losses(&out).len(), total(&one).len()), (3, 3));
    assert!(stderr(&o).contains("W 4 (Mpi(4))"), "{}", stderr(&o));
    for (a, b) in losses(&out).iter().zip(losses(&one)).chain(total(&out).iter().zip(total(&one))) {
        assert!((a - b).abs() <= 1e-6 * b, "np 4 × K 2: {a} vs one process {b}");
    }
    let read = |dir: &std::path::Path| -> Vec<f32> {
        let t = llama::hf::read_tensors(&dir.join("model.safetensors")).expect("the model file reads");
        t.into_iter().flat_map(|(_, _, data)| data).collect()
    };
    let (a, b) = (read(&out), read(&one));
    assert!(max_diff(&a, &b) <= 1e-6 * max_abs(&b), "weights differ by {}", max_diff(&a, &b));
    let _ = (std::fs::remove_dir_all(&out), std::fs::remove_dir_all(&one));
}
