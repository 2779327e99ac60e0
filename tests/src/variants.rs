//! openb-style pod lists along every axis the FGD paper varies, made the way its variants were made
//! from the default list (no generator was published; the method is read off the released files —
//! every variant row is a whole copy of a default row):
//! - `cpuXXX`: all GPU pods of the default list, in order, after a block of CPU-only pods sampled from
//!   the default's CPU-only pods so that they are XX.X % of all tasks;
//! - `gpushareXX`: the CPU-only pods, then sharing pods (one card, < 100 %) sampled so that they carry
//!   XX % of the GPU request, then the rest of the GPU pods sampled from the non-sharing ones (the
//!   number of GPU pods stays the same);
//! - `multigpuXX`: the default list plus multi-GPU pods sampled from its own until they carry XX % of
//!   the GPU request;
//! - `gpuspecXX`: the default list with about XX % of the GPU pods constrained to card models, each
//!   kind of pod (sharing, 1, 2, 4, 8 cards) at the rate and with the model sets the released
//!   `gpuspec20` list gives that kind.
//!
//! Samples are drawn without replacement when the pool is large enough, else with replacement, in a
//! seeded order. Everything is read from the released lists at run time: nothing derived from the
//! trace lives in the repository, and the generated lists go to an ignored cache directory.

use nano_gpu_engine::rng::Rng;
use std::collections::BTreeMap;
use std::path::Path;

/// One axis of variation and its level in percent (`Cpu(25.0)` = 25 % CPU-only tasks).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Axis {
    /// Share of tasks that ask no GPU.
    Cpu(f64),
    /// Share of the GPU request from sharing pods.
    Gpushare(f64),
    /// Share of the GPU request from pods of two or more cards.
    Multigpu(f64),
    /// Share of GPU pods constrained to card models.
    Gpuspec(f64),
}

impl Axis {
    /// The list's name as the released files name theirs (`cpu250`, `gpushare80`, `gpuspec05`).
    pub fn name(self) -> String {
        match self {
            Axis::Cpu(p) => format!("cpu{:03}", (p * 10.0).round() as u32),
            Axis::Gpushare(p) => format!("gpushare{:02}", p.round() as u32),
            Axis::Multigpu(p) => format!("multigpu{:02}", p.round() as u32),
            Axis::Gpuspec(p) => format!("gpuspec{:02}", p.round() as u32),
        }
    }

    /// Every list the allocation-quality study uses, beyond the released ones.
    pub fn all() -> Vec<Axis> {
        let mut out: Vec<Axis> = [0.0, 15.0, 20.0, 25.0, 30.0].map(Axis::Cpu).to_vec();
        out.extend([20.0, 80.0, 100.0].map(Axis::Gpushare));
        out.extend([40.0, 50.0].map(Axis::Multigpu));
        out.extend([5.0, 10.0, 33.0].map(Axis::Gpuspec));
        out
    }
}

/// A pod list: its header and rows, as CSV text split into fields.
#[derive(Clone, Debug, PartialEq)]
pub struct PodList {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

/// The kind of GPU request a row makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Cpu,
    Sharing,
    Cards(u32),
}

impl PodList {
    /// Reads a pod list in the openb CSV format.
    pub fn read(path: &Path) -> Result<PodList, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let header: Vec<String> =
            lines.next().ok_or("empty pod list")?.split(',').map(str::to_owned).collect();
        let rows = lines.map(|l| l.split(',').map(str::to_owned).collect()).collect();
        let list = PodList { header, rows };
        for column in ["name", "num_gpu", "gpu_milli"] {
            list.column(column)?;
        }
        Ok(list)
    }

    fn column(&self, name: &str) -> Result<usize, String> {
        self.header.iter().position(|h| h == name).ok_or_else(|| format!("no column {name}"))
    }

    fn field(&self, row: &[String], name: &str) -> u64 {
        self.column(name).ok().and_then(|i| row.get(i)?.parse().ok()).unwrap_or(0)
    }

    fn kind(&self, row: &[String]) -> Kind {
        match (self.field(row, "num_gpu"), self.field(row, "gpu_milli")) {
            (0, _) | (_, 0) => Kind::Cpu,
            (1, m) if m < 1000 => Kind::Sharing,
            (n, _) => Kind::Cards(n as u32),
        }
    }

    /// GPU request of a row in milli-GPU.
    fn milli(&self, row: &[String]) -> u64 {
        match self.kind(row) {
            Kind::Cpu => 0,
            _ => self.field(row, "num_gpu") * self.field(row, "gpu_milli"),
        }
    }

    fn of(&self, keep: impl Fn(Kind) -> bool) -> Vec<Vec<String>> {
        self.rows.iter().filter(|r| keep(self.kind(r))).cloned().collect()
    }

    /// Number of pods.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the list has no pods.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The list as CSV text, rows renamed `openb-pod-NNNN` in order (samples repeat rows).
    pub fn to_csv(&self) -> String {
        let name = self.column("name").unwrap_or(0);
        let mut out = self.header.join(",");
        out.push('\n');
        for (i, row) in self.rows.iter().enumerate() {
            let mut row = row.clone();
            row[name] = format!("openb-pod-{i:04}");
            out.push_str(&row.join(","));
            out.push('\n');
        }
        out
    }

    /// Shares, in percent: CPU-only tasks, the GPU request from sharing and from multi-card pods, and
    /// GPU pods with a card-model constraint.
    pub fn shares(&self) -> [f64; 4] {
        let spec = self.column("gpu_spec").ok();
        let gpu_rows: Vec<&Vec<String>> = self.rows.iter().filter(|r| self.kind(r) != Kind::Cpu).collect();
        let total: u64 = gpu_rows.iter().map(|r| self.milli(r)).sum();
        let from = |k: fn(Kind) -> bool| {
            100.0 * gpu_rows.iter().filter(|r| k(self.kind(r))).map(|r| self.milli(r)).sum::<u64>() as f64
                / total.max(1) as f64
        };
        let constrained =
            gpu_rows.iter().filter(|r| spec.and_then(|i| r.get(i)).is_some_and(|s| !s.is_empty())).count();
        [
            100.0 * (self.rows.len() - gpu_rows.len()) as f64 / self.rows.len().max(1) as f64,
            from(|k| k == Kind::Sharing),
            from(|k| matches!(k, Kind::Cards(n) if n >= 2)),
            100.0 * constrained as f64 / gpu_rows.len().max(1) as f64,
        ]
    }
}

