//! The mutating admission webhook's decision, pure: a pod that asks for nano-gpu resources (or
//! gpushare's, when compatibility is on) is sent to the nano-gpu scheduler profile (and, on clusters
//! whose GPU runtime is a RuntimeClass rather than the nodes' default, given that class), and an
//! invalid request is refused at admission with the same message the engine would give.
//!
//! With DRA ([`Shares::Claims`]), such a pod is turned into a pod with claims instead, so that it
//! runs unchanged on nodes whose agent serves DRA: each GPU slot (a container, and the init
//! containers that reuse its cards) gets a claim made from nano-gpu's ResourceClaimTemplate of the
//! slot's shape (`nano-gpu-p30`, `nano-gpu-w2`, …: [`crate::decide::claim::template_name`]), and the
//! containers lose the nano-gpu resources. The allocator makes the template in the pod's namespace
//! and allocates the claim with its policy. Why templates: a pod's claims are fixed at creation,
//! and the pod has no UID yet at admission; a template lets Kubernetes' ResourceClaim controller
//! make each claim, owned by the pod, and delete it with the pod.

use crate::decide::claim::template_name;
use k8s_openapi::api::core::v1::{Pod, Toleration};
use nano_gpu_engine::request::SlotDemand;
use nano_gpu_proto::admission::{AdmissionResponse, AdmissionReview, AdmissionStatus, base64};
use nano_gpu_proto::annotations::{FRONT_END_DRA, FRONT_END_LABEL};
use nano_gpu_proto::demand::CardDemand;
use nano_gpu_proto::demand::{DemandOptions, pod_demand};
use nano_gpu_proto::resources::{GPU_MEMORY, GPU_PERCENT, GPUSHARE_MEMORY};
use serde_json::{Value, json};
use std::collections::BTreeMap;

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
    /// Which pods asking nano-gpu resources are turned into pods with claims.
    pub shares: Shares,
    /// Tolerations every pod asking nano-gpu resources is given (those it lacks): for the taints
    /// GPU nodes carry on managed clusters, which would keep such pods off every GPU node.
    pub tolerations: Vec<Toleration>,
}

/// The tolerations GPU pods get unless told otherwise (`--gpu-pod-tolerations`): GKE taints its
/// GPU node pools `nvidia.com/gpu=present:NoSchedule`, the same key is the usual taint on EKS, and
/// AKS's documentation taints GPU node pools `sku=gpu:NoSchedule`.
pub const DEFAULT_GPU_POD_TOLERATIONS: &str = "nvidia.com/gpu:NoSchedule,sku=gpu:NoSchedule";

/// Parses tolerations written as taints are (`kubectl taint`): `KEY[=VALUE][:EFFECT]`, comma
/// separated; `KEY` alone tolerates the key whatever its value (`Exists`), `KEY=VALUE` only that
/// value (`Equal`), no effect every effect. `none` is no toleration.
pub fn parse_tolerations(text: &str) -> Result<Vec<Toleration>, String> {
    if text.trim() == "none" {
        return Ok(Vec::new());
    }
    text.split(',').map(str::trim).map(parse_toleration).collect()
}

/// [`parse_tolerations`]' list, as a flag's value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tolerations(pub Vec<Toleration>);

impl std::str::FromStr for Tolerations {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        parse_tolerations(text).map(Tolerations)
    }
}

