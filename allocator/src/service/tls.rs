//! HTTPS for the webhook and the extender: mounted certificate files that are re-read when they
//! change, or one certificate shared by every replica through a Secret ([`secret`]), whose CA bundle
//! goes into the webhook configuration's `caBundle`. The extender's verbs over HTTPS (for a
//! kube-scheduler in another pod) also require a client certificate from a given CA
//! ([`ClientCa`], re-read when its file changes). When each of these certificates ends is kept for
//! `/metrics` ([`CertificateEnds`]).

pub mod secret;

use axum::Router;
use nano_gpu_runtime::listen::{self, Bounds};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::server::danger::ClientCertVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

/// A certificate problem.
#[derive(Debug, Error)]
pub enum TlsError {
    /// Generating a certificate failed.
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// The PEM files cannot be read or used.
    #[error("{0}")]
    Pem(String),
}

/// A serving certificate, its key, and the CA that signed it (all PEM).
#[derive(Clone, Debug)]
pub struct Generated {
    /// The CA certificate, for `caBundle`.
    pub ca_pem: String,
    /// The serving certificate.
    pub cert_pem: String,
    /// The serving key.
    pub key_pem: String,
}

/// The names the API server and kube-scheduler reach the Service `service` in `namespace` by: what
/// the webhook's serving certificate must name.
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![format!("{service}.{namespace}.svc"), format!("{service}.{namespace}.svc.cluster.local")]
}

/// A new CA and a serving certificate for `dns_names` signed by it; with `valid` (from, to), valid from
/// the start of the UTC day before `from` to [`utc_day_start`] of `to`, else without end.
pub fn generate(
    dns_names: &[String],
    valid: Option<(SystemTime, SystemTime)>,
) -> Result<Generated, TlsError> {
    let day = |t: SystemTime| {
        let (y, m, d) = utc_date(t);
        rcgen::date_time_ymd(y, m, d)
    };
    let validity = valid.map(|(from, to)| (day(from - std::time::Duration::from_secs(86_400)), day(to)));
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    if let Some((from, to)) = validity {
        (ca.not_before, ca.not_after) = (from, to);
    }
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "nano-gpu-allocator CA");
    ca.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let mut leaf = CertificateParams::new(dns_names.to_vec())?;
    if let Some((from, to)) = validity {
        (leaf.not_before, leaf.not_after) = (from, to);
    }
    leaf.distinguished_name.push(DnType::CommonName, dns_names.first().cloned().unwrap_or_default());
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;
    Ok(Generated { ca_pem: ca_cert.pem(), cert_pem: leaf_cert.pem(), key_pem: leaf_key.serialize_pem() })
}

/// The end (notAfter) of each certificate in `pem`, in order; an error when a block is not an X.509
/// certificate or there is none.
pub fn certificate_ends(pem: &[u8]) -> Result<Vec<SystemTime>, TlsError> {
    let mut ends = Vec::new();
    for der in CertificateDer::pem_slice_iter(pem) {
        let der = der.map_err(|e| TlsError::Pem(format!("certificate: {e}")))?;
        ends.push(der_end(&der)?);
    }
    if ends.is_empty() {
        return Err(TlsError::Pem("certificate: no CERTIFICATE block".into()));
    }
    Ok(ends)
}

/// The end (notAfter) of one DER certificate.
fn der_end(der: &[u8]) -> Result<SystemTime, TlsError> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|e| TlsError::Pem(format!("certificate: {e}")))?;
    let secs = cert.validity().not_after.timestamp();
    Ok(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(u64::try_from(secs).unwrap_or(0)))
}

/// Which certificate a [`CertificateEnds`] entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Certificate {
    /// The certificate the webhook (and the extender over HTTPS) serves.
    Serving,
    /// The soonest-ending CA of `--extender-client-ca` (the client certificates it signs should end
    /// before it; the allocator checks a client certificate's own dates, not its CA's).
    ExtenderClientCa,
    /// The client certificate kube-scheduler last presented to the extender over HTTPS.
    ExtenderClient,
}

impl Certificate {
    /// Its `certificate` label.
    pub fn label(self) -> &'static str {
        match self {
            Certificate::Serving => "serving",
            Certificate::ExtenderClientCa => "extender-client-ca",
            Certificate::ExtenderClient => "extender-client",
        }
    }
}

/// When each certificate the allocator serves or accepts ends, as last seen (for `/metrics`).
#[derive(Debug, Default)]
pub struct CertificateEnds(RwLock<BTreeMap<Certificate, SystemTime>>);

