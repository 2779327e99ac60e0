//! Benchmark of the extender service: starts the real `nano-gpu-allocator serve` on loopback against a
//! fake API server holding a synthetic cluster (default 5,000 nodes × 8 cards, 40,000 placed pods and the pending pods to place),
//! drives filter (all nodes by name) → prioritize → bind for new pods (default 10,000) the way
//! kube-scheduler does (one pod at a time; each bind in a binding cycle beside the next pod's
//! scheduling cycle; keep-alive connections), and prints one JSON line:
//! `{"nodes":…,"filter_p99_ms":…,"prioritize_p99_ms":…,"bind_p99_ms":…,"pods_per_s":…,"rss_mib":…}`.
//!
//! `rss_mib` is the allocator's peak resident memory (VmHWM); `allocator_cpu_s_per_1000_pods` the
//! CPU it spent while the new pods were placed, per 1,000 of them (the unit the peers were compared
//! in); `filter_max_ms` the longest filter
//! (a verb that waited on something else holding the view shows there). With `--shapes N` the new pods ask N
//! distinct CPU requests (1000m + 7919·i mod N), so the engine sees N request shapes, as when users pick
//! exact CPU requests; the line then has a `shapes` field. With `--scrape-ms N`, while the pods are
//! placed, `/metrics` (as Prometheus scrapes it) and `/map/data` (as the GPU map's page polls it) are
//! each read every N ms on their own connections (`--scrape PATH,…` for others); the line then has a
//! `scrape` field with their p99 and sizes, and the verbs' numbers show what the reads cost them.
//! With `--preemptors N`, after the pods are placed, N pods of priority 1000 that ask eight whole
//! cards (no node has one free: each card holds a placed pod of priority 0) are filtered one by one:
//! each filter refuses every node and searches them for pods to preempt, under the view's lock.
//! The line then has a `preempt` field: those filters' latencies and how many found victims (the
//! other figures leave them out, but `server_mean_ms` counts them).
//! Usage: `bench-extender [--nodes N] [--cards N] [--placed N] [--pods N] [--shapes N]
//! [--scrape-ms N] [--scrape PATH,…] [--preemptors N] [--allocator PATH]`.

use anyhow::{Context, Result, bail};
use nano_gpu_tests::fake_api::{Objects, ServedAllocator};
use nano_gpu_tests::http_client::Conn;
use nano_gpu_tests::{TICKS_PER_S, cpu_ticks, p99, peak_rss_mib};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};

struct Args {
    nodes: usize,
    cards: usize,
    placed: usize,
    pods: usize,
    shapes: Option<usize>,
    scrape_ms: Option<u64>,
    scrape: Vec<String>,
    preemptors: usize,
    allocator: PathBuf,
}

fn args() -> Result<Args> {
    let mut a = Args {
        nodes: 5000,
        cards: 8,
        placed: 40_000,
        pods: 10_000,
        shapes: None,
        scrape_ms: None,
        scrape: vec!["/metrics".into(), "/map/data".into()],
        preemptors: 0,
        allocator: nano_gpu_tests::workspace_binary("nano-gpu-allocator"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--nodes" => a.nodes = value.parse()?,
            "--cards" => a.cards = value.parse()?,
            "--placed" => a.placed = value.parse()?,
            "--pods" => a.pods = value.parse()?,
            "--shapes" => a.shapes = Some(value.parse::<usize>()?.max(1)),
            "--scrape-ms" => a.scrape_ms = Some(value.parse::<u64>()?.max(1)),
            "--scrape" => a.scrape = value.split(',').map(str::to_owned).collect(),
            "--preemptors" => a.preemptors = value.parse()?,
            "--allocator" => a.allocator = value.into(),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

/// Shares the synthetic pods ask, in percent.
const SHARES: [u32; 6] = [10, 20, 25, 30, 40, 50];

fn objects(a: &Args) -> Objects {
    let mut objects = Objects::synthetic(a.nodes, a.cards, a.placed, |i| SHARES[i % SHARES.len()]);
    // The pods to schedule exist before kube-scheduler asks about them (bind reads them).
    objects.pods.extend((0..a.pods).map(|i| new_pod(i, a.shapes)));
    objects
}

fn new_pod(i: usize, shapes: Option<usize>) -> Value {
    let percent = SHARES[(i * 7) % SHARES.len()];
    // The N values in a scrambled order (7,919 is prime, so every value comes once per N pods), as
    // pods from many users arrive; not a sweep from the smallest to the largest.
    let cpu = shapes.map_or("1".to_owned(), |n| format!("{}m", 1000 + (i * 7919) % n));
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("new-{i}"), "namespace": "bench", "uid": format!("new-{i}"), "resourceVersion": "1"},
        "spec": {"schedulerName": "nano-gpu-scheduler", "containers": [{"name": "main", "resources":
            {"limits": {"nano-gpu/gpu-percent": percent.to_string(), "cpu": cpu, "memory": "4Gi"}}}]},
        "status": {"phase": "Pending"}})
}

