//! Writing a Llama as GGUF: export → `GgufModel::write` → the family's own
//! GGUF loader gives back the parameters (exactly in F32; within Q8_0's
//! step in Q8_0) and the shape, and transformers' GGUF loader computes our
//! logits from the file.

use engine::ParamLayout;
use family::{Build, Family, Registration};
use gguf::{GgmlType, GgufFile};
use std::path::PathBuf;
use std::sync::Arc;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("macrobatch-llama-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn ty(id: u32) -> GgmlType {
    GgmlType::from_id(id).unwrap()
}

/// The tiny preset (`tied`: its head is the embedding) with `lora` if given.
fn family(tied: bool, lora: Option<&str>) -> Arc<dyn Family> {
    let mut m = config::ModelConfig { family: "llama".into(), preset: Some("tiny".into()), ..Default::default() };
    m.shape.insert("tie_word_embeddings".into(), toml::Value::Boolean(tied));
    let lora: Option<toml::Table> = lora.map(|l| toml::from_str(l).unwrap());
    llama::FAMILY.for_config(&m, lora.as_ref()).unwrap()
}

/// Random parameters of `f`'s layout (norms drawn too, so none is 1).
fn params(f: &dyn Family, seed: u64) -> (ParamLayout, Vec<f32>) {
    let layout = f.build(Build::default()).unwrap().layout().clone();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let p = (0..layout.n_params())
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
        })
        .collect();
    (layout, p)
}

fn write(f: &dyn Family, layout: &ParamLayout, p: &[f32], name: &str, id: u32) -> PathBuf {
    let path = tmp(name);
    f.gguf_export(layout, p).unwrap().write(&path, ty(id)).unwrap();
    path
}

#[test]
fn f32_files_load_back_exactly_tied_and_untied() {
    for tied in [true, false] {
        let f = family(tied, None);
        let (layout, p) = params(&*f, 1);
        let path = write(&*f, &layout, &p, &format!("f32-{tied}.gguf"), GgmlType::F32);
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.tensor("output.weight").is_some(), !tied, "output.weight only when untied");
        assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(file.get_u64("general.file_type").unwrap(), 0);
        let (g, q) = llama::FAMILY.load_gguf(file).unwrap();
        assert_eq!(g.hf_config(), f.hf_config(), "tied = {tied}");
        assert_eq!(q.len(), p.len());
        assert!(q.iter().zip(&p).all(|(a, b)| a.to_bits() == b.to_bits()), "tied = {tied}: bit-exact");
    }
}

/// Llama 3's RoPE scaling goes out as llama.cpp's `rope_freqs` (and the
/// original context) and comes back as the same `rope_scaling`, every
/// parameter bit for bit: Llama 3's low and high factors (one pair between
/// the bands of the tiny heads), and others (two pairs, the fitted line).
#[test]
fn llama3_rope_scaling_loads_back() {
    use llama::{Dialect, RopeScaling};
    for (factor, low, high, old) in [(8.0, 1.0, 4.0, 256), (16.0, 1.5, 12.0, 2048)] {
        let scaling =
            RopeScaling { factor, low_freq_factor: low, high_freq_factor: high, original_max_position_embeddings: old };
        let cfg = llama::LlamaConfig { rope_scaling: Some(scaling), ..llama::LLAMA.preset("tiny").unwrap() };
        let f = llama::FAMILY.for_hf_dir(&std::env::temp_dir(), &llama::LLAMA.hf_json(&cfg)).unwrap();
        family::round_trip::assert_gguf_round_trip(&llama::FAMILY, &*f, 21);
    }
}

/// Q8_0 stores each run of 32 values of a row as d·q with d = amax/127 and
/// |x − d·q| ≤ d/2 (+ the f16 rounding of d: ≤ 127·d·2⁻¹¹, together
/// < 0.57·d); ffn_down's rows (176 values) are not whole blocks and fall
/// back to F16 (relative 2⁻¹¹ ≤ amax/127 too); norms stay F32 (exact).
/// So every value is within amax/127 of its block of 32 in the row.
#[test]
fn q8_0_files_load_back_within_a_step() {
    let f = family(false, None);
    let (layout, p) = params(&*f, 2);
    let path = write(&*f, &layout, &p, "q8_0.gguf", GgmlType::Q8_0);
    let file = GgufFile::open(&path).unwrap();
    let types: Vec<_> = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight"]
        .iter()
        .map(|n| file.tensor(n).unwrap().type_id)
        .collect();
    assert_eq!(types, [GgmlType::Q8_0, GgmlType::F16, GgmlType::F32]);
    assert_eq!(file.get_u64("general.file_type").unwrap(), 7);
    let (_, q) = llama::FAMILY.load_gguf(file).unwrap();
    for t in layout.tensors() {
        let cols = *t.shape.last().unwrap();
        let (x, y) = (&p[t.range()], &q[t.range()]);
        for (xr, yr) in x.chunks(cols).zip(y.chunks(cols)) {
            for (xb, yb) in xr.chunks(32).zip(yr.chunks(32)) {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (a, b) in xb.iter().zip(yb) {
                    assert!((a - b).abs() <= amax / 127.0, "{}: {a} -> {b} (amax {amax})", t.name);
                }
            }
        }
        if t.shape.len() == 1 {
            assert_eq!(x, y, "{}: norms stay F32", t.name);
        }
    }
}

