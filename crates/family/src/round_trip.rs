//! A family's GGUF file read back as what was written: the check each
//! family that llama.cpp knows runs on its own small model.

use crate::{Build, Family, Registration};

/// `f`'s model written as an f32 GGUF file and read back through `r` (by
/// the file's `general.architecture`) must be the same family at the same
/// shape with the same parameters, bit for bit. The parameters are
/// multiples of 2⁻¹² in (−0.25, 0.25), so a file's own transforms (Gemma's
/// gains stored as `1 + w`, llama.cpp's Q/K row order) are exact in f32:
/// any difference is a wrong name, order or transform. Panics naming the
/// first tensor that differs.
pub fn assert_gguf_round_trip(r: &dyn Registration, f: &dyn Family, seed: u64) {
    let layout = f.build(Build::default()).unwrap_or_else(|e| panic!("{e}")).layout().clone();
    let p: Vec<f32> = gguf::testing::uniform_params(layout.n_params(), seed)
        .into_iter()
        .map(|x| (x * 4096.0).round() / 4096.0)
        .collect();
    let path = std::env::temp_dir().join(format!("macrobatch-{}-{seed}-{}.gguf", r.family(), std::process::id()));
    let model = f.gguf_export(&layout, &p).unwrap_or_else(|e| panic!("{e}"));
    let f32_type = gguf::GgmlType::from_id(gguf::GgmlType::F32).expect("F32 is a ggml type");
    model.write(&path, f32_type).unwrap_or_else(|e| panic!("{e}"));
    let file = gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.gguf_architecture(), Some(file.get_str("general.architecture").unwrap_or_default()));
    let (g, q) = r.load_gguf(file).unwrap_or_else(|e| panic!("{}: {e}", r.family()));
    let _ = std::fs::remove_file(&path);
    assert_eq!(g.hf_config(), f.hf_config(), "{}: the shape read back", r.family());
    assert_eq!(q.len(), p.len());
    for t in layout.tensors() {
        let same = q[t.range()].iter().zip(&p[t.range()]).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{}: `{}` differs after the round trip", r.family(), t.name);
    }
}
