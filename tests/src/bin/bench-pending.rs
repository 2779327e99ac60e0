//! Memory per pending pod: what a tenant's pending GPU pods cost the allocator, whose watch keeps
//! every pending GPU pod (its demand and its `nano-gpu/gpu-model` list) for the GPU map and `why`.
//! Starts the real `nano-gpu-allocator serve` twice against a fake API server holding the same
//! synthetic cluster (default 500 nodes × 8 cards, 4,000 placed pods): first alone (the baseline),
//! then with `--pending` pending GPU pods (default 1,000) whose annotations are as large as the API
//! server and our admission allow: a `nano-gpu/gpu-model` of 32 models in 1 KiB (the admission
//! webhook's limit) and 250 KiB of annotations the allocator does not read (the API server allows
//! 256 KiB in all). Prints one JSON line: each run's resident memory once ready and settled
//! (`rss_mib`, VmRSS) and at its peak (`peak_mib`, VmHWM, the initial list included), and the growth
//! per pending pod (`growth_kib_per_pod`, from the settled figures).
//! The fake lists in pages (`--listing paged`, as API servers before 1.34 do) or streams its lists
//! as the watches' first events (`--listing streamed`, as 1.34 and later do by default).
//! Usage: `bench-pending [--nodes N] [--cards N] [--placed N] [--pending N] [--filler-kib N]
//! [--listing paged|streamed] [--allocator PATH]` (`--filler-kib`: the annotations the allocator
//! does not read, per pod).

use anyhow::{Context, Result, bail};
use nano_gpu_tests::fake_api::{Objects, ServedAllocator};
use nano_gpu_tests::{peak_rss_mib, rss_mib};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;

struct Args {
    nodes: usize,
    cards: usize,
    placed: usize,
    pending: usize,
    filler_kib: usize,
    streamed: bool,
    allocator: PathBuf,
}

fn args() -> Result<Args> {
    let mut a = Args {
        nodes: 500,
        cards: 8,
        placed: 4000,
        pending: 1000,
        filler_kib: 250,
        streamed: false,
        allocator: nano_gpu_tests::workspace_binary("nano-gpu-allocator"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--nodes" => a.nodes = value.parse()?,
            "--cards" => a.cards = value.parse()?,
            "--placed" => a.placed = value.parse()?,
            "--pending" => a.pending = value.parse()?,
            "--filler-kib" => a.filler_kib = value.parse()?,
            "--listing" => {
                a.streamed = match value.as_str() {
                    "streamed" => true,
                    "paged" => false,
                    other => bail!("--listing {other}: paged or streamed"),
                }
            }
            "--allocator" => a.allocator = value.into(),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

/// The nodes, and the placed pods spread over their cards.
fn cluster(a: &Args) -> Objects {
    Objects { streams: a.streamed, ..Objects::synthetic(a.nodes, a.cards, a.placed, |_| 20) }
}

/// A `nano-gpu/gpu-model` of 32 distinct models, 1,024 bytes with the separators.
fn models() -> String {
    let names: Vec<String> =
        (0..32).map(|i| format!("NVIDIA Tenant Model {i:02} {}", "x".repeat(8))).collect();
    let text = names.join("|");
    debug_assert!(text.len() <= 1024);
    text
}

/// Pending GPU pod `i`, with the largest annotations a tenant can give it.
fn pending_pod(i: usize, models: &str, filler: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("pending-{i}"), "namespace": "tenant", "uid": format!("pending-{i}"),
            "resourceVersion": "1", "creationTimestamp": "2026-11-26T00:00:00Z",
            "annotations": {"nano-gpu/gpu-model": models, "tenant.example/notes": filler}},
        "spec": {"schedulerName": "nano-gpu-scheduler", "containers": [{"name": "main", "resources":
            {"limits": {"nano-gpu/gpu-percent": "30", "cpu": "1", "memory": "4Gi"}}}]},
        "status": {"phase": "Pending"}})
}

/// The allocator's settled and peak resident memory, once ready against `objects`.
async fn measure(a: &Args, objects: Objects) -> Result<(f64, f64, f64)> {
    let (served, _conn) = ServedAllocator::start(&a.allocator, objects, Duration::from_secs(300)).await?;
    // Let what the initial list held be given back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok((rss_mib(served.pid()), peak_rss_mib(served.pid()), served.ready_s))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> Result<()> {
    let a = args()?;
    let (base_rss, base_peak, base_ready) = measure(&a, cluster(&a)).await?;
    let (models, filler) = (models(), "n".repeat(a.filler_kib * 1024));
    let mut objects = cluster(&a);
    objects.pods.extend((0..a.pending).map(|i| pending_pod(i, &models, &filler)));
    let (rss, peak, ready) = measure(&a, objects).await?;
    let round = |v: f64| (v * 1000.0).round() / 1000.0;
    let per_pod = if a.pending > 0 { (rss - base_rss) * 1024.0 / a.pending as f64 } else { 0.0 };
    let line = json!({
        "nodes": a.nodes, "cards_per_node": a.cards, "placed_pods": a.placed, "pending_pods": a.pending,
        "annotation_bytes_per_pod": models.len() + filler.len(),
        "listing": if a.streamed { "streamed" } else { "paged" },
        "baseline": {"rss_mib": round(base_rss), "peak_mib": round(base_peak), "ready_s": round(base_ready)},
        "with_pending": {"rss_mib": round(rss), "peak_mib": round(peak), "ready_s": round(ready)},
        "growth_kib_per_pod": round(per_pod),
    });
    println!("{line}");
    Ok(())
}
