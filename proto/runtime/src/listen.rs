//! HTTP listeners whose every connection is bounded: in number (all peers together, and one peer
//! alone), in time (its handshake, each request, and how long it may sit idle) and in memory (the
//! head of a request, HTTP/2's streams). Any pod can reach some of these ports, and a port held
//! open without bounds takes the process with it: connections that never send a byte, or send a
//! request's head one byte a minute, each cost a task and a buffer until the process runs out of
//! file descriptors, and then the accept loop fails.
//!
//! [`serve`] runs one listener: it closes a new connection at once from an address that already
//! holds [`Bounds::per_peer`]; when [`Bounds::connections`] are open, it makes room for a new one by
//! closing the oldest connection of the address that holds the most (so a few addresses that fill
//! the port cannot keep out the kubelet's probes or the API server); it gives the `upgrade` (TLS,
//! or nothing) [`Bounds::handshake`] to finish, each request [`Bounds::request`] from its head to
//! its answer (408 past it), and closes a connection that has read nothing for [`Bounds::idle`]. An
//! accept that fails for want of a resource (file descriptors, memory) is tried again after a pause
//! that doubles up to a second, instead of at once (which spins a core).

use axum::Router;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio_util::task::TaskTracker;

/// What one listener allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Connections open at once; past it, the oldest connection of the address that holds the most
    /// is closed for the new one.
    pub connections: usize,
    /// Connections open at once from one IP address; past it, a new one is closed at once. `None`
    /// on loopback, where every peer is the same address.
    pub per_peer: Option<usize>,
    /// Time for the connection's handshake (TLS), from its accept.
    pub handshake: Duration,
    /// A connection that has read nothing for this long is closed (HTTP/1 also between requests and
    /// while a request's head comes in). Longer than clients keep an idle connection (Go's 90 s), so
    /// a client does not send a request on a connection just as it closes.
    pub idle: Duration,
    /// Time for one request, from its head to its answer (the body read, the handler done); past it
    /// the answer is 408.
    pub request: Duration,
}

impl Bounds {
    /// A port any pod may reach (the webhook's, the probes' and metrics'): 32 connections a peer.
    pub const REACHABLE: Bounds = Bounds {
        connections: 256,
        per_peer: Some(32),
        handshake: Duration::from_secs(10),
        idle: Duration::from_secs(120),
        request: Duration::from_secs(30),
    };

    /// A port on the pod's loopback (kube-scheduler's, an operator's `kubectl port-forward`).
    pub const LOOPBACK: Bounds = Bounds { connections: 512, per_peer: None, ..Bounds::REACHABLE };
}

/// The largest head of an HTTP/1 request, and of an HTTP/2 header list.
const MAX_HEAD: usize = 64 * 1024;
/// HTTP/2 requests open at once on one connection.
const MAX_STREAMS: u32 = 32;
/// The first and the longest pause after an accept that failed for want of a resource.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(5), Duration::from_secs(1));
/// At most one warning this often about a peer past its cap, or a port at its.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// How long a new connection waits for the one closed to make room for it.
const EVICT_WAIT: Duration = Duration::from_secs(1);

