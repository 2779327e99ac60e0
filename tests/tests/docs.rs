//! The book (`docs/`) and the README hold together and say what the code does: every page is in the
//! table of contents and every entry has its page; every relative link and anchor resolves (by
//! mdBook's heading ids); the book links nothing outside itself; every Event reason, metric and
//! `nano-gpu/` key the code names is in its reference page, and nothing stale is; the README stays a
//! front page. The flag pages are checked by each binary's own `cli_reference` test, and `hack/test.sh`
//! builds the book with mdBook.

use nano_gpu_proto::events::Reason;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn book() -> PathBuf {
    root().join("docs/src")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

fn pages() -> Vec<PathBuf> {
    let mut out = Vec::new();
    files(&book(), "md", &mut out);
    out.sort();
    out
}

/// The Markdown outside fenced code blocks, line by line (inline code is left in: callers strip it).
fn prose(text: &str) -> Vec<&str> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(open), Some(m)) if open == m && trimmed.trim_end() == m => fence = None,
            (None, None) => out.push(line),
            _ => {}
        }
    }
    out
}

/// `line` without its inline code spans (links inside them are not links).
fn without_code(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for ch in line.chars() {
        if ch == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(ch);
        }
    }
    out
}

/// The targets of inline links `[text](target)` in `text`'s prose.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        let line = without_code(line);
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("").to_owned();
            out.push(target);
            rest = &after[end..];
        }
    }
    out
}

/// A heading's id as mdBook makes it: its text (code spans' text kept, link targets dropped)
/// lower-cased, whitespace to `-`, every other character but letters, digits, `-` and `_` dropped.
fn heading_id(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[label](target)` keeps the label.
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](").map(|m| open + m) else { break };
        let Some(close) = rest[mid..].find(')').map(|c| mid + c) else { break };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..mid]);
        rest = &rest[close + 1..];
    }
    text.push_str(rest);
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The anchors a page offers: its headings' ids (a repeated id gets `-1`, `-2`, … as mdBook does)
/// and any `id="…"` an HTML element sets.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in prose(text) {
        let trimmed = line.trim_start();
        if let Some(heading) = trimmed.strip_prefix('#') {
            let heading = heading.trim_start_matches('#');
            if heading.starts_with(' ') {
                let id = heading_id(heading.trim());
                let n = seen.entry(id.clone()).or_default();
                out.insert(if *n == 0 { id.clone() } else { format!("{id}-{n}") });
                *n += 1;
            }
        }
        let mut rest = line;
        while let Some(at) = rest.find("id=\"") {
            let after = &rest[at + 4..];
            let Some(end) = after.find('"') else { break };
            out.insert(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    out
}

/// `base/target` with `.` and `..` resolved, or `None` when it climbs above the filesystem root.
fn resolve(base: &Path, target: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in base.join(target).components() {
        match part {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

/// What is wrong with the relative links of `file`: missing files, missing anchors, and, for pages of
/// the book (`inside` set), a target outside the book.
fn broken_links(
    file: &Path,
    inside: Option<&Path>,
    cache: &mut BTreeMap<PathBuf, BTreeSet<String>>,
) -> Vec<String> {
    let text = read(file);
    let mut problems = Vec::new();
    for target in links(&text) {
        if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let resolved =
            if path.is_empty() { Some(file.to_path_buf()) } else { resolve(file.parent().unwrap(), path) };
        let Some(resolved) = resolved.filter(|p| p.exists()) else {
            problems.push(format!("{}: {target}: no such file", file.display()));
            continue;
        };
        if let Some(book) = inside.filter(|book| !resolved.starts_with(book)) {
            problems.push(format!(
                "{}: {target}: outside the book {} (the book is served without the repository: name \
                 repository files as code)",
                file.display(),
                book.display()
            ));
            continue;
        }
        if let Some(anchor) = anchor {
            if resolved.extension().is_none_or(|e| e != "md") {
                problems
                    .push(format!("{}: {target}: an anchor into a file that is not a page", file.display()));
                continue;
            }
            let offered = cache.entry(resolved.clone()).or_insert_with(|| anchors(&read(&resolved)));
            if !offered.contains(anchor) {
                problems.push(format!("{}: {target}: no heading with that id", file.display()));
            }
        }
    }
    problems
}

#[test]
fn headings_get_mdbooks_ids() {
    assert_eq!(
        heading_id("Devices only through the device plugin"),
        "devices-only-through-the-device-plugin"
    );
    assert_eq!(heading_id("`--memory-limit driver`"), "--memory-limit-driver");
    assert_eq!(heading_id("The driver's memory limit"), "the-drivers-memory-limit");
    assert_eq!(heading_id("From [gpushare](x.md) (Aliyun)"), "from-gpushare-aliyun");
    let page = "# A\n## Same\n```sh\n# not a heading\n```\n## Same\n<a id=\"custom\"></a>\n";
    let want: BTreeSet<String> = ["a", "same", "same-1", "custom"].into_iter().map(String::from).collect();
    assert_eq!(anchors(page), want);
    assert_eq!(links("see [a](b.md#c) and `[x](y)`\n```\n[z](w)\n```\n"), vec!["b.md#c".to_owned()]);
}

