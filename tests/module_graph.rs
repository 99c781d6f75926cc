//! The crate's modules depend on each other one way: among the children of any module, the
//! `crate::` paths each one names (its `use` lines and inline paths) form no cycle. A module may
//! name its own ancestors and descendants (a parent re-exports its children); an arrow between
//! two siblings' subtrees counts as one between the siblings. No maintained tool reads this
//! without a nightly toolchain or a long build (`cargo modules ... --acyclic`), so this test
//! reads the sources itself.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every `.rs` file under `dir` by its module path (`attn/x86/mod.rs` is `attn::x86`).
fn modules(root: &Path, dir: &Path, out: &mut BTreeMap<Module, PathBuf>) {
    for entry in fs::read_dir(dir).expect("readable source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            modules(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(root).expect("under root").with_extension("");
            let mut parts: Module = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            out.insert(parts, path);
        }
    }
}

/// The `crate::a::b::...` paths in `text` (comments dropped), use groups expanded one level:
/// `crate::attn::{dot, types::Rows}` gives `attn::dot` and `attn::types::Rows`.
fn crate_paths(text: &str) -> Vec<Module> {
    let code: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let mut found = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `$crate::` or part of another name
        }
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
        let base: Module = rest[..end].split("::").filter(|s| !s.is_empty()).map(str::to_owned).collect();
        if rest[end..].starts_with('{') && rest[..end].ends_with("::") {
            let close = rest[end..].find('}').map_or(rest.len(), |i| end + i);
            for item in rest[end + 1..close].split(',') {
                let item = item.split(" as ").next().unwrap_or("").trim();
                let mut path = base.clone();
                path.extend(item.split("::").filter(|s| !s.is_empty() && *s != "self").map(str::to_owned));
                found.push(path);
            }
        } else {
            found.push(base);
        }
    }
    found
}

/// The longest prefix of `path` that is a module.
fn resolve(path: &[String], mods: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|m| mods.contains_key(m))
}

/// Per parent module, the arrows between its children.
fn sibling_graph(root: &Path) -> BTreeMap<Module, BTreeMap<String, BTreeSet<String>>> {
    let mut mods = BTreeMap::new();
    modules(root, root, &mut mods);
    let mut graph: BTreeMap<Module, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (from, file) in &mods {
        let text = fs::read_to_string(file).expect("readable source");
        for to in crate_paths(&text).iter().filter_map(|p| resolve(p, &mods)) {
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue; // an ancestor or a descendant
            }
            let siblings = graph.entry(from[..common].to_vec()).or_default();
            siblings.entry(from[common].clone()).or_default().insert(to[common].clone());
        }
    }
    graph
}

/// One cycle of `graph`, if it has any.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|start| visit(start, graph, &mut Vec::new(), &mut done))
}

fn cycles(root: &Path) -> Vec<String> {
    sibling_graph(root)
        .iter()
        .filter_map(|(parent, children)| {
            let name = if parent.is_empty() { "crate".to_owned() } else { parent.join("::") };
            find_cycle(children).map(|c| format!("in {name}: {}", c.join(" -> ")))
        })
        .collect()
}

#[test]
fn no_module_cycles_in_the_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("rust");
    let found = cycles(&root);
    assert!(found.is_empty(), "module cycles (make the arrows run one way):\n{}", found.join("\n"));
}

#[test]
fn the_check_sees_a_cycle_through_a_use_group_and_an_inline_path() {
    let dir = std::env::temp_dir().join(format!("neo_rs_module_graph_{}", std::process::id()));
    let write = |rel: &str, text: &str| {
        let path = dir.join(rel);
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(path, text).expect("write");
    };
    write("lib.rs", "pub mod a;\n");
    write("a/mod.rs", "mod x;\nmod y;\nmod z;\npub use x::X; // crate::a::y::Y in a comment is no arrow\n");
    write("a/x.rs", "use crate::a::{y::Y, z};\npub struct X;\n");
    write("a/y.rs", "pub struct Y;\n");
    write("a/z.rs", "pub struct Z;\n");
    assert!(cycles(&dir).is_empty(), "x -> y and x -> z, a parent naming its child: no cycle");
    write("a/z.rs", "pub struct Z(crate::a::x::X);\n");
    assert_eq!(cycles(&dir), ["in a: x -> z -> x"]);
    fs::remove_dir_all(&dir).expect("cleanup");
}
