//! The extender over HTTPS with client certificates (`--extender-tls-listen`), over real sockets: a
//! client with a certificate the configured CA signed gets answers; one without a certificate, or
//! with one another CA signed, gets none. The CA file is rotated under the running server (both CAs,
//! then the new one alone) and each step holds at once, with no restart; the ends of the CA and of
//! the accepted client certificate are recorded for `/metrics`.

use nano_gpu_allocator::service::bind_api::KubeBinder;
use nano_gpu_allocator::service::{server, tls};
use nano_gpu_allocator::state::ClusterState;
use nano_gpu_engine::engine::Engine;
use nano_gpu_engine::model::Cluster;
use nano_gpu_engine::policy;
use nano_gpu_proto::demand::DemandOptions;
use nano_gpu_runtime::listen::Bounds;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

/// `GET /healthz` over TLS to `addr`, trusting `server_ca`, presenting `client` (cert, key) if any;
/// the first line of the answer, or why there was none.
async fn healthz(
    addr: std::net::SocketAddr,
    server_ca: &str,
    client: Option<(&str, &str)>,
) -> Result<String, String> {
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(server_ca.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain: Vec<CertificateDer<'static>> =
                CertificateDer::pem_slice_iter(cert.as_bytes()).collect::<Result<_, _>>().unwrap();
            builder
                .with_client_auth_cert(chain, PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap())
                .unwrap()
        }
    };
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = TlsConnector::from(Arc::new(config)).connect(name, tcp).await.map_err(|e| e.to_string())?;
    let ask = tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").await;
    ask.map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    tls.read_to_end(&mut answer).await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&answer);
    text.lines().next().map(str::to_owned).filter(|l| !l.is_empty()).ok_or_else(|| "no answer".to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_clients_with_a_certificate_of_the_configured_ca_reach_the_extender() {
    // The serving certificate (as the Secret would hold it), the scheduler's client CA and
    // certificate, and a stranger's.
    // The scheduler's CA and certificate end in 100 days, the stranger's (the next CA) in 200.
    let now = SystemTime::now();
    let days = |n: u64| now + Duration::from_secs(n * 86_400);
    let serving = tls::generate(&["localhost".into()], None).unwrap();
    let scheduler = tls::generate(&["kube-scheduler".into()], Some((now, days(100)))).unwrap();
    let stranger = tls::generate(&["kube-scheduler".into()], Some((now, days(200)))).unwrap();
    let config = tls::server_config(serving.cert_pem.as_bytes(), serving.key_pem.as_bytes()).unwrap();
    let certs = Arc::new(tls::CertSource::Shared(RwLock::new(config)));
    let dir = std::env::temp_dir().join(format!("nano-gpu-extender-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ca.crt");
    std::fs::write(&file, &scheduler.ca_pem).unwrap();
    let ends = Arc::new(tls::CertificateEnds::default());
    let clients = Arc::new(tls::ClientCa::open(file.clone(), ends.clone()).unwrap());

    let engine =
        Engine::new(Cluster::new(), policy::by_name(policy::DEFAULT, 0).unwrap(), Default::default());
    let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let shared =
        server::Shared::new(ClusterState::new(engine, 0, DemandOptions::default()), KubeBinder::new(client));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tls::serve(
        "extender HTTPS",
        listener,
        server::router(shared),
        Bounds::REACHABLE,
        certs,
        Some(clients),
    ));

    let ca = serving.ca_pem.as_str();
    let scheduler_pair = Some((scheduler.cert_pem.as_str(), scheduler.key_pem.as_str()));
    let stranger_pair = Some((stranger.cert_pem.as_str(), stranger.key_pem.as_str()));
    let answer = healthz(addr, ca, scheduler_pair).await;
    assert_eq!(answer.as_deref(), Ok("HTTP/1.1 200 OK"), "the scheduler's certificate");
    for (who, client) in [("no certificate", None), ("another CA's certificate", stranger_pair)] {
        let answer = healthz(addr, ca, client).await;
        assert!(answer.is_err(), "{who} got {answer:?}");
    }
    // The certificates end at the start of their last UTC day (tls::generate).
    let end = |n| tls::utc_day_start(days(n));
    let seen: Vec<_> = ends.all();
    assert_eq!(
        seen,
        [(tls::Certificate::ExtenderClientCa, end(100)), (tls::Certificate::ExtenderClient, end(100))]
    );

    // A rotation, as the certificates page says: both CAs in the file (a Secret's update reaches
    // the volume as a new file, with a later modification time), then the new one alone.
    let rewrite = |text: String, secs: u64| {
        std::fs::write(&file, text).unwrap();
        let later = SystemTime::now() + Duration::from_secs(secs);
        std::fs::File::options().write(true).open(&file).unwrap().set_modified(later).unwrap();
    };
    rewrite(format!("{}{}", scheduler.ca_pem, stranger.ca_pem), 10);
    for (who, client) in [("the old CA's", scheduler_pair), ("the new CA's", stranger_pair)] {
        assert_eq!(healthz(addr, ca, client).await.as_deref(), Ok("HTTP/1.1 200 OK"), "{who}, both CAs");
    }
    rewrite(stranger.ca_pem.clone(), 20);
    assert!(healthz(addr, ca, scheduler_pair).await.is_err(), "the old CA's certificate after the rotation");
    assert_eq!(healthz(addr, ca, stranger_pair).await.as_deref(), Ok("HTTP/1.1 200 OK"));
    assert_eq!(
        ends.all(),
        [(tls::Certificate::ExtenderClientCa, end(200)), (tls::Certificate::ExtenderClient, end(200))]
    );
    // A broken file keeps the CA in use.
    rewrite("not a certificate".to_owned(), 30);
    assert_eq!(
        healthz(addr, ca, stranger_pair).await.as_deref(),
        Ok("HTTP/1.1 200 OK"),
        "after a broken file"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // A CA file without a certificate is refused at start, with the reason.
    let err = tls::client_verifier(b"not a certificate").err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("client CA"), "{err}");
    let missing =
        tls::ClientCa::open(dir.join("missing"), ends).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(missing.contains("missing"), "{missing}");
}
