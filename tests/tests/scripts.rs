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

/// The directories of the workspace's members, as the root manifest lists them.
fn members() -> Vec<std::path::PathBuf> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let members = manifest.split("members = [").nth(1).unwrap().split(']').next().unwrap();
    members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| root().join(m))
        .collect()
}

/// Each workspace package's name → its binaries' names and whether it has a library.
fn packages() -> BTreeMap<String, (BTreeSet<String>, bool)> {
    let mut out = BTreeMap::new();
    for dir in members() {
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

/// The suites `hack/run-tests.sh` knows, as its table lists them: name → (weight, group, needs).
fn run_tests_table() -> BTreeMap<String, (u32, String, String)> {
    let text = std::fs::read_to_string(root().join("hack/run-tests.sh")).unwrap();
    let table = text.split("TABLE='").nth(1).unwrap().split('\'').next().unwrap();
    table
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 4)
                .then(|| (f[0].to_owned(), (f[1].parse().unwrap(), f[2].to_owned(), f[3].to_owned())))
        })
        .collect()
}

/// `hack/run-tests.sh` runs suites side by side: every suite that uses the machine's MPS directories
/// (`/run/nano-gpu/mps`, which outlive a cluster) is in its group `mps`, so no two of them overlap,
/// `uninstall` (which checks that nothing of nano-gpu is left on the machine) runs alone, and every
/// suite its table names exists (the runner refuses a name cargo did not build).
#[test]
fn the_test_runner_keeps_the_mps_suites_apart() {
    let table = run_tests_table();
    assert!(table.len() >= 10 && table["tenant"].1 == "mps", "the table is read: {table:?}");
    assert_eq!(table["uninstall"].1, "alone", "uninstall runs alone");
    // A suite that starts what a background build makes waits for that build (else it would build it
    // itself, while the runner builds something else beside it).
    let builds = [
        ("up_with_containerd2", "containerd2"),
        ("up_with_dra", "containerd2"),
        ("previous-build.sh", "previous"),
        ("gpushare-inspect-build.sh", "gpushare"),
        ("prometheus-operator-build.sh", "prometheus-operator"),
        ("--from-harness", "containerd2"),
        ("--from-harness", "nvidia-toolkit"),
    ];
    let mut mps_users = BTreeSet::new();
    for entry in std::fs::read_dir(root().join("tests/tests")).unwrap().flatten() {
        let name = entry.path().file_stem().unwrap().to_string_lossy().into_owned();
        if name == "scripts" {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).unwrap();
        let row = table.get(name.as_str());
        if text.contains("clear_mps_dirs") || text.contains("mps_layout") {
            assert_eq!(
                row.map(|t| t.1.as_str()),
                Some("mps"),
                "{name} uses the MPS directories but is not in the group mps"
            );
            mps_users.insert(name.clone());
        }
        let needs: Vec<&str> = row.map(|t| t.2.split(',').collect()).unwrap_or_default();
        for (uses, build) in builds {
            assert!(
                !text.contains(uses) || needs.contains(&build),
                "{name} uses {uses}, so the runner's table has it need {build}"
            );
        }
    }
    assert!(mps_users.contains("enforcement") && mps_users.contains("tenant"), "{mps_users:?}");
    for name in table.keys() {
        let file = root().join("tests/tests").join(format!("{}.rs", name.trim_end_matches("@oldest")));
        assert!(file.is_file(), "the table names {name}, which is no suite");
    }
}