fn parse_toleration(text: &str) -> Result<Toleration, String> {
    let (pair, effect) = match text.rsplit_once(':') {
        Some((pair, effect)) => (pair, Some(effect)),
        None => (text, None),
    };
    if let Some(e) = effect
        && !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&e)
    {
        return Err(format!("{text:?}: the effect {e:?} is none of NoSchedule, PreferNoSchedule, NoExecute"));
    }
    let (key, value) = match pair.split_once('=') {
        Some((key, value)) => (key, Some(value)),
        None => (pair, None),
    };
    let name = |n: &str| {
        !n.is_empty()
            && n.len() <= 316
            && n.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    };
    if !name(key)
        || value.is_some_and(|v| {
            v.len() > 63 || !v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
    {
        return Err(format!("{text:?}: not a taint's KEY[=VALUE][:EFFECT] (a label key, and a label value)"));
    }
    Ok(Toleration {
        key: Some(key.to_owned()),
        operator: Some(if value.is_some() { "Equal" } else { "Exists" }.to_owned()),
        value: value.map(str::to_owned),
        effect: effect.map(str::to_owned),
        toleration_seconds: None,
    })
}

/// Whether `have` tolerates every taint `want` does.
fn covers(have: &Toleration, want: &Toleration) -> bool {
    let exists = have.operator.as_deref() == Some("Exists");
    let key = have.key.as_deref().unwrap_or("").is_empty() && exists || have.key == want.key;
    let value = exists || (want.operator.as_deref() != Some("Exists") && have.value == want.value);
    let effect = have.effect.as_deref().unwrap_or("").is_empty() || have.effect == want.effect;
    // A toleration that expires does not keep a pod on a NoExecute node for good.
    key && value && effect && have.toleration_seconds.is_none()
}

/// Which pods asking nano-gpu's resources the webhook turns into pods with claims (DRA).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Shares {
    /// None: the allocator does not allocate claims.
    #[default]
    DevicePlugin,
    /// Those annotated `nano-gpu/front-end: dra` (the allocator allocates claims).
    ClaimsIfAnnotated,
    /// All of them (every GPU node serves DRA).
    Claims,
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
        let annotated =
            pod.metadata.annotations.as_ref().and_then(|a| a.get(FRONT_END_LABEL)).map(String::as_str)
                == Some(FRONT_END_DRA);
        let claims = match self.shares {
            Shares::DevicePlugin => false,
            Shares::ClaimsIfAnnotated => annotated,
            Shares::Claims => true,
        };
        if claims {
            match to_claims(&pod, &self.demand) {
                Ok(mut o) => ops.append(&mut o),
                Err(e) => return AdmissionReview::reply(deny(uid, format!("nano-gpu: {e}"))),
            }
        } else if annotated {
            return AdmissionReview::reply(deny(
                uid,
                format!(
                    "nano-gpu: the pod asks for its cards through DRA ({FRONT_END_LABEL}: {FRONT_END_DRA}) \
                     and this cluster's allocator does not allocate claims (no --dra)"
                ),
            ));
        }
        let op = match spec.and_then(|s| s.scheduler_name.as_deref()) {
            // A pod with claims needs no extender: its claims are allocated before it is scheduled.
            _ if claims => None,
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
        // The tolerations the pod lacks, so that tainted GPU nodes take it.
        let have = spec.and_then(|s| s.tolerations.as_ref());
        let missing: Vec<&Toleration> =
            self.tolerations.iter().filter(|t| !have.into_iter().flatten().any(|h| covers(h, t))).collect();
        match have {
            _ if missing.is_empty() => {}
            None => ops.push(json!({"op": "add", "path": "/spec/tolerations", "value": missing})),
            Some(_) => ops.extend(
                missing.iter().map(|t| json!({"op": "add", "path": "/spec/tolerations/-", "value": t})),
            ),
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

/// The JSON patch that turns `pod`'s GPU slots into claims made from nano-gpu's templates (see the
/// module's doc), or why it cannot be done.
fn to_claims(pod: &Pod, options: &DemandOptions) -> Result<Vec<Value>, String> {
    let demand = pod_demand(pod, options).map_err(|e| e.to_string())?;
    let spec = pod.spec.as_ref().ok_or("the pod has no spec")?;
    let mut entries: Vec<Value> = spec.resource_claims.iter().flatten().map(|c| json!(c)).collect();
    let taken: Vec<&str> = spec.resource_claims.iter().flatten().map(|c| c.name.as_str()).collect();
    // Container name → the claim entry its slot uses.
    let mut uses: BTreeMap<&str, String> = BTreeMap::new();
    for (i, slot) in demand.slots.iter().enumerate() {
        let entry = format!("nano-gpu-{i}");
        if taken.contains(&entry.as_str()) {
            return Err(format!("the pod already names a claim {entry:?}, which nano-gpu would use"));
        }
        let shape = match slot.demand {
            CardDemand::Share { percent, memory } => SlotDemand::Share { percent, mem: memory },
            CardDemand::Whole { cards, memory } => SlotDemand::Whole { cards, mem: memory },
        };
        entries.push(json!({"name": entry, "resourceClaimTemplateName": template_name(&shape)}));
        for c in &slot.containers {
            uses.insert(c, entry.clone());
        }
    }
    let ours = |name: &str| {
        name == GPU_PERCENT || name == GPU_MEMORY || (options.gpushare.is_some() && name == GPUSHARE_MEMORY)
    };
    let convert = |containers: &[k8s_openapi::api::core::v1::Container]| -> Value {
        let converted: Vec<Value> = containers
            .iter()
            .map(|c| {
                let mut c = json!(c);
                for list in ["limits", "requests"] {
                    if let Some(map) =
                        c.get_mut("resources").and_then(|r| r.get_mut(list)).and_then(Value::as_object_mut)
                    {
                        map.retain(|name, _| !ours(name));
                    }
                }
                if let Some(entry) = uses.get(c["name"].as_str().unwrap_or_default()) {
                    let claims = &mut c["resources"]["claims"];
                    if !claims.is_array() {
                        *claims = json!([]);
                    }
                    if let Some(list) = claims.as_array_mut() {
                        list.push(json!({"name": entry}));
                    }
                }
                c
            })
            .collect();
        Value::Array(converted)
    };
    let mut ops = vec![
        json!({"op": "add", "path": "/spec/resourceClaims", "value": entries}),
        json!({"op": "replace", "path": "/spec/containers", "value": convert(&spec.containers)}),
    ];
    if let Some(init) = &spec.init_containers {
        ops.push(json!({"op": "replace", "path": "/spec/initContainers", "value": convert(init)}));
    }
    Ok(ops)
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
            shares: Shares::DevicePlugin,
            tolerations: Vec::new(),
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
    fn tolerations_are_written_as_taints() {
        let t = parse_tolerations(DEFAULT_GPU_POD_TOLERATIONS).unwrap();
        assert_eq!(
            serde_json::to_value(&t).unwrap(),
            json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                   {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}])
        );
        let any = parse_tolerations("example.com/gpu").unwrap();
        assert_eq!(
            serde_json::to_value(&any).unwrap(),
            json!([{"key": "example.com/gpu", "operator": "Exists"}])
        );
        assert!(parse_tolerations("none").unwrap().is_empty());
        for bad in ["", "a:NoWay", "=x:NoSchedule", "a=b c", "a,,b", "k=v=w"] {
            assert!(parse_tolerations(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_tolerations("a:NoWay").unwrap_err().contains("none of NoSchedule"));
    }

    #[test]
    fn a_gpu_pod_gets_the_tolerations_it_lacks() {
        let a =
            Admission { tolerations: parse_tolerations(DEFAULT_GPU_POD_TOLERATIONS).unwrap(), ..admission() };
        let r = a.review(&review(gpu("30"))).response.unwrap();
        let patch = decoded_patch(&r);
        assert_eq!(patch[1]["path"], "/spec/tolerations");
        assert_eq!(patch[1]["value"].as_array().unwrap().len(), 2, "{patch}");
        // One it has (or one that covers it: any value of the key) is not given again; the rest
        // are added to its own.
        let mut spec = gpu("30");
        spec["tolerations"] = json!([{"key": "nvidia.com/gpu", "operator": "Exists"}]);
        let patch = decoded_patch(&a.review(&review(spec)).response.unwrap());
        assert_eq!(
            patch.as_array().unwrap()[1..],
            [json!({"op": "add", "path": "/spec/tolerations/-",
                    "value": {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}})]
        );
        // A toleration of everything covers all; one that expires covers nothing.
        let mut spec = gpu("30");
        spec["tolerations"] = json!([{"operator": "Exists"}]);
        assert_eq!(decoded_patch(&a.review(&review(spec)).response.unwrap()).as_array().unwrap().len(), 1);
        let mut spec = gpu("30");
        spec["tolerations"] = json!([{"operator": "Exists", "tolerationSeconds": 60}]);
        assert_eq!(decoded_patch(&a.review(&review(spec)).response.unwrap()).as_array().unwrap().len(), 3);
        // A pod that asks no GPU gets none.
        let cpu = json!({"containers": [{"name": "c"}]});
        assert!(a.review(&review(cpu)).response.unwrap().patch.is_none());
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
    fn with_dra_a_gpu_pod_gets_claims_from_nano_gpus_templates_and_loses_the_resources() {
        let claims = Admission { shares: Shares::Claims, ..admission() };
        let spec = json!({
            "initContainers": [{"name": "init", "resources": {"limits": {"nano-gpu/gpu-percent": "30"}}}],
            "containers": [
                {"name": "train", "resources": {"limits": {"nano-gpu/gpu-percent": "30", "cpu": "1"}}},
                {"name": "two", "resources": {"limits": {"nano-gpu/gpu-percent": "200"},
                    "requests": {"nano-gpu/gpu-percent": "200"}}},
                {"name": "mem", "resources": {"limits": {"nano-gpu/gpu-percent": "10", "nano-gpu/gpu-memory": "4096"}, "claims": [{"name": "own"}]}},
                {"name": "web", "resources": {"limits": {"cpu": "1"}}},
            ],
            "resourceClaims": [{"name": "own", "resourceClaimName": "mine"}],
        });
        let r = claims.review(&review(spec)).response.unwrap();
        assert!(r.allowed, "{:?}", r.status);
        let patch = decoded_patch(&r);
        let ops = patch.as_array().unwrap();
        // No extender scheduler: the claims are allocated before kube-scheduler sees the pod.
        assert!(ops.iter().all(|o| o["path"] != "/spec/schedulerName"), "{patch}");
        let by_path = |p: &str| ops.iter().find(|o| o["path"] == p).unwrap()["value"].clone();
        assert_eq!(
            by_path("/spec/resourceClaims"),
            json!([{"name": "own", "resourceClaimName": "mine"},
                   {"name": "nano-gpu-0", "resourceClaimTemplateName": "nano-gpu-p30"},
                   {"name": "nano-gpu-1", "resourceClaimTemplateName": "nano-gpu-w2"},
                   {"name": "nano-gpu-2", "resourceClaimTemplateName": "nano-gpu-p10-m4096"}])
        );
        let containers = by_path("/spec/containers");
        assert_eq!(
            containers[0]["resources"],
            json!({"limits": {"cpu": "1"}, "claims": [{"name": "nano-gpu-0"}]})
        );
        assert_eq!(
            containers[1]["resources"],
            json!({"limits": {}, "requests": {}, "claims": [{"name": "nano-gpu-1"}]})
        );
        assert_eq!(containers[2]["resources"]["claims"], json!([{"name": "own"}, {"name": "nano-gpu-2"}]));
        assert_eq!(containers[3]["resources"], json!({"limits": {"cpu": "1"}}));
        // The init container reuses its app container's cards: the same claim.
        let init = by_path("/spec/initContainers");
        assert_eq!(init[0]["resources"], json!({"limits": {}, "claims": [{"name": "nano-gpu-0"}]}));

        // Only pods annotated for DRA, when the allocator allocates claims but not all shares go there.
        let annotated = Admission { shares: Shares::ClaimsIfAnnotated, ..admission() };
        let plain = annotated.review(&review(gpu("30"))).response.unwrap();
        assert_eq!(decoded_patch(&plain)[0]["path"], "/spec/schedulerName");
        let mut asked = review(gpu("30"));
        asked.request.as_mut().unwrap().object.as_mut().unwrap()["metadata"]["annotations"] =
            json!({"nano-gpu/front-end": "dra"});
        let r = annotated.review(&asked).response.unwrap();
        assert_eq!(decoded_patch(&r)[0]["path"], "/spec/resourceClaims");
        // Without DRA such a pod is refused, not silently served by the device plugin.
        let r = admission().review(&asked).response.unwrap();
        assert!(!r.allowed);
        assert!(r.status.unwrap().message.contains("does not allocate claims"));
        // A claim entry by the name nano-gpu would use is refused.
        let mut taken = gpu("30");
        taken["resourceClaims"] = json!([{"name": "nano-gpu-0", "resourceClaimName": "x"}]);
        let r = claims.review(&review(taken)).response.unwrap();
        assert!(!r.allowed);
        assert!(r.status.unwrap().message.contains("nano-gpu-0"));
    }

    #[test]
    fn a_review_without_a_request_is_refused() {
        let r = admission().review(&AdmissionReview::default()).response.unwrap();
        assert!(!r.allowed);
    }
}