impl CertificateEnds {
    /// `which` ends at `end`.
    pub fn set(&self, which: Certificate, end: SystemTime) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).insert(which, end);
    }

    /// Every certificate seen, with its end.
    pub fn all(&self) -> Vec<(Certificate, SystemTime)> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).iter().map(|(c, t)| (*c, *t)).collect()
    }
}

/// The UTC calendar date of `t`.
fn utc_date(t: SystemTime) -> (i32, u8, u8) {
    use k8s_openapi::jiff::{Timestamp, tz::TimeZone};
    let date = Timestamp::try_from(t).unwrap_or(Timestamp::UNIX_EPOCH).to_zoned(TimeZone::UTC).date();
    (i32::from(date.year()), date.month() as u8, date.day() as u8)
}

/// The start (00:00 UTC) of the UTC day of `t`: where a certificate [`generate`]d to `t` ends.
pub fn utc_day_start(t: SystemTime) -> SystemTime {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs();
    SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs - secs % 86_400)
}

/// A rustls server configuration from PEM text.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem(format!("certificate: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::Pem("certificate: no CERTIFICATE block".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Pem(format!("key: {e}")))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Pem(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Pem(format!("certificate and key: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Where the serving certificate comes from.
pub enum CertSource {
    /// Served until [`CertSource::replace`]d (the shared certificate, by [`secret::keep`]).
    Shared(RwLock<Arc<ServerConfig>>),
    /// Mounted files, re-read when either changes.
    Files {
        /// Certificate chain (PEM).
        cert: PathBuf,
        /// Private key (PEM).
        key: PathBuf,
        /// The configuration in use and the modification times it was read at.
        current: RwLock<(Arc<ServerConfig>, Option<SystemTime>, Option<SystemTime>)>,
        /// Where the certificate's end is recorded.
        ends: Arc<CertificateEnds>,
    },
}

/// Records the end of the first (the serving) certificate of `pem`.
fn record_serving_end(ends: &CertificateEnds, pem: &[u8]) {
    match certificate_ends(pem) {
        Ok(list) => ends.set(Certificate::Serving, list[0]),
        Err(e) => tracing::warn!(error = %e, "the serving certificate's end cannot be read"),
    }
}

fn modified(path: &PathBuf) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl CertSource {
    /// Serves `config` from now on (only a [`CertSource::Shared`] changes).
    pub fn replace(&self, config: Arc<ServerConfig>) {
        if let CertSource::Shared(current) = self {
            *current.write().unwrap_or_else(|e| e.into_inner()) = config;
        }
    }

    /// Mounted files (read now: a bad pair is an error at start); their certificate's end goes to
    /// `ends` now and at each reload.
    pub fn files(cert: PathBuf, key: PathBuf, ends: Arc<CertificateEnds>) -> Result<Self, TlsError> {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| TlsError::Pem(format!("{}: {e}", p.display())));
        let pem = read(&cert)?;
        let config = server_config(&pem, &read(&key)?)?;
        record_serving_end(&ends, &pem);
        let times = (modified(&cert), modified(&key));
        Ok(CertSource::Files { current: RwLock::new((config, times.0, times.1)), cert, key, ends })
    }

    /// The configuration for the next connection, re-reading changed files (a bad new pair is logged
    /// and the previous one kept).
    pub fn config(&self) -> Arc<ServerConfig> {
        match self {
            CertSource::Shared(c) => c.read().map(|g| g.clone()).unwrap_or_else(|e| e.into_inner().clone()),
            CertSource::Files { cert, key, current, ends } => {
                let times = (modified(cert), modified(key));
                let (config, c_at, k_at) =
                    current.read().map(|g| g.clone()).unwrap_or_else(|e| e.into_inner().clone());
                if (c_at, k_at) == times {
                    return config;
                }
                let fresh = std::fs::read(cert)
                    .and_then(|c| std::fs::read(key).map(|k| (c, k)))
                    .map_err(|e| TlsError::Pem(e.to_string()))
                    .and_then(|(c, k)| server_config(&c, &k).map(|config| (config, c)));
                match fresh {
                    Ok((new, pem)) => {
                        tracing::info!(cert = %cert.display(), "serving certificate reloaded");
                        record_serving_end(ends, &pem);
                        if let Ok(mut g) = current.write() {
                            *g = (new.clone(), times.0, times.1);
                        }
                        new
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "new certificate files unusable; keeping the previous ones");
                        config
                    }
                }
            }
        }
    }
}

