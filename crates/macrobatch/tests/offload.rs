//! `dist.offload_optimizer = "disk"` through the CLI: a stopped and resumed
//! offloaded run equals a straight in-memory one bit for bit, the state files
//! are gone at the end, and an unusable offload folder is a clear error.

mod common;

use common::*;

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = SMALL.to_vec();
    s.extend(["batch.micro=4", "batch.accumulation_steps=2", "train.steps=8", "train.eval_every=4"]);
    s.extend(["train.checkpoint_every=4", "train.keep_checkpoints=0"]);
    s.extend_from_slice(extra);
    s
}

fn ok(o: std::process::Output) -> String {
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    err
}

fn loss_text(out: &std::path::Path) -> Vec<String> {
    metrics(out).iter().map(|r| format!("{} {}", r["loss"], r["val_loss"])).collect()
}

#[test]
fn offloaded_stop_and_resume_equals_a_straight_in_memory_run() {
    let variants: [&[&str]; 3] = [
        &["dist.world_size=1"],
        &["dist.world_size=2", "dist.zero_stage=1"],
        &["dist.world_size=2", "dist.zero_stage=2", "optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.05"],
    ];
    for (i, extra) in variants.iter().enumerate() {
        let (a, b) = (tmp(&format!("offload-straight-{i}")), tmp(&format!("offload-resumed-{i}")));
        ok(train(&a, &sets(extra)));
        let mut disk = sets(extra);
        disk.push("dist.offload_optimizer=disk");
        let mut c = bin();
        c.arg("train").arg("--out").arg(&b).args(["--stop-after", "4"]);
        with_sets(&mut c, &disk);
        let err = ok(c.output().unwrap());
        assert!(err.contains("offloaded to disk"), "{err}");
        assert!(!b.join("offload").exists(), "offload files left after the run");
        let mut c = bin();
        c.arg("train").arg("--resume").arg(&b);
        with_sets(&mut c, &["dist.offload_optimizer=disk"]);
        let err = ok(c.output().unwrap());
        assert!(err.contains("resuming from"), "{err}");
        assert!(!b.join("offload").exists(), "offload files left after the run");
        assert_eq!(loss_text(&a), loss_text(&b), "{extra:?}: every logged loss identical");
        assert_eq!(weights(&a), weights(&b), "{extra:?}: final parameters identical bit for bit");
        let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
    }
}

#[test]
fn an_unusable_offload_folder_is_an_error_naming_it() {
    let out = tmp("offload-blocked");
    std::fs::create_dir_all(&out).unwrap();
    // A regular file where the offload folder should go: the run folder is
    // not empty, so the run refuses it up front, naming the file and keeping it.
    std::fs::write(out.join("offload"), b"x").unwrap();
    let o = train(&out, &sets(&["dist.offload_optimizer=disk"]));
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(err.contains("not empty") && err.contains("offload"), "{err}");
    assert_eq!(std::fs::read(out.join("offload")).unwrap(), b"x");
    let _ = std::fs::remove_dir_all(&out);
}
