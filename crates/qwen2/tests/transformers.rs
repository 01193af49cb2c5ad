//! Qwen2 against transformers' `Qwen2ForCausalLM` (a random small model
//! made and saved by transformers on the spot, see family::reference for
//! the procedure and the tolerance): logits at every position, greedy
//! tokens, and the folder we write loaded back by transformers.

#[test]
fn qwen2_matches_transformers_in_and_out() {
    let work = std::env::temp_dir().join(format!("macrobatch-qwen2-ref-{}", std::process::id()));
    match family::reference::check(&qwen2::FAMILY, "qwen2", &work) {
        Ok(Some(a)) => {
            println!("qwen2: logits within {:.1e} of scale, greedy {:?}; {}", a.logits_rel_err, a.greedy, a.reloaded)
        }
        Ok(None) => {}
        Err(e) => panic!("{e}"),
    }
}
