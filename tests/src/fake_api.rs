//! A fake Kubernetes API server on loopback, just enough for `nano-gpu-allocator serve` and the agent:
//! lists of Nodes and Pods, in pages or (with [`Objects::streams`], as an API server of 1.35 does)
//! streamed as a watch's first events (their watches then stay open and quiet), reading a pod, the assignment PATCH,
//! the `pods/binding` POST, the Node PATCH and Events. Every write is recorded so tests can check what was sent.
//!
//! For benchmarks and service tests only; end-to-end tests use the real kube-apiserver.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// The objects the fake serves.
#[derive(Default)]
pub struct Objects {
    /// Node objects.
    pub nodes: Vec<Value>,
    /// Pod objects.
    pub pods: Vec<Value>,
    /// Whether it answers as an API server of 1.35 (`/version`), which streams a watch's initial
    /// list (`sendInitialEvents`); else it has no version, and a client lists in pages.
    pub streams: bool,
}

impl Objects {
    /// A synthetic cluster for the benchmarks: `nodes` Nodes (`node-00000`, ...) of `cards` A100-80GB
    /// cards each, as their agents publish them, and `placed` Running pods in namespace `bench`
    /// placed round-robin over the nodes and their cards, pod `i` holding `percent(i)` of its card.
    pub fn synthetic(nodes: usize, cards: usize, placed: usize, percent: impl Fn(usize) -> u32) -> Objects {
        let node_objects = (0..nodes)
            .map(|n| {
                let gpus: Vec<Value> = (0..cards)
                    .map(|i| {
                        json!({"index": i, "uuid": format!("GPU-{n:05}-{i}"), "vendor": "nvidia",
                        "model": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920, "healthy": true})
                    })
                    .collect();
                json!({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": format!("node-{n:05}"), "resourceVersion": "1",
                        "annotations": {"nano-gpu/gpus": json!({"v": 1, "gpus": gpus}).to_string()}},
                    "status": {"allocatable": {"cpu": "128", "memory": "1Ti",
                        "nano-gpu/gpu-percent": (cards * 100).to_string()}}})
            })
            .collect();
        let pods = (0..placed)
            .map(|i| {
                let (n, card) = (i % nodes, (i / nodes) % cards);
                let percent = percent(i);
                let assignment = json!({"v": 1, "node": format!("node-{n:05}"), "at": "2026-11-21T00:00:00Z",
                    "containers": {"main": [{"uuid": format!("GPU-{n:05}-{card}"), "index": card, "percent": percent}]}});
                json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": format!("placed-{i}"), "namespace": "bench", "uid": format!("placed-{i}"),
                        "resourceVersion": "1", "annotations": {"nano-gpu/assignment": assignment.to_string()}},
                    "spec": {"nodeName": format!("node-{n:05}"), "containers": [{"name": "main", "resources":
                        {"limits": {"nano-gpu/gpu-percent": percent.to_string(), "cpu": "1", "memory": "4Gi"}}}]},
                    "status": {"phase": "Running"}})
            })
            .collect();
        Objects { nodes: node_objects, pods, streams: false }
    }
}

struct Inner {
    nodes: Vec<Value>,
    pods: Vec<Value>,
    streams: bool,
    by_name: HashMap<(String, String), Value>,
    writes: Mutex<Vec<(String, String, Value)>>,
}

/// A running fake API server.
pub struct FakeApi {
    /// Where it listens.
    pub addr: SocketAddr,
    inner: Arc<Inner>,
}

impl FakeApi {
    /// Starts serving `objects` on 127.0.0.1 (an ephemeral port), on the current tokio runtime.
    pub async fn start(objects: Objects) -> std::io::Result<FakeApi> {
        let by_name = objects
            .pods
            .iter()
            .map(|p| {
                let key = (
                    p["metadata"]["namespace"].as_str().unwrap_or("").to_owned(),
                    p["metadata"]["name"].as_str().unwrap_or("").to_owned(),
                );
                (key, p.clone())
            })
            .collect();
        let inner = Arc::new(Inner {
            nodes: objects.nodes,
            pods: objects.pods,
            streams: objects.streams,
            by_name,
            writes: Mutex::new(Vec::new()),
        });
        let app = Router::new().fallback(handle).with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(FakeApi { addr, inner })
    }

    /// A kubeconfig pointing at this server.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\nusers:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\n",
            self.addr
        )
    }

    /// Every write so far: (method, path, body).
    pub fn writes(&self) -> Vec<(String, String, Value)> {
        self.inner.writes.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "status": if code < 300 { "Success" } else { "Failure" },
        "reason": reason, "message": message, "code": code});
    (StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), axum::Json(body))
        .into_response()
}

