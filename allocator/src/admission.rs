//! The mutating admission webhook's decision, pure: a pod that asks for nano-gpu resources (or
//! gpushare's, when compatibility is on) is sent to the nano-gpu scheduler profile (and, on clusters
//! whose GPU runtime is a RuntimeClass rather than the nodes' default, given that class), and an
//! invalid request is refused at admission with the same message the engine would give.

use k8s_openapi::api::core::v1::Pod;
use nano_gpu_proto::admission::{AdmissionResponse, AdmissionReview, AdmissionStatus, base64};
use nano_gpu_proto::demand::{DemandOptions, pod_demand};
use nano_gpu_proto::resources::{GPU_MEMORY, GPU_PERCENT, GPUSHARE_MEMORY};

/// The scheduler every pod gets unless it names one.
const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// What the webhook does.
#[derive(Clone, Debug)]
pub struct Admission {
    /// The scheduler profile that calls the nano-gpu extender.
    pub scheduler_name: String,
    /// How pods are read (gpushare compatibility).
    pub demand: DemandOptions,
    /// The RuntimeClass that gives containers their cards (the NVIDIA runtime's, where it is not the
    /// nodes' default runtime): GPU pods that name none get it.
    pub runtime_class: Option<String>,
}

/// Whether any container of the pod names one of our resources.
pub fn asks_nano_gpu(pod: &Pod, demand: &DemandOptions) -> bool {
    let Some(spec) = pod.spec.as_ref() else { return false };
    let ours = |name: &str| {
        name == GPU_PERCENT || name == GPU_MEMORY || (demand.gpushare.is_some() && name == GPUSHARE_MEMORY)
    };
    spec.containers.iter().chain(spec.init_containers.iter().flatten()).any(|c| {
        c.resources
            .as_ref()
            .is_some_and(|r| r.limits.iter().chain(r.requests.iter()).flatten().any(|(name, _)| ours(name)))
    })
}

impl Admission {
    /// Answers one review.
    pub fn review(&self, review: &AdmissionReview) -> AdmissionReview {
        let Some(request) = review.request.as_ref() else {
            return AdmissionReview::reply(deny("", "the AdmissionReview has no request".into()));
        };
        let uid = request.uid.as_str();
        let allow = AdmissionResponse { uid: uid.to_owned(), allowed: true, ..Default::default() };
        let Some(pod) = request.object.clone().and_then(|o| serde_json::from_value::<Pod>(o).ok()) else {
            return AdmissionReview::reply(allow);
        };
        if !asks_nano_gpu(&pod, &self.demand) {
            return AdmissionReview::reply(allow);
        }
        if let Err(e) = pod_demand(&pod, &self.demand) {
            return AdmissionReview::reply(deny(uid, format!("nano-gpu: {e}")));
        }
        let spec = pod.spec.as_ref();
        let mut ops = Vec::new();
        let op = match spec.and_then(|s| s.scheduler_name.as_deref()) {
            None => Some("add"),
            Some(DEFAULT_SCHEDULER) | Some("") => Some("replace"),
            // The pod names another scheduler on purpose: leave it.
            Some(_) => None,
        };
        if let Some(op) = op {
            ops.push(
                serde_json::json!({"op": op, "path": "/spec/schedulerName", "value": self.scheduler_name}),
            );
        }
        // A pod that names a runtime class chose it (e.g. a sandboxed GPU runtime): leave it.
        if let Some(class) = &self.runtime_class {
            let op = match spec.and_then(|s| s.runtime_class_name.as_deref()) {
                None => Some("add"),
                Some("") => Some("replace"),
                Some(_) => None,
            };
            if let Some(op) = op {
                ops.push(serde_json::json!({"op": op, "path": "/spec/runtimeClassName", "value": class}));
            }
        }
        if ops.is_empty() {
            return AdmissionReview::reply(allow);
        }
        let patch = serde_json::Value::Array(ops);
        AdmissionReview::reply(AdmissionResponse {
            patch_type: Some("JSONPatch".into()),
            patch: Some(base64(patch.to_string().as_bytes())),
            ..allow
        })
    }
}

