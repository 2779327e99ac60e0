//! Cluster and workload traces in the openb CSV format (Alibaba cluster-trace-gpu-v2023), and a
//! built-in synthetic cluster and workload generated from a seed, so `simulate` runs anywhere.
//!
//! Nodes: `sn,cpu_milli,memory_mib,gpu,model`. Pods: `name,cpu_milli,memory_mib,num_gpu,gpu_milli`
//! and optionally `gpu_spec` (models separated by `|`); other columns are ignored. Columns are found
//! by header name. A malformed row is an error naming the file and line.

use crate::model::{Card, Cluster, Node};
use crate::request::{Request, SlotDemand};
use crate::rng::Rng;
use nano_gpu_proto::units::{MiB, Percent};
use thiserror::Error;

/// A trace that cannot be read.
#[derive(Debug, Error)]
pub enum TraceError {
    /// The file cannot be opened or read (the caller reads it; parsing here never does I/O).
    #[error("{file}: {source}")]
    Io {
        /// File name.
        file: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A line is malformed.
    #[error("{file}:{line}: {message}")]
    Row {
        /// File name.
        file: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// One node of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceNode {
    /// Node name.
    pub name: String,
    /// CPU in millicores.
    pub cpu_milli: u64,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Number of cards.
    pub gpus: u32,
    /// Model of every card (empty for CPU-only nodes).
    pub model: String,
}

/// One pod of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TracePod {
    /// Pod name.
    pub name: String,
    /// CPU in millicores.
    pub cpu_milli: u64,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Cards (0 for CPU-only).
    pub num_gpu: u32,
    /// Milli-GPU per card (1000 for whole cards).
    pub gpu_milli: u32,
    /// Allowed models; empty means any.
    pub gpu_spec: Vec<String>,
}

impl TracePod {
    /// GPU asked in percent of one card, in total.
    pub fn gpu_percent(&self) -> u64 {
        u64::from(self.num_gpu) * u64::from(self.gpu_milli) / 10
    }

    /// The slots this pod asks for: a share of one card, whole cards, or none.
    pub fn slots(&self) -> Vec<SlotDemand> {
        match (self.num_gpu, self.gpu_milli) {
            (0, _) | (_, 0) => vec![],
            (1, m) if m < 1000 => vec![SlotDemand::Share { percent: Some(Percent(m / 10)), mem: None }],
            (k, _) => vec![SlotDemand::Whole { cards: k, mem: None }],
        }
    }

    /// The engine request of this pod in `cluster` (unknown models match nothing).
    pub fn request(&self, cluster: &Cluster) -> Request {
        let models = (!self.gpu_spec.is_empty()).then(|| {
            let mut ids: Vec<_> = self.gpu_spec.iter().filter_map(|m| cluster.models.get(m)).collect();
            ids.sort();
            ids.dedup();
            ids
        });
        Request { models, ..Request::new(self.cpu_milli, self.memory_mib, self.slots()) }
    }
}

/// GPU memory by openb model name (0 for the undisclosed models: not accounted).
fn card_memory(model: &str) -> MiB {
    MiB(match model {
        "P100" | "V100M16" => 16_384,
        "T4" => 15_360,
        "V100M32" => 32_768,
        "A10" => 24_576,
        _ => 0,
    })
}

/// The cluster of a node list: every card free and healthy.
pub fn build_cluster(nodes: &[TraceNode]) -> Result<Cluster, crate::model::ModelError> {
    let mut cluster = Cluster::new();
    for n in nodes {
        let model = cluster.models.intern(&n.model);
        let cards = (0..n.gpus)
            .map(|i| Card::new(format!("{}-gpu{i}", n.name), i, model, card_memory(&n.model)))
            .collect();
        cluster.add_node(Node::new(n.name.clone(), n.cpu_milli, n.memory_mib, cards))?;
    }
    Ok(cluster)
}

struct Csv<'a> {
    file: &'a str,
    header: Vec<&'a str>,
    rows: Vec<(usize, Vec<&'a str>)>,
}

impl<'a> Csv<'a> {
    fn parse(file: &'a str, text: &'a str) -> Result<Self, TraceError> {
        let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
        let Some((_, header)) = lines.next() else {
            return Err(TraceError::Row {
                file: file.into(),
                line: 1,
                message: "empty file, expected a header".into(),
            });
        };
        let header: Vec<&str> = header.split(',').map(str::trim).collect();
        let rows = lines.map(|(i, l)| (i + 1, l.split(',').map(str::trim).collect())).collect();
        Ok(Csv { file, header, rows })
    }

    fn column(&self, name: &str, required: bool) -> Result<Option<usize>, TraceError> {
        match self.header.iter().position(|h| *h == name) {
            Some(i) => Ok(Some(i)),
            None if required => Err(TraceError::Row {
                file: self.file.into(),
                line: 1,
                message: format!("no column {name:?} in the header"),
            }),
            None => Ok(None),
        }
    }

