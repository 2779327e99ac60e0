//! One keep-alive HTTP/1.1 connection, as kube-scheduler holds to its extender.

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// A connection to one server.
pub struct Conn {
    send: SendRequest<Full<Bytes>>,
    host: String,
}

impl Conn {
    /// Connects to `addr` (`127.0.0.1:8888`).
    pub async fn open(addr: &str) -> anyhow::Result<Conn> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(Conn { send, host: addr.to_owned() })
    }

    /// Sends one request and returns the status and body.
    pub async fn call(&mut self, method: &str, path: &str, body: Vec<u8>) -> anyhow::Result<(u16, Vec<u8>)> {
        self.send.ready().await?;
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.host)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let resp = self.send.send_request(req).await?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes.to_vec()))
    }
}
