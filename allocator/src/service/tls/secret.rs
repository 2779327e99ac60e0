//! One webhook certificate for every replica. A Secret of type `kubernetes.io/tls` in the allocator's
//! namespace holds the CA bundle (`ca.crt`), the serving certificate (`tls.crt`) and its key
//! (`tls.key`), with the certificate's end in the annotation [`NOT_AFTER_ANNOTATION`].
//!
//! The first replica to start creates it (the others' create fails with 409; they read it); every
//! replica serves that certificate and writes its CA bundle into the webhook configuration, so it does
//! not matter which replica the Service picks, or which restarted last. A certificate within
//! [`RENEW_BEFORE`] of its end, or a Secret that does not decode, is replaced with the read
//! resourceVersion (one replica wins, the others read the winner's); the new bundle keeps the previous
//! CA after the new one, so the API server trusts the replicas still serving the previous certificate
//! until they re-read the Secret ([`keep`] does that every [`RECHECK`]).

use super::{CertSource, TlsError, generate, publish_ca_bundle, server_config, utc_day_start};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use thiserror::Error;

/// The certificate's end (RFC 3339), written with it.
pub const NOT_AFTER_ANNOTATION: &str = "nano-gpu/not-after";
/// How long a new certificate is valid.
pub const VALIDITY: Duration = Duration::from_secs(365 * 86_400);
/// A certificate this close to its end is replaced.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 86_400);
/// How often every replica re-reads the Secret.
pub const RECHECK: Duration = Duration::from_secs(60);
/// How long one API call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What the Secret holds, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Material {
    /// The CA bundle the webhook configuration trusts (the current CA first).
    pub ca_pem: String,
    /// The serving certificate.
    pub cert_pem: String,
    /// Its key.
    pub key_pem: String,
    /// The certificate's end.
    pub not_after: SystemTime,
}

/// Why the shared certificate cannot be had.
#[derive(Debug, Error)]
pub enum SecretError {
    /// The API server refused or failed.
    #[error("secret {name}: {source}")]
    Api {
        /// The Secret.
        name: String,
        /// Why.
        source: kube::Error,
    },
    /// The API server did not answer in time.
    #[error("secret {0}: the API server did not answer within {CALL_TIMEOUT:?}")]
    Timeout(String),
    /// Generating a certificate failed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Other replicas kept replacing it.
    #[error("secret {0}: still contended after several attempts")]
    Contended(String),
}

/// What to do with the Secret as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Serve what it holds.
    Use(Material),
    /// There is none: create it.
    Create,
    /// Replace it (`why`), keeping `previous_ca` in the bundle if it had a usable one.
    Renew {
        /// Why it is replaced.
        why: String,
        /// The CA bundle to keep trusting while replicas move over.
        previous_ca: Option<String>,
    },
}

fn text(data: &BTreeMap<String, ByteString>, key: &str) -> Option<String> {
    data.get(key).and_then(|b| String::from_utf8(b.0.clone()).ok()).filter(|t| t.contains("-----BEGIN"))
}

/// The Secret decoded, or why it cannot be used.
pub fn decode(secret: &Secret) -> Result<Material, String> {
    let empty = BTreeMap::new();
    let data = secret.data.as_ref().unwrap_or(&empty);
    let field = |key: &str| text(data, key).ok_or_else(|| format!("{key} is missing or not PEM"));
    let not_after = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NOT_AFTER_ANNOTATION))
        .ok_or_else(|| format!("annotation {NOT_AFTER_ANNOTATION} is missing"))?;
    let not_after: Timestamp =
        not_after.parse().map_err(|e| format!("annotation {NOT_AFTER_ANNOTATION} {not_after:?}: {e}"))?;
    let material = Material {
        ca_pem: field("ca.crt")?,
        cert_pem: field("tls.crt")?,
        key_pem: field("tls.key")?,
        not_after: SystemTime::from(not_after),
    };
    server_config(material.cert_pem.as_bytes(), material.key_pem.as_bytes()).map_err(|e| e.to_string())?;
    Ok(material)
}

