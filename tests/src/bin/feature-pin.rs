//! Lets a build of another version of this workspace (hack/previous-build.sh: the version an upgrade
//! starts from) reuse the dependencies the checkout's build already compiled. Cargo reuses a compiled
//! dependency only when its features are the same, and it unifies a dependency's features over the
//! packages a build selects: the previous version's agent and allocator alone turn fewer features on
//! (tokio's `test-util` comes from the tests' dev-dependencies, `time`'s macros from a crate added
//! since), and every crate above such a dependency compiles again, tokio's dependents most of all.
//!
//! Both inputs are cargo's unit graphs (`cargo build --unit-graph`, unstable: `RUSTC_BOOTSTRAP=1 ...
//! -Z unstable-options`), of the checkout's build and of the previous version's.
//!
//! Usage: feature-pin manifest CURRENT PREVIOUS
//!          the Cargo.toml of a crate whose dependencies turn on, for each dependency PREVIOUS
//!          compiles with other features than CURRENT, the features CURRENT compiles it with (on the
//!          host side, as a build-dependency, where it is built for build scripts and proc-macros);
//!          build it alongside the previous version's packages
//!        feature-pin compare CURRENT PREVIOUS
//!          how many of PREVIOUS's dependency units CURRENT has not compiled, and which

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// One compiled (or run) piece of a dependency, as the unit graph lists it.
struct Unit {
    /// `name@version` of a registry package; units of path packages (the workspace's) are left out.
    package: String,
    target: String,
    mode: String,
    lib: bool,
    features: BTreeSet<String>,
    /// Built for build scripts and proc-macros rather than for the binaries.
    host: bool,
}

impl Unit {
    fn key(&self) -> (&str, &str, &str, &BTreeSet<String>) {
        (&self.package, &self.target, &self.mode, &self.features)
    }
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [command, current, previous] = &args[..] else {
        return Err("usage: feature-pin manifest|compare CURRENT PREVIOUS (unit graphs)".into());
    };
    let current = units(current)?;
    let previous = units(previous)?;
    match command.as_str() {
        "manifest" => print!("{}", manifest(&current, &previous)?),
        "compare" => {
            let compiled: BTreeSet<_> = current.iter().map(Unit::key).collect();
            let missing: Vec<_> = previous.iter().filter(|u| !compiled.contains(&u.key())).collect();
            println!("{} of {} dependency units are not the checkout's", missing.len(), previous.len());
            for u in missing {
                let features: Vec<_> = u.features.iter().map(String::as_str).collect();
                println!("  {} {} ({}) [{}]", u.package, u.target, u.mode, features.join(","));
            }
        }
        other => return Err(format!("unknown command {other:?}: manifest or compare")),
    }
    Ok(())
}

/// The registry units of the unit graph in `path`, each marked host or not by walking from the roots.
fn units(path: &str) -> Result<Vec<Unit>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let graph: Value = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let raw = graph["units"].as_array().ok_or_else(|| format!("{path}: no units (not a unit graph?)"))?;
    let kinds = |u: &Value| -> Vec<String> {
        u["target"]["kind"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|k| k.as_str().map(String::from))
            .collect()
    };
    // host[i]: unit i is reached through a proc-macro or a build script's compilation. A unit that is
    // reached both ways is the same unit on both sides.
    let mut host = vec![None::<bool>; raw.len()];
    let mut queue: Vec<(usize, bool)> = graph["roots"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r.as_u64().map(|i| (i as usize, false)))
        .collect();
    let mut seen = BTreeSet::new();
    while let Some((i, on_host)) = queue.pop() {
        if !seen.insert((i, on_host)) {
            continue;
        }
        let unit = raw.get(i).ok_or_else(|| format!("{path}: unit {i} out of range"))?;
        host[i] = Some(host[i].unwrap_or(false) || on_host);
        let k = kinds(unit);
        let builds_for_host = k.iter().any(|k| k == "proc-macro")
            || (k.iter().any(|k| k == "custom-build") && unit["mode"] == "build");
        for dep in unit["dependencies"].as_array().into_iter().flatten() {
            if let Some(j) = dep["index"].as_u64() {
                queue.push((j as usize, on_host || builds_for_host));
            }
        }
    }
    let mut out = Vec::new();
    for (i, u) in raw.iter().enumerate() {
        let id = u["pkg_id"].as_str().unwrap_or_default();
        let Some(package) = id.strip_prefix("registry+").and_then(|s| s.rsplit_once('#')).map(|(_, p)| p)
        else {
            continue;
        };
        let k = kinds(u);
        out.push(Unit {
            package: package.to_string(),
            target: u["target"]["name"].as_str().unwrap_or_default().to_string(),
            mode: u["mode"].as_str().unwrap_or_default().to_string(),
            lib: u["mode"] == "build" && k.iter().any(|k| k == "lib" || k == "rlib" || k == "proc-macro"),
            features: u["features"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f.as_str().map(String::from))
                .collect(),
            host: host[i].unwrap_or(false),
        });
    }
    Ok(out)
}

/// The pin crate's Cargo.toml (see the module's documentation).
fn manifest(current: &[Unit], previous: &[Unit]) -> Result<String, String> {
    let compiled: BTreeSet<_> = current.iter().map(Unit::key).collect();
    // (host side?, package) -> features to turn on.
    let mut pins: BTreeMap<(bool, &str), &BTreeSet<String>> = BTreeMap::new();
    for u in previous.iter().filter(|u| u.lib && !compiled.contains(&u.key())) {
        // The smallest feature set the checkout compiled this library with, on the same side, that
        // holds everything the previous version needs of it.
        let best = current
            .iter()
            .filter(|c| c.lib && c.package == u.package && c.target == u.target && c.host == u.host)
            .filter(|c| c.features.is_superset(&u.features))
            .min_by_key(|c| c.features.len());
        if let Some(c) = best {
            pins.insert((u.host, &u.package), &c.features);
        }
    }
    let mut toml = String::from(
        "# Written by tests/src/bin/feature-pin.rs for hack/previous-build.sh: the checkout's features.\n\
         [package]\nname = \"nano-gpu-feature-pin\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\
         build = \"build.rs\"\n\n[lib]\npath = \"lib.rs\"\n",
    );
    for (host, table) in [(false, "dependencies"), (true, "build-dependencies")] {
        let _ = write!(toml, "\n[{table}]\n");
        for ((_, package), features) in pins.iter().filter(|((h, _), _)| *h == host) {
            let (name, version) = package.split_once('@').ok_or_else(|| format!("package id {package}"))?;
            let list: Vec<_> = features.iter().map(|f| format!("{f:?}")).collect();
            let _ = writeln!(
                toml,
                "pin-{}-{} = {{ package = {name:?}, version = \"={version}\", default-features = false, features = [{}] }}",
                name,
                version.replace(['.', '+'], "_"),
                list.join(", ")
            );
        }
    }
    eprintln!(
        "feature-pin: {} dependencies turned to the checkout's features ({} on the host side)",
        pins.len(),
        pins.keys().filter(|(h, _)| *h).count()
    );
    Ok(toml)
}
