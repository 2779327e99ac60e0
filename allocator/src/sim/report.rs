//! What `simulate` prints: per policy, the median (and quartiles) over seeds of unallocated GPU at
//! every arrived percent, as a table, a JSON document, or an SVG plot like the paper's Fig. 9(a).

use nano_gpu_engine::replay::{MAX_ARRIVED, Replay};
use serde::Serialize;
use std::fmt::Write as _;

/// One point of a policy's curve, aggregated over seeds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CurvePoint {
    /// Arrived GPU demand in % of capacity.
    pub arrived_pct: usize,
    /// Median over seeds of unallocated GPU in % of capacity.
    pub unallocated_pct_median: Option<f64>,
    /// First quartile.
    pub unallocated_pct_q25: Option<f64>,
    /// Third quartile.
    pub unallocated_pct_q75: Option<f64>,
    /// Median fragmented GPU (F(M)) in % of capacity.
    pub frag_pct_median: Option<f64>,
}

/// One policy's result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyReport {
    /// Policy name.
    pub policy: String,
    /// Whether decisions went through the extender path.
    pub through_extender: bool,
    /// Seeds replayed.
    pub seeds: Vec<u64>,
    /// Wall time of all seeds of this policy.
    pub wall_ms: u64,
    /// Median over seeds of the pods that found no node.
    pub failed_pods_median: f64,
    /// Median over seeds of the pods that arrived.
    pub arrived_pods_median: f64,
    /// One point per arrived percent 0..=130.
    pub curve: Vec<CurvePoint>,
}

/// Everything `simulate` measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Per policy, in the order asked.
    pub policies: Vec<PolicyReport>,
}

/// Quantile with linear interpolation between order statistics (numpy's default).
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    Some(v[lo] + (v[hi] - v[lo]) * (pos - lo as f64))
}

fn round(v: Option<f64>, places: i32) -> Option<f64> {
    let f = 10f64.powi(places);
    v.map(|v| (v * f).round() / f)
}

impl PolicyReport {
    /// Aggregates the replays of one policy.
    pub fn from_replays(
        policy: &str,
        through_extender: bool,
        replays: &[(u64, Replay)],
        wall_ms: u64,
    ) -> Self {
        let curve = (0..=MAX_ARRIVED)
            .map(|x| {
                let un: Vec<f64> =
                    replays.iter().filter_map(|(_, r)| r.curve[x].map(|p| p.unallocated)).collect();
                let fr: Vec<f64> = replays.iter().filter_map(|(_, r)| r.curve[x].map(|p| p.frag)).collect();
                CurvePoint {
                    arrived_pct: x,
                    unallocated_pct_median: round(quantile(&un, 0.5), 3),
                    unallocated_pct_q25: round(quantile(&un, 0.25), 3),
                    unallocated_pct_q75: round(quantile(&un, 0.75), 3),
                    frag_pct_median: round(quantile(&fr, 0.5), 3),
                }
            })
            .collect();
        let failed: Vec<f64> = replays.iter().map(|(_, r)| r.failed as f64).collect();
        let arrived: Vec<f64> = replays.iter().map(|(_, r)| r.arrived as f64).collect();
        PolicyReport {
            policy: policy.to_owned(),
            through_extender,
            seeds: replays.iter().map(|(s, _)| *s).collect(),
            wall_ms,
            failed_pods_median: quantile(&failed, 0.5).unwrap_or(0.0),
            arrived_pods_median: quantile(&arrived, 0.5).unwrap_or(0.0),
            curve,
        }
    }

    /// Median unallocated % at an arrived percent.
    pub fn unallocated_at(&self, arrived_pct: usize) -> Option<f64> {
        self.curve.get(arrived_pct).and_then(|p| p.unallocated_pct_median)
    }
}

impl Report {
    /// The JSON document.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// A table a person reads: unallocated GPU % (median over seeds, quartiles) at arrived 90, 100, 130.
    pub fn to_table(&self) -> String {
        let cell = |p: &PolicyReport, x: usize| {
            let c = &p.curve[x];
            match (c.unallocated_pct_median, c.unallocated_pct_q25, c.unallocated_pct_q75) {
                (Some(m), Some(a), Some(b)) => format!("{m:6.2} [{a:5.2}–{b:5.2}]"),
                _ => "     –".to_owned(),
            }
        };
        let mut out = String::new();
        let _ =
            writeln!(out, "unallocated GPU % of capacity at arrived workload (median over seeds [q25–q75])");
        let _ = writeln!(
            out,
            "{:<12} {:<9} {:>5} {:>22} {:>22} {:>22} {:>8} {:>8}",
            "policy", "path", "seeds", "arrived 90%", "arrived 100%", "arrived 130%", "failed", "wall s"
        );
        for p in &self.policies {
            let _ = writeln!(
                out,
                "{:<12} {:<9} {:>5} {:>22} {:>22} {:>22} {:>8} {:>8.1}",
                p.policy,
                if p.through_extender { "extender" } else { "raw" },
                p.seeds.len(),
                cell(p, 90),
                cell(p, 100),
                cell(p, 130),
                p.failed_pods_median,
                p.wall_ms as f64 / 1000.0
            );
        }
        out
    }

