//! The layout stays what the README's Layout section says: inside each crate, no top-level module
//! reaches (through `crate::` paths) a module that reaches back to it. A cycle is reported with its
//! path, e.g. `health -> inventory -> health`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Crates whose modules are checked, by their `src` directory from the repository root.
const CRATES: &[&str] = &["proto/src", "allocator/engine/src", "allocator/src", "agent/src"];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Top-level module → the top-level modules its code names as `crate::<module>`; comment lines are
/// skipped, and `lib.rs`/`main.rs` (the module map and the wiring) are not modules.
fn module_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph = Graph::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
        let module = first.trim_end_matches(".rs").to_owned();
        if module == "lib" || module == "main" || module == "bin" {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let uses = graph.entry(module.clone()).or_default();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                // `nano_gpu_crate::x` is another crate, not this one.
                if line[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                let name: String =
                    line[i + 7..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if !name.is_empty() && name != module {
                    uses.insert(name);
                }
            }
        }
    }
    let known: BTreeSet<String> = graph.keys().cloned().collect();
    for uses in graph.values_mut() {
        uses.retain(|m| known.contains(m));
    }
    graph
}

/// A cycle in `graph`, as the path around it, if there is one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        graph: &Graph,
        node: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(graph, next, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|start| visit(graph, start, &mut Vec::new(), &mut done))
}

fn graph(edges: &[(&str, &str)]) -> Graph {
    let mut g = Graph::new();
    for (a, b) in edges {
        g.entry((*a).to_owned()).or_default().insert((*b).to_owned());
        g.entry((*b).to_owned()).or_default();
    }
    g
}

#[test]
fn no_crate_has_a_module_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for krate in CRATES {
        let g = module_graph(&root.join(krate));
        assert!(g.len() > 1, "{krate}: no modules found");
        if let Some(cycle) = find_cycle(&g) {
            panic!("{krate}: module cycle {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_check_finds_a_cycle_through_several_modules_and_none_in_a_chain() {
    let cyclic = graph(&[("server", "bind"), ("bind", "state"), ("state", "server"), ("watch", "state")]);
    let cycle = find_cycle(&cyclic).unwrap();
    assert_eq!(cycle.first(), cycle.last());
    assert_eq!(cycle.len(), 4, "{cycle:?}");
    let chain = graph(&[("server", "bind"), ("bind", "state"), ("watch", "state")]);
    assert_eq!(find_cycle(&chain), None);
}