/// The decision for `secret` (None: absent) at `now`.
pub fn decide(secret: Option<&Secret>, now: SystemTime) -> Decision {
    let Some(secret) = secret else { return Decision::Create };
    match decode(secret) {
        Ok(m) if m.not_after > now + RENEW_BEFORE => Decision::Use(m),
        Ok(m) => {
            Decision::Renew { why: "the certificate ends within 30 days".into(), previous_ca: Some(m.ca_pem) }
        }
        Err(why) => {
            let previous_ca = secret.data.as_ref().and_then(|d| text(d, "ca.crt"));
            Decision::Renew { why, previous_ca }
        }
    }
}

/// A new certificate for `dns_names`, valid from `now` for [`VALIDITY`], whose bundle also trusts
/// `previous_ca`.
pub fn fresh(dns_names: &[String], now: SystemTime, previous_ca: Option<&str>) -> Result<Material, TlsError> {
    let g = generate(dns_names, Some((now, now + VALIDITY)))?;
    // Only the newest previous CA: a bundle does not grow with every rotation.
    let previous = previous_ca.and_then(|p| p.split_inclusive("-----END CERTIFICATE-----").next());
    let ca_pem = match previous {
        Some(p) if !g.ca_pem.contains(p.trim()) => format!("{}\n{}\n", g.ca_pem.trim_end(), p.trim()),
        _ => g.ca_pem,
    };
    // Where the certificate really ends (certificates carry whole UTC days).
    let not_after = utc_day_start(now + VALIDITY);
    Ok(Material { ca_pem, cert_pem: g.cert_pem, key_pem: g.key_pem, not_after })
}

/// The Secret holding `m`, named `name`.
pub fn secret(name: &str, m: &Material) -> Secret {
    let not_after = Timestamp::try_from(m.not_after).unwrap_or(Timestamp::UNIX_EPOCH).to_string();
    let data = [("ca.crt", &m.ca_pem), ("tls.crt", &m.cert_pem), ("tls.key", &m.key_pem)]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
        .collect();
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            annotations: Some(BTreeMap::from([(NOT_AFTER_ANNOTATION.to_owned(), not_after)])),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/name".to_owned(),
                "nano-gpu-allocator".to_owned(),
            )])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(data),
        ..Default::default()
    }
}