/// Pending pod `i` of priority 1000 asking eight whole cards (`--preemptors`).
fn preemptor(i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("urgent-{i}"), "namespace": "bench", "uid": format!("urgent-{i}"), "resourceVersion": "1"},
        "spec": {"schedulerName": "nano-gpu-scheduler", "priority": 1000, "containers": [{"name": "main", "resources":
            {"limits": {"nano-gpu/gpu-percent": "800", "cpu": "1", "memory": "4Gi"}}}]},
        "status": {"phase": "Pending"}})
}

/// The filter answer, borrowing the names from the body (no allocation per node).
#[derive(serde::Deserialize)]
struct FilterResult<'a> {
    #[serde(rename = "NodeNames", borrow)]
    node_names: Option<Vec<&'a str>>,
}

#[derive(serde::Deserialize)]
struct HostPriority<'a> {
    #[serde(rename = "Host")]
    host: &'a str,
    #[serde(rename = "Score")]
    score: i64,
}

#[derive(serde::Deserialize)]
struct BindResult {
    #[serde(rename = "Error", default)]
    error: String,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> Result<()> {
    let a = args()?;
    // Ready once the 5,000 nodes and 40,000 pods are listed.
    let (served, mut conn) =
        ServedAllocator::start(&a.allocator, objects(&a), Duration::from_secs(300)).await?;
    let (addr, pid, ready_s) = (served.addr.clone(), served.pid(), served.ready_s);
    let operator_addr = served.operator_addr.clone();

    // The driver plays kube-scheduler: it must not be the bottleneck, so bodies are assembled from
    // pre-serialized parts and answers are read into typed structs.
    let names: Vec<String> = (0..a.nodes).map(|n| format!("node-{n:05}")).collect();
    let all_names = serde_json::to_string(&names)?;
    let (mut filter, mut prioritize) = (Vec::new(), Vec::new());
    let mut failed = 0usize;
    // kube-scheduler binds in a binding cycle that runs beside the next pod's scheduling cycle: binds
    // go through their own connection, in order, while the next pod is filtered and scored.
    let (binds, mut queue) = tokio::sync::mpsc::channel::<String>(64);
    let bind_addr = addr.clone();
    let binder = tokio::spawn(async move {
        let mut conn = Conn::open(&bind_addr).await?;
        let (mut latencies, mut failed) = (Vec::new(), 0usize);
        while let Some(body) = queue.recv().await {
            let t = Instant::now();
            let (_, answer) = conn.call("POST", "/bind", body.into_bytes()).await?;
            latencies.push(t.elapsed().as_secs_f64() * 1000.0);
            let result: BindResult = serde_json::from_slice(&answer)?;
            if !result.error.is_empty() {
                if failed < 3 {
                    eprintln!("bind failed: {}", result.error);
                }
                failed += 1;
            }
        }
        anyhow::Ok((latencies, failed))
    });
    // Readers of /metrics and /map/data beside the verbs, each on its own connection.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = a
        .scrape_ms
        .into_iter()
        .flat_map(|every| a.scrape.iter().map(move |path| (every, path.clone())))
        .map(|(every, path)| {
            // The map's data is on the operators' port.
            let at = if path.starts_with("/map") { operator_addr.clone() } else { addr.clone() };
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut conn = Conn::open(&at).await?;
                let (mut latencies, mut bytes) = (Vec::new(), 0usize);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = Instant::now();
                    let (status, body) = conn.call("GET", &path, vec![]).await?;
                    if status != 200 {
                        bail!("GET {path}: {status}");
                    }
                    latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                    bytes = body.len();
                    tokio::time::sleep(Duration::from_millis(every)).await;
                }
                anyhow::Ok((latencies, bytes))
            })
        })
        .collect();
    let run = Instant::now();
    let ticks = cpu_ticks(pid);
    for i in 0..a.pods {
        let pod = new_pod(i, a.shapes).to_string();
        let body = format!(r#"{{"Pod":{pod},"NodeNames":{all_names}}}"#).into_bytes();
        let t = Instant::now();
        let (_, answer) = conn.call("POST", "/filter", body).await?;
        filter.push(t.elapsed().as_secs_f64() * 1000.0);
        let result: FilterResult = serde_json::from_slice(&answer)?;
        let feasible = result.node_names.unwrap_or_default();
        if feasible.is_empty() {
            failed += 1;
            continue;
        }
        let chosen = if feasible.len() == 1 {
            feasible[0].to_owned()
        } else {
            let list = if feasible.len() == names.len() {
                all_names.clone()
            } else {
                serde_json::to_string(&feasible)?
            };
            let body = format!(r#"{{"Pod":{pod},"NodeNames":{list}}}"#).into_bytes();
            let t = Instant::now();
            let (_, answer) = conn.call("POST", "/prioritize", body).await?;
            prioritize.push(t.elapsed().as_secs_f64() * 1000.0);
            let scores: Vec<HostPriority> = serde_json::from_slice(&answer)?;
            scores.into_iter().max_by_key(|h| h.score).context("no scores")?.host.to_owned()
        };
        let body =
            format!(r#"{{"PodName":"new-{i}","PodNamespace":"bench","PodUID":"new-{i}","Node":"{chosen}"}}"#);
        binds.send(body).await?;
    }
    drop(binds);
    let (bind, bind_failed) = binder.await??;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut scraped = Vec::new();
    for reader in readers {
        scraped.push(reader.await??);
    }
    failed += bind_failed;
    if a.pods > 0 && failed == a.pods {
        bail!("no pod was placed: every filter or bind failed (see the allocator's warnings above)");
    }
    let wall = run.elapsed().as_secs_f64();
    // The allocator's CPU (user and system) while the pods were placed.
    let cpu_s = cpu_ticks(pid).saturating_sub(ticks) as f64 / TICKS_PER_S;
    // Then pods that fit nowhere and may preempt (not in the figures above): each filter searches
    // the refused nodes for pods to preempt.
    let (mut preempt, mut nominated) = (Vec::new(), 0usize);
    for i in 0..a.preemptors {
        let body = format!(r#"{{"Pod":{},"NodeNames":{all_names}}}"#, preemptor(i)).into_bytes();
        let t = Instant::now();
        let (_, answer) = conn.call("POST", "/filter", body).await?;
        preempt.push(t.elapsed().as_secs_f64() * 1000.0);
        if String::from_utf8_lossy(&answer).contains("preempting pods of lower priority") {
            nominated += 1;
        }
    }
    let rss = peak_rss_mib(pid);
    // Server-side mean time per verb, from its own histogram, to tell server time from driver time.
    let (_, metrics) = conn.call("GET", "/metrics", vec![]).await?;
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    let sample = |name: &str, verb: &str| {
        let key = format!("{name}{{verb=\"{verb}\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
    };
    let server_mean_ms = |verb: &str| {
        let count = sample("nano_gpu_decision_seconds_count", verb);
        if count > 0.0 { sample("nano_gpu_decision_seconds_sum", verb) / count * 1000.0 } else { 0.0 }
    };
    let bind_writes = served.api.writes().len();
    drop(served);
    let round = |v: f64| (v * 1000.0).round() / 1000.0;
    let mut line = json!({
        "nodes": a.nodes, "cards_per_node": a.cards, "placed_pods": a.placed, "new_pods": a.pods,
        "filter_max_ms": round(filter.iter().copied().fold(0.0, f64::max)),
        "filter_p99_ms": round(p99(filter)), "prioritize_p99_ms": round(p99(prioritize)), "bind_p99_ms": round(p99(bind)),
        "pods_per_s": round(a.pods as f64 / wall), "rss_mib": round(rss), "failed": failed,
        "allocator_cpu_s_per_1000_pods": round(cpu_s * 1000.0 / a.pods.max(1) as f64),
        "ready_s": round(ready_s), "bind_writes": bind_writes,
        "server_mean_ms": {"filter": round(server_mean_ms("filter")), "prioritize": round(server_mean_ms("prioritize")),
            "bind": round(server_mean_ms("bind"))},
    });
    if let Some(n) = a.shapes {
        line["shapes"] = json!(n);
    }
    if a.preemptors > 0 {
        let max = preempt.iter().copied().fold(0.0, f64::max);
        line["preempt"] = json!({"pods": a.preemptors, "found_victims": nominated,
            "filter_p50_ms": round(nano_gpu_tests::quantile(preempt, 0.5)), "filter_max_ms": round(max)});
    }
    if let Some(every) = a.scrape_ms {
        let reads: serde_json::Map<String, Value> = a
            .scrape
            .iter()
            .zip(&scraped)
            .map(|(path, (latencies, bytes))| {
                let read = json!({"reads": latencies.len(), "p99_ms": round(p99(latencies.clone())), "bytes": bytes});
                (path.clone(), read)
            })
            .collect();
        line["scrape"] = json!({"every_ms": every, "paths": reads});
    }
    println!("{line}");
    Ok(())
}
