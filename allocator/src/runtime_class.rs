//! The RuntimeClass the webhook gives GPU pods (`--runtime-class`), applied as the API server applies
//! a class a pod names at creation. The API server's own RuntimeClass admission step runs before
//! mutating webhooks: it sets the class's `overhead` on the pod and merges its `scheduling` (node
//! selector and tolerations) into the pod's, and later refuses a pod whose overhead differs from its
//! class's. A class given by the webhook missed the first step, so without this a class with an
//! overhead would have every GPU pod refused, and one with scheduling constraints would not hold them.
//!
//! The class is watched by name ([`watch`]) and kept in a [`Known`]; [`ops`] is pure.

use k8s_openapi::api::core::v1::{PodSpec, Toleration};
use k8s_openapi::api::node::v1::RuntimeClass;
use serde_json::{Value, json};
use std::sync::{Arc, RwLock};

/// The class as last read, shared by the watch and the webhook (`None`: not read yet, or it does not
/// exist: the webhook then gives the name only, and the API server judges the pod).
pub type Known = Arc<RwLock<Option<RuntimeClass>>>;

/// The JSON patch operations that apply `class`'s overhead and scheduling to a pod with `spec`, which
/// is being given the class; or, where the pod's node selector contradicts the class's, why the pod
/// is refused (the API server's words for a pod that names the class itself).
pub fn ops(spec: &PodSpec, class: &RuntimeClass) -> Result<Vec<Value>, String> {
    let mut ops = Vec::new();
    // A pod that sets an overhead of its own is compared with the class's by the API server.
    if let Some(overhead) = class.overhead.as_ref().and_then(|o| o.pod_fixed.as_ref())
        && spec.overhead.is_none()
    {
        ops.push(json!({"op": "add", "path": "/spec/overhead", "value": overhead}));
    }
    let Some(scheduling) = class.scheduling.as_ref() else { return Ok(ops) };
    if let Some(wanted) = scheduling.node_selector.as_ref().filter(|s| !s.is_empty()) {
        let mut selector = spec.node_selector.clone().unwrap_or_default();
        for (key, value) in wanted {
            match selector.get(key) {
                Some(own) if own != value => {
                    return Err(format!(
                        "conflict: runtimeClass.scheduling.nodeSelector[{key}] = {value}; \
                         pod.spec.nodeSelector[{key}] = {own} (the RuntimeClass {} that nano-gpu gives GPU pods)",
                        class.metadata.name.as_deref().unwrap_or("")
                    ));
                }
                _ => {
                    selector.insert(key.clone(), value.clone());
                }
            }
        }
        ops.push(json!({"op": "add", "path": "/spec/nodeSelector", "value": selector}));
    }
    if let Some(extra) = scheduling.tolerations.as_ref().filter(|t| !t.is_empty()) {
        let mut tolerations: Vec<Toleration> = spec.tolerations.clone().unwrap_or_default();
        let before = tolerations.len();
        for t in extra {
            if !tolerations.iter().any(|own| covers(own, t)) {
                tolerations.push(t.clone());
            }
        }
        if tolerations.len() > before {
            ops.push(json!({"op": "add", "path": "/spec/tolerations", "value": tolerations}));
        }
    }
    Ok(ops)
}

/// Whether toleration `own` already tolerates everything `other` does (the same key, effect and
/// value, or `own` tolerating any value or any effect of the key), as Kubernetes merges a class's
/// tolerations into a pod's.
fn covers(own: &Toleration, other: &Toleration) -> bool {
    let exists = |t: &Toleration| t.operator.as_deref() == Some("Exists");
    let key = own.key == other.key || (own.key.as_deref().unwrap_or("").is_empty() && exists(own));
    let effect = own.effect == other.effect || own.effect.as_deref().unwrap_or("").is_empty();
    let value = exists(own) || (own.value == other.value && !exists(other));
    let seconds = own.toleration_seconds.is_none() || own.toleration_seconds == other.toleration_seconds;
    key && effect && value && seconds
}