#[test]
fn adapters_must_be_merged_first() {
    let f = family(true, Some("r = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]"));
    let (layout, p) = params(&*f, 3);
    let e = f.gguf_export(&layout, &p).unwrap_err().to_string();
    assert!(e.contains("merge"), "{e}");
    let (g, merged) = f.merged(&p).unwrap().unwrap();
    let (glayout, _) = params(&*g, 0);
    let m = g.gguf_export(&glayout, &merged).unwrap();
    assert!(m.tensors.iter().all(|t| !t.name.contains("lora")));
    let e = g.gguf_export(&glayout, &merged[1..]).unwrap_err().to_string();
    assert!(e.contains(&merged.len().to_string()), "{e}");
}

/// transformers' GGUF loader undoes our permutation and names: its logits
/// at every position equal ours to 1e-5 of the largest (both f32 with
/// different summation orders, ~1e-6 measured on these shapes by
/// `family::reference`; a wrong permutation or name moves them by ~1e-1).
/// For Q8_0 both sides compute with the file's dequantised values (ours
/// through the family's loader: ggml's arithmetic, as gguf-py's), so the
/// same tolerance holds; against the f32 model Q8_0 moves them further.
#[test]
fn transformers_reads_the_file_with_our_logits() {
    let f = family(false, None);
    let (layout, p) = params(&*f, 4);
    let ids: Vec<u32> = vec![3, 17, 200, 5, 99, 42, 7, 255, 0, 128];
    let mut model = f.build(Build::default()).unwrap();
    for id in [GgmlType::F32, GgmlType::Q8_0] {
        let path = write(&*f, &layout, &p, &format!("hf-{id}.gguf"), id);
        let (_, stored) = llama::FAMILY.load_gguf(GgufFile::open(&path).unwrap()).unwrap();
        assert_eq!(stored == p, id == GgmlType::F32);
        let Some(theirs) = gguf::testing::transformers_logits("llama-gguf", &path, &ids).unwrap() else { return };
        let (worst, largest) =
            gguf::testing::logits_gap(&theirs, |t| model.next_token_logits(&stored, &ids[..=t]).unwrap());
        let (vs_f32, _) = gguf::testing::logits_gap(&theirs, |t| model.next_token_logits(&p, &ids[..=t]).unwrap());
        println!(
            "llama GGUF {} via transformers: max |Δlogit| = {worst:e} (vs the f32 model {vs_f32:e}), largest |logit| = {largest}",
            ty(id).name
        );
        assert!(worst <= 1e-5 * largest, "{}: max |Δ| {worst} vs largest {largest}", ty(id).name);
    }
}

