//! What a local-cluster kubelet's own log says about our plugin after the kubelet's start, for the
//! tests that restart kubelets: when the agent registered, when the kubelet had its devices, and
//! whether a pod the kubelet failed for want of a healthy device was denied before that (a
//! restarted kubelet's first admissions, upstream).

use crate::cluster::Cluster;
use std::time::Duration;

/// How soon after a kubelet's start (its eviction manager's, the line after its device manager's
/// start at this log level) our plugin must have registered with it: 1 to 40 ms seen.
pub const REGISTERED_WITHIN: Duration = Duration::from_millis(500);

/// How soon after our registration the kubelet must have our devices (its first ListAndWatch
/// answer): it dials our socket, asks our options and opens the stream, each answered at once; a
/// few milliseconds, 330 ms seen with two clusters on 2 cores (the registration's answer came then).
pub const LISTED_WITHIN: Duration = Duration::from_secs(2);

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

/// When the kubelet of `log` first had our devices: its line for the first ListAndWatch answer
/// (`client.go` at -v=2, `hack/cluster.sh`).
fn listed(log: &str) -> Option<Duration> {
    first(log, r#""State pushed for device plugin" resource="nano-gpu/gpu-percent""#)
}

/// Each time the kubelet of `log` had no plugin for `nano-gpu/gpu-percent` while running: from its
/// line for the plugin's disconnection (with no other plugin for the resource, its devices are
/// marked unhealthy then, so it fails what it admits) to the next ListAndWatch answer of a plugin
/// (`client.go` at -v=2, `hack/cluster.sh`).
pub fn unserved_windows(log: &str) -> Vec<Duration> {
    const GONE: &str = r#""Device plugin disconnected" resource="nano-gpu/gpu-percent""#;
    const BACK: &str = r#""State pushed for device plugin" resource="nano-gpu/gpu-percent""#;
    let mut windows = Vec::new();
    let mut since = None;
    for line in log.lines() {
        if line.contains(GONE) {
            since = since.or_else(|| klog_time(line));
        } else if line.contains(BACK)
            && let (Some(from), Some(to)) = (since.take(), klog_time(line))
        {
            windows.push(to.saturating_sub(from));
        }
    }
    windows
}

/// How long after the kubelet of `log` started its eviction manager our plugin registered: zero when
/// it registered before (the kubelet's plugin registration may start first).
pub fn registration_lag(log: &str) -> Option<Duration> {
    Some(registered(log)?.saturating_sub(first(log, "Eviction manager: starting control loop")?))
}

/// How long after our registration the kubelet of `log` had our devices.
pub fn listing_lag(log: &str) -> Option<Duration> {
    listed(log)?.checked_sub(registered(log)?)
}

/// Whether `node`'s kubelet failed pod `namespace/pod` (failed `why`) for want of a healthy device
/// before it had our devices, while we were prompt: registered within [`REGISTERED_WITHIN`] of its
/// start, listed within [`LISTED_WITHIN`] of that. Those are a restarted kubelet's first
/// admissions, which may come milliseconds after its device manager starts, before any plugin can
/// be heard. `None` while that cannot be told yet: the kubelet denied it so and does not have our
/// devices yet (the pod's status is written milliseconds after the denial; the devices may come
/// hundreds later on a loaded machine).
pub fn denied_before_our_devices(
    cluster: &Cluster,
    namespace: &str,
    pod: &str,
    node: &str,
    why: &str,
) -> Option<bool> {
    if !why.contains("no healthy devices present") {
        return Some(false);
    }
    first_admissions(&log(cluster, node), namespace, pod)
}

/// [`denied_before_our_devices`], from the kubelet's `log`, for a pod it failed for want of a
/// healthy device.
fn first_admissions(log: &str, namespace: &str, pod: &str) -> Option<bool> {
    let pod = format!(r#"pod="{namespace}/{pod}""#);
    let denial = log.lines().find(|l| l.contains("Pod admission denied") && l.contains(&pod));
    let Some(denied) = denial.and_then(klog_time) else {
        return Some(false);
    };
    let listed = listed(log)?;
    let prompt = registration_lag(log).is_some_and(|l| l < REGISTERED_WITHIN)
        && listing_lag(log).is_some_and(|l| l < LISTED_WITHIN);
    Some(prompt && denied < listed)
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
        // Registered before the eviction manager started (seen on a landing CI's restarted kubelet):
        // no wait at all.
        let early = "I1129 00:55:01.100000   17506 server.go:161] \"Got registration request from device plugin with resource\" resourceName=\"nano-gpu/gpu-percent\"\n\
                     I1129 00:55:01.200000   17506 eviction_manager.go:193] \"Eviction manager: starting control loop\"\n";
        assert_eq!(registration_lag(early), Some(Duration::ZERO));
    }

    #[test]
    fn an_unserved_window_runs_from_the_last_disconnection_to_the_next_push() {
        let line = |at: &str, what: &str| format!("I1128 {at}   27314 manager.go:274] {what}\n");
        let gone = r#""Device plugin disconnected" resource="nano-gpu/gpu-percent""#;
        let back = r#""State pushed for device plugin" resource="nano-gpu/gpu-percent" resourceCapacity=400"#;
        let other = r#""State pushed for device plugin" resource="aliyun.com/gpu-mem" resourceCapacity=64"#;
        let log = [
            line("04:10:00.000000", back),
            line("04:10:05.100000", gone),
            line("04:10:05.200000", other),
            line("04:10:07.350000", back),
            line("04:10:09.000000", back),
            line("04:11:00.000000", gone),
        ]
        .concat();
        // The second disconnection has no push after it yet: no window.
        assert_eq!(unserved_windows(&log), [Duration::from_millis(2_250)]);
        assert!(unserved_windows("").is_empty());
    }

    /// The lines of the landing CI's node-3 kubelet that failed 24 shares (02:31:28), and the
    /// ListAndWatch line its -v=1 did not print.
    #[test]
    fn a_denial_before_the_kubelet_had_our_devices_is_its_own_once_the_devices_came() {
        let start = "I1125 02:31:28.717445   27314 eviction_manager.go:193] \"Eviction manager: starting control loop\"\n\
                     I1125 02:31:28.756391   27314 server.go:161] \"Got registration request from device plugin with resource\" resourceName=\"nano-gpu/gpu-percent\"\n\
                     I1125 02:31:28.900648   27314 allocation_manager.go:660] \"Pod admission denied\" podUID=\"a92a\" pod=\"e2e/kubelets-01\" reason=\"UnexpectedAdmissionError\"\n";
        // Denied, our devices not there yet: not told yet.
        assert_eq!(first_admissions(start, "e2e", "kubelets-01"), None);
        // A pod it did not deny is not its own.
        assert_eq!(first_admissions(start, "e2e", "kubelets-02"), Some(false));
        let pushed = |at: &str| {
            format!(
                "{start}I1125 {at}   27314 client.go:98] \"State pushed for device plugin\" resource=\"nano-gpu/gpu-percent\" resourceCapacity=400\n"
            )
        };
        assert_eq!(listing_lag(&pushed("02:31:29.081000")), Some(Duration::from_micros(324_609)));
        assert_eq!(first_admissions(&pushed("02:31:29.081000"), "e2e", "kubelets-01"), Some(true));
        // Devices that came before the denial: ours.
        assert_eq!(first_admissions(&pushed("02:31:28.890000"), "e2e", "kubelets-01"), Some(false));
        // Devices that came too late after the registration: ours too.
        assert_eq!(first_admissions(&pushed("02:31:31.000000"), "e2e", "kubelets-01"), Some(false));
    }
}
