//! `serve --prometheus-url`: real load as the last tie rule ([`nano_gpu_engine::load`]). Off the
//! request path, every `--load-refresh-seconds` the allocator asks Prometheus for each card's
//! utilisation over the last minute (the agents' `nano_gpu_card_utilization_percent`) and hands the
//! reading to the engine. A reading older than `--load-stale-seconds` (Prometheus absent, slow,
//! failing) is dropped: placement is then exactly the policy's.

use crate::state::SharedView;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use nano_gpu_engine::load::Load;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Each card's mean utilisation over the last minute, by UUID.
pub const QUERY: &str = "avg by (uuid) (avg_over_time(nano_gpu_card_utilization_percent[1m]))";

/// How long one query may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The cards of a Prometheus instant-query answer (`/api/v1/query`) by their `uuid` label.
pub fn parse(body: &[u8]) -> Result<HashMap<String, f64>, String> {
    let answer: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    if answer["status"] != "success" {
        return Err(format!("Prometheus answered {}", answer["error"]));
    }
    let mut by_uuid = HashMap::new();
    for sample in answer["data"]["result"].as_array().into_iter().flatten() {
        let uuid = sample["metric"]["uuid"].as_str();
        let value = sample["value"][1].as_str().and_then(|v| v.parse::<f64>().ok());
        if let (Some(uuid), Some(v)) = (uuid, value.filter(|v| v.is_finite())) {
            by_uuid.insert(uuid.to_owned(), v);
        }
    }
    Ok(by_uuid)
}

/// The HTTP client the reading takes.
type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// One reading from Prometheus at `base` (`http://host:port`, a path prefix allowed), given up
/// after `limit`.
async fn read(client: &HttpClient, base: &str, limit: Duration) -> Result<HashMap<String, f64>, String> {
    let query: String = url_encode(QUERY);
    let uri: http::Uri = format!("{}/api/v1/query?query={query}", base.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("--prometheus-url {base}: {e}"))?;
    let answer = tokio::time::timeout(limit, async {
        let response = client.get(uri).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let body = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        if !status.is_success() {
            return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
        }
        Ok(body)
    })
    .await
    .map_err(|_| format!("no answer within {} ms", limit.as_millis()))??;
    parse(&answer)
}