async fn handle(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let watch = query.get("watch").is_some_and(|v| v == "true" || v == "1");
    let body = axum::body::to_bytes(req.into_body(), 64 << 20).await.unwrap_or_default();
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (items, list_kind) =
        if parts.last() == Some(&"nodes") { (&inner.nodes, "NodeList") } else { (&inner.pods, "PodList") };
    match (&method, parts.as_slice()) {
        (&Method::GET, ["version"]) if inner.streams => axum::Json(json!({
            "major": "1", "minor": "35", "gitVersion": "v1.35.0", "gitCommit": "", "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go", "compiler": "gc", "platform": "linux/amd64"}))
        .into_response(),
        (&Method::GET, ["api", "v1", "nodes" | "pods"])
            if watch && inner.streams && query.get("sendInitialEvents").is_some_and(|v| v == "true") =>
        {
            // The list as the watch's first events, one object at a time, then the bookmark that
            // ends it; then quiet.
            let kind = list_kind.trim_end_matches("List");
            let mut lines: Vec<Result<Bytes, std::io::Error>> = items
                .iter()
                .map(|item| Ok(Bytes::from(format!("{}\n", json!({"type": "ADDED", "object": item})))))
                .collect();
            let end = json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": "v1",
                "metadata": {"resourceVersion": "1", "annotations": {"k8s.io/initial-events-end": "true"}}}});
            lines.push(Ok(Bytes::from(format!("{end}\n"))));
            let stream = futures::StreamExt::chain(futures::stream::iter(lines), futures::stream::pending());
            Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(stream))
                .unwrap_or_default()
        }
        (&Method::GET, ["api", "v1", "nodes" | "pods"]) => {
            if watch {
                // A quiet watch: stays open, never sends an event.
                let pending = futures::stream::pending::<Result<Bytes, std::io::Error>>();
                return Response::builder()
                    .header("content-type", "application/json")
                    .body(Body::from_stream(pending))
                    .unwrap_or_default();
            }
            // Paged like the real API server: `limit` items from the `continue` offset.
            let from: usize = query.get("continue").and_then(|c| c.parse().ok()).unwrap_or(0);
            let limit: usize =
                query.get("limit").and_then(|l| l.parse().ok()).filter(|l| *l > 0).unwrap_or(usize::MAX);
            let to = from.saturating_add(limit).min(items.len());
            let mut meta = json!({"resourceVersion": "1"});
            if to < items.len() {
                meta["continue"] = to.to_string().into();
            }
            let page = items.get(from..to).unwrap_or_default();
            axum::Json(json!({"kind": list_kind, "apiVersion": "v1", "metadata": meta, "items": page}))
                .into_response()
        }
        (&Method::GET, ["api", "v1", "namespaces", ns, "pods", name]) => {
            match inner.by_name.get(&(ns.to_string(), name.to_string())) {
                Some(p) => axum::Json(p.clone()).into_response(),
                None => status(404, "NotFound", &format!("pods \"{name}\" not found")),
            }
        }
        (&Method::PATCH, ["api", "v1", "namespaces", ns, "pods", name])
        | (&Method::POST, ["api", "v1", "namespaces", ns, "pods", name, "binding"]) => {
            let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            inner.writes.lock().unwrap_or_else(|e| e.into_inner()).push((
                method.to_string(),
                path.clone(),
                value,
            ));
            if parts.len() == 7 {
                return status(201, "", "");
            }
            let pod = inner.by_name.get(&(ns.to_string(), name.to_string())).cloned().unwrap_or_else(
                || json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}}),
            );
            axum::Json(pod).into_response()
        }
        (&Method::PATCH, ["api", "v1", "nodes", name]) => {
            let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            inner.writes.lock().unwrap_or_else(|e| e.into_inner()).push((
                method.to_string(),
                path.clone(),
                value,
            ));
            let node = inner.nodes.iter().find(|n| n["metadata"]["name"] == *name).cloned();
            axum::Json(
                node.unwrap_or_else(
                    || json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}),
                ),
            )
            .into_response()
        }
        (&Method::POST, ["apis", "events.k8s.io", "v1", "namespaces", _, "events"]) => {
            let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            inner.writes.lock().unwrap_or_else(|e| e.into_inner()).push((
                method.to_string(),
                path.clone(),
                value.clone(),
            ));
            (StatusCode::CREATED, axum::Json(value)).into_response()
        }
        _ => status(404, "NotFound", &format!("{method} {path} is not served by the fake API server")),
    }
}

/// The real `nano-gpu-allocator serve` on a loopback port against a [`FakeApi`], once ready (its
/// watches listed every node and pod); killed, and its directory removed, when dropped.
pub struct ServedAllocator {
    /// The fake API server it watches.
    pub api: FakeApi,
    /// Its process.
    pub server: crate::Killed,
    /// Where its extender listens (`127.0.0.1:<port>`).
    pub addr: String,
    /// Where it serves `/inspect` and the GPU map (`--operator-listen`).
    pub operator_addr: String,
    /// Seconds from its start to ready.
    pub ready_s: f64,
    dir: std::path::PathBuf,
}

impl ServedAllocator {
    /// Starts `allocator` against a fake API server holding `objects`; waits up to `limit` for it to
    /// be ready, returning a connection to it.
    pub async fn start(
        allocator: &std::path::Path,
        objects: Objects,
        limit: std::time::Duration,
    ) -> anyhow::Result<(ServedAllocator, crate::http_client::Conn)> {
        use anyhow::Context;
        if !allocator.exists() {
            anyhow::bail!(
                "{} not found: build it first (cargo build --release -p nano-gpu-allocator)",
                allocator.display()
            );
        }
        let api = FakeApi::start(objects).await?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = std::env::temp_dir().join(format!("nano-gpu-bench-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig())?;
        let addr = format!("127.0.0.1:{port}");
        let operators = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let operator_addr = format!("127.0.0.1:{operators}");
        let child = std::process::Command::new(allocator)
            .args(["serve", "--listen", &addr, "--operator-listen", &operator_addr])
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", allocator.display()))?;
        let server = crate::Killed(child);
        let started = std::time::Instant::now();
        let conn = loop {
            if started.elapsed() > limit {
                anyhow::bail!("the allocator was not ready within {limit:?}");
            }
            if let Ok(mut c) = crate::http_client::Conn::open(&addr).await
                && matches!(c.call("GET", "/readyz", vec![]).await, Ok((200, _)))
            {
                break c;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        };
        let ready_s = started.elapsed().as_secs_f64();
        Ok((ServedAllocator { api, server, addr, operator_addr, ready_s, dir }, conn))
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.server.0.id()
    }
}

impl Drop for ServedAllocator {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
