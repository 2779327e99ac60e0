//! The layout stays what the layout page (docs/src/development/layout.md) says: inside each crate,
//! no top-level module reaches (through `crate::` or `super::` paths) a module that reaches back to
//! it, nor does a module one folder down with its siblings; the allocator's and the agent's folders by job
//! use only the folders before them. A cycle is reported with its path, e.g. `health -> inventory -> health`.

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

/// A file's module path inside its crate: `service/watch.rs` → `service::watch`, `state.rs` →
/// `state`; `lib.rs`, `main.rs` and `bin/` (the module map and the wiring) are no module (`None`).
fn module_path(rel: &Path) -> Option<Vec<String>> {
    let mut path: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if matches!(path.first().map(String::as_str), Some("lib" | "main" | "bin")) {
        return None;
    }
    if path.last().is_some_and(|l| l == "mod") {
        path.pop();
    }
    Some(path)
}

/// The module paths a line names: `crate::a::b::C` gives `a::b::C`, `super::x` in module `m::n`
/// gives `m::x` (a path is cut to a known module later). `nano_gpu_crate::x` is another crate.
fn named_paths(line: &str, module: &[String]) -> Vec<Vec<String>> {
    let ident = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|part| part.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>())
            .take_while(|part| !part.is_empty())
            .collect()
    };
    let mut out = Vec::new();
    for (prefix, up) in [("crate::", None), ("super::", Some(()))] {
        for (i, _) in line.match_indices(prefix) {
            if line[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut rest = &line[i + prefix.len()..];
            let mut base: Vec<String> = Vec::new();
            if up.is_some() {
                // `super::` from module m::n is m; each further `super::` goes one more up.
                let mut depth = module.len().saturating_sub(1);
                while let Some(r) = rest.strip_prefix("super::") {
                    depth = depth.saturating_sub(1);
                    rest = r;
                }
                base.extend_from_slice(&module[..depth]);
            }
            base.extend(ident(rest));
            if !base.is_empty() {
                out.push(base);
            }
        }
    }
    out
}

/// Module → the modules its code names (through `crate::` or `super::` paths), each module cut to
/// its first `depth` path segments (1: the crate's top-level modules; 2: also those one folder down).
/// A named path is cut to the longest module the crate has; comment lines are skipped.
fn module_graph(src: &Path, depth: usize) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut modules: Vec<(Vec<String>, PathBuf)> = Vec::new();
    for file in files {
        if let Some(path) = module_path(file.strip_prefix(src).unwrap()) {
            modules.push((path, file));
        }
    }
    let cut = |p: &[String]| p[..p.len().min(depth)].join("::");
    let known: BTreeSet<String> = modules.iter().map(|(p, _)| cut(p)).collect();
    let mut graph = Graph::new();
    for (path, file) in &modules {
        let from = cut(path);
        let uses = graph.entry(from.clone()).or_default();
        let text = std::fs::read_to_string(file).unwrap();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for named in named_paths(line, path) {
                let to = (1..=named.len().min(depth))
                    .rev()
                    .map(|n| named[..n].join("::"))
                    .find(|m| known.contains(m));
                if let Some(to) = to.filter(|to| *to != from) {
                    uses.insert(to);
                }
            }
        }
    }
    graph
}

/// The graph of the modules one level down that share a parent (`service::watch`,
/// `service::leader`, ...), with only the edges between such siblings: a folder's own file (its
/// module map) and its children may name each other, as `lib.rs` and the top level do.
fn sibling_graph(graph: &Graph) -> Graph {
    let parent = |m: &str| m.rsplit_once("::").map(|(p, _)| p.to_owned());
    let mut g = Graph::new();
    for (from, uses) in graph {
        let Some(p) = parent(from) else { continue };
        let siblings = uses.iter().filter(|to| parent(to).as_deref() == Some(p.as_str())).cloned();
        g.entry(from.clone()).or_default().extend(siblings);
    }
    g
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
        let top = module_graph(&root.join(krate), 1);
        assert!(top.len() > 1, "{krate}: no modules found");
        if let Some(cycle) = find_cycle(&top) {
            panic!("{krate}: module cycle {}", cycle.join(" -> "));
        }
        // One folder down: no two modules of a folder name each other, round a cycle.
        if let Some(cycle) = find_cycle(&sibling_graph(&module_graph(&root.join(krate), 2))) {
            panic!("{krate}: module cycle {}", cycle.join(" -> "));
        }
    }
}

/// The allocator's folders by job, each using only those before it (`allocator/src/lib.rs`).
const ALLOCATOR_ORDER: &[&str] = &["decide", "state", "service", "commands", "sim"];

/// The agent's folders by job, each using only those before it (`agent/src/lib.rs`).
const AGENT_ORDER: &[&str] = &["cards", "node", "kubelet", "serve", "commands"];

/// In crate `src` (from the repository root), every top-level module is one of `order` (or a test
/// helper of `helpers`), and none names a module after its own in `order`.
fn folders_use_only_those_before_them(src: &str, order: &[&str], helpers: &[&str]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let top = module_graph(&root.join(src), 1);
    let rank = |m: &str| order.iter().position(|o| *o == m);
    for module in top.keys() {
        assert!(
            rank(module).is_some() || helpers.contains(&module.as_str()),
            "{src}/{module}: in no folder by job"
        );
    }
    for (from, uses) in &top {
        let Some(r) = rank(from) else { continue };
        if let Some(to) = uses.iter().find(|to| rank(to).is_some_and(|t| t > r)) {
            panic!("{src}/{from} reaches up to {to} (allowed: the folders before it in lib.rs)");
        }
    }
}

#[test]
fn the_allocators_folders_use_only_those_before_them() {
    folders_use_only_those_before_them("allocator/src", ALLOCATOR_ORDER, &["api_replies"]);
}

#[test]
fn the_agents_folders_use_only_those_before_them() {
    folders_use_only_those_before_them("agent/src", AGENT_ORDER, &["scratch"]);
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

#[test]
fn paths_are_read_from_crate_and_super() {
    let module = ["state".to_owned(), "claims".to_owned()];
    let named =
        named_paths("use super::preemption::{Needs, Preemptor}; crate::service::watch::run(x)", &module);
    assert_eq!(named, [vec!["service", "watch", "run"], vec!["state", "preemption"]]);
    // `super::super::` from a test module inside state::claims reaches the state folder.
    let module = ["state".to_owned(), "claims".to_owned(), "tests".to_owned()];
    assert_eq!(named_paths("use super::super::ClusterState;", &module), [vec!["state", "ClusterState"]]);
    // Another crate's path is not this one's.
    assert!(named_paths("nano_gpu_allocator::state::X", &module).is_empty());
}