    fn err(&self, line: usize, message: String) -> TraceError {
        TraceError::Row { file: self.file.into(), line, message }
    }

    fn text<'r>(
        &self,
        line: usize,
        row: &'r [&'a str],
        col: usize,
        name: &str,
    ) -> Result<&'r str, TraceError> {
        if row.len() != self.header.len() {
            return Err(self.err(line, format!("{} fields, the header has {}", row.len(), self.header.len())));
        }
        row.get(col).copied().ok_or_else(|| self.err(line, format!("missing {name}")))
    }

    fn number(&self, line: usize, row: &[&str], col: usize, name: &str) -> Result<u64, TraceError> {
        let t = self.text(line, row, col, name)?;
        t.parse().map_err(|_| self.err(line, format!("{name} {t:?} is not a non-negative integer")))
    }
}

/// Parses a node list; `file` names it in errors.
pub fn parse_nodes(file: &str, text: &str) -> Result<Vec<TraceNode>, TraceError> {
    let csv = Csv::parse(file, text)?;
    let [sn, cpu, mem, gpu] = ["sn", "cpu_milli", "memory_mib", "gpu"].map(|c| csv.column(c, true));
    let (sn, cpu, mem, gpu) = (sn?.unwrap_or(0), cpu?.unwrap_or(0), mem?.unwrap_or(0), gpu?.unwrap_or(0));
    let model = csv.column("model", false)?;
    let mut seen = std::collections::HashSet::new();
    let mut nodes = Vec::with_capacity(csv.rows.len());
    for (line, row) in &csv.rows {
        let name = csv.text(*line, row, sn, "sn")?.to_owned();
        if name.is_empty() || !seen.insert(name.clone()) {
            return Err(csv.err(*line, format!("node name {name:?} is empty or repeated")));
        }
        let gpus = csv.number(*line, row, gpu, "gpu")?;
        if gpus > 64 {
            return Err(csv.err(*line, format!("gpu {gpus} is more than 64 cards")));
        }
        let model = model.map(|c| csv.text(*line, row, c, "model")).transpose()?.unwrap_or("").to_owned();
        nodes.push(TraceNode {
            name,
            cpu_milli: csv.number(*line, row, cpu, "cpu_milli")?,
            memory_mib: csv.number(*line, row, mem, "memory_mib")?,
            gpus: gpus as u32,
            model,
        });
    }
    Ok(nodes)
}

/// Parses a pod list; `file` names it in errors.
pub fn parse_pods(file: &str, text: &str) -> Result<Vec<TracePod>, TraceError> {
    let csv = Csv::parse(file, text)?;
    let cols = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"].map(|c| csv.column(c, true));
    let [name, cpu, mem, num_gpu, gpu_milli] = cols;
    let (name, cpu, mem) = (name?.unwrap_or(0), cpu?.unwrap_or(0), mem?.unwrap_or(0));
    let (num_gpu, gpu_milli) = (num_gpu?.unwrap_or(0), gpu_milli?.unwrap_or(0));
    let spec = csv.column("gpu_spec", false)?;
    let mut pods = Vec::with_capacity(csv.rows.len());
    for (line, row) in &csv.rows {
        let line = *line;
        let k = csv.number(line, row, num_gpu, "num_gpu")?;
        let mut m = csv.number(line, row, gpu_milli, "gpu_milli")?;
        if k > 64 {
            return Err(csv.err(line, format!("num_gpu {k} is more than 64 cards")));
        }
        if k == 0 {
            m = 0;
        } else if m == 0 || m > 1000 || (k > 1 && m != 1000) {
            return Err(csv.err(
                line,
                format!("gpu_milli {m} with num_gpu {k}: expected 1..=1000 per card, 1000 for several cards"),
            ));
        } else if m % 10 != 0 {
            return Err(csv.err(line, format!("gpu_milli {m} is not a whole percent (a multiple of 10)")));
        }
        let gpu_spec = spec
            .map(|c| csv.text(line, row, c, "gpu_spec"))
            .transpose()?
            .map(|s| s.split('|').filter(|m| !m.is_empty()).map(str::to_owned).collect())
            .unwrap_or_default();
        pods.push(TracePod {
            name: csv.text(line, row, name, "name")?.to_owned(),
            cpu_milli: csv.number(line, row, cpu, "cpu_milli")?,
            memory_mib: csv.number(line, row, mem, "memory_mib")?,
            num_gpu: k as u32,
            gpu_milli: m as u32,
            gpu_spec,
        });
    }
    Ok(pods)
}