fn deny(uid: &str, message: String) -> AdmissionResponse {
    AdmissionResponse {
        uid: uid.to_owned(),
        allowed: false,
        status: Some(AdmissionStatus { code: 400, message }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn admission() -> Admission {
        Admission {
            scheduler_name: "nano-gpu-scheduler".into(),
            demand: DemandOptions::default(),
            runtime_class: None,
        }
    }

    fn review(spec: Value) -> AdmissionReview {
        serde_json::from_value(json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "operation": "CREATE", "object": {"metadata": {"name": "p"}, "spec": spec}}}))
        .unwrap()
    }

    fn gpu(percent: &str) -> Value {
        json!({"containers": [{"name": "train", "resources": {"limits": {"nano-gpu/gpu-percent": percent}}}]})
    }

    fn decoded_patch(r: &AdmissionResponse) -> Value {
        serde_json::from_str(&String::from_utf8(decode(r.patch.as_deref().unwrap())).unwrap()).unwrap()
    }

    /// Base64 decoding, independent of the encoder under test.
    fn decode(text: &str) -> Vec<u8> {
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut bits = 0u32;
        let mut n = 0;
        let mut out = Vec::new();
        for c in text.bytes().filter(|c| *c != b'=') {
            bits = bits << 6 | alphabet.iter().position(|a| *a == c).unwrap() as u32;
            n += 6;
            if n >= 8 {
                n -= 8;
                out.push((bits >> n) as u8);
            }
        }
        out
    }

    #[test]
    fn a_gpu_pod_is_sent_to_the_nano_gpu_scheduler() {
        let r = admission().review(&review(gpu("30"))).response.unwrap();
        assert!(r.allowed);
        assert_eq!(r.uid, "u-1");
        assert_eq!(r.patch_type.as_deref(), Some("JSONPatch"));
        assert_eq!(
            decoded_patch(&r),
            json!([{"op": "add", "path": "/spec/schedulerName", "value": "nano-gpu-scheduler"}])
        );
        let mut spec = gpu("200");
        spec["schedulerName"] = "default-scheduler".into();
        let r = admission().review(&review(spec)).response.unwrap();
        assert_eq!(decoded_patch(&r)[0]["op"], "replace");
    }

    #[test]
    fn percent_150_is_refused_with_the_engines_message() {
        let r = admission().review(&review(gpu("150"))).response.unwrap();
        assert!(!r.allowed);
        let status = r.status.unwrap();
        assert_eq!(status.code, 400);
        assert_eq!(
            status.message,
            "nano-gpu: container \"train\": nano-gpu/gpu-percent 150 is neither 1..=100 nor a multiple of 100"
        );
    }

    #[test]
    fn other_pods_and_chosen_schedulers_are_left_alone() {
        let plain = json!({"containers": [{"name": "web", "resources": {"limits": {"cpu": "1"}}}]});
        let r = admission().review(&review(plain)).response.unwrap();
        assert!(r.allowed && r.patch.is_none());
        let mut spec = gpu("30");
        spec["schedulerName"] = "volcano".into();
        let r = admission().review(&review(spec)).response.unwrap();
        assert!(r.allowed && r.patch.is_none());
        // gpushare pods only when compatibility is on.
        let share =
            json!({"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "2"}}}]});
        assert!(admission().review(&review(share.clone())).response.unwrap().patch.is_none());
        let compat = Admission {
            demand: DemandOptions { gpushare: Some(nano_gpu_proto::demand::GpushareUnit::GiB) },
            ..admission()
        };
        assert!(compat.review(&review(share)).response.unwrap().patch.is_some());
    }

    #[test]
    fn with_a_runtime_class_a_gpu_pod_that_names_none_gets_it() {
        let nvidia = Admission { runtime_class: Some("nvidia".into()), ..admission() };
        let r = nvidia.review(&review(gpu("30"))).response.unwrap();
        assert_eq!(
            decoded_patch(&r),
            json!([{"op": "add", "path": "/spec/schedulerName", "value": "nano-gpu-scheduler"},
                   {"op": "add", "path": "/spec/runtimeClassName", "value": "nvidia"}])
        );
        // Its own class and its own scheduler are its choice; a pod asking no GPU is left alone.
        let mut spec = gpu("30");
        spec["runtimeClassName"] = "kata-nvidia".into();
        spec["schedulerName"] = "volcano".into();
        let r = nvidia.review(&review(spec)).response.unwrap();
        assert!(r.allowed && r.patch.is_none());
        let cpu = json!({"containers": [{"name": "c", "resources": {"limits": {"cpu": "1"}}}]});
        assert!(nvidia.review(&review(cpu)).response.unwrap().patch.is_none());
        // Another scheduler named on purpose still gets the class.
        let mut spec = gpu("30");
        spec["schedulerName"] = "volcano".into();
        let r = nvidia.review(&review(spec)).response.unwrap();
        assert_eq!(
            decoded_patch(&r),
            json!([{"op": "add", "path": "/spec/runtimeClassName", "value": "nvidia"}])
        );
    }

    #[test]
    fn a_review_without_a_request_is_refused() {
        let r = admission().review(&AdmissionReview::default()).response.unwrap();
        assert!(!r.allowed);
    }
}