/// SmolLM2 (read from its Q4_1 file as f32) written back as F32 with the
/// source's tokenizer keys appended (as the CLI appends the tokenizer's,
/// where the loader finds the BOS / EOS ids): the architecture keys equal
/// the source's (value and type), the tensors keep the source's names and
/// shapes, and the family's loader gives back the parameters bit for bit.
#[test]
fn smollm2_round_trips_with_the_source_metadata() {
    let Some(source) = gguf::testing::smollm2_or_skip("smollm2_round_trips_with_the_source_metadata") else { return };
    let src = GgufFile::open(&source).unwrap();
    let (f, p) = llama::FAMILY.load_gguf(GgufFile::open(&source).unwrap()).unwrap();
    let layout = f.build(Build::default()).unwrap().layout().clone();
    let t0 = std::time::Instant::now();
    let mut m = f.gguf_export(&layout, &p).unwrap();
    m.metadata.extend(src.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")).cloned());
    for (key, value) in src.metadata().iter().filter(|(k, _)| k.starts_with("llama.") || k == "general.architecture") {
        let ours = m.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        assert_eq!(ours, Some(value), "{key}");
    }
    let mut names: Vec<(String, Vec<u64>)> = m.tensors.iter().map(|t| (t.name.clone(), t.ne.clone())).collect();
    let mut theirs: Vec<(String, Vec<u64>)> = src.tensors().iter().map(|t| (t.name.clone(), t.ne.clone())).collect();
    names.sort();
    theirs.sort();
    assert_eq!(names, theirs);
    let path = tmp("smollm2-f32.gguf");
    m.write(&path, ty(GgmlType::F32)).unwrap();
    let written = t0.elapsed();
    drop(m);
    let mb = std::fs::metadata(&path).unwrap().len() as f64 / 1e6;
    let loaded = llama::FAMILY.load_gguf(GgufFile::open(&path).unwrap());
    // Removed before any assertion: a 540 MB file is not left behind.
    std::fs::remove_file(&path).unwrap();
    let (g, q) = loaded.unwrap();
    assert_eq!(g.hf_config(), f.hf_config());
    assert!(q.len() == p.len() && q.iter().zip(&p).all(|(a, b)| a.to_bits() == b.to_bits()), "bit-exact");
    println!("SmolLM2 export + F32 write: {:.2} s, {mb:.0} MB", written.as_secs_f64());
}

/// `generate` and `eval` keep a GGUF's projections in their blocks
/// (`Family::packed_for_inference`): the packed model's greedy decoding,
/// with the key/value cache, gives the f32 model's logits on the
/// dequantised file bit for bit (each packed GEMM dequantises a panel and
/// runs the f32 kernel on it, so no tolerance), while holding the
/// projections in their file bytes. An F32 file has nothing to pack.
#[test]
fn packed_inference_decodes_as_the_dequantised_model_to_the_bit() {
    for (id, tied) in [(GgmlType::Q8_0, false), (GgmlType::Q4_0, true), (GgmlType::F16, false), (GgmlType::BF16, true)]
    {
        let f = family(tied, None);
        let (layout, p) = params(&*f, 3);
        let path = write(&*f, &layout, &p, &format!("packed-{id}-{tied}.gguf"), id);
        let (whole, all) = llama::FAMILY.load_gguf(GgufFile::open(&path).unwrap()).unwrap();
        let shape = llama::FAMILY.gguf_shape(GgufFile::open(&path).unwrap()).unwrap();
        let packed = shape.packed_for_inference(&path).unwrap().unwrap_or_else(|| panic!("type {id}: packable"));
        let rest = packed.load_unfrozen(&path).unwrap();
        let frozen = packed.frozen_bytes().unwrap();
        assert_eq!(packed.n_params() as usize, rest.len());
        // The projections (all but the embedding, norms and head) are held
        // in their 16-bit or block bytes: under half of their f32 bytes.
        let projected = (all.len() - rest.len()) as u128;
        assert!(
            projected > 0 && frozen.bytes * 2 <= 4 * projected + 64,
            "type {id}: {frozen:?} for {projected} values"
        );
        let mut a = whole.build(Build::default()).unwrap();
        let mut b = packed.build(Build::default()).unwrap();
        a.set_kv_cache(20).unwrap();
        b.set_kv_cache(20).unwrap();
        let mut tokens = vec![1u32, 7, 30, 2];
        for step in 0..12 {
            let la = a.next_token_logits(&all, &tokens).unwrap();
            let lb = b.next_token_logits(&rest, &tokens).unwrap();
            assert!(
                la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()),
                "type {id}, tied {tied}: step {step}'s logits differ"
            );
            let next = (0..la.len()).max_by(|&i, &j| la[i].total_cmp(&la[j])).unwrap();
            tokens.push(next as u32);
        }
        // The embedding stays in its bytes too (a tied head reads it there):
        // not in the layout, counted with the packed bytes; `eval`'s loss is
        // the f32 model's, and a training pass is refused.
        assert!(b.layout().get("model.embed_tokens.weight").is_none(), "type {id}: the embedding is packed");
        let c = shape.hf_config();
        let embedding = (c["vocab_size"].as_u64().unwrap() * c["hidden_size"].as_u64().unwrap()) as u128;
        let projections: usize =
            a.layout().tensors().iter().filter(|t| t.name.ends_with("_proj.weight")).map(|t| t.range().len()).sum();
        assert_eq!(projected, projections as u128 + embedding, "type {id}: projections and embedding packed");
        let batch = engine::TokenBatch {
            n_seqs: 2,
            seq_len: 5,
            inputs: vec![1, 7, 30, 2, 9, 4, 4, 8, 15, 16],
            targets: vec![7, 30, 2, 9, 4, 4, 8, 15, 16, 23],
            positions: Vec::new(),
        };
        let loss = |m: &mut Box<dyn family::LanguageModel>, p: &[f32], train: bool| {
            let mut g = vec![0.0; p.len()];
            let mut store = engine::FullStore::for_model(&*m, p, &mut g).unwrap();
            match train {
                true => m.micro_step(&mut store, &batch, 1.0).map(|s| s.loss_sum),
                false => m.loss(&mut store, &batch).map(|s| s.loss_sum),
            }
        };
        a.set_kv_cache(0).unwrap();
        b.set_kv_cache(0).unwrap();
        let (la, lb) = (loss(&mut a, &all, false).unwrap(), loss(&mut b, &rest, false).unwrap());
        assert_eq!(la.to_bits(), lb.to_bits(), "type {id}: eval loss {lb} vs {la}");
        let e = loss(&mut b, &rest, true).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("embedding"), "type {id}: training on a packed embedding: {e}");
    }
    let f = family(false, None);
    let (layout, p) = params(&*f, 4);
    let path = write(&*f, &layout, &p, "packed-f32.gguf", GgmlType::F32);
    let shape = llama::FAMILY.gguf_shape(GgufFile::open(&path).unwrap()).unwrap();
    assert!(shape.packed_for_inference(&path).unwrap().is_none(), "F32 projections stay in the layout");
}
