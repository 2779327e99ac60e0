//! Prometheus text metrics: decisions by verb and result, latency histograms per verb, and per-card
//! allocated percent and memory (read from the cluster view at scrape time), written through
//! [`nano_gpu_runtime::exposition`] as the agent's are.

use nano_gpu_engine::engine::Engine;
use nano_gpu_proto::units::Percent;
use nano_gpu_runtime::exposition::Exposition;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Extender verbs that are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// `POST /filter`.
    Filter,
    /// `POST /prioritize`.
    Prioritize,
    /// `POST /bind`.
    Bind,
}

impl Verb {
    const ALL: [Verb; 3] = [Verb::Filter, Verb::Prioritize, Verb::Bind];

    fn name(self) -> &'static str {
        match self {
            Verb::Filter => "filter",
            Verb::Prioritize => "prioritize",
            Verb::Bind => "bind",
        }
    }
}

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 10] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5];

#[derive(Default)]
struct VerbStats {
    ok: AtomicU64,
    error: AtomicU64,
    buckets: [AtomicU64; BUCKETS.len()],
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

/// Counters shared by the handlers.
#[derive(Default)]
pub struct Metrics {
    verbs: [VerbStats; 3],
    /// When the certificates this replica serves and accepts end (the TLS code records them).
    pub certificates: std::sync::Arc<crate::service::tls::CertificateEnds>,
}

impl Metrics {
    /// Counts one call of `verb`.
    pub fn observe(&self, verb: Verb, ok: bool, took: Duration) {
        let v = &self.verbs[verb as usize];
        if ok { &v.ok } else { &v.error }.fetch_add(1, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        for (bound, bucket) in BUCKETS.iter().zip(&v.buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        v.sum_nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        v.count.fetch_add(1, Ordering::Relaxed);
    }

    /// The exposition text: the calls, and what `view` holds of the cluster ([`Scrape::of`]).
    pub fn render(&self, view: &Scrape) -> String {
        let mut out = Exposition::with_capacity(
            512 + view.nodes.iter().map(|n| 64 + 160 * n.cards.len()).sum::<usize>(),
        );
        let mut f = out.family("nano_gpu_decisions_total", "counter", "Extender calls by verb and result.");
        for verb in Verb::ALL {
            let v = &self.verbs[verb as usize];
            for (result, n) in [("ok", &v.ok), ("error", &v.error)] {
                f.sample(&[("verb", verb.name()), ("result", result)], n.load(Ordering::Relaxed));
            }
        }
        let mut f = out.family("nano_gpu_decision_seconds", "histogram", "Extender call latency.");
        for verb in Verb::ALL {
            let v = &self.verbs[verb as usize];
            for (bound, bucket) in BUCKETS.iter().zip(&v.buckets) {
                let le = bound.to_string();
                f.sample_of("_bucket", &[("verb", verb.name()), ("le", &le)], bucket.load(Ordering::Relaxed));
            }
            let count = v.count.load(Ordering::Relaxed);
            f.sample_of("_bucket", &[("verb", verb.name()), ("le", "+Inf")], count);
            let sum = v.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
            f.sample_of("_sum", &[("verb", verb.name())], sum);
            f.sample_of("_count", &[("verb", verb.name())], count);
        }
        type CardValue = fn(&CardRow) -> u64;
        let per_card: [(&str, &str, CardValue); 2] = [
            ("nano_gpu_card_allocated_percent", "Percent of each card allocated to pods.", |c| {
                u64::from(c.percent)
            }),
            ("nano_gpu_card_allocated_memory_mib", "GPU memory of each card allocated to pods.", |c| {
                c.memory_mib
            }),
        ];
        for (name, help, value) in per_card {
            let mut f = out.family(name, "gauge", help);
            for n in &view.nodes {
                for c in &n.cards {
                    let index = c.index.to_string();
                    f.sample(&[("node", &n.name), ("gpu", &c.uuid), ("index", &index)], value(c));
                }
            }
        }
        let mut f = out.family(
            "nano_gpu_node_fragmentation_percent",
            "gauge",
            "GPU (percent of a card) the expected workload could not use on the node, the measure the policy places by.",
        );
        for n in &view.nodes {
            f.sample(&[("node", &n.name)], format_args!("{:.1}", n.frag));
        }
        let gauges: [(&str, &str, u64); 4] = [
            (
                "nano_gpu_allocator_leading",
                "1 when this replica decides, else 0.",
                u64::from(view.gauges.leading),
            ),
            ("nano_gpu_pods_waiting", "GPU pods pending without an assignment.", view.gauges.waiting as u64),
            (
                "nano_gpu_pods_waiting_oldest_seconds",
                "Age of the oldest waiting GPU pod (0 when none waits).",
                view.gauges.oldest_waiting_seconds,
            ),
            (
                "nano_gpu_load_cards",
                "Cards with a fresh utilisation reading breaking placement ties (0: none, --prometheus-url unset or stale).",
                view.gauges.load_cards as u64,
            ),
        ];
        for (name, help, value) in gauges {
            out.family(name, "gauge", help).sample(&[], value);
        }
        let mut f = out.family(
            "nano_gpu_certificate_not_after_seconds",
            "gauge",
            "When each certificate this replica serves or accepts ends (Unix time): serving (the webhook's), extender-client-ca (the soonest-ending CA of --extender-client-ca), extender-client (the client certificate kube-scheduler last presented).",
        );
        for (which, end) in self.certificates.all() {
            let secs = end.duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
            f.sample(&[("certificate", which.label())], secs);
        }
        out.finish()
    }
}

/// What a scrape reads of the cluster view, copied under its lock so that the fragmentation and the
/// text are computed outside it (at 5,000 nodes the text is megabytes; the extender's verbs wait on
/// that lock).
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    /// The schedulable nodes, in the view's order.
    pub nodes: Vec<NodeRow>,
    /// The gauges beside them.
    pub gauges: ViewGauges,
}

/// One node of a [`Scrape`].
#[derive(Clone, Debug)]
pub struct NodeRow {
    /// Node name.
    pub name: String,
    /// Its fragmentation now, in percent of a card.
    pub frag: f64,
    /// Its cards.
    pub cards: Vec<CardRow>,
}

/// One card of a [`NodeRow`].
#[derive(Clone, Debug)]
pub struct CardRow {
    /// UUID.
    pub uuid: String,
    /// Index on its node.
    pub index: u32,
    /// Percent allocated to pods.
    pub percent: u32,
    /// Memory allocated to pods, MiB.
    pub memory_mib: u64,
}

impl Scrape {
    /// What `engine`'s cluster holds now, with `gauges`.
    pub fn of(engine: &Engine, gauges: ViewGauges) -> Scrape {
        Scrape::taken(engine, gauges).rows()
    }

