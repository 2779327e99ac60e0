//! The `hack/` scripts build what they run: every `cargo build` in them that narrows the targets
//! with `--bin` (which cargo applies to every package the command names) names, for each package it
//! names, one of that package's own binaries or `--lib`. A package named without either builds
//! nothing, and the script would run a binary an earlier command happened to leave in `target/`
//! (README command 1 failed so on a fresh clone).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Each workspace package's name → its binaries' names and whether it has a library.
fn packages() -> BTreeMap<String, (BTreeSet<String>, bool)> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let members = manifest.split("members = [").nth(1).unwrap().split(']').next().unwrap();
    let mut out = BTreeMap::new();
    for member in members.split(',').map(|m| m.trim().trim_matches('"')).filter(|m| !m.is_empty()) {
        let dir = root().join(member);
        let toml = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let value = |line: &str| line.split('"').nth(1).map(str::to_owned);
        let name = toml.lines().find(|l| l.starts_with("name = ")).and_then(value).unwrap();
        let mut bins: BTreeSet<String> = BTreeSet::new();
        let mut in_bin = false;
        for line in toml.lines() {
            if line.starts_with('[') {
                in_bin = line == "[[bin]]";
            } else if in_bin && line.starts_with("name = ") {
                bins.extend(value(line));
            }
        }
        if dir.join("src/main.rs").is_file() && bins.is_empty() {
            bins.insert(name.clone());
        }
        if let Ok(entries) = std::fs::read_dir(dir.join("src/bin")) {
            for e in entries.flatten() {
                let path = e.path();
                if path.extension().is_some_and(|x| x == "rs") {
                    bins.insert(path.file_stem().unwrap().to_string_lossy().into_owned());
                } else if path.join("main.rs").is_file() {
                    bins.insert(e.file_name().to_string_lossy().into_owned());
                }
            }
        }
        let lib = dir.join("src/lib.rs").is_file();
        out.insert(name, (bins, lib));
    }
    out
}

/// Why the `cargo build` command `words` builds nothing for a package it names, if it does not.
fn unbuilt(words: &[&str], packages: &BTreeMap<String, (BTreeSet<String>, bool)>) -> Vec<String> {
    let after =
        |flag: &str| -> Vec<&str> { words.windows(2).filter(|w| w[0] == flag).map(|w| w[1]).collect() };
    let (named, bins) = (after("-p"), after("--bin"));
    let lib = words.contains(&"--lib");
    if bins.is_empty() || words.contains(&"--bins") {
        return Vec::new();
    }
    named
        .into_iter()
        .filter_map(|p| {
            let Some((own, has_lib)) = packages.get(p) else {
                return Some(format!("{p}: not a package of the workspace"));
            };
            let built = bins.iter().any(|b| own.contains(*b)) || (lib && *has_lib);
            (!built).then(|| format!("{p}: none of {bins:?} is its binary, and no --lib"))
        })
        .collect()
}

#[test]
fn every_cargo_build_in_hack_builds_each_package_it_names() {
    let packages = packages();
    assert!(
        packages["nano-gpu-tests"].0.contains("gpu-check")
            && packages["nano-gpu-agent"].0.contains("nano-gpu-agent")
    );
    // The command README command 1 ran before it was fixed: three packages named for nothing.
    let old = "cargo build --release --locked -p nano-gpu-tests --bin netns-forward --bin pause -p fakenvml \
               -p nano-gpu-allocator -p nano-gpu-agent";
    let words: Vec<&str> = old.split_whitespace().collect();
    assert_eq!(unbuilt(&words, &packages).len(), 3, "the checker sees the old bug");

    let mut problems = Vec::new();
    let mut seen = 0;
    for entry in std::fs::read_dir(root().join("hack")).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|x| x != "sh") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap().replace("\\\n", " ");
        for line in text.lines() {
            for (at, _) in line.match_indices("cargo build") {
                seen += 1;
                let command: Vec<&str> =
                    line[at..].split([';', '&', '|', ')']).next().unwrap().split_whitespace().collect();
                for p in unbuilt(&command, &packages) {
                    problems.push(format!("{}: {p}", path.file_name().unwrap().to_string_lossy()));
                }
            }
        }
    }
    assert!(seen >= 7, "the scripts' cargo builds are found ({seen})");
    assert!(problems.is_empty(), "{problems:#?}");
}
