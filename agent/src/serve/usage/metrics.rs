//! The newest [`Report`] as Prometheus text (exposition format 0.0.4). Names follow Prometheus'
//! conventions (base units, `_total` for counters) under `nano_gpu_`; labels follow dcgm-exporter's
//! Kubernetes mapping (`namespace`, `pod`, `container`) with the card as `gpu` (index), `uuid` and
//! `model`, and `node` on every series. The list, with meanings, is in the README.

use super::Report;
use nano_gpu_runtime::exposition::Exposition;

/// Bytes in a MiB.
const MIB: u64 = 1 << 20;

/// The report of node `node` as metrics; `at` is when it was sampled (seconds since the epoch).
pub fn render(report: &Report, node: &str, at: f64) -> String {
    let mut out = Exposition::default();
    type CardValue = fn(&super::CardUsage) -> Option<f64>;
    let per_card: [(&str, &str, &str, CardValue); 8] = [
        (
            "nano_gpu_card_utilization_percent",
            "gauge",
            "Percent of the last sample period a kernel ran on the card.",
            |c| c.sample.utilization.map(f64::from),
        ),
        (
            "nano_gpu_card_memory_used_bytes",
            "gauge",
            "Card memory in use (every process and the driver).",
            |c| Some((c.sample.memory_used.0 * MIB) as f64),
        ),
        ("nano_gpu_card_memory_total_bytes", "gauge", "Card memory.", |c| {
            Some((c.sample.memory_total.0 * MIB) as f64)
        }),
        ("nano_gpu_card_temperature_celsius", "gauge", "Card temperature.", |c| {
            c.sample.temperature.map(f64::from)
        }),
        ("nano_gpu_card_power_watts", "gauge", "Card power draw.", |c| {
            c.sample.power_mw.map(|mw| f64::from(mw) / 1000.0)
        }),
        (
            "nano_gpu_card_xid_errors_total",
            "counter",
            "XID errors reported on the card since the agent started.",
            |c| Some(c.xids as f64),
        ),
        (
            "nano_gpu_card_healthy",
            "gauge",
            "1 when the card is served as healthy, 0 when the kubelet gives it to nobody.",
            |c| Some(f64::from(u8::from(c.healthy))),
        ),
        (
            "nano_gpu_card_granted_percent",
            "gauge",
            "Sum of the shares granted on the card to pods of this node.",
            |c| Some(f64::from(c.granted)),
        ),
    ];
    for (name, kind, help, value) in per_card {
        let mut f = out.family(name, kind, help);
        for c in &report.cards {
            if let Some(v) = value(c) {
                let gpu = c.sample.index.to_string();
                f.sample(&[("node", node), ("gpu", &gpu), ("uuid", &c.sample.uuid), ("model", &c.model)], v);
            }
        }
    }
    type ContainerValue = fn(&super::ContainerUsage) -> f64;
    let per_container: [(&str, &str, ContainerValue); 6] = [
        (
            "nano_gpu_container_granted_percent",
            "Share of the card granted to the container (0: a card it was not given).",
            |r| f64::from(r.granted.0),
        ),
        (
            "nano_gpu_container_granted_memory_bytes",
            "Card memory granted to the container (asked, or its percent of the card's).",
            |r| (r.granted_memory.0 * MIB) as f64,
        ),
        ("nano_gpu_container_memory_used_bytes", "Card memory the container's processes use.", |r| {
            (r.memory_used.0 * MIB) as f64
        }),
        (
            "nano_gpu_container_utilization_percent",
            "Sum of the SM utilisation of the container's processes on the card.",
            |r| f64::from(r.utilization),
        ),
        ("nano_gpu_container_processes", "The container's processes on the card.", |r| r.pids.len() as f64),
        (
            "nano_gpu_container_memory_overrun",
            "1 when the container has used more card memory than granted for longer than the grace period.",
            |r| f64::from(u8::from(r.overrun.is_some())),
        ),
    ];
    for (name, help, value) in per_container {
        let mut f = out.family(name, "gauge", help);
        for r in &report.containers {
            let gpu = r.index.to_string();
            let labels = [
                ("node", node),
                ("namespace", &r.namespace),
                ("pod", &r.pod),
                ("container", &r.container),
                ("gpu", &gpu),
                ("uuid", &r.uuid),
            ];
            f.sample(&labels, value(r));
        }
    }
    let mut f = out.family(
        "nano_gpu_card_unattributed_memory_used_bytes",
        "gauge",
        "Card memory used by processes of no pod on this node (the host's, or a pod's the agent cannot name).",
    );
    for c in &report.cards {
        let bytes: u64 =
            report.unattributed.iter().filter(|u| u.uuid == c.sample.uuid).map(|u| u.memory.0 * MIB).sum();
        let (gpu, uuid) = (c.sample.index.to_string(), c.sample.uuid.as_str());
        f.sample(&[("node", node), ("gpu", &gpu), ("uuid", uuid)], bytes);
    }
    let mut f =
        out.family("nano_gpu_usage_sampled_timestamp_seconds", "gauge", "When the cards were last sampled.");
    f.sample(&[("node", node)], at);
    out.finish()
}