/// Writes every list of [`Axis::all`] made from the released lists (`openb_dir()`) with `seed` into
/// `dir` as `openb_pod_list_<name>.csv`, unless already there; returns the paths and lists.
pub fn write_all(dir: &Path, seed: u64) -> Result<Vec<(std::path::PathBuf, PodList)>, String> {
    let openb = crate::openb_dir();
    let default = PodList::read(&openb.join("openb_pod_list_default.csv"))?;
    let gpuspec = PodList::read(&openb.join("openb_pod_list_gpuspec20.csv"))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for axis in Axis::all() {
        let list = generate(&default, &gpuspec, axis, seed)?;
        let path = dir.join(format!("openb_pod_list_{}.csv", axis.name()));
        let csv = list.to_csv();
        if std::fs::read_to_string(&path).ok().as_deref() != Some(csv.as_str()) {
            std::fs::write(&path, csv).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        out.push((path, list));
    }
    Ok(out)
}

/// `n` rows of `pool` in a seeded order: without replacement when the pool has them, else with.
fn sample(pool: &[Vec<String>], n: usize, rng: &mut Rng) -> Vec<Vec<String>> {
    if pool.is_empty() {
        return Vec::new();
    }
    if n <= pool.len() {
        let mut all = pool.to_vec();
        rng.shuffle(&mut all);
        all.truncate(n);
        return all;
    }
    (0..n).map(|_| pool[rng.below(pool.len())].clone()).collect()
}

/// The variant `axis` of `default`; `gpuspec` is the released list whose model constraints the
/// `gpuspec` axis follows (rates and model sets per kind of pod).
pub fn generate(default: &PodList, gpuspec: &PodList, axis: Axis, seed: u64) -> Result<PodList, String> {
    let mut rng = Rng::new(seed);
    let cpu = default.of(|k| k == Kind::Cpu);
    let gpu = default.of(|k| k != Kind::Cpu);
    let mut out = PodList { header: default.header.clone(), rows: Vec::new() };
    match axis {
        Axis::Cpu(p) => {
            let n = (p / (100.0 - p) * gpu.len() as f64).round() as usize;
            out.rows = sample(&cpu, n, &mut rng);
            out.rows.extend(gpu);
        }
        Axis::Gpushare(p) => {
            let sharing = default.of(|k| k == Kind::Sharing);
            let whole = default.of(|k| matches!(k, Kind::Cards(_)));
            let mean = |rows: &[Vec<String>]| {
                rows.iter().map(|r| default.milli(r)).sum::<u64>() as f64 / rows.len().max(1) as f64
            };
            let (ms, mw, x) = (mean(&sharing), mean(&whole), p / 100.0);
            // n·ms / (n·ms + (G − n)·mw) = x, with G GPU pods in all.
            let n = (x * gpu.len() as f64 * mw / (ms * (1.0 - x) + x * mw)).round() as usize;
            let n = n.min(gpu.len());
            out.rows = cpu;
            out.rows.extend(sample(&sharing, n, &mut rng));
            out.rows.extend(sample(&whole, gpu.len() - n, &mut rng));
        }
        Axis::Multigpu(p) => {
            let multi = default.of(|k| matches!(k, Kind::Cards(n) if n >= 2));
            if multi.is_empty() {
                return Err("the default list has no multi-card pods".into());
            }
            out.rows = default.rows.clone();
            let total: u64 = gpu.iter().map(|r| default.milli(r)).sum();
            let mut from_multi: u64 = multi.iter().map(|r| default.milli(r)).sum();
            let mut total = total;
            while (from_multi as f64) < p / 100.0 * total as f64 {
                let row = multi[rng.below(multi.len())].clone();
                from_multi += default.milli(&row);
                total += default.milli(&row);
                out.rows.push(row);
            }
        }
        Axis::Gpuspec(p) => {
            let spec_at = gpuspec.column("gpu_spec")?;
            let out_spec = default.column("gpu_spec")?;
            // Per kind of GPU pod in the released list: how many there are and the model sets of the
            // constrained ones.
            let mut kinds: BTreeMap<Kind, (usize, Vec<String>)> = BTreeMap::new();
            for row in gpuspec.rows.iter().filter(|r| gpuspec.kind(r) != Kind::Cpu) {
                let entry = kinds.entry(gpuspec.kind(row)).or_default();
                entry.0 += 1;
                if let Some(s) = row.get(spec_at).filter(|s| !s.is_empty()) {
                    entry.1.push(s.clone());
                }
            }
            let released = gpuspec.shares()[3];
            if released <= 0.0 {
                return Err("the gpuspec list has no constrained pods".into());
            }
            out.rows = default.rows.clone();
            for row in out.rows.iter_mut() {
                let Some((count, specs)) = kinds.get(&default.kind(row)) else { continue };
                let rate = specs.len() as f64 / *count as f64 * p / released;
                if !specs.is_empty() && (rng.next_u64() as f64 / u64::MAX as f64) < rate {
                    row[out_spec] = specs[rng.below(specs.len())].clone();
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(rows: &[(&str, u64, u64, &str)]) -> PodList {
        PodList {
            header: ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"]
                .map(String::from)
                .to_vec(),
            rows: rows
                .iter()
                .map(|(n, g, m, s)| {
                    vec![
                        n.to_string(),
                        "1000".into(),
                        "1024".into(),
                        g.to_string(),
                        m.to_string(),
                        s.to_string(),
                    ]
                })
                .collect(),
        }
    }

    fn small() -> PodList {
        let mut rows = Vec::new();
        for i in 0..400 {
            let name: &'static str = Box::leak(format!("p{i}").into_boxed_str());
            rows.push(match i % 8 {
                0 => (name, 0, 0, ""),
                1..=3 => (name, 1, 500, ""),
                4..=5 => (name, 1, 1000, ""),
                6 => (name, 2, 1000, ""),
                _ => (name, 8, 1000, ""),
            });
        }
        list(&rows)
    }

    #[test]
    fn each_axis_reaches_its_level_and_the_same_seed_gives_the_same_list() {
        let default = small();
        let mut spec = small();
        for (i, row) in spec.rows.iter_mut().enumerate() {
            if i % 3 == 1 && row[3] != "0" {
                row[5] = "T4".into();
            }
        }
        for (axis, at, want, tolerance) in [
            (Axis::Cpu(30.0), 0, 30.0, 1.0),
            (Axis::Cpu(0.0), 0, 0.0, 0.0),
            (Axis::Gpushare(80.0), 1, 80.0, 12.0),
            (Axis::Multigpu(90.0), 2, 90.0, 3.0),
        ] {
            let v = generate(&default, &spec, axis, 7).unwrap();
            let got = v.shares()[at];
            assert!((got - want).abs() <= tolerance, "{}: {got} vs {want}", axis.name());
            assert_eq!(v, generate(&default, &spec, axis, 7).unwrap(), "{} is seeded", axis.name());
        }
        // Constrained pods get model sets of their own kind, at about the asked rate.
        let v = generate(&default, &spec, Axis::Gpuspec(100.0), 7).unwrap();
        assert!(v.rows.iter().all(|r| r[5].is_empty() || r[5] == "T4"));
        assert!(v.shares()[3] > 50.0, "{:?}", v.shares());
    }

    #[test]
    fn names_follow_the_released_files() {
        assert_eq!(Axis::Cpu(25.0).name(), "cpu250");
        assert_eq!(Axis::Cpu(0.0).name(), "cpu000");
        assert_eq!(Axis::Gpuspec(5.0).name(), "gpuspec05");
        assert_eq!(Axis::Gpushare(100.0).name(), "gpushare100");
    }

    #[test]
    fn rows_are_renamed_in_order() {
        let csv = list(&[("x", 1, 500, ""), ("x", 1, 500, "")]).to_csv();
        assert!(csv.contains("openb-pod-0000,") && csv.contains("openb-pod-0001,"), "{csv}");
    }
}
