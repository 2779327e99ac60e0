//! `nano-gpu-allocator top`: granted against used, per pod, container and card, from every agent's
//! `/metrics` (read through the API server's pod proxy, with the caller's kubeconfig, as
//! `kubectl get --raw` would). The agents' series are read back here, so this shows exactly what
//! Prometheus would scrape.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One container on one card.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    /// Node.
    pub node: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// Card index.
    pub gpu: String,
    /// Card UUID.
    pub uuid: String,
    /// Share granted (percent).
    pub granted_percent: f64,
    /// SM utilisation of its processes (percent of the card).
    pub used_percent: f64,
    /// Memory granted, MiB.
    pub granted_mib: f64,
    /// Memory used, MiB.
    pub used_mib: f64,
    /// Processes on the card.
    pub processes: f64,
    /// Over its memory grant past the agent's grace.
    pub overrun: bool,
}

/// One sample line: metric name, labels, value; `None` for comments and lines that do not parse.
pub fn sample(line: &str) -> Option<(&str, BTreeMap<String, String>, f64)> {
    if line.starts_with('#') || line.trim().is_empty() {
        return None;
    }
    let (name, rest) = match line.find('{') {
        Some(at) => (&line[..at], &line[at + 1..]),
        None => {
            let (name, value) = line.split_once(' ')?;
            return Some((name, BTreeMap::new(), value.trim().parse().ok()?));
        }
    };
    let mut labels = BTreeMap::new();
    let mut chars = rest.char_indices().peekable();
    loop {
        match chars.peek() {
            Some((_, '}')) => break,
            Some((_, ',' | ' ')) => {
                chars.next();
                continue;
            }
            None => return None,
            _ => {}
        }
        let key: String = chars.by_ref().take_while(|(_, c)| *c != '=').map(|(_, c)| c).collect();
        if chars.next().map(|(_, c)| c) != Some('"') {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()?.1 {
                '"' => break,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        }
        labels.insert(key.trim().to_owned(), value);
    }
    let (end, _) = chars.next()?;
    Some((name, labels, rest[end + 1..].trim().parse().ok()?))
}

/// The per-container rows of one agent's metrics text.
pub fn rows(text: &str) -> Vec<Row> {
    const MIB: f64 = (1u64 << 20) as f64;
    let mut by_key: BTreeMap<Vec<String>, Row> = BTreeMap::new();
    for (name, labels, value) in text.lines().filter_map(sample) {
        let Some(field) = name.strip_prefix("nano_gpu_container_") else { continue };
        let label = |k: &str| labels.get(k).cloned().unwrap_or_default();
        let key = ["node", "namespace", "pod", "container", "gpu", "uuid"].map(label);
        let row = by_key.entry(key.to_vec()).or_insert_with(|| {
            let [node, namespace, pod, container, gpu, uuid] = key.clone();
            Row { node, namespace, pod, container, gpu, uuid, ..Default::default() }
        });
        match field {
            "granted_percent" => row.granted_percent = value,
            "utilization_percent" => row.used_percent = value,
            "granted_memory_bytes" => row.granted_mib = value / MIB,
            "memory_used_bytes" => row.used_mib = value / MIB,
            "processes" => row.processes = value,
            "memory_overrun" => row.overrun = value > 0.0,
            _ => {}
        }
    }
    by_key.into_values().collect()
}

/// The rows as a table, by namespace, pod, container and card.
pub fn table(rows: &[Row]) -> String {
    let mut rows = rows.to_vec();
    rows.sort_by(|a, b| {
        (&a.namespace, &a.pod, &a.container, &a.node, &a.gpu).cmp(&(
            &b.namespace,
            &b.pod,
            &b.container,
            &b.node,
            &b.gpu,
        ))
    });
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<36} {:<16} {:<12} {:>4} {:>8} {:>6} {:>10} {:>10} {:>5}  NOTE",
        "NAMESPACE/POD", "CONTAINER", "NODE", "GPU", "GRANTED%", "USED%", "GRANT MiB", "USED MiB", "PROCS"
    );
    for r in &rows {
        let note = if r.overrun {
            "over its memory grant"
        } else if r.granted_percent == 0.0 {
            "uses a card it was not given"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "{:<36} {:<16} {:<12} {:>4} {:>8} {:>6} {:>10} {:>10} {:>5}  {note}",
            format!("{}/{}", r.namespace, r.pod),
            r.container,
            r.node,
            r.gpu,
            r.granted_percent,
            r.used_percent,
            r.granted_mib.round(),
            r.used_mib.round(),
            r.processes,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP nano_gpu_container_granted_percent Share.
# TYPE nano_gpu_container_granted_percent gauge
nano_gpu_container_granted_percent{node="node-1",namespace="ml",pod="train",container="c",gpu="0",uuid="GPU-a"} 30
nano_gpu_container_granted_percent{node="node-1",namespace="ml",pod="odd \"name\"",container="c",gpu="1",uuid="GPU-b"} 0
nano_gpu_container_granted_memory_bytes{node="node-1",namespace="ml",pod="train",container="c",gpu="0",uuid="GPU-a"} 4831838208
nano_gpu_container_memory_used_bytes{node="node-1",namespace="ml",pod="train",container="c",gpu="0",uuid="GPU-a"} 5242880000
nano_gpu_container_utilization_percent{node="node-1",namespace="ml",pod="train",container="c",gpu="0",uuid="GPU-a"} 25
nano_gpu_container_processes{node="node-1",namespace="ml",pod="train",container="c",gpu="0",uuid="GPU-a"} 2
nano_gpu_container_memory_overrun{node="node-1",namespace="ml",pod="train",container="c",gpu="0",uuid="GPU-a"} 1
nano_gpu_card_power_watts{node="node-1",gpu="0",uuid="GPU-a",model="Tesla T4"} 33.5
nano_gpu_usage_sampled_timestamp_seconds{node="node-1"} 1700000000.5
garbage line {
"#;

    #[test]
    fn container_series_become_one_row_per_container_and_card() {
        let rows = rows(TEXT);
        assert_eq!(rows.len(), 2, "{rows:?}");
        let train = rows.iter().find(|r| r.pod == "train").unwrap();
        assert_eq!(
            (
                train.granted_percent,
                train.used_percent,
                train.granted_mib,
                train.used_mib,
                train.processes,
                train.overrun
            ),
            (30.0, 25.0, 4608.0, 5000.0, 2.0, true)
        );
        assert!(rows.iter().any(|r| r.pod == "odd \"name\"" && r.granted_percent == 0.0));
        let table = table(&rows);
        assert!(
            table.lines().any(|l| l.starts_with("ml/train") && l.contains("over its memory grant")),
            "{table}"
        );
        assert!(table.contains("uses a card it was not given"), "{table}");
    }

    #[test]
    fn samples_parse_with_and_without_labels() {
        assert_eq!(sample("up 1"), Some(("up", BTreeMap::new(), 1.0)));
        let (name, labels, value) = sample(r#"m{a="x\\y",b="1"} 2.5"#).unwrap();
        assert_eq!((name, value), ("m", 2.5));
        assert_eq!(labels["a"], "x\\y");
        assert_eq!(sample("# TYPE m gauge"), None);
        assert_eq!(sample("m{a=\"unterminated} 1"), None);
    }
}
