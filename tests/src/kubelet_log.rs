//! What a local-cluster kubelet's own log says about our plugin's registration after its start, for
//! the tests that restart kubelets: when the agent registered, and whether a pod the kubelet failed
//! for want of a healthy device was denied before that (the kubelet's first batch, upstream).

use crate::cluster::Cluster;
use std::time::Duration;

/// How soon after a kubelet's start (its eviction manager's, the line after its device manager's
/// start at this log level) our plugin must have registered with it: 1 to 40 ms seen.
pub const REGISTERED_WITHIN: Duration = Duration::from_millis(500);

/// The log of `node`'s kubelet since it last started (`hack/cluster.sh` starts each one on a new
/// log).
pub fn log(cluster: &Cluster, node: &str) -> String {
    let path = cluster.path(&format!("kubelet-{node}.log"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The time of day of a klog line (`I1124 21:14:54.751062 ...`).
fn klog_time(line: &str) -> Option<Duration> {
    let t = line.get(6..21)?;
    let (h, m, s) = (t.get(0..2)?.parse::<u64>().ok()?, t.get(3..5)?.parse::<u64>().ok()?, t.get(6..)?);
    Some(Duration::from_secs(h * 3600 + m * 60) + Duration::from_secs_f64(s.parse().ok()?))
}

/// The time of the first line of `log` that holds `what`.
fn first(log: &str, what: &str) -> Option<Duration> {
    log.lines().find(|l| l.contains(what)).and_then(klog_time)
}

/// The kubelet's first registration of `nano-gpu/gpu-percent` in `log`.
fn registered(log: &str) -> Option<Duration> {
    first(
        log,
        r#"Got registration request from device plugin with resource" resourceName="nano-gpu/gpu-percent""#,
    )
}

/// How long after the kubelet of `log` started its eviction manager our plugin registered.
pub fn registration_lag(log: &str) -> Option<Duration> {
    registered(log)?.checked_sub(first(log, "Eviction manager: starting control loop")?)
}

/// Whether `node`'s kubelet failed pod `namespace/pod` (failed `why`) for want of a healthy device
/// before our plugin registered with it, and the registration came within [`REGISTERED_WITHIN`] of
/// its start: the restarted kubelet's first batch, which came before any plugin could register.
pub fn denied_before_registration(
    cluster: &Cluster,
    namespace: &str,
    pod: &str,
    node: &str,
    why: &str,
) -> bool {
    if !why.contains("no healthy devices present") {
        return false;
    }
    let log = log(cluster, node);
    let denied = log
        .lines()
        .find(|l| l.contains("Pod admission denied") && l.contains(&format!(r#"pod="{namespace}/{pod}""#)))
        .and_then(klog_time);
    let prompt = registration_lag(&log).is_some_and(|l| l < REGISTERED_WITHIN);
    prompt && denied.zip(registered(&log)).is_some_and(|(d, r)| d < r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_lag_come_from_the_kubelets_lines() {
        let log = "I1124 23:38:12.558785   17506 eviction_manager.go:193] \"Eviction manager: starting control loop\"\n\
                   I1124 23:38:12.560626   17506 server.go:161] \"Got registration request from device plugin with resource\" resourceName=\"nano-gpu/gpu-percent\"\n";
        assert_eq!(klog_time("I1124 23:38:12.5"), None);
        let lag = registration_lag(log).unwrap();
        assert!(lag > Duration::from_micros(1_800) && lag < Duration::from_micros(1_900), "{lag:?}");
        assert_eq!(registration_lag("I1124 23:38:12.558785 no such lines"), None);
    }
}
