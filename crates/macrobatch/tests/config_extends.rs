//! `extends` through the command line: a config built on a base in another
//! folder trains with the merged keys, `--set` applied last, and the run
//! folder's `config.resolved.toml` stands alone (no `extends`) and reads
//! back as the config that ran.

mod common;
use common::*;

#[test]
fn a_config_extending_a_base_runs_merged_and_resolves_to_a_standalone_file() {
    let dir = tmp("extends");
    std::fs::create_dir_all(dir.join("base")).unwrap();
    std::fs::write(
        dir.join("base/tiny.toml"),
        "[model]\nn_layer = 1\nn_embd = 32\nn_head = 2\nblock_size = 32\n[batch]\nmicro = 4\naccumulation_steps = 2\n[train]\nsteps = 50\neval_every = 0\nthreads = 1\nseed = 11\n",
    )
    .unwrap();
    std::fs::write(dir.join("run.toml"), "extends = \"base/tiny.toml\"\n[train]\nsteps = 9\n[optim]\nlr = 0.002\n")
        .unwrap();
    let out = dir.join("out");
    let mut c = train_cmd(&out, &["train.steps=2"]);
    c.arg(dir.join("run.toml"));
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(&out).len(), 2, "--set train.steps=2 applies after the merge");
    let resolved = std::fs::read_to_string(out.join("config.resolved.toml")).unwrap();
    assert!(!resolved.contains("extends"), "{resolved}");
    let cfg = config::Config::from_toml(&resolved, "config.resolved.toml", &[]).unwrap();
    assert_eq!((cfg.train.steps, cfg.train.seed, cfg.optim.lr), (2, 11, 0.002));
    assert_eq!(cfg.model.shape.get("n_embd").and_then(|v| v.as_integer()), Some(32), "the base's [model]");
    // a base that is not there is named with the file naming it, before any folder exists
    std::fs::write(dir.join("broken.toml"), "extends = \"base/missing.toml\"\n").unwrap();
    let missing = dir.join("base/missing.toml").display().to_string();
    let named_by = dir.join("broken.toml").display().to_string();
    refused_train("extends-missing", Some(&dir.join("broken.toml")), &[], &[&missing, &named_by]);
    std::fs::remove_dir_all(&dir).unwrap();
}