    /// The nodes and the workload a scrape needs, copied (under the view's lock): the fragmentation
    /// of each node, which takes the longest, is computed from the copy after the lock is let go
    /// ([`Taken::rows`]).
    pub fn taken(engine: &Engine, gauges: ViewGauges) -> Taken {
        let nodes = engine.cluster().nodes().iter().filter(|n| n.schedulable).cloned().collect();
        Taken { nodes, workload: engine.workload().clone(), gauges }
    }
}

/// The copy of the view a scrape reads ([`Scrape::taken`]).
pub struct Taken {
    nodes: Vec<nano_gpu_engine::model::Node>,
    workload: nano_gpu_engine::workload::Workload,
    gauges: ViewGauges,
}

impl Taken {
    /// The scrape's rows: each node's cards and fragmentation.
    pub fn rows(self) -> Scrape {
        let Taken { nodes, workload, gauges } = self;
        let nodes = nodes
            .iter()
            .map(|n| NodeRow {
                name: n.name.to_string(),
                frag: workload.frag_now(n),
                cards: n
                    .cards
                    .iter()
                    .map(|c| CardRow {
                        uuid: c.uuid.to_string(),
                        index: c.index,
                        percent: (Percent::FULL - c.free).0,
                        memory_mib: c.mem_total.saturating_sub(c.mem_free).0,
                    })
                    .collect(),
            })
            .collect();
        Scrape { nodes, gauges }
    }
}

/// What the view says beside the cards: whether this replica decides, and the GPU pods waiting (a
/// count and an age: the public metrics name no pod).
#[derive(Clone, Copy, Debug, Default)]
pub struct ViewGauges {
    /// This replica decides now.
    pub leading: bool,
    /// GPU pods pending without an assignment.
    pub waiting: usize,
    /// Age of the oldest of them, in seconds.
    pub oldest_waiting_seconds: u64,
    /// Cards with a fresh load reading.
    pub load_cards: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_engine::model::{Card, Cluster, ModelId, Node};
    use nano_gpu_proto::units::MiB;

