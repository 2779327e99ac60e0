//! The flag reference of a binary, rendered from its clap definition as a page of the book
//! (`docs/src/reference/cli-*.md`), so the page cannot drift from the code: each binary's tests render
//! it and compare ([`check_book_page`]); `NANO_GPU_BLESS=1` writes it anew.

use clap::Command;
use std::fmt::Write as _;
use std::path::Path;

/// The page for `command` and every subcommand under it, titled `title` (its entry in the book's
/// table of contents).
pub fn render(title: &str, command: &Command) -> String {
    let mut page = format!(
        "# {title}\n\n<!-- Generated from the code's clap definitions; do not edit. After changing a flag: \
         `NANO_GPU_BLESS=1 cargo test --workspace cli_reference`. -->\n"
    );
    section(&mut page, command, command.get_name());
    page
}

fn section(page: &mut String, command: &Command, path: &str) {
    let _ = write!(page, "\n## `{path}`\n\n");
    if let Some(about) = command.get_long_about().or(command.get_about()) {
        let about = about.to_string();
        let about = about.trim();
        let _ = writeln!(page, "{about}{}\n", if about.ends_with('.') { "" } else { "." });
    }
    let args: Vec<_> =
        command.get_arguments().filter(|a| !a.is_hide_set() && !is_builtin(a.get_id().as_str())).collect();
    if !args.is_empty() {
        page.push_str("| flag | environment | default | meaning |\n|---|---|---|---|\n");
        for arg in args {
            let flag = match (arg.get_long(), arg.get_value_names()) {
                (Some(long), _) if !arg.get_action().takes_values() => format!("`--{long}`"),
                (Some(long), Some(names)) => format!("`--{long} <{}>`", names.join(" ")),
                (Some(long), None) => format!("`--{long} <{}>`", arg.get_id().as_str().to_uppercase()),
                (None, _) => format!("`<{}>`", arg.get_id().as_str().to_uppercase()),
            };
            let env = arg.get_env().map_or(String::new(), |e| format!("`{}`", e.to_string_lossy()));
            let default: Vec<String> =
                arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
            let default = if default.is_empty() { String::new() } else { format!("`{}`", default.join(",")) };
            let mut meaning =
                arg.get_long_help().or(arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
            let values: Vec<String> = arg
                .get_possible_values()
                .iter()
                .filter(|v| !v.is_hide_set())
                .map(|v| format!("`{}`", v.get_name()))
                .collect();
            if !meaning.is_empty() && !meaning.ends_with('.') {
                meaning.push('.');
            }
            if !values.is_empty() && arg.get_action().takes_values() {
                let _ = write!(meaning, " One of: {}.", values.join(", "));
            }
            if arg.is_global_set() {
                meaning.push_str(" (Global: also after a subcommand.)");
            }
            let _ = writeln!(page, "| {flag} | {env} | {default} | {} |", cell(&meaning));
        }
    }
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
        section(page, sub, &format!("{path} {}", sub.get_name()));
    }
}

fn is_builtin(id: &str) -> bool {
    matches!(id, "help" | "version")
}

/// One table cell: a single line, pipes escaped.
fn cell(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|")
}

/// A binary's test: the book's page `file` (under `docs/src/reference/`, found from the crate's
/// `manifest_dir`, a directory below the repository's root) is `command` rendered under `title`.
/// Panics with what to run when it is not; with `NANO_GPU_BLESS=1` it writes the page instead. First
/// clap's own checks of the definition (unique names and the like), which it runs only at parse
/// otherwise.
pub fn check_book_page(manifest_dir: &str, file: &str, title: &str, command: &Command) {
    command.clone().debug_assert();
    let page = Path::new(manifest_dir).join("../docs/src/reference").join(file);
    check_page(&page, &render(title, command));
}

fn check_page(page: &Path, rendered: &str) {
    if std::env::var_os("NANO_GPU_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(page, rendered).unwrap_or_else(|e| panic!("writing {}: {e}", page.display()));
        return;
    }
    let written = std::fs::read_to_string(page).unwrap_or_default();
    if written != rendered {
        let line = written
            .lines()
            .zip(rendered.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| written.lines().count().min(rendered.lines().count()));
        panic!(
            "{} is not what the code's flags give (first difference at line {}): run \
             `NANO_GPU_BLESS=1 cargo test --workspace cli_reference` and commit the page",
            page.display(),
            line + 1
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction};

    #[test]
    fn a_page_lists_every_visible_flag_with_its_env_default_and_values() {
        let cmd = Command::new("tool")
            .about("A tool.")
            .arg(Arg::new("level").long("level").env("TOOL_LEVEL").default_value("3").help("How | much."))
            .arg(Arg::new("verbose").long("verbose").action(ArgAction::SetTrue).help("Say more.\nMuch more."))
            .arg(Arg::new("secret").long("secret").hide(true))
            .arg(Arg::new("mode").long("mode").value_parser(["a", "b"]))
            .subcommand(Command::new("run").about("Run it.").arg(Arg::new("file").required(true)));
        let page = render("tool flags", &cmd);
        assert!(page.starts_with("# tool flags\n"), "{page}");
        assert!(page.contains("| `--level <LEVEL>` | `TOOL_LEVEL` | `3` | How \\| much. |"), "{page}");
        assert!(page.contains("| `--verbose` |  |  | Say more. Much more. |"), "{page}");
        assert!(page.contains("One of: `a`, `b`."), "{page}");
        assert!(page.contains("## `tool run`\n\nRun it.") && page.contains("| `<FILE>` |"), "{page}");
        assert!(!page.contains("secret") && !page.contains("--help"), "{page}");
    }
}
