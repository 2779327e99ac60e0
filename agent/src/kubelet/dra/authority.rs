//! An HTTP/2 front for the registration socket: the kubelet's plugin watcher dials it with grpc-go
//! given the bare socket path, so grpc-go sends that path as the request's `:authority`
//! (kubernetes/kubernetes#108254; the kubelet's device-plugin and DRA clients set `localhost`, its
//! plugin watcher does not, up to 1.37 at least). `h2`, under tonic, refuses such a request with
//! `PROTOCOL_ERROR` (hyperium/h2#487, open), so no tonic server can be registered as it comes.
//!
//! Each connection is relayed to the tonic server over an in-memory stream. From the client, the
//! connection preface and every frame go through unchanged except header blocks (HEADERS and its
//! CONTINUATIONs), which are decoded, given `:authority: localhost` in place of the one sent, and
//! encoded again as one HEADERS frame (without padding or priority). Answers go back unchanged.

use futures::Stream;
use loona_hpack::{Decoder, Encoder};
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::UnixListener;

/// The client's connection preface.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame a peer must accept without asking (SETTINGS_MAX_FRAME_SIZE's initial value).
const MAX_FRAME: usize = 16_384;
/// What a header block may grow to across its frames before the connection is dropped.
const MAX_BLOCK: usize = 1 << 20;

/// The connections accepted on `listener`, each already relayed through the front: what the server
/// reads as its incoming connections.
pub fn incoming(listener: UnixListener) -> impl Stream<Item = io::Result<DuplexStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let (client, _) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting on the registration socket");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (ours, server) = tokio::io::duplex(64 * 1024);
            if tx.send(Ok(server)).await.is_err() {
                return;
            }
            tokio::spawn(async move {
                if let Err(e) = relay(client, ours).await {
                    tracing::debug!(error = %e, "registration connection ended");
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Relays one connection: the client's frames rewritten as the module says, the server's as they are.
pub async fn relay<C>(client: C, server: DuplexStream) -> io::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let (mut from_server, mut to_server) = tokio::io::split(server);
    let back = tokio::spawn(async move {
        let copied = tokio::io::copy(&mut from_server, &mut to_client).await;
        let _ = to_client.shutdown().await;
        copied
    });
    let forth = async {
        let mut preface = [0u8; 24];
        from_client.read_exact(&mut preface).await?;
        if &preface != PREFACE {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not an HTTP/2 connection preface"));
        }
        to_server.write_all(&preface).await?;
        let mut front = Front::default();
        loop {
            let mut head = [0u8; 9];
            match from_client.read_exact(&mut head).await {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                other => other?,
            };
            let length = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; length];
            from_client.read_exact(&mut payload).await?;
            for frame in front.frame(head, payload)? {
                to_server.write_all(&frame).await?;
            }
        }
    };
    let result = forth.await;
    let _ = to_server.shutdown().await;
    drop(to_server);
    let _ = back.await;
    result
}

/// The client-to-server direction's state: the header block being gathered and the two HPACK
/// contexts (the client's encoder, mirrored by `decoder`; ours, mirrored by the server's decoder).
#[derive(Default)]
pub struct Front {
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    /// Stream, END_STREAM flag and the block so far, between a HEADERS without END_HEADERS and the
    /// CONTINUATION that ends it.
    open: Option<(u32, u8, Vec<u8>)>,
}

impl Front {
    /// What to send the server for one client frame (its 9-byte header and payload): the frame
    /// itself, nothing while a header block is incomplete, or the rewritten block.
    pub fn frame(&mut self, head: [u8; 9], payload: Vec<u8>) -> io::Result<Vec<Vec<u8>>> {
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_owned());
        match (kind, &mut self.open) {
            (HEADERS, None) => {
                let mut block = &payload[..];
                let mut pad = 0;
                if flags & PADDED != 0 {
                    pad =
                        usize::from(*block.first().ok_or_else(|| bad("padded HEADERS without its length"))?);
                    block = &block[1..];
                }
                if flags & PRIORITY != 0 {
                    block = block.get(5..).ok_or_else(|| bad("HEADERS shorter than its priority"))?;
                }
                let block =
                    block.get(..block.len().checked_sub(pad).ok_or_else(|| bad("padding over HEADERS"))?);
                let block = block.ok_or_else(|| bad("padding over HEADERS"))?.to_vec();
                if flags & END_HEADERS != 0 {
                    return Ok(vec![self.rewrite(stream, flags & END_STREAM, &block)?]);
                }
                self.open = Some((stream, flags & END_STREAM, block));
                Ok(Vec::new())
            }
            (CONTINUATION, Some((open, end_stream, block))) if *open == stream => {
                block.extend_from_slice(&payload);
                if block.len() > MAX_BLOCK {
                    return Err(bad("header block over 1 MiB"));
                }
                if flags & END_HEADERS == 0 {
                    return Ok(Vec::new());
                }
                let (end_stream, block) = (*end_stream, std::mem::take(block));
                self.open = None;
                Ok(vec![self.rewrite(stream, end_stream, &block)?])
            }
            (_, Some(_)) => Err(bad("a frame inside a header block")),
            (CONTINUATION, None) => Err(bad("CONTINUATION without HEADERS")),
            _ => {
                let mut frame = head.to_vec();
                frame.extend_from_slice(&payload);
                Ok(vec![frame])
            }
        }
    }

    /// The block with `:authority: localhost`, as one HEADERS frame of `stream`.
    fn rewrite(&mut self, stream: u32, end_stream: u8, block: &[u8]) -> io::Result<Vec<u8>> {
        let headers = self
            .decoder
            .decode(block)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("header block: {e}")))?;
        let fixed = headers.iter().map(|(name, value)| {
            if name.as_slice() == b":authority" {
                (&name[..], &b"localhost"[..])
            } else {
                (&name[..], &value[..])
            }
        });
        let encoded = self.encoder.encode(fixed);
        if encoded.len() > MAX_FRAME {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "header block over one frame"));
        }
        let length = encoded.len();
        let mut frame =
            vec![(length >> 16) as u8, (length >> 8) as u8, length as u8, HEADERS, END_HEADERS | end_stream];
        frame.extend_from_slice(&stream.to_be_bytes());
        frame.extend_from_slice(&encoded);
        Ok(frame)
    }
}