#[test]
fn every_page_is_in_the_table_of_contents_and_every_entry_has_its_page() {
    let summary = read(&book().join("SUMMARY.md"));
    let listed: BTreeSet<PathBuf> = links(&summary).iter().map(|l| book().join(l)).collect();
    let on_disk: BTreeSet<PathBuf> = pages().into_iter().filter(|p| !p.ends_with("SUMMARY.md")).collect();
    let missing: Vec<_> = listed.difference(&on_disk).collect();
    let unlisted: Vec<_> = on_disk.difference(&listed).collect();
    assert!(
        missing.is_empty() && unlisted.is_empty(),
        "listed without a page: {missing:?}; pages not listed: {unlisted:?}"
    );
    // Each page opens with its one title, the one the table of contents gives it.
    let mut wrong = Vec::new();
    for line in prose(&summary) {
        let Some((title, rest)) = line.split_once("](").and_then(|(a, b)| Some((a.rsplit_once('[')?.1, b)))
        else {
            continue;
        };
        let page = book().join(rest.trim_end_matches(')'));
        let text = read(&page);
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        let titles = prose(&text).iter().filter(|l| l.starts_with("# ")).count();
        if first != format!("# {title}") || titles != 1 {
            wrong.push(format!(
                "{}: opens with {first:?} ({titles} titles), the contents say {title:?}",
                page.display()
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_link_and_anchor_resolves() {
    let mut cache = BTreeMap::new();
    let mut problems = Vec::new();
    for page in pages() {
        problems.extend(broken_links(&page, Some(&book()), &mut cache));
    }
    for file in ["README.md", "CHANGELOG.md"] {
        problems.extend(broken_links(&root().join(file), None, &mut cache));
    }
    assert!(problems.is_empty(), "{} broken link(s):\n{}", problems.len(), problems.join("\n"));
}

/// Every `### Reason` of the catalogue, in order.
fn catalogued_reasons() -> Vec<String> {
    let page = read(&book().join("reference/events.md"));
    prose(&page)
        .iter()
        .filter_map(|l| l.strip_prefix("### "))
        .map(|h| h.trim().trim_matches('`').to_owned())
        .collect()
}

#[test]
fn every_event_reason_has_its_entry_in_the_catalogue() {
    let catalogued: BTreeSet<String> = catalogued_reasons().into_iter().collect();
    let emitted: BTreeSet<String> = Reason::ALL.iter().map(|r| r.as_str().to_owned()).collect();
    let missing: Vec<_> = emitted.difference(&catalogued).collect();
    let stale: Vec<_> = catalogued.difference(&emitted).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/src/reference/events.md: reasons the code emits without an entry: {missing:?}; entries for \
         reasons it no longer emits: {stale:?}"
    );
}

/// The code of `dirs` (test modules included: a name only a test uses is rare and harmless).
fn sources(dirs: &[&str]) -> String {
    let mut out = Vec::new();
    for dir in dirs {
        files(&root().join(dir), "rs", &mut out);
    }
    out.iter().map(|p| read(p)).collect::<Vec<_>>().join("\n")
}

/// Every quoted string literal's start that begins with `prefix`, taken up to the first character not
/// in `allowed`; an image reference (the name followed by `:`, e.g. `nano-gpu/agent:0.1.0`) is not a
/// key.
fn quoted(code: &str, prefix: &str, allowed: impl Fn(char) -> bool) -> BTreeSet<String> {
    let needle = format!("\"{prefix}");
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find(&needle) {
        let after = &rest[at + 1..];
        let name: String = after.chars().take_while(|c| allowed(*c)).collect();
        if !after[name.len()..].starts_with(':') {
            out.insert(name);
        }
        rest = &after[1..];
    }
    out
}

/// Every name in code spans of `page` that begins with `prefix`.
fn in_code_spans(page: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, span) in page.split('`').enumerate() {
        if i % 2 == 1 {
            for word in span.split(|c: char| !(c.is_alphanumeric() || "_-./".contains(c))) {
                if word.starts_with(prefix) {
                    out.insert(word.to_owned());
                }
            }
        }
    }
    out
}

#[test]
fn every_metric_the_code_exports_is_in_the_metrics_reference() {
    let code = sources(&["agent/src", "allocator/src"]);
    let metric = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    let exported: BTreeSet<String> = quoted(&code, "nano_gpu_", metric)
        .into_iter()
        .map(|m| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .fold(m, |m, s| m.strip_suffix(s).map_or(m.clone(), str::to_owned))
        })
        .collect();
    assert!(exported.len() >= 20, "the scan found too few metrics to be right: {exported:?}");
    let page = read(&book().join("reference/metrics.md"));
    let documented = in_code_spans(&page, "nano_gpu_");
    let missing: Vec<_> = exported.difference(&documented).collect();
    let stale: Vec<_> = documented
        .iter()
        .filter(|d| {
            !exported.contains(*d) && !exported.iter().any(|e| d.starts_with(e.as_str()) && e.ends_with('_'))
        })
        .filter(|d| !code.contains(d.as_str()))
        .collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/src/reference/metrics.md: metrics without an entry: {missing:?}; names no code has: {stale:?}"
    );
}

#[test]
fn every_nano_gpu_key_the_code_names_is_in_the_annotations_reference() {
    let code = sources(&["proto/src", "agent/src", "allocator/src"]);
    let key = |c: char| c.is_ascii_alphanumeric() || "-./".contains(c);
    let named = quoted(&code, "nano-gpu/", key);
    assert!(named.len() >= 15, "the scan found too few keys to be right: {named:?}");
    let page = read(&book().join("reference/annotations-and-labels.md"));
    let documented = in_code_spans(&page, "nano-gpu/");
    let missing: Vec<_> = named.iter().filter(|k| !documented.contains(*k)).collect();
    assert!(
        missing.is_empty(),
        "docs/src/reference/annotations-and-labels.md: keys without an entry: {missing:?}"
    );
}

#[test]
fn the_readme_stays_a_front_page() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines: it is the front page (at most 200); the rest goes in docs/"
    );
    for command in ["bash hack/local-up.sh", "bash hack/test.sh"] {
        assert!(readme.contains(command), "README.md lost one of its two commands: {command}");
    }
}

