//! The `admission.k8s.io/v1` AdmissionReview wire types a mutating webhook reads and answers, and the
//! base64 its JSON patches travel in. (k8s-openapi does not carry these types.)

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The envelope of a webhook call, in both directions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionReview {
    /// `admission.k8s.io/v1`.
    pub api_version: String,
    /// `AdmissionReview`.
    pub kind: String,
    /// What the API server asks (in a call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<AdmissionRequest>,
    /// The answer (in a reply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<AdmissionResponse>,
}

/// The part of a request a pod mutator needs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionRequest {
    /// Echoed in the response.
    pub uid: String,
    /// `CREATE`, `UPDATE`, …
    #[serde(default)]
    pub operation: String,
    /// Namespace of the object.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The object as it would be stored.
    #[serde(default)]
    pub object: Option<Value>,
}

/// Why a request was refused.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionStatus {
    /// HTTP-like code shown to the user.
    pub code: u16,
    /// The message shown to the user.
    pub message: String,
}

/// The answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionResponse {
    /// The request's uid.
    pub uid: String,
    /// Whether the object may be stored.
    pub allowed: bool,
    /// `JSONPatch` when `patch` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<String>,
    /// Base64 of a JSON patch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// Why not, when not allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<AdmissionStatus>,
}

impl AdmissionReview {
    /// A reply carrying `response`.
    pub fn reply(response: AdmissionResponse) -> Self {
        AdmissionReview {
            api_version: "admission.k8s.io/v1".into(),
            kind: "AdmissionReview".into(),
            request: None,
            response: Some(response),
        }
    }
}

/// Standard base64 with padding (RFC 4648 §4).
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        for (plain, coded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), coded);
        }
    }

    #[test]
    fn reviews_use_the_api_server_field_names() {
        let review: AdmissionReview = serde_json::from_value(json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "705ab4f5", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
                        "namespace": "ml", "object": {"metadata": {"name": "p"}}}
        }))
        .unwrap();
        assert_eq!(review.request.as_ref().unwrap().uid, "705ab4f5");
        let reply = AdmissionReview::reply(AdmissionResponse {
            uid: "705ab4f5".into(),
            allowed: false,
            status: Some(AdmissionStatus { code: 400, message: "no".into() }),
            ..Default::default()
        });
        assert_eq!(
            serde_json::to_value(&reply).unwrap(),
            json!({
                "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": "705ab4f5", "allowed": false, "status": {"code": 400, "message": "no"}}
            })
        );
    }
}