/// Keeps `known` equal to the RuntimeClass `name` as the API server has it, until the process ends;
/// a class that is deleted (or not there) is `None`. Errors are logged and retried with backoff.
pub async fn watch(client: kube::Client, name: String, known: Known) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let api: kube::Api<RuntimeClass> = kube::Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher::watcher(api, config).backoff(nano_gpu_runtime::watch_backoff()).boxed();
    let set = |class: Option<RuntimeClass>| {
        *known.write().unwrap_or_else(|e| e.into_inner()) = class;
    };
    let mut seen = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Init) => seen = false,
            Ok(watcher::Event::InitApply(class) | watcher::Event::Apply(class)) => {
                seen = true;
                tracing::info!(class = %name, overhead = class.overhead.is_some(), scheduling = class.scheduling.is_some(), "RuntimeClass read");
                set(Some(class));
            }
            Ok(watcher::Event::InitDone) if !seen => {
                tracing::warn!(class = %name, "the RuntimeClass GPU pods are given does not exist; the API server will refuse them");
                set(None);
            }
            Ok(watcher::Event::InitDone) => {}
            Ok(watcher::Event::Delete(_)) => {
                tracing::warn!(class = %name, "the RuntimeClass GPU pods are given was deleted");
                set(None);
            }
            Err(e) => tracing::warn!(class = %name, error = %e, "watching the RuntimeClass failed; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(value: Value) -> RuntimeClass {
        let mut base = json!({"metadata": {"name": "nvidia"}, "handler": "nvidia"});
        for (k, v) in value.as_object().unwrap() {
            base[k] = v.clone();
        }
        serde_json::from_value(base).unwrap()
    }

    fn spec(value: Value) -> PodSpec {
        let mut base = json!({"containers": [{"name": "c"}]});
        for (k, v) in value.as_object().unwrap() {
            base[k] = v.clone();
        }
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn a_classs_overhead_and_scheduling_are_applied_as_the_api_server_would() {
        let nvidia = class(json!({
            "overhead": {"podFixed": {"cpu": "50m", "memory": "16Mi"}},
            "scheduling": {"nodeSelector": {"gpu": "nvidia"},
                           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}));
        let got = ops(&spec(json!({"nodeSelector": {"zone": "a"}})), &nvidia).unwrap();
        assert_eq!(
            got,
            vec![
                json!({"op": "add", "path": "/spec/overhead", "value": {"cpu": "50m", "memory": "16Mi"}}),
                json!({"op": "add", "path": "/spec/nodeSelector", "value": {"gpu": "nvidia", "zone": "a"}}),
                json!({"op": "add", "path": "/spec/tolerations", "value": [
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}),
            ]
        );
        // A pod's own overhead is left for the API server to compare; a toleration it has is not
        // added twice; the same selector value is no conflict.
        let own = spec(json!({"overhead": {"cpu": "1"}, "nodeSelector": {"gpu": "nvidia"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}));
        assert_eq!(
            ops(&own, &nvidia).unwrap(),
            vec![json!({"op": "add", "path": "/spec/nodeSelector", "value": {"gpu": "nvidia"}})]
        );
        // A contradicting selector is refused in the API server's words.
        let e = ops(&spec(json!({"nodeSelector": {"gpu": "amd"}})), &nvidia).unwrap_err();
        assert!(e.starts_with("conflict: runtimeClass.scheduling.nodeSelector[gpu] = nvidia; pod.spec.nodeSelector[gpu] = amd"), "{e}");
        // A plain class asks nothing.
        assert!(ops(&spec(json!({})), &class(json!({}))).unwrap().is_empty());
    }

    #[test]
    fn a_toleration_covers_another_only_when_it_tolerates_all_of_it() {
        let t = |v: Value| -> Toleration { serde_json::from_value(v).unwrap() };
        let exact = t(json!({"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"}));
        assert!(covers(&exact, &exact));
        assert!(covers(&t(json!({"key": "k", "operator": "Exists"})), &exact));
        assert!(covers(&t(json!({"operator": "Exists"})), &exact));
        assert!(!covers(&exact, &t(json!({"key": "k", "operator": "Exists", "effect": "NoSchedule"}))));
        assert!(!covers(&t(json!({"key": "k", "operator": "Equal", "value": "w"})), &exact));
        assert!(!covers(&t(json!({"key": "k", "operator": "Exists", "effect": "NoExecute"})), &exact));
    }
}
