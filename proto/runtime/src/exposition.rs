//! Prometheus' text exposition format (0.0.4), as both binaries write it: each metric family whole
//! (its `# HELP`, its `# TYPE`, then every sample of it, as the format requires: a family's samples
//! may not be split by another's), label values and help texts escaped. A [`Family`] borrows the
//! [`Exposition`] it writes to, so the next family cannot begin before it is done.

use std::fmt::{Display, Write};

/// A label value with `\`, `"` and newlines escaped.
fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// A help text with `\` and newlines escaped.
fn escape_help(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\n', "\\n")
}

/// The exposition text being written.
#[derive(Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// An empty text with room for about `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        Exposition { out: String::with_capacity(capacity) }
    }

    /// Begins the family `name` of `kind` (`counter`, `gauge`, `histogram`), described by `help`;
    /// its samples follow through the [`Family`].
    pub fn family<'a>(&'a mut self, name: &'a str, kind: &str, help: &str) -> Family<'a> {
        let _ = writeln!(self.out, "# HELP {name} {}\n# TYPE {name} {kind}", escape_help(help));
        Family { out: &mut self.out, name }
    }

    /// The text.
    pub fn finish(self) -> String {
        self.out
    }
}

/// One family being written.
pub struct Family<'a> {
    out: &'a mut String,
    name: &'a str,
}

impl Family<'_> {
    /// A sample of the family's series, with `labels` in their order.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: impl Display) {
        self.sample_of("", labels, value);
    }

    /// A sample of the series named the family's name and `suffix` (a histogram's `_bucket`, `_sum`
    /// and `_count`).
    pub fn sample_of(&mut self, suffix: &str, labels: &[(&str, &str)], value: impl Display) {
        let _ = write!(self.out, "{}{suffix}", self.name);
        for (i, (key, label)) in labels.iter().enumerate() {
            let open = if i == 0 { "{" } else { "," };
            let _ = write!(self.out, "{open}{key}=\"{}\"", escape_label(label));
        }
        let close = if labels.is_empty() { "" } else { "}" };
        let _ = writeln!(self.out, "{close} {value}");
    }
}

/// Whether `text` keeps every family whole: no sample before its family's `# TYPE`, no family
/// begun twice, no sample of one family after another family began. (Prometheus' own parser merges
/// a split family; the format forbids it, and other parsers refuse it.) The error names the line.
pub fn check_whole(text: &str) -> Result<(), String> {
    let mut begun = std::collections::BTreeSet::new();
    let mut current: Option<(&str, &str)> = None;
    for (n, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l)) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                return Err(format!("line {n}: a TYPE without a name and kind: {line}"));
            };
            if !begun.insert(name) {
                return Err(format!("line {n}: family {name} begun a second time"));
            }
            current = Some((name, kind));
        } else if line.starts_with('#') || line.trim().is_empty() {
            continue;
        } else {
            let series = line.split(['{', ' ']).next().unwrap_or_default();
            let Some((name, kind)) = current else {
                return Err(format!("line {n}: a sample before any TYPE: {line}"));
            };
            let suffixes: &[&str] = match kind {
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                _ => &[""],
            };
            if !suffixes.iter().any(|s| series.strip_suffix(s) == Some(name)) {
                return Err(format!("line {n}: a sample of {series} inside family {name}"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_written_whole_with_their_labels_escaped() {
        let mut text = Exposition::default();
        let mut f = text.family("x_total", "counter", "Calls.\nBy \\ verb.");
        f.sample(&[("verb", "a\"b\\c\nd"), ("result", "ok")], 3);
        f.sample(&[], 1.5);
        let mut h = text.family("x_seconds", "histogram", "Latency.");
        h.sample_of("_bucket", &[("le", "+Inf")], 2);
        h.sample_of("_sum", &[], 0.25);
        let text = text.finish();
        assert_eq!(
            text,
            "# HELP x_total Calls.\\nBy \\\\ verb.\n# TYPE x_total counter\n\
             x_total{verb=\"a\\\"b\\\\c\\nd\",result=\"ok\"} 3\nx_total 1.5\n\
             # HELP x_seconds Latency.\n# TYPE x_seconds histogram\n\
             x_seconds_bucket{le=\"+Inf\"} 2\nx_seconds_sum 0.25\n"
        );
        assert_eq!(check_whole(&text), Ok(()));
    }

    #[test]
    fn a_split_family_is_found() {
        let split = "# TYPE a gauge\n# TYPE b gauge\na{x=\"1\"} 1\nb{x=\"1\"} 2\n";
        assert!(check_whole(split).unwrap_err().contains("a sample of a inside family b"));
        let twice = "# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\n# TYPE a gauge\na 2\n";
        assert!(check_whole(twice).unwrap_err().contains("family a begun a second time"));
        assert!(check_whole("a 1\n").unwrap_err().contains("before any TYPE"));
        let histogram = "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n";
        assert_eq!(check_whole(histogram), Ok(()));
    }
}