/// A built-in synthetic cluster and workload: 240 nodes of five shapes and 3,000 pods with the mix
/// of the openb default trace (CPU-only, shares of one card, one card, several cards), from `seed`.
pub fn synthetic(seed: u64) -> (Vec<TraceNode>, Vec<TracePod>) {
    let mut rng = Rng::new(seed);
    let shapes: [(&str, u32, u64, u64, usize); 5] = [
        ("A100", 8, 128_000, 1_048_576, 60),
        ("V100M32", 8, 96_000, 393_216, 40),
        ("T4", 2, 104_000, 524_288, 80),
        ("A10", 4, 64_000, 262_144, 40),
        ("T4", 1, 32_000, 131_072, 20),
    ];
    let mut nodes = Vec::new();
    for (model, gpus, cpu, mem, count) in shapes {
        for _ in 0..count {
            nodes.push(TraceNode {
                name: format!("sim-node-{:04}", nodes.len()),
                cpu_milli: cpu,
                memory_mib: mem,
                gpus,
                model: model.to_owned(),
            });
        }
    }
    let shares = [50, 110, 230, 250, 320, 470, 500, 650, 810];
    let mut pods = Vec::new();
    for i in 0..3000 {
        let roll = rng.below(100);
        let (num_gpu, gpu_milli) = match roll {
            0..=12 => (0, 0),
            13..=52 => (1, shares[rng.below(shares.len())]),
            53..=96 => (1, 1000),
            _ => ([2, 4, 8][rng.below(3)], 1000),
        };
        let cpu = [2000, 4000, 6000, 8000, 12_000, 16_000][rng.below(6)] * u64::from(num_gpu.max(1)) / 2;
        let gpu_spec = if num_gpu > 0 && rng.below(10) == 0 {
            vec![["A100", "T4", "V100M32"][rng.below(3)].to_owned()]
        } else {
            vec![]
        };
        pods.push(TracePod {
            name: format!("sim-pod-{i:05}"),
            cpu_milli: cpu.max(1000),
            memory_mib: cpu * 4,
            num_gpu,
            gpu_milli,
            gpu_spec,
        });
    }
    (nodes, pods)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openb_rows_parse_by_header_name() {
        let pods = parse_pods(
            "p.csv",
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n\
             a,6000,12288,1,460,,LS\n\
             b,12000,16384,2,1000,V100M16|V100M32,BE\n\
             c,8000,30517,0,0,,BE\n",
        )
        .unwrap();
        assert_eq!(pods.len(), 3);
        assert_eq!(pods[0].slots(), vec![SlotDemand::Share { percent: Some(Percent(46)), mem: None }]);
        assert_eq!(pods[1].slots(), vec![SlotDemand::Whole { cards: 2, mem: None }]);
        assert_eq!(pods[1].gpu_spec, vec!["V100M16".to_string(), "V100M32".to_string()]);
        assert!(pods[2].slots().is_empty());
        assert_eq!(pods[1].gpu_percent(), 200);
    }

    #[test]
    fn a_malformed_row_names_file_and_line() {
        let e =
            parse_pods("pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,1,500\nb,x,1,1,500\n")
                .unwrap_err();
        assert_eq!(e.to_string(), "pods.csv:3: cpu_milli \"x\" is not a non-negative integer");
        let e = parse_pods("pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,1\n").unwrap_err();
        assert_eq!(e.to_string(), "pods.csv:2: 4 fields, the header has 5");
        let e =
            parse_pods("pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,2,500\n").unwrap_err();
        assert!(e.to_string().starts_with("pods.csv:2: gpu_milli 500 with num_gpu 2"), "{e}");
        let e =
            parse_pods("pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,1,325\n").unwrap_err();
        assert!(e.to_string().contains("not a whole percent"), "{e}");
        let e = parse_nodes("nodes.csv", "sn,cpu_milli,memory_mib\nn,1,1\n").unwrap_err();
        assert_eq!(e.to_string(), "nodes.csv:1: no column \"gpu\" in the header");
        let e = parse_nodes("nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,2,T4\nn,1,1,2,T4\n")
            .unwrap_err();
        assert_eq!(e.to_string(), "nodes.csv:3: node name \"n\" is empty or repeated");
        assert!(parse_nodes("nodes.csv", "").unwrap_err().to_string().contains("empty file"));
    }

    #[test]
    fn the_synthetic_trace_is_fixed_by_its_seed() {
        assert_eq!(synthetic(42), synthetic(42));
        assert_ne!(synthetic(42).1, synthetic(43).1);
        let (nodes, pods) = synthetic(42);
        let cluster = build_cluster(&nodes).unwrap();
        assert_eq!(cluster.card_count(), 60 * 8 + 40 * 8 + 80 * 2 + 40 * 4 + 20);
        assert!(pods.iter().any(|p| p.num_gpu == 0) && pods.iter().any(|p| p.num_gpu > 1));
    }
}
