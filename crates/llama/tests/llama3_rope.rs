//! Llama 3's RoPE scaling (`rope_type = "llama3"`) against transformers'
//! `LlamaForCausalLM` (a random small model made and saved by transformers
//! on the spot, its head's frequencies in all three bands of the scaling;
//! see family::reference for the procedure and the tolerance).

#[test]
fn llama3_rope_scaling_matches_transformers_in_and_out() {
    let work = std::env::temp_dir().join(format!("macrobatch-llama3-ref-{}", std::process::id()));
    match family::reference::check(&llama::FAMILY, "llama3", &work) {
        Ok(Some(a)) => {
            println!("llama3: logits within {:.1e} of scale, greedy {:?}; {}", a.logits_rel_err, a.greedy, a.reloaded)
        }
        Ok(None) => {}
        Err(e) => panic!("{e}"),
    }
}