    /// Unallocated GPU against arrived workload, one line per policy (like the paper's Fig. 9(a)),
    /// with the ideal line `100 − x` for reference. Arrived 70..=130 %.
    pub fn to_svg(&self) -> String {
        let (w, h, left, right, top, bottom) = (760.0, 480.0, 70.0, 170.0, 30.0, 60.0);
        let (x0, x1) = (70.0, 130.0);
        let y_max = self
            .policies
            .iter()
            .flat_map(|p| p.curve[70..].iter().filter_map(|c| c.unallocated_pct_median))
            .fold(10.0f64, f64::max)
            .min(35.0)
            .ceil();
        let px = |x: f64| left + (x - x0) / (x1 - x0) * (w - left - right);
        let py = |y: f64| top + (1.0 - y.clamp(0.0, y_max) / y_max) * (h - top - bottom);
        let colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        // Axes, grid and ticks.
        for i in 0..=6 {
            let x = x0 + 10.0 * f64::from(i);
            let _ = writeln!(
                s,
                r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#ddd"/><text x="{0}" y="{3}" text-anchor="middle">{4}</text>"##,
                px(x),
                top,
                h - bottom,
                h - bottom + 18.0,
                x
            );
        }
        let step = if y_max > 20.0 { 5.0 } else { 2.0 };
        let mut y = 0.0;
        while y <= y_max {
            let _ = writeln!(
                s,
                r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="#ddd"/><text x="{3}" y="{4}" text-anchor="end">{5}</text>"##,
                left,
                py(y),
                w - right,
                left - 6.0,
                py(y) + 4.0,
                y
            );
            y += step;
        }
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{top}" width="{}" height="{}" fill="none" stroke="#333"/>"##,
            w - left - right,
            h - top - bottom
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">Arrived workloads (% of cluster GPU capacity)</text>"#,
            (left + w - right) / 2.0,
            h - 15.0
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate(18,{}) rotate(-90)" text-anchor="middle">Unallocated GPU (%)</text>"#,
            (top + h - bottom) / 2.0
        );
        // Ideal line: everything that arrived is allocated.
        let _ = writeln!(
            s,
            r##"<polyline fill="none" stroke="#999" stroke-dasharray="4 3" points="{},{} {},{}"/>"##,
            px(70.0),
            py(30.0),
            px(100.0),
            py(0.0)
        );
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="#999" stroke-dasharray="4 3"/>"##,
            px(100.0),
            py(0.0),
            px(130.0)
        );
        for (i, p) in self.policies.iter().enumerate() {
            let color = colors[i % colors.len()];
            let points: Vec<String> = p.curve[70..]
                .iter()
                .filter_map(|c| {
                    c.unallocated_pct_median.map(|m| format!("{:.1},{:.1}", px(c.arrived_pct as f64), py(m)))
                })
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                points.join(" ")
            );
            let label = format!("{}{}", p.policy, if p.through_extender { " (extender)" } else { "" });
            let ly = top + 16.0 + 20.0 * i as f64;
            let _ = writeln!(
                s,
                r#"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="{color}" stroke-width="2"/><text x="{3}" y="{4}">{label}</text>"#,
                w - right + 10.0,
                ly,
                w - right + 30.0,
                w - right + 36.0,
                ly + 4.0
            );
        }
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end" fill="#999">ideal</text>"##,
            px(128.0),
            py(0.0) - 4.0
        );
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_engine::replay::Point;

    #[test]
    fn quantiles_interpolate_like_numpy() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(quantile(&v, 0.5), Some(2.5));
        assert_eq!(quantile(&v, 0.25), Some(1.75));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn report_takes_medians_over_seeds_and_renders() {
        let replay = |u: f64| Replay {
            curve: (0..=MAX_ARRIVED).map(|_| Some(Point { unallocated: u, frag: u / 2.0 })).collect(),
            failed: u as usize,
            arrived: 100,
        };
        let p = PolicyReport::from_replays(
            "fgd",
            false,
            &[(1, replay(4.0)), (2, replay(6.0)), (3, replay(5.0))],
            7,
        );
        assert_eq!(p.unallocated_at(100), Some(5.0));
        assert_eq!(p.failed_pods_median, 5.0);
        let report = Report { policies: vec![p] };
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(json["policies"][0]["curve"].as_array().unwrap().len(), 131);
        assert_eq!(json["policies"][0]["curve"][100]["unallocated_pct_median"], 5.0);
        assert!(report.to_table().contains("fgd"));
        let svg = report.to_svg();
        assert!(svg.starts_with("<svg") && svg.contains("polyline") && svg.trim_end().ends_with("</svg>"));
    }
}