/// The webhook configuration with every webhook trusting `ca_pem`.
pub fn with_ca_bundle(
    mut config: k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration,
    ca_pem: &str,
) -> k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration {
    for hook in config.webhooks.iter_mut().flatten() {
        hook.client_config.ca_bundle = Some(k8s_openapi::ByteString(ca_pem.as_bytes().to_vec()));
    }
    config
}

/// Writes `ca_pem` into the `caBundle` of every webhook of the named MutatingWebhookConfiguration,
/// unless every one holds it already; whether it wrote. (A re-apply of the shipped manifest, e.g.
/// a GitOps re-sync, empties it: kube-apiserver then cannot call the webhook, and GPU pods are refused.)
pub async fn publish_ca_bundle(client: kube::Client, name: &str, ca_pem: &str) -> Result<bool, kube::Error> {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    let api: kube::Api<MutatingWebhookConfiguration> = kube::Api::all(client);
    let current = api.get(name).await?;
    let wanted = with_ca_bundle(current.clone(), ca_pem);
    if wanted == current {
        return Ok(false);
    }
    api.replace(name, &kube::api::PostParams::default(), &wanted).await?;
    Ok(true)
}

/// A verifier that accepts only client certificates signed by a CA of `ca_pem` (and requires one).
pub fn client_verifier(ca_pem: &[u8]) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| TlsError::Pem(format!("client CA: {e}")))?;
        roots.add(cert).map_err(|e| TlsError::Pem(format!("client CA: {e}")))?;
    }
    if roots.is_empty() {
        return Err(TlsError::Pem("client CA: no CERTIFICATE block".into()));
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| TlsError::Pem(format!("client CA: {e}")))
}

/// The CA file that client certificates must chain to (`--extender-client-ca`), re-read when it
/// changes: a Secret's new contents reach its volume within a minute or two, so rotating the CA (both
/// CAs in the file, then the new one alone) needs no restart. A new file that cannot be used is
/// logged and the previous CA kept. The soonest end among its CAs, and the end of each client
/// certificate accepted, go to [`CertificateEnds`].
pub struct ClientCa {
    path: PathBuf,
    /// The verifier in use and the file's modification time it was read at.
    current: RwLock<(Arc<dyn ClientCertVerifier>, Option<SystemTime>)>,
    ends: Arc<CertificateEnds>,
}

impl ClientCa {
    /// The CA in `path`, read now (a file that cannot be used is an error at start).
    pub fn open(path: PathBuf, ends: Arc<CertificateEnds>) -> Result<Self, TlsError> {
        let at = modified(&path);
        let verifier = Self::load(&path, &ends)?;
        Ok(ClientCa { current: RwLock::new((verifier, at)), path, ends })
    }

    fn load(path: &PathBuf, ends: &CertificateEnds) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
        let pem = std::fs::read(path).map_err(|e| TlsError::Pem(format!("{}: {e}", path.display())))?;
        let verifier = client_verifier(&pem)?;
        let soonest = certificate_ends(&pem)?.into_iter().min();
        if let Some(end) = soonest {
            ends.set(Certificate::ExtenderClientCa, end);
        }
        Ok(verifier)
    }

    /// The verifier for the next connection, re-reading the file if it changed.
    pub fn verifier(&self) -> Arc<dyn ClientCertVerifier> {
        let at = modified(&self.path);
        let (verifier, read_at) =
            self.current.read().map(|g| g.clone()).unwrap_or_else(|e| e.into_inner().clone());
        if read_at == at {
            return verifier;
        }
        match Self::load(&self.path, &self.ends) {
            Ok(fresh) => {
                tracing::info!(file = %self.path.display(), "extender client CA reloaded");
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = (fresh.clone(), at);
                fresh
            }
            Err(e) => {
                tracing::warn!(error = %e, "the new extender client CA is unusable; keeping the previous one");
                // Not read again until it changes once more.
                self.current.write().unwrap_or_else(|e| e.into_inner()).1 = at;
                verifier
            }
        }
    }

    /// A client presented `der` and was accepted: its end is recorded.
    fn accepted(&self, der: &[u8]) {
        match der_end(der) {
            Ok(end) => self.ends.set(Certificate::ExtenderClient, end),
            Err(e) => tracing::debug!(error = %e, "an accepted client certificate's end cannot be read"),
        }
    }
}

