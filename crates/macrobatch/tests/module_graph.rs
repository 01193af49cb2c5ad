//! The module graph of every crate in the workspace: which top-level
//! module uses which (`crate::x…` paths, `crate::{…}` groups, and names the
//! crate root re-exports, resolved to their module), and its cycles.
//!
//! `cargo test --release -p macrobatch --test module_graph -- --nocapture`
//! prints the edges and the cycles. The test fails on any cycle: a crate's
//! modules form layers, each using only those below it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for path in entries.flatten().map(|e| e.path()) {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without line comments and without its test module
/// (a `tests.rs` file of a module folder is all test code).
fn code(path: &Path) -> String {
    if path.file_stem().is_some_and(|s| s == "tests") {
        return String::new();
    }
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let text = text.split("#[cfg(test)]").next().unwrap_or("").to_string();
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first identifier of each item of `crate::{…}` or of `crate::x…`.
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // `macrobatch_crate::`, `$crate::`
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut item_start) = (0, true);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        out.push(ident(&group[i..]).to_string());
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest).to_string());
        }
    }
    out
}

/// Top-level modules of a crate's `src` (a file `x.rs` and its folder `x/`).
fn modules(src: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut mods: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for path in std::fs::read_dir(src).into_iter().flatten().flatten().map(|e| e.path()) {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("").to_string();
        if path.is_dir() && name != "bin" {
            rust_files(&path, mods.entry(name).or_default());
        } else if path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main" {
            mods.entry(name).or_default().push(path);
        }
    }
    mods
}

/// Names the crate root re-exports (`pub use x::{A, B}` / `pub use x::A`), by module.
fn reexports(src: &Path, mods: &BTreeMap<String, Vec<PathBuf>>) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for root in ["lib.rs", "main.rs"] {
        let text = code(&src.join(root));
        for stmt in text.split(';') {
            let Some(path) = stmt.trim().strip_prefix("pub use ") else { continue };
            let module = ident(path);
            if !mods.contains_key(module) {
                continue;
            }
            let items = path.rsplit_once("::{").map_or(path.rsplit("::").next().unwrap_or(""), |(_, g)| g);
            for item in items.trim_end_matches('}').split(',') {
                let item = item.trim();
                let name = item.rsplit(" as ").next().unwrap_or(item).rsplit("::").next().unwrap_or(item);
                names.insert(ident(name.trim()).to_string(), module.to_string());
            }
        }
    }
    names
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        for w in t.g.get(v).into_iter().flatten() {
            if !t.index.contains_key(w.as_str()) {
                visit(t, w);
                let lw = t.low[w.as_str()];
                t.low.insert(v, t.low[v].min(lw));
            } else if t.stack.contains(&w.as_str()) {
                let iw = t.index[w.as_str()];
                t.low.insert(v, t.low[v].min(iw));
            }
        }
        if t.low[v] == t.index[v] {
            let at = t.stack.iter().rposition(|&x| x == v).unwrap_or(0);
            let mut comp: Vec<String> = t.stack.drain(at..).map(String::from).collect();
            comp.sort();
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T { g: graph, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), out: Vec::new() };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_crate_has_a_module_cycle() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates).expect("crates/").flatten().map(|e| e.path()).collect();
    dirs.sort();
    let mut found = BTreeSet::new();
    for dir in dirs {
        let src = dir.join("src");
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        if !src.is_dir() {
            continue;
        }
        let mods = modules(&src);
        let names = reexports(&src, &mods);
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (m, files) in &mods {
            let edges = graph.entry(m.clone()).or_default();
            for f in files {
                for first in crate_paths(&code(f)) {
                    let target = if mods.contains_key(&first) { Some(&first) } else { names.get(&first) };
                    if let Some(t) = target.filter(|t| *t != m) {
                        edges.insert(t.clone());
                    }
                }
            }
        }
        for (m, edges) in &graph {
            println!("{name}::{m} -> {}", edges.iter().cloned().collect::<Vec<_>>().join(", "));
        }
        for comp in cycles(&graph) {
            println!("cycle in {name}: {}", comp.join(" ⇄ "));
            found.insert(format!("{name}: {}", comp.join(", ")));
        }
    }
    assert!(found.is_empty(), "module cycles (break them: move what both sides need below both): {found:?}");
}