    #[test]
    fn calls_are_counted_into_buckets_and_cards_are_listed() {
        let m = Metrics::default();
        m.observe(Verb::Filter, true, Duration::from_micros(700));
        m.observe(Verb::Bind, false, Duration::from_millis(30));
        let mut c = Cluster::new();
        let mut card = Card::new("GPU-a", 0, ModelId(0), MiB(1000));
        card.free = Percent(70);
        card.mem_free = MiB(400);
        c.add_node(Node::new("n1", 1, 1, vec![card])).unwrap();
        let mut engine = Engine::new(
            Cluster::new(),
            nano_gpu_engine::policy::by_name("fgd", 0).unwrap(),
            Default::default(),
        );
        *engine.cluster_mut() = c;
        let gauges = ViewGauges { leading: true, waiting: 2, oldest_waiting_seconds: 90, load_cards: 3 };
        let text = m.render(&Scrape::of(&engine, gauges));
        assert!(text.contains("nano_gpu_decisions_total{verb=\"filter\",result=\"ok\"} 1"), "{text}");
        assert!(text.contains("nano_gpu_decisions_total{verb=\"bind\",result=\"error\"} 1"));
        assert!(text.contains("nano_gpu_decision_seconds_bucket{verb=\"filter\",le=\"0.0005\"} 0"));
        assert!(text.contains("nano_gpu_decision_seconds_bucket{verb=\"filter\",le=\"0.001\"} 1"));
        assert!(text.contains("nano_gpu_decision_seconds_bucket{verb=\"bind\",le=\"+Inf\"} 1"));
        assert!(text.contains("nano_gpu_card_allocated_percent{node=\"n1\",gpu=\"GPU-a\",index=\"0\"} 30"));
        assert!(
            text.contains("nano_gpu_card_allocated_memory_mib{node=\"n1\",gpu=\"GPU-a\",index=\"0\"} 600\n")
        );
        // Each family whole: its samples together, after its TYPE (they were interleaved before).
        assert_eq!(nano_gpu_runtime::exposition::check_whole(&text), Ok(()), "{text}");
        // Every sample line is `name{labels} number` and nothing more (Prometheus refused the
        // whole scrape over a "600 MiB").
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap_or_default();
            assert!(!series.contains(' ') && value.parse::<f64>().is_ok(), "not a sample: {line}");
        }
        assert!(text.contains("nano_gpu_node_fragmentation_percent{node=\"n1\"} 0.0"), "{text}");
        assert!(text.contains("nano_gpu_allocator_leading 1\n"), "{text}");
        assert!(text.contains("nano_gpu_pods_waiting 2\n"), "{text}");
        assert!(text.contains("nano_gpu_pods_waiting_oldest_seconds 90\n"), "{text}");
        assert!(text.contains("nano_gpu_load_cards 3\n"), "{text}");
    }
}