/// Serves `router` on `listener` within `bounds` until `shutdown` resolves; then accepts no more,
/// asks every open connection to close after its requests in flight, and returns when all have
/// (each within [`Bounds::request`] of the shutdown). `upgrade` turns an accepted stream into the
/// one HTTP is spoken on (a TLS handshake), or `None` to drop it; `name` goes in the logs.
pub async fn serve<U, F, IO>(
    name: &'static str,
    listener: TcpListener,
    router: Router,
    bounds: Bounds,
    upgrade: U,
    shutdown: impl Future<Output = ()>,
) where
    U: Fn(TcpStream, SocketAddr) -> F,
    F: Future<Output = Option<IO>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let request = bounds.request;
    let router = router.layer(axum::middleware::from_fn(move |req: Request, next: Next| async move {
        within(request, req, next).await
    }));
    let open = Arc::new(Open::default());
    let tracker = TaskTracker::new();
    let (closing, closed) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    let mut backoff = Duration::ZERO;
    let mut warned: Option<Instant> = None;
    let mut warn = |what: &str, peer: SocketAddr| {
        if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
            warned = Some(Instant::now());
            tracing::warn!(listener = name, %peer, "{what}");
        }
    };
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => {
                backoff = Duration::ZERO;
                a
            }
            // The peer gave up before its accept: nothing is short, take the next.
            Err(e) if per_connection(&e) => continue,
            Err(e) => {
                backoff = next_backoff(backoff);
                tracing::warn!(listener = name, error = %e, retry_in = ?backoff, "accepting a connection failed");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => continue,
                    () = &mut shutdown => break,
                }
            }
        };
        let slot = loop {
            match Open::admit(&open, peer.ip(), &bounds) {
                Ok(slot) => break Some(slot),
                Err(Full::Peer) => {
                    warn("a peer holds its most connections: closing its new ones", peer);
                    break None;
                }
                Err(Full::Port) => {
                    warn(
                        "the port holds its most connections: closing the oldest of the address that holds the most",
                        peer,
                    );
                    let freed = open.freed.notified();
                    let mut freed = pin!(freed);
                    freed.as_mut().enable();
                    open.evict();
                    if tokio::time::timeout(EVICT_WAIT, freed).await.is_err() {
                        break None;
                    }
                }
            }
        };
        let Some(slot) = slot else { continue };
        let handshake = upgrade(stream, peer);
        let (router, closed) = (router.clone(), closed.clone());
        tracker.spawn(async move {
            let evicted = slot.evicted.clone();
            let _held = slot;
            let io = tokio::select! {
                done = tokio::time::timeout(bounds.handshake, handshake) => match done {
                    Ok(Some(io)) => io,
                    Ok(None) => return,
                    Err(_) => {
                        tracing::debug!(listener = name, %peer, "handshake not done in time: closed");
                        return;
                    }
                },
                () = evicted.notified() => return,
            };
            connection(name, peer, io, router, bounds, closed, &evicted).await;
        });
    }
    drop(listener);
    let _ = closing.send(true);
    tracker.close();
    tracker.wait().await;
}

/// [`serve`] of plain HTTP.
pub async fn serve_plain(
    name: &'static str,
    listener: TcpListener,
    router: Router,
    bounds: Bounds,
    shutdown: impl Future<Output = ()>,
) {
    serve(name, listener, router, bounds, |stream, _| async move { Some(stream) }, shutdown).await
}

/// One connection's HTTP, until it ends, goes idle for [`Bounds::idle`], or the listener closes (then
/// its requests in flight get [`Bounds::request`] to finish).
async fn connection<IO>(
    name: &'static str,
    peer: SocketAddr,
    io: IO,
    router: Router,
    bounds: Bounds,
    mut closed: watch::Receiver<bool>,
    evicted: &Notify,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let read = Arc::new(LastRead::new());
    let io = Watched { inner: io, read: read.clone() };
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(bounds.idle).max_buf_size(MAX_HEAD);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(MAX_HEAD as u32);
    let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(router));
    let mut conn = pin!(conn);
    // When it was asked to close: from then it has `bounds.request` to do so.
    let mut closing: Option<tokio::time::Instant> = None;
    loop {
        let idle_left = bounds.idle.saturating_sub(read.elapsed());
        let deadline = match closing {
            Some(at) => at + bounds.request,
            None => tokio::time::Instant::now() + idle_left,
        };
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(listener = name, %peer, error = %e, "connection ended with an error");
                }
                return;
            }
            () = evicted.notified() => {
                tracing::debug!(listener = name, %peer, "closed to make room for a newer connection");
                return;
            }
            changed = closed.changed(), if closing.is_none() => {
                // The listener closed (or its sender went): no more requests here.
                let _ = changed;
                conn.as_mut().graceful_shutdown();
                closing = Some(tokio::time::Instant::now());
            }
            () = tokio::time::sleep_until(deadline) => match closing {
                Some(_) => {
                    tracing::debug!(listener = name, %peer, "connection did not close in time: dropped");
                    return;
                }
                None if read.elapsed() >= bounds.idle => {
                    tracing::debug!(listener = name, %peer, "connection idle: closing");
                    conn.as_mut().graceful_shutdown();
                    closing = Some(tokio::time::Instant::now());
                }
                None => {}
            },
        }
    }
}

/// Runs the rest of the request's handling within `limit`, else answers 408.
async fn within(limit: Duration, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(answer) => answer,
        Err(_) => {
            let why = format!("the request was not read and answered within {} s\n", limit.as_secs());
            (http::StatusCode::REQUEST_TIMEOUT, why).into_response()
        }
    }
}

/// Whether an accept error is about the one connection (it is gone), not about the process.
fn per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
    )
}

/// The pause after an accept failed for want of a resource, given the last (zero after a success).
fn next_backoff(last: Duration) -> Duration {
    (last * 2).clamp(BACKOFF.0, BACKOFF.1)
}

