//! The GPU map: a page (`GET /map`, its script `/map/app.js`, both compiled into the binary, nothing
//! fetched from elsewhere) that draws every node's cards as bars filled by the pods on them, each
//! node's fragmentation and the GPU pods waiting with their reasons, live: the page asks
//! `/map/data` every 2 s, answered `304 Not Modified` while the view's generation is unchanged.
//!
//! It is served on the extender's loopback listener only, beside `/inspect`: it names pods, so
//! whoever sees it must be allowed to (`kubectl port-forward` to the allocator pod, which the API
//! server authorizes), as operators reach a dashboard.

use crate::binder::Binder;
use crate::server::Shared;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::{Arc, OnceLock};

/// The oldest waiting pods the map lists with their reasons (each is judged against every node).
pub const WAITING_SHOWN: usize = 200;

const PAGE: &str = include_str!("../assets/map/index.html");
const SCRIPT: &str = include_str!("../assets/map/app.js");

/// `GET /map`.
pub async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")], PAGE)
        .into_response()
}

/// `GET /map/app.js`.
pub async fn script() -> Response {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")], SCRIPT)
        .into_response()
}

/// `GET /map/data`: the map's document ([`crate::state::ClusterState::map`]) with the view's
/// generation as its ETag; `304` when the caller has that generation already.
pub async fn data<B: Binder>(State(s): State<Arc<Shared<B>>>, headers: HeaderMap) -> Response {
    let mut view = s.state();
    let etag = etag(view.generation());
    if headers.get(header::IF_NONE_MATCH).is_some_and(|v| v.as_bytes() == etag.as_bytes()) {
        return (StatusCode::NOT_MODIFIED, [(header::ETAG, etag)]).into_response();
    }
    let doc = view.map(WAITING_SHOWN);
    drop(view);
    match serde_json::to_vec(&doc) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json".to_owned()), (header::ETAG, etag)], body)
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// A generation as an ETag, unique to this process (a restarted replica counts from 0 again).
fn etag(generation: u64) -> String {
    static BOOT: OnceLock<u128> = OnceLock::new();
    let boot = BOOT.get_or_init(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
    });
    format!("\"{boot:x}-{generation}\"")
}
