//! The AVX2 kernels, reached on every x86-64 machine: the binary runs under
//! `qemu-x86_64 -cpu Haswell` (a CPU with AVX2, FMA and F16C and without
//! AVX-512, which qemu's TCG does not emulate), so the `gemm` crate's AVX2
//! micro-kernels and the AVX2 clones of our `multiversion` loops (norms,
//! activations, softmax, loss, AdamW, bf16/f16 conversions, packed-weight
//! decoding) do the work, while the same run natively takes whatever this
//! CPU offers (AVX-512 on most servers).
//!
//! Expected: the same bits. Each path evaluates every element as the same
//! IEEE operations in the same order: a GEMM output is one chain of FMAs
//! over `k` in both `gemm` kernels (they differ in register tile, not in the
//! order along `k`; `gemm` splits `k` into blocks of at least 512, and
//! every `k` here is below that), and Rust neither contracts nor
//! reassociates the loops. So losses, gradient norms and the saved weights
//! are compared bit for bit; a difference means a kernel's arithmetic
//! depends on the instruction set, which this test exists to catch.
//!
//! Where qemu is missing the test says so and passes, unless
//! `MACROBATCH_REQUIRE_QEMU=1` (CI installs `qemu-user`). On a CPU without
//! AVX-512 both runs take the AVX2 path: the test still runs, and the
//! AVX-512 path is then not reached (qemu cannot emulate it).
#![cfg(target_arch = "x86_64")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn qemu() -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join("qemu-x86_64")).find(|p| p.is_file()));
    if found.is_none() {
        assert!(
            std::env::var("MACROBATCH_REQUIRE_QEMU").as_deref() != Ok("1"),
            "MACROBATCH_REQUIRE_QEMU=1 but qemu-x86_64 is not on PATH (apt-get install qemu-user)"
        );
        eprintln!("isa: qemu-x86_64 not found (apt-get install qemu-user): the AVX2 path is not run here; skipped");
    }
    found
}

/// `macrobatch train --out out` with `sets`, natively or under qemu as a
/// Haswell; `gemm` forces the f32 backend, so a timing probe (slow under
/// qemu) cannot pick another one (and no probe cache is read or written).
fn train(qemu: Option<&Path>, out: &Path, gemm: &str, sets: &[&str], extra: &[&str]) -> Output {
    let bin = env!("CARGO_BIN_EXE_macrobatch");
    let mut c = match qemu {
        Some(q) => {
            let mut c = Command::new(q);
            c.args(["-cpu", "Haswell", bin]);
            c
        }
        None => Command::new(bin),
    };
    c.arg("train").arg("--out").arg(out).args(extra);
    common::with_sets(&mut c, sets);
    c.env("MACROBATCH_GEMM", gemm);
    // bf16 stays out of it: the AVX512-BF16 kernel is compared with its
    // portable twin bit for bit in the linalg tests.
    c.env_remove("MACROBATCH_BF16").env_remove("MACROBATCH_REQUIRE_BF16");
    let o = c.output().expect("the binary (or qemu) runs");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), common::stderr(&o));
    assert!(o.status.success(), "train {} failed:\n{text}", if qemu.is_some() { "under qemu" } else { "natively" });
    let want = if qemu.is_some() { "AVX2".to_string() } else { linalg::vector_isa().to_string() };
    assert!(text.contains(&format!("threads, {want} |")), "the run should say it computes with {want}:\n{text}");
    o
}

/// Trains natively and as a Haswell and compares every step's loss, micro
/// losses and gradient norm, and every saved file named in `files`.
fn same_bits(tag: &str, q: &Path, gemm: &str, sets: &[&str], extra: &[&str], files: &[&str]) -> PathBuf {
    let native = common::tmp(&format!("isa-{tag}-native"));
    let avx2 = common::tmp(&format!("isa-{tag}-avx2"));
    train(None, &native, gemm, sets, extra);
    train(Some(q), &avx2, gemm, sets, extra);
    let (a, b) = (common::metrics(&native), common::metrics(&avx2));
    assert_eq!(a.len(), b.len(), "{tag}: step count");
    for (x, y) in a.iter().zip(&b) {
        for key in ["loss", "grad_norm", "micro_losses", "val_loss"] {
            // serde_json prints an f64 shortest-round-trip: equal text, equal bits.
            assert_eq!(
                x[key],
                y[key],
                "{tag}: step {}: {key} differs between {} and AVX2",
                x["step"],
                linalg::vector_isa()
            );
        }
    }
    for f in files {
        let (x, y) =
            (std::fs::read(native.join(f)).expect("native file"), std::fs::read(avx2.join(f)).expect("AVX2 file"));
        assert!(x == y, "{tag}: {f} differs between {} and AVX2", linalg::vector_isa());
    }
    let _ = std::fs::remove_dir_all(&avx2);
    native
}

/// GPT-2 in f32 (LayerNorm, GELU, softmax, cross-entropy, AdamW) on the
/// `crate` backend; then a Llama (RMSNorm, SwiGLU, RoPE, GQA) trained in f32
/// on `split`, and from it a LoRA run with an NF4-packed frozen base in f16
/// with loss scaling (packed decoding, f16 conversions). About 40 s under
/// qemu on a 2-core Zen 4.
#[test]
fn the_avx2_path_gives_the_same_bits_as_this_cpus() {
    let Some(q) = qemu() else { return };
    let steps = ["train.steps=2", "train.eval_every=2", "train.eval_batches=1", "batch.micro=4"];
    let gpt: Vec<&str> = common::SMALL.iter().chain(&steps).copied().collect();
    let d = same_bits("gpt", &q, "crate", &gpt, &[], &["model.safetensors"]);
    let _ = std::fs::remove_dir_all(d);

    // bf16 on a CPU without AVX512-BF16: the header says what the GEMMs
    // run on instead and what that means for speed.
    let out = common::tmp("isa-bf16-header");
    let mut bf16 = gpt.clone();
    bf16.extend(["train.precision=bf16", "train.steps=1"]);
    let o = train(Some(&q), &out, "crate", &bf16, &[]);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), common::stderr(&o));
    assert!(text.contains("bf16 GEMMs: f32 operands: this CPU has no AVX512-BF16"), "{text}");
    let _ = std::fs::remove_dir_all(&out);

    let mut llama = vec!["model.family=llama", "model.preset=tiny", "model.intermediate_size=192", "data.seq_len=64"];
    llama.extend(steps);
    let base = same_bits("llama", &q, "split", &llama, &[], &["model.safetensors"]);
    let mut lora = llama.clone();
    lora.extend(["train.precision=f16", "lora.r=4", "lora.target_modules=all-linear", "train.frozen_dtype=nf4"]);
    let init = base.to_str().expect("temp paths are UTF-8");
    let d = same_bits("lora", &q, "split", &lora, &["--init-from", init], &["adapter_model.safetensors"]);
    let _ = std::fs::remove_dir_all(d);
    let _ = std::fs::remove_dir_all(base);
}