/// The connections a listener holds, by address, each with a way to close it.
#[derive(Default)]
struct Open {
    held: Mutex<Held>,
    /// Woken when a connection closes.
    freed: Notify,
}

#[derive(Default)]
struct Held {
    /// The next connection's number: numbers grow, so the smallest is the oldest.
    next: u64,
    per_ip: HashMap<IpAddr, usize>,
    /// Each open connection's address, and what closes it.
    conns: HashMap<u64, (IpAddr, Arc<Notify>)>,
}

/// Why a connection was not admitted.
enum Full {
    /// Its address holds [`Bounds::per_peer`] already.
    Peer,
    /// The port holds [`Bounds::connections`].
    Port,
}

impl Open {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A slot for one more connection from `ip`, unless a cap of `bounds` is reached.
    fn admit(open: &Arc<Open>, ip: IpAddr, bounds: &Bounds) -> Result<Slot, Full> {
        let ip = ip.to_canonical();
        let mut held = open.held();
        let from_ip = held.per_ip.get(&ip).copied().unwrap_or(0);
        if bounds.per_peer.is_some_and(|cap| from_ip >= cap) {
            return Err(Full::Peer);
        }
        if held.conns.len() >= bounds.connections.max(1) {
            return Err(Full::Port);
        }
        let id = held.next;
        held.next += 1;
        let evicted = Arc::new(Notify::new());
        held.conns.insert(id, (ip, evicted.clone()));
        *held.per_ip.entry(ip).or_default() += 1;
        Ok(Slot { open: open.clone(), id, ip, evicted })
    }

    /// Closes the oldest connection of the address that holds the most.
    fn evict(&self) {
        let held = self.held();
        let victim = held
            .conns
            .iter()
            .max_by_key(|(id, (ip, _))| (held.per_ip.get(ip).copied().unwrap_or(0), std::cmp::Reverse(**id)));
        if let Some((_, (_, evicted))) = victim {
            evicted.notify_one();
        }
    }
}

/// One open connection; given back when dropped.
struct Slot {
    open: Arc<Open>,
    id: u64,
    ip: IpAddr,
    /// Notified to close the connection for a newer one.
    evicted: Arc<Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.open.held();
        held.conns.remove(&self.id);
        if let Some(n) = held.per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                held.per_ip.remove(&self.ip);
            }
        }
        drop(held);
        self.open.freed.notify_waiters();
    }
}

/// When a connection last read a byte.
struct LastRead {
    start: Instant,
    /// Milliseconds from `start`.
    at: AtomicU64,
}

impl LastRead {
    fn new() -> LastRead {
        LastRead { start: Instant::now(), at: AtomicU64::new(0) }
    }

    fn mark(&self) {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.at.store(now, Ordering::Relaxed);
    }

    fn elapsed(&self) -> Duration {
        self.start.elapsed().saturating_sub(Duration::from_millis(self.at.load(Ordering::Relaxed)))
    }
}

/// A stream that marks each read that brought bytes.
struct Watched<IO> {
    inner: IO,
    read: Arc<LastRead>,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.read.mark();
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Short bounds, so the tests take well under a second each.
    const SHORT: Bounds = Bounds {
        connections: 8,
        per_peer: Some(3),
        handshake: Duration::from_millis(300),
        idle: Duration::from_millis(400),
        request: Duration::from_millis(300),
    };