/// `base` (its certificate and protocols) asking every client for a certificate `clients` accepts.
fn with_clients(
    base: &ServerConfig,
    clients: Arc<dyn ClientCertVerifier>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Pem(e.to_string()))?
        .with_client_cert_verifier(clients)
        .with_cert_resolver(base.cert_resolver.clone());
    config.alpn_protocols = base.alpn_protocols.clone();
    Ok(Arc::new(config))
}

/// Serves `router` over TLS on `listener` within `bounds` until the process ends; with `clients`,
/// only to clients presenting a certificate it accepts (the handshake of any other fails). The
/// handshake is the connection's first [`Bounds::handshake`].
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    router: Router,
    bounds: Bounds,
    certs: Arc<CertSource>,
    clients: Option<Arc<ClientCa>>,
) {
    let handshake = move |stream: TcpStream, peer: SocketAddr| {
        // Each connection takes the certificates as they are now (they are re-read when they change).
        let config = match &clients {
            None => Ok(certs.config()),
            Some(ca) => with_clients(&certs.config(), ca.verifier()),
        };
        let clients = clients.clone();
        async move {
            let config = match config {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "TLS with client certificates");
                    return None;
                }
            };
            let tls = match TlsAcceptor::from(config).accept(stream).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return None;
                }
            };
            if let (Some(ca), Some(leaf)) =
                (&clients, tls.get_ref().1.peer_certificates().and_then(<[_]>::first))
            {
                ca.accepted(leaf);
            }
            Some(tls)
        }
    };
    listen::serve(name, listener, router, bounds, handshake, std::future::pending()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_certificate_names_the_service_in_the_install_namespace() {
        assert_eq!(
            service_dns_names("nano-gpu-allocator", "gpu-sharing"),
            ["nano-gpu-allocator.gpu-sharing.svc", "nano-gpu-allocator.gpu-sharing.svc.cluster.local"]
        );
    }

    #[test]
    fn a_certificate_ends_at_the_start_of_the_utc_day_of_its_end() {
        // 2026-11-23T06:30:00Z and midnight of that day.
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_795_415_400);
        let day = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_795_392_000);
        assert_eq!(utc_day_start(t), day);
        assert_eq!(utc_date(day), (2026, 11, 23));
        assert_eq!(utc_day_start(day), day);
    }

    #[test]
    fn a_generated_pair_makes_a_server_config() {
        let g = generate(&["nano-gpu-allocator.nano-gpu-system.svc".into()], None).unwrap();
        assert!(g.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(g.key_pem.contains("PRIVATE KEY"));
        assert!(server_config(g.cert_pem.as_bytes(), g.key_pem.as_bytes()).is_ok());
    }

    #[test]
    fn every_webhook_gets_the_ca_bundle() {
        let config: k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "w"}, "webhooks": [
                {"name": "pods.nano-gpu.io", "clientConfig": {"service": {"name": "s", "namespace": "n"}},
                 "admissionReviewVersions": ["v1"], "sideEffects": "None"}]}))
            .unwrap();
        let out = serde_json::to_value(with_ca_bundle(config, "PEM")).unwrap();
        // caBundle travels as base64 of the PEM.
        assert_eq!(out["webhooks"][0]["clientConfig"]["caBundle"], "UEVN");
    }

    #[tokio::test]
    async fn an_emptied_ca_bundle_is_written_again_and_a_present_one_left_alone() {
        use crate::api_replies::{body_json, respond};
        use http::{Request, Response};
        use kube::client::Body;
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(svc, "default");
        let config = |bundle: Option<&str>| {
            let mut client_config = serde_json::json!({"service": {"name": "s", "namespace": "n"}});
            if let Some(b) = bundle {
                client_config["caBundle"] = b.into();
            }
            serde_json::json!({"apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration", "metadata": {"name": "w", "resourceVersion": "3"},
                "webhooks": [{"name": "pods.nano-gpu.io", "clientConfig": client_config,
                    "admissionReviewVersions": ["v1"], "sideEffects": "None"}]})
        };
        let server = tokio::spawn(async move {
            // A re-applied manifest emptied it: read, then written with the bundle.
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method(), "GET");
            send.send_response(respond(200, config(None)));
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method(), "PUT");
            let written = body_json(req).await;
            assert_eq!(written["webhooks"][0]["clientConfig"]["caBundle"], "UEVN");
            send.send_response(respond(200, written));
            // Holding it: read only.
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method(), "GET");
            send.send_response(respond(200, config(Some("UEVN"))));
        });
        assert!(publish_ca_bundle(client.clone(), "w", "PEM").await.unwrap());
        assert!(!publish_ca_bundle(client, "w", "PEM").await.unwrap());
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_client_that_trusts_the_generated_ca_gets_an_answer_over_tls() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio_rustls::rustls::{ClientConfig, RootCertStore};
        let g = generate(&["localhost".into()], None).unwrap();
        let config = server_config(g.cert_pem.as_bytes(), g.key_pem.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let certs = Arc::new(CertSource::Shared(RwLock::new(config)));
        tokio::spawn(serve("test", listener, router, Bounds::REACHABLE, certs, None));

        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(g.ca_pem.as_bytes()) {
            roots.add(ca.unwrap()).unwrap();
        }
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let mut tls = connector.connect(name, tcp).await.unwrap();
        tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        tls.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(answer.ends_with("ok"), "{answer}");
    }

    #[tokio::test]
    async fn a_connection_that_starts_no_handshake_is_closed_within_the_handshake_bound() {
        use tokio::io::AsyncReadExt;
        let g = generate(&["localhost".into()], None).unwrap();
        let config = server_config(g.cert_pem.as_bytes(), g.key_pem.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let bounds = Bounds { handshake: std::time::Duration::from_millis(200), ..Bounds::REACHABLE };
        let certs = Arc::new(CertSource::Shared(RwLock::new(config)));
        tokio::spawn(serve("test", listener, Router::new(), bounds, certs, None));
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut out = Vec::new();
        let closed =
            tokio::time::timeout(std::time::Duration::from_secs(3), silent.read_to_end(&mut out)).await;
        assert!(closed.is_ok(), "a connection without a handshake stayed open");
    }

    #[test]
    fn certificate_ends_are_read_from_each_block() {
        let now = SystemTime::now();
        let (a, b) = (
            now + std::time::Duration::from_secs(86_400 * 10),
            now + std::time::Duration::from_secs(86_400 * 400),
        );
        let first = generate(&["a".into()], Some((now, a))).unwrap();
        let second = generate(&["b".into()], Some((now, b))).unwrap();
        let bundle = format!("{}{}", first.ca_pem, second.cert_pem);
        assert_eq!(certificate_ends(bundle.as_bytes()).unwrap(), [utc_day_start(a), utc_day_start(b)]);
        let none = certificate_ends(b"no pem here").unwrap_err().to_string();
        assert!(none.contains("no CERTIFICATE block"), "{none}");
        let garbled = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(certificate_ends(garbled.as_bytes()).is_err());
    }

    #[test]
    fn bad_pem_is_a_clear_error() {
        let e = server_config(b"nothing", b"nothing").unwrap_err();
        assert!(e.to_string().contains("certificate"), "{e}");
    }

    #[test]
    fn changed_files_are_reloaded_and_bad_ones_ignored() {
        let dir = std::env::temp_dir().join(format!("nano-gpu-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        let first = generate(&["a.example".into()], None).unwrap();
        std::fs::write(&cert, &first.cert_pem).unwrap();
        std::fs::write(&key, &first.key_pem).unwrap();
        let ends = Arc::new(CertificateEnds::default());
        let source = CertSource::files(cert.clone(), key.clone(), ends.clone()).unwrap();
        let before = source.config();
        // generate(.., None) gives rcgen's default end, 4096-01-01.
        let first_end = ends.all();
        assert_eq!(first_end.len(), 1);
        assert_eq!(first_end[0].0, Certificate::Serving);
        assert!(Arc::ptr_eq(&before, &source.config()));
        // Files rewritten with explicit, later modification times (no waiting on the clock).
        let rewrite = |path: &PathBuf, text: &str, secs: u64| {
            std::fs::write(path, text).unwrap();
            let later = SystemTime::now() + std::time::Duration::from_secs(secs);
            std::fs::File::options().write(true).open(path).unwrap().set_modified(later).unwrap();
        };
        // A rotation.
        let now = SystemTime::now();
        let end = now + std::time::Duration::from_secs(30 * 86_400);
        let second = generate(&["a.example".into()], Some((now, end))).unwrap();
        rewrite(&cert, &second.cert_pem, 10);
        rewrite(&key, &second.key_pem, 10);
        let after = source.config();
        assert!(!Arc::ptr_eq(&before, &after));
        assert_eq!(ends.all(), [(Certificate::Serving, utc_day_start(end))]);
        // A broken write keeps the last good configuration.
        rewrite(&key, "broken", 20);
        assert!(Arc::ptr_eq(&after, &source.config()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
