//! Answers of a fake API server for the tower-test scenarios of the real kube adapters (binder,
//! leader election, the shared certificate): a JSON body with a status code, the `Status` object
//! the API server sends with an error, the JSON body of what a client sent, and a server that
//! answers and records every request.

use http::{Request, Response};
use kube::client::Body;
use serde_json::{Value, json};

/// `value` as the API server's answer with HTTP status `code`.
pub fn respond(code: u16, value: Value) -> Response<Body> {
    Response::builder().status(code).body(Body::from(serde_json::to_vec(&value).unwrap())).unwrap()
}

/// The JSON body of a request (Null when it has none or it is not JSON).
pub async fn body_json(req: Request<Body>) -> Value {
    let bytes = req.into_body().collect_bytes().await.unwrap();
    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
}

/// The API server's error answer: a `Status` with `reason` (`NotFound`, `AlreadyExists`, `Conflict`…).
pub fn failure(code: u16, reason: &str) -> Response<Body> {
    respond(
        code,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code}),
    )
}

/// The requests a [`recording`] server saw: path and JSON body, in order.
pub type Seen = Vec<(String, Value)>;

/// A fake API server on `handle`: answers each request with `answer(path, body, seen before it)`,
/// and once the client is gone returns every request it saw.
pub fn recording(
    mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
    answer: impl Fn(&str, &Value, &Seen) -> Response<Body> + Send + 'static,
) -> tokio::task::JoinHandle<Seen> {
    tokio::spawn(async move {
        let mut seen = Seen::new();
        while let Some((req, send)) = handle.next_request().await {
            let path = req.uri().path().to_owned();
            let body = body_json(req).await;
            send.send_response(answer(&path, &body, &seen));
            seen.push((path, body));
        }
        seen
    })
}