    fn app() -> Router {
        Router::new().route("/", get(|| async { "ok" })).route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                "late"
            }),
        )
    }

    /// A listener serving `app()` within `bounds`, its address, and the sender that shuts it down.
    async fn listening(
        bounds: Bounds,
    ) -> (SocketAddr, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve_plain("test", listener, app(), bounds, async move {
            let _ = stopped.await;
        }));
        (addr, stop, task)
    }

    /// Reads until the peer closes (or `limit` passes: then `None`).
    async fn read_to_close(stream: &mut TcpStream, limit: Duration) -> Option<String> {
        let mut out = Vec::new();
        tokio::time::timeout(limit, stream.read_to_end(&mut out)).await.ok()?.ok()?;
        Some(String::from_utf8_lossy(&out).into_owned())
    }

    async fn get_once(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let head = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(head.as_bytes()).await.unwrap();
        read_to_close(&mut s, Duration::from_secs(5)).await.expect("an answer")
    }

    #[tokio::test]
    async fn a_peer_past_its_cap_has_its_new_connections_closed_and_gets_them_back_as_its_others_close() {
        let (addr, _stop, _task) =
            listening(Bounds { idle: Duration::from_secs(30), handshake: Duration::from_secs(30), ..SHORT })
                .await;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        // The fourth is accepted by the kernel, then closed by the listener without a byte.
        let mut fourth = TcpStream::connect(addr).await.unwrap();
        assert_eq!(read_to_close(&mut fourth, Duration::from_secs(2)).await.as_deref(), Some(""));
        // The three it holds still work.
        let mut first = held.remove(0);
        first.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let answer = read_to_close(&mut first, Duration::from_secs(2)).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"), "{answer}");
        // One closed: room for one more (its slot is given back once the listener saw it close).
        let start = Instant::now();
        loop {
            let answer = get_once(addr, "/").await;
            if answer.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(2), "no slot came back: {answer:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn a_connection_that_sends_nothing_or_half_a_head_is_closed_once_idle() {
        let (addr, _stop, _task) = listening(SHORT).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost:").await.unwrap();
        let start = Instant::now();
        assert!(
            read_to_close(&mut silent, Duration::from_secs(3)).await.is_some(),
            "the silent one stayed open"
        );
        let half = read_to_close(&mut slow, Duration::from_secs(3)).await;
        assert!(half.is_some(), "the half head stayed open");
        assert!(
            start.elapsed() >= Duration::from_millis(300),
            "closed before its idle time: {:?}",
            start.elapsed()
        );
    }

    #[tokio::test]
    async fn a_kept_alive_connection_is_closed_once_idle_after_its_answer() {
        let (addr, _stop, _task) = listening(SHORT).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let answer = read_to_close(&mut s, Duration::from_secs(3)).await.expect("closed once idle");
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"), "{answer}");
    }

    #[tokio::test]
    async fn a_request_not_answered_in_time_gets_408() {
        let (addr, _stop, _task) = listening(SHORT).await;
        let answer = get_once(addr, "/slow").await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    }

    /// A connection to `addr` from the loopback address `from` (127.0.0.N: another peer).
    async fn connect_from(from: [u8; 4], addr: SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from((from, 0))).unwrap();
        socket.connect(addr).await.unwrap()
    }

    /// Whether the peer closed `stream` within 300 ms.
    async fn closed_soon(stream: &mut TcpStream) -> bool {
        read_to_close(stream, Duration::from_millis(300)).await.is_some()
    }

    #[tokio::test]
    async fn past_the_listeners_cap_the_oldest_connection_of_the_address_holding_most_makes_room() {
        let long = Duration::from_secs(30);
        let bounds = Bounds { connections: 3, per_peer: None, idle: long, handshake: long, ..SHORT };
        let (addr, _stop, _task) = listening(bounds).await;
        let mut a1 = connect_from([127, 0, 0, 2], addr).await;
        let mut a2 = connect_from([127, 0, 0, 2], addr).await;
        let mut b = connect_from([127, 0, 0, 3], addr).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        // A new peer gets its answer at once: a1 (the oldest of the address holding two) is closed.
        let mut c = connect_from([127, 0, 0, 4], addr).await;
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let answer = read_to_close(&mut c, Duration::from_secs(2)).await.expect("answered");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(closed_soon(&mut a1).await, "the oldest of the biggest holder stayed open");
        assert!(!closed_soon(&mut a2).await, "the newer of the biggest holder was closed");
        assert!(!closed_soon(&mut b).await, "the other peer's one connection was closed");
    }

    #[tokio::test]
    async fn shutdown_lets_the_request_in_flight_end_then_accepts_no_more() {
        let bounds = Bounds { request: Duration::from_secs(5), ..SHORT };
        let (addr, stop, task) = listening(bounds).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(()).unwrap();
        let answer = read_to_close(&mut s, Duration::from_secs(8)).await.expect("answered, then closed");
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("late"), "{answer}");
        tokio::time::timeout(Duration::from_secs(2), task).await.expect("serve returned").unwrap();
        assert!(TcpStream::connect(addr).await.is_err(), "still accepting after shutdown");
    }

    #[test]
    fn the_pause_after_a_failed_accept_doubles_up_to_a_second() {
        let mut pause = Duration::ZERO;
        let mut seen = Vec::new();
        for _ in 0..10 {
            pause = next_backoff(pause);
            seen.push(pause.as_millis());
        }
        assert_eq!(seen, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
    }

    #[test]
    fn only_errors_of_the_one_connection_are_taken_without_a_pause() {
        assert!(per_connection(&io::Error::from(io::ErrorKind::ConnectionAborted)));
        // EMFILE: the process is out of file descriptors.
        assert!(!per_connection(&io::Error::from_raw_os_error(24)));
    }
}
