//! `nano-gpu-allocator inspect`: the cluster view as a person reads it, per node and card, built from
//! the same JSON the service's `/inspect` endpoint serves.

use serde_json::Value;
use std::fmt::Write as _;

/// Keeps only the node named `node` (all nodes if `None`).
pub fn only_node(mut view: Value, node: Option<&str>) -> Value {
    if let (Some(name), Some(nodes)) = (node, view["nodes"].as_array_mut()) {
        nodes.retain(|n| n["name"] == name);
    }
    view
}

/// One line per card: node, card index, model, percent used and free, memory, pods (and the
/// ResourceClaims allocated on it, as `claim:namespace/name`).
pub fn table(view: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:>4} {:<28} {:>5} {:>5} {:>18} {:>7}  PODS",
        "NODE", "CARD", "MODEL", "USED%", "FREE%", "MEM USED/TOTAL MiB", "HEALTHY"
    );
    for n in view["nodes"].as_array().into_iter().flatten() {
        let name = n["name"].as_str().unwrap_or("");
        let cards = n["cards"].as_array().cloned().unwrap_or_default();
        if cards.is_empty() {
            let _ = writeln!(out, "{name:<24} {:>4} (no cards)", "-");
        }
        for (i, c) in cards.iter().enumerate() {
            let total = c["memoryMiB"].as_u64().unwrap_or(0);
            let used = total.saturating_sub(c["memoryFreeMiB"].as_u64().unwrap_or(0));
            let pods =
                c["pods"].as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_owned);
            let claims = c["claims"].as_array().into_iter().flatten();
            let claims = claims.filter_map(|c| c["claim"].as_str()).map(|name| format!("claim:{name}"));
            let pods: Vec<String> = pods.chain(claims).collect();
            let _ = writeln!(
                out,
                "{:<24} {:>4} {:<28} {:>5} {:>5} {:>18} {:>7}  {}",
                if i == 0 { name } else { "" },
                // Numbers, not JSON values: a JSON value's Display ignores width and alignment.
                c["index"].as_u64().unwrap_or(0),
                c["model"].as_str().unwrap_or(""),
                c["percentUsed"].as_u64().unwrap_or(0),
                c["percentFree"].as_u64().unwrap_or(0),
                format!("{used}/{total}"),
                if c["healthy"] == true { "yes" } else { "no" },
                pods.join(",")
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn view() -> Value {
        json!({"nodes": [
            {"name": "n1", "cards": [
                {"index": 0, "uuid": "GPU-a", "model": "Tesla T4", "healthy": true, "percentUsed": 60, "percentFree": 40,
                 "memoryMiB": 15360, "memoryFreeMiB": 11264, "pods": ["default/a", "default/b"],
                 "claims": [{"claim": "ml/c1", "percent": 20, "memoryMiB": 3072}]},
                {"index": 1, "uuid": "GPU-b", "model": "Tesla T4", "healthy": false, "percentUsed": 0, "percentFree": 100,
                 "memoryMiB": 15360, "memoryFreeMiB": 15360, "pods": []}]},
            {"name": "cpu", "cards": []}
        ]})
    }

    #[test]
    fn the_table_has_a_line_per_card_and_names_the_pods_and_claims() {
        let t = table(&view());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(
            lines[1].starts_with("n1")
                && lines[1].contains("4096/15360")
                && lines[1].ends_with("default/a,default/b,claim:ml/c1"),
            "{t}"
        );
        assert!(lines[2].starts_with(' ') && lines[2].contains(" no "), "{t}");
        assert!(lines[3].contains("(no cards)"));
        // Columns line up: the used percent ends where its header ends.
        let end = lines[0].find("USED%").unwrap() + "USED%".len();
        assert_eq!(&lines[1][end - 2..end], "60", "{t}");
        let end = lines[0].find("MEM USED/TOTAL MiB").unwrap() + "MEM USED/TOTAL MiB".len();
        assert_eq!(&lines[1][end - "4096/15360".len()..end], "4096/15360", "{t}");
    }

    #[test]
    fn only_node_keeps_the_named_node() {
        assert_eq!(only_node(view(), Some("cpu"))["nodes"].as_array().unwrap().len(), 1);
        assert_eq!(only_node(view(), None)["nodes"].as_array().unwrap().len(), 2);
        assert!(only_node(view(), Some("nope"))["nodes"].as_array().unwrap().is_empty());
    }
}
