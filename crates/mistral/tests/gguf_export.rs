//! Mistral as GGUF: llama.cpp's converter writes it as `llama` (Q and K
//! rows permuted), which has no sliding window — so a model whose window is
//! shorter than its context is refused with the reason, and one without a
//! window (v0.3, NeMo) is written as `llama`.

use family::{Build, Registration};
use llama::Dialect;

#[test]
fn a_window_shorter_than_the_context_is_refused_and_none_is_written_as_llama() {
    let dir = std::env::temp_dir().join(format!("macrobatch-mistral-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tiny = mistral::MISTRAL.preset("tiny").unwrap();
    for window in [tiny.sliding_window, None] {
        let json = mistral::MISTRAL.hf_json(&llama::LlamaConfig { sliding_window: window, ..tiny.clone() });
        let f = mistral::FAMILY.for_hf_dir(&dir, &json).unwrap();
        let model = f.build(Build::default()).unwrap();
        let layout = model.layout().clone();
        let p = vec![0.01f32; layout.n_params()];
        match (window, f.gguf_export(&layout, &p)) {
            (Some(w), Err(e)) => assert!(e.to_string().contains(&format!("sliding window of {w} keys")), "{e}"),
            (None, Ok(m)) => {
                let arch = m.metadata.iter().find(|(k, _)| k == "general.architecture").map(|(_, v)| v.clone());
                assert_eq!(arch, Some(gguf::Value::String("llama".into())));
            }
            (w, r) => panic!("window {w:?}: {:?}", r.map(|_| "written")),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