/// The `{{#include FILE}}` directives of `text`.
fn includes(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("{{#include ") {
        let after = &rest[at + "{{#include ".len()..];
        let Some(end) = after.find("}}") else { break };
        out.push(after[..end].trim().to_owned());
        rest = &after[end..];
    }
    out
}

#[test]
fn every_capture_is_shown_and_every_include_is_there() {
    let mut used = BTreeSet::new();
    let mut missing = Vec::new();
    for page in pages() {
        let text = read(&page);
        let targets = includes(&text).into_iter().chain(links(&text));
        for target in targets.filter(|t| t.contains("captures/")) {
            match resolve(page.parent().unwrap(), &target) {
                Some(file) if file.exists() => {
                    used.insert(file);
                }
                _ => missing.push(format!("{}: {target}", page.display())),
            }
        }
    }
    let mut captures = Vec::new();
    for ext in ["txt", "png"] {
        files(&book().join("captures"), ext, &mut captures);
    }
    let unused: Vec<_> = captures.iter().filter(|c| !used.contains(*c)).collect();
    assert!(
        missing.is_empty() && unused.is_empty(),
        "captures missing: {missing:?}; captures no page shows: {unused:?}"
    );
    assert!(used.len() >= 5, "the captures of the end-to-end test: {used:?}");
}
