//! Layering rules of the binary that the compiler cannot see.

use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The binary names a model family only in `family::FAMILIES`: everything
/// else goes through the `Registration` / `LanguageModel` boundary (and
/// files through `nn::io`), so adding a family is one line.
#[test]
fn the_binary_names_a_model_family_only_in_its_registry() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 20, "found only {} source files under {}", files.len(), src.display());
    let mut found = Vec::new();
    for f in &files {
        if f.ends_with("family.rs") && f.parent() == Some(src.as_path()) {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("a source file");
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for name in ["gpt::", "llama::", "qwen2::", "qwen3::", "mistral::", "phi3::", "gemma2::"] {
                // `nn::…` or `family::…` paths may contain these as a suffix.
                let starts_a_path = code
                    .match_indices(name)
                    .any(|(at, _)| !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':'));
                if starts_a_path {
                    found.push(format!("{}:{}: {}", f.strip_prefix(&src).unwrap_or(f).display(), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "a model family named outside src/family.rs:\n{}", found.join("\n"));
}