/// Percent-encodes everything but unreserved characters (RFC 3986).
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Keeps the engine's load reading fresh from Prometheus at `base`, every `every`; drops it once the
/// last good reading is older than `stale`, also while a query hangs (a query is given up when the
/// reading in use turns stale). Runs until the process ends.
pub async fn follow(base: String, view: Arc<SharedView>, every: Duration, stale: Duration) {
    let client = Client::builder(TokioExecutor::new()).build_http();
    let mut last_ok: Option<Instant> = None;
    let mut failing = false;
    loop {
        // While a reading is in use, the query may last until it turns stale; after, TIMEOUT.
        let limit = match last_ok.map(|t| (t + stale).saturating_duration_since(Instant::now())) {
            Some(left) if !left.is_zero() => TIMEOUT.min(left),
            _ => TIMEOUT,
        };
        match read(&client, &base, limit).await {
            Ok(by_uuid) => {
                if failing || last_ok.is_none() {
                    tracing::info!(cards = by_uuid.len(), prometheus = %base, "card load read: equal placements go to the less busy cards");
                }
                failing = false;
                last_ok = Some(Instant::now());
                view.lock().set_load(Some(Load::new(by_uuid)));
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, prometheus = %base, "card load not read; kept for {} s at most", stale.as_secs());
                }
                failing = true;
                if last_ok.is_none_or(|t| t.elapsed() >= stale) {
                    view.lock().set_load(None);
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_gives_each_card_its_load_and_a_refusal_an_error() {
        let body = br#"{"status":"success","data":{"resultType":"vector","result":[
            {"metric":{"uuid":"GPU-a"},"value":[1.7e9,"90"]},
            {"metric":{"uuid":"GPU-b"},"value":[1.7e9,"0"]},
            {"metric":{},"value":[1.7e9,"5"]},
            {"metric":{"uuid":"GPU-c"},"value":[1.7e9,"NaN"]}]}}"#;
        let by_uuid = parse(body).unwrap();
        assert_eq!(by_uuid.len(), 2);
        assert_eq!((by_uuid["GPU-a"], by_uuid["GPU-b"]), (90.0, 0.0));
        assert!(parse(br#"{"status":"error","error":"bad query"}"#).unwrap_err().contains("bad query"));
        assert!(parse(b"<html>").unwrap_err().contains("not JSON"));
    }

    /// What the stand-in Prometheus does with a query.
    #[derive(Clone, Copy, PartialEq)]
    enum Answer {
        Reading,
        Refusal,
        Hang,
    }

    /// A Prometheus over a real socket that answers as `mode` says (one card, `GPU-a`, at 90 %).
    async fn prometheus(mode: Arc<std::sync::Mutex<Answer>>) -> (String, tokio::task::JoinHandle<()>) {
        use axum::http::StatusCode;
        let app = axum::Router::new().route(
            "/api/v1/query",
            axum::routing::get(move || {
                let mode = *mode.lock().unwrap();
                async move {
                    match mode {
                        Answer::Reading => (
                            StatusCode::OK,
                            r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{"uuid":"GPU-a"},"value":[1.7e9,"90"]}]}}"#,
                        ),
                        Answer::Refusal => (StatusCode::SERVICE_UNAVAILABLE, "overloaded"),
                        Answer::Hang => std::future::pending().await,
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        (base, tokio::spawn(async move { axum::serve(listener, app).await.unwrap() }))
    }

    /// Waits (up to `limit`) until the view's reading covers `cards` cards; how long it took.
    async fn covers(view: &SharedView, cards: usize, limit: Duration) -> Duration {
        let start = Instant::now();
        while view.lock().load_cards() != cards {
            assert!(
                start.elapsed() < limit,
                "the reading covers {} cards, not {cards}",
                view.lock().load_cards()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        start.elapsed()
    }

    #[tokio::test]
    async fn a_slow_failing_or_absent_prometheus_leaves_the_policy_alone_once_the_reading_is_stale() {
        let engine = nano_gpu_engine::engine::Engine::new(
            nano_gpu_engine::model::Cluster::new(),
            nano_gpu_engine::policy::by_name("fgd", 0).unwrap(),
            nano_gpu_engine::workload::Workload::default(),
        );
        let view = Arc::new(SharedView::new(crate::state::ClusterState::new(engine, 0, Default::default())));
        let mode = Arc::new(std::sync::Mutex::new(Answer::Reading));
        let (base, server) = prometheus(mode.clone()).await;
        let stale = Duration::from_millis(300);
        let following = tokio::spawn(follow(base, view.clone(), Duration::from_millis(20), stale));
        covers(&view, 1, Duration::from_secs(10)).await;
        // Hung queries: the reading is dropped when it turns stale, not when the hung query ends
        // (TIMEOUT, 5 s, later).
        *mode.lock().unwrap() = Answer::Hang;
        let dropped = covers(&view, 0, Duration::from_secs(10)).await;
        assert!(dropped < TIMEOUT - Duration::from_secs(1), "dropped after {dropped:?}");
        *mode.lock().unwrap() = Answer::Reading;
        covers(&view, 1, Duration::from_secs(10)).await;
        // Refused queries: kept while fresh, then dropped.
        *mode.lock().unwrap() = Answer::Refusal;
        assert!(covers(&view, 0, Duration::from_secs(10)).await >= stale - Duration::from_millis(50));
        *mode.lock().unwrap() = Answer::Reading;
        covers(&view, 1, Duration::from_secs(10)).await;
        following.abort();
        server.abort();
        // No Prometheus at the address (connections refused): a reading held is dropped.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        view.lock().set_load(Some(Load::new(HashMap::from([("GPU-a".to_owned(), 90.0)]))));
        tokio::spawn(follow(base, view.clone(), Duration::from_millis(20), stale));
        covers(&view, 0, Duration::from_secs(10)).await;
    }

    #[test]
    fn the_query_is_percent_encoded() {
        assert_eq!(url_encode("avg by (uuid) (x[1m])"), "avg%20by%20%28uuid%29%20%28x%5B1m%5D%29");
    }
}
