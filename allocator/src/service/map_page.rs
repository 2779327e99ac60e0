//! The GPU map: a page (`GET /map`, its script `/map/app.js`, both compiled into the binary, nothing
//! fetched from elsewhere) that draws every node's cards as bars filled by the pods on them, each
//! node's fragmentation and the GPU pods waiting with their reasons, live: the page asks
//! `/map/data` every 2 s, answered `304 Not Modified` while the view's generation is unchanged.
//!
//! It is served on the extender's loopback listener only, beside `/inspect`: it names pods, so
//! whoever sees it must be allowed to (`kubectl port-forward` to the allocator pod, which the API
//! server authorizes), as operators reach a dashboard.

use crate::state::{ClusterState, MapDoc};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::OnceLock;

/// The oldest waiting pods the map lists with their reasons (each is judged against every node).
pub const WAITING_SHOWN: usize = 200;

const PAGE: &str = include_str!("../../assets/map/index.html");
const SCRIPT: &str = include_str!("../../assets/map/app.js");

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

/// What `GET /map/data` answers, taken from the view under its lock; written out by
/// [`Data::respond`] once the lock is let go (at 5,000 nodes the document is megabytes of JSON).
pub enum Data {
    /// The caller has this generation (the ETag) already.
    Unchanged(String),
    /// The map's document ([`ClusterState::map`]) and the view's generation as its ETag.
    Doc(String, Box<MapDoc>),
}

/// `GET /map/data` over `view`: `304` when the caller has its generation already (`if_none_match`).
pub fn data(view: &mut ClusterState, if_none_match: Option<&HeaderValue>) -> Data {
    let etag = etag(view.generation());
    if if_none_match.is_some_and(|v| v.as_bytes() == etag.as_bytes()) {
        return Data::Unchanged(etag);
    }
    Data::Doc(etag, Box::new(view.map(WAITING_SHOWN)))
}

impl Data {
    /// The HTTP answer.
    pub fn respond(self) -> Response {
        match self {
            Data::Unchanged(etag) => (StatusCode::NOT_MODIFIED, [(header::ETAG, etag)]).into_response(),
            Data::Doc(etag, doc) => match serde_json::to_vec(&doc) {
                Ok(body) => {
                    ([(header::CONTENT_TYPE, "application/json".to_owned()), (header::ETAG, etag)], body)
                        .into_response()
                }
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
            },
        }
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