async fn in_time<T>(
    name: &str,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<Result<T, kube::Error>, SecretError> {
    tokio::time::timeout(CALL_TIMEOUT, call).await.map_err(|_| SecretError::Timeout(name.to_owned()))
}

/// The shared certificate: read, created if absent, replaced if ending or unusable.
pub async fn ensure(api: &Api<Secret>, name: &str, dns_names: &[String]) -> Result<Material, SecretError> {
    let api_err = |source| SecretError::Api { name: name.to_owned(), source };
    for _ in 0..5 {
        let current = in_time(name, api.get_opt(name)).await?.map_err(api_err)?;
        let now = SystemTime::now();
        let written = match decide(current.as_ref(), now) {
            Decision::Use(m) => return Ok(m),
            Decision::Create => {
                let m = fresh(dns_names, now, None)?;
                in_time(name, api.create(&PostParams::default(), &secret(name, &m))).await?.map(|_| m)
            }
            Decision::Renew { why, previous_ca } => {
                tracing::info!(secret = name, %why, "replacing the webhook certificate");
                let m = fresh(dns_names, now, previous_ca.as_deref())?;
                let mut s = secret(name, &m);
                // The read resourceVersion: a replica that replaced it first makes this a 409.
                s.metadata.resource_version = current.and_then(|c| c.metadata.resource_version);
                in_time(name, api.replace(name, &PostParams::default(), &s)).await?.map(|_| m)
            }
        };
        match written {
            Ok(m) => return Ok(m),
            // Another replica wrote first: read what it wrote.
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(api_err(e)),
        }
    }
    Err(SecretError::Contended(name.to_owned()))
}

/// Keeps serving the shared certificate: every [`RECHECK`], reads (or renews) it, serves it when it
/// changed, and writes its CA bundle into the webhook configuration `webhook` wherever it is missing
/// or another (a re-applied manifest empties it). `published`: whether the bundle is in place now;
/// while it is not (the configuration not created yet, or a write that failed), it is tried again
/// within seconds, not a [`RECHECK`] later: until then the API server trusts no replica, and every
/// GPU pod's creation fails.
#[allow(clippy::too_many_arguments)]
pub async fn keep(
    api: Api<Secret>,
    name: String,
    dns_names: Vec<String>,
    served: Arc<CertSource>,
    mut current: Material,
    client: kube::Client,
    webhook: String,
    mut published: bool,
    ends: Arc<super::CertificateEnds>,
) {
    let mut retry = RETRY_FIRST;
    loop {
        if published {
            retry = RETRY_FIRST;
            tokio::time::sleep(RECHECK).await;
        } else {
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(RECHECK);
        }
        match ensure(&api, &name, &dns_names).await {
            Ok(m) if m != current => {
                match server_config(m.cert_pem.as_bytes(), m.key_pem.as_bytes()) {
                    Ok(config) => served.replace(config),
                    Err(e) => {
                        tracing::warn!(secret = %name, error = %e, "new webhook certificate unusable");
                        continue;
                    }
                }
                published = publish(&client, &webhook, &m.ca_pem).await;
                ends.set(super::Certificate::Serving, m.not_after);
                tracing::info!(secret = %name, "serving the renewed webhook certificate");
                current = m;
            }
            Ok(_) => published = publish(&client, &webhook, &current.ca_pem).await,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the webhook certificate; serving the last one")
            }
        }
    }
}

/// The first wait before a CA bundle that could not be written is tried again (doubling up to
/// [`RECHECK`]).
pub const RETRY_FIRST: Duration = Duration::from_secs(1);