/// A binary built without its test harness (`test = false`, to spare the build a harness that tests
/// nothing) has no tests: any it had would never run.
#[test]
fn no_binary_built_without_its_test_harness_has_tests() {
    let mut untested = Vec::new();
    for dir in members() {
        let toml = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        for section in toml.split("[[bin]]").skip(1) {
            let section = section.split("\n[").next().unwrap();
            let field = |key: &str| {
                section
                    .lines()
                    .find_map(|l| l.strip_prefix(key)?.trim().strip_prefix('=')?.trim().split('"').nth(1))
            };
            if !section.lines().any(|l| l.replace(' ', "") == "test=false") {
                continue;
            }
            let name = field("name").unwrap();
            let source = match field("path") {
                Some(path) => dir.join(path),
                None if dir.join(format!("src/bin/{name}.rs")).is_file() => {
                    dir.join(format!("src/bin/{name}.rs"))
                }
                None => dir.join(format!("src/bin/{name}")),
            };
            untested.push((name.to_owned(), source));
        }
    }
    assert!(untested.iter().any(|(n, _)| n == "pause"), "the binaries are read: {untested:?}");
    let mut problems = Vec::new();
    for (name, source) in untested {
        let files: Vec<std::path::PathBuf> = if source.is_dir() {
            std::fs::read_dir(&source)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "rs"))
                .collect()
        } else {
            vec![source.clone()]
        };
        assert!(!files.is_empty(), "{name}: no source at {}", source.display());
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            if ["#[test]", "#[tokio::test", "#[cfg(test)]"].iter().any(|m| text.contains(m)) {
                problems.push(format!(
                    "{name}: {} has tests, but its manifest says test = false",
                    file.display()
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// A unit graph as `cargo build --unit-graph` prints it: `units` as (package id, target kind,
/// features, dependencies), the first the root.
fn unit_graph(units: &[(&str, &str, &[&str], &[usize])]) -> String {
    let units: Vec<_> = units
        .iter()
        .map(|(id, kind, features, deps)| {
            serde_json::json!({
                "pkg_id": id,
                "target": { "kind": [kind], "name": id.rsplit(['#', '@']).nth(1).unwrap_or(id) },
                "mode": "build",
                "features": features,
                "dependencies": deps.iter().map(|i| serde_json::json!({ "index": i })).collect::<Vec<_>>(),
            })
        })
        .collect();
    serde_json::json!({ "version": 1, "units": units, "roots": [0] }).to_string()
}

#[test]
fn the_feature_pin_turns_on_the_checkouts_features_on_the_side_each_dependency_is_built_for() {
    let crates = "registry+https://github.com/rust-lang/crates.io-index#";
    let (tokio, mac, syn) =
        (format!("{crates}tokio@1.0.0"), format!("{crates}mac@0.1.0"), format!("{crates}syn@2.0.0"));
    let graph = |tokio_features: &[&str], syn_features: &[&str]| {
        unit_graph(&[
            ("path+file:///w/app#0.1.0", "bin", &[], &[1, 2]),
            (&tokio, "lib", tokio_features, &[]),
            (&mac, "proc-macro", &[], &[3]),
            (&syn, "lib", syn_features, &[]),
        ])
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("feature-pin");
    std::fs::create_dir_all(&dir).unwrap();
    let (current, previous) = (dir.join("current.json"), dir.join("previous.json"));
    std::fs::write(&current, graph(&["rt", "test-util"], &["full", "visit"])).unwrap();
    std::fs::write(&previous, graph(&["rt"], &["full"])).unwrap();
    let run = |command: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_feature-pin"))
            .args([command, current.to_str().unwrap(), previous.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let compare = run("compare");
    assert!(compare.starts_with("2 of 3 dependency units are not the checkout's"), "{compare}");
    let manifest = run("manifest");
    let (normal, build) = manifest.split_once("[build-dependencies]").unwrap();
    let tokio_pin = r#"pin-tokio-1_0_0 = { package = "tokio", version = "=1.0.0", default-features = false, features = ["rt", "test-util"] }"#;
    let syn_pin = r#"pin-syn-2_0_0 = { package = "syn", version = "=2.0.0", default-features = false, features = ["full", "visit"] }"#;
    assert!(normal.contains(tokio_pin) && !normal.contains("syn"), "{manifest}");
    assert!(build.contains(syn_pin) && !build.contains("tokio") && !manifest.contains("mac"), "{manifest}");
}