/// Writes `ca_pem` into the webhook configuration `webhook` (the same bundle from every replica);
/// whether the configuration holds it now.
pub async fn publish(client: &kube::Client, webhook: &str, ca_pem: &str) -> bool {
    match tokio::time::timeout(CALL_TIMEOUT, publish_ca_bundle(client.clone(), webhook, ca_pem)).await {
        Ok(Ok(true)) => {
            tracing::info!(webhook, "CA bundle written into the webhook configuration");
            true
        }
        Ok(Ok(false)) => {
            tracing::debug!(webhook, "the webhook configuration holds the CA bundle");
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(webhook, error = %e, "could not write the CA bundle into the webhook configuration");
            false
        }
        Err(_) => {
            tracing::warn!(webhook, "writing the CA bundle timed out");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api_replies::{body_json, failure, respond};
    use http::{Request, Response};
    use kube::client::Body;

    const DNS: &[&str] = &["nano-gpu-allocator.nano-gpu-system.svc"];

    fn dns() -> Vec<String> {
        DNS.iter().map(|s| s.to_string()).collect()
    }

    fn stored(m: &Material, rv: &str) -> Secret {
        let mut s = secret("tls", m);
        s.metadata.resource_version = Some(rv.into());
        s
    }

    #[test]
    fn a_valid_secret_is_used_and_one_near_its_end_or_garbled_is_renewed() {
        let now = SystemTime::now();
        let m = fresh(&dns(), now, None).unwrap();
        assert_eq!(decide(Some(&stored(&m, "1")), now), Decision::Use(m.clone()));
        assert_eq!(decide(None, now), Decision::Create);
        // 340 days later the certificate ends within 30 days: renewed, trusting the old CA meanwhile.
        let later = now + Duration::from_secs(340 * 86_400);
        assert_eq!(
            decide(Some(&stored(&m, "1")), later),
            Decision::Renew {
                why: "the certificate ends within 30 days".into(),
                previous_ca: Some(m.ca_pem.clone())
            }
        );
        // Edited by hand: a key that is not PEM, a missing annotation.
        let mut garbled = stored(&m, "1");
        garbled.data.as_mut().unwrap().insert("tls.key".into(), ByteString(b"not a key".to_vec()));
        assert!(
            matches!(decide(Some(&garbled), now), Decision::Renew { why, .. } if why.contains("tls.key"))
        );
        let mut unannotated = stored(&m, "1");
        unannotated.metadata.annotations = None;
        assert!(
            matches!(decide(Some(&unannotated), now), Decision::Renew { why, .. } if why.contains(NOT_AFTER_ANNOTATION))
        );
    }

    #[test]
    fn a_renewed_bundle_trusts_the_new_ca_first_and_the_previous_one_only() {
        let now = SystemTime::now();
        let first = fresh(&dns(), now, None).unwrap();
        let second = fresh(&dns(), now, Some(&first.ca_pem)).unwrap();
        let third = fresh(&dns(), now, Some(&second.ca_pem)).unwrap();
        let count = |pem: &str| pem.matches("BEGIN CERTIFICATE").count();
        assert_eq!((count(&first.ca_pem), count(&second.ca_pem), count(&third.ca_pem)), (1, 2, 2));
        assert!(second.ca_pem.ends_with(&format!("{}\n", first.ca_pem.trim())));
        assert!(server_config(third.cert_pem.as_bytes(), third.key_pem.as_bytes()).is_ok());
    }

    #[tokio::test]
    async fn the_first_replica_creates_it_and_a_replica_that_loses_the_race_reads_the_winners() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let api: Api<Secret> = Api::namespaced(kube::Client::new(svc, "default"), "nano-gpu-system");
        let winner = fresh(&dns(), SystemTime::now(), None).unwrap();
        let theirs = serde_json::to_value(stored(&winner, "7")).unwrap();
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.uri().path(), "/api/v1/namespaces/nano-gpu-system/secrets/tls");
            send.send_response(failure(404, "NotFound"));
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(
                (req.method().as_str(), req.uri().path()),
                ("POST", "/api/v1/namespaces/nano-gpu-system/secrets")
            );
            let body = body_json(req).await;
            assert_eq!(
                (body["type"].as_str(), body["metadata"]["name"].as_str()),
                (Some("kubernetes.io/tls"), Some("tls"))
            );
            // Another replica created it a moment earlier.
            send.send_response(failure(409, "AlreadyExists"));
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method().as_str(), "GET");
            send.send_response(respond(200, theirs));
        });
        let got = ensure(&api, "tls", &dns()).await.unwrap();
        assert_eq!(got, winner, "both replicas serve the same certificate");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn an_ending_certificate_is_replaced_with_the_read_resource_version() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let api: Api<Secret> = Api::namespaced(kube::Client::new(svc, "default"), "nano-gpu-system");
        let old = fresh(&dns(), SystemTime::now() - Duration::from_secs(340 * 86_400), None).unwrap();
        let current = serde_json::to_value(stored(&old, "41")).unwrap();
        let old_ca = old.ca_pem.clone();
        let server = tokio::spawn(async move {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(respond(200, current));
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(
                (req.method().as_str(), req.uri().path()),
                ("PUT", "/api/v1/namespaces/nano-gpu-system/secrets/tls")
            );
            let body = body_json(req).await;
            assert_eq!(body["metadata"]["resourceVersion"], "41");
            send.send_response(respond(200, body));
        });
        let renewed = ensure(&api, "tls", &dns()).await.unwrap();
        assert!(renewed.not_after > SystemTime::now() + Duration::from_secs(300 * 86_400));
        assert!(renewed.ca_pem.contains(old_ca.trim()), "the old CA stays trusted during the change");
        server.await.unwrap();
    }
}
