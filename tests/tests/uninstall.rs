//! `kubectl nano-gpu uninstall` on a real node: with a share running, a GPU pod Pending for
//! `nano-gpu-scheduler`, a socket a killed agent left behind and an image pull Secret on the agents'
//! ServiceAccount (copied for the cleanup pods), `--dry-run` changes nothing; the
//! uninstall then leaves no object of the install (inside or outside its namespace), no `nano-gpu/`
//! key on the Node, none of nano-gpu's files on the node, and no cleanup pod or namespace of its
//! own; the running share keeps running; the Pending pod gets an Event saying why it waits. A second
//! run finds nothing left to do.

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use nano_gpu_proto::install::{KEY_PREFIX, NAMESPACE, OUTSIDE};
use nano_gpu_tests::cluster::{Cluster, NS, create, percent_pod, wait_running, wait_until};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstall_leaves_nothing_and_running_shares_keep_their_cards() {
    let cluster = Cluster::up("uninstall", 1);
    let client = cluster.client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let nodes: Api<Node> = Api::all(client.clone());
    cluster.ok(&["create", "namespace", NS]);

    // A running share, and a GPU pod no node takes (its node selector matches none).
    create(&pods, &percent_pod("share", 30)).await;
    wait_running(&pods, &["share".to_owned()], Duration::from_secs(120)).await;
    let mut waits = percent_pod("waits", 30);
    waits.spec.as_mut().unwrap().node_selector = Some([("no-such".to_owned(), "node".to_owned())].into());
    let waits = create(&pods, &waits).await;
    assert_eq!(waits.spec.unwrap().scheduler_name.as_deref(), Some("nano-gpu-scheduler"));
    // What a killed agent leaves: its socket in the kubelet's plugin directory.
    let plugins = cluster.path("nodes/node-1/var/lib/kubelet/device-plugins");
    let stale = plugins.join("nano-gpu.killed-agent.sock");
    std::fs::write(&stale, "").unwrap();
    assert!(std::path::Path::new("/run/nano-gpu/mps").is_dir(), "the install made no MPS directory");

    let keys = |node: &Node| -> Vec<String> {
        let m = &node.metadata;
        m.labels
            .iter()
            .chain(&m.annotations)
            .flatten()
            .map(|(k, _)| k.clone())
            .filter(|k| k.starts_with(KEY_PREFIX))
            .collect()
    };
    assert!(!keys(&nodes.get("node-1").await.unwrap()).is_empty(), "node-1 has no nano-gpu keys");
    // A private registry's Secret, as an operator gives the agents' ServiceAccount (the harness's
    // images are on the node already: nothing is pulled with it).
    cluster.ok(&[
        "create",
        "secret",
        "docker-registry",
        "nano-gpu-pull",
        "-n",
        NAMESPACE,
        "--docker-server=registry.invalid",
        "--docker-username=u",
        "--docker-password=p",
    ]);
    let pull = r#"{"imagePullSecrets":[{"name":"nano-gpu-pull"}]}"#;
    cluster.ok(&["patch", "serviceaccount", "nano-gpu-agent", "-n", NAMESPACE, "-p", pull]);
    let pull_line = format!("secret/nano-gpu-pull -n {NAMESPACE}");

    // --dry-run: says what would go, and nothing goes.
    let out = cluster.kubectl_plugin(&["uninstall", "--dry-run"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("uninstall --dry-run:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    assert!(
        text.contains("would be deleted") && text.contains("would run nano-gpu-agent clean-node"),
        "{text}"
    );
    assert!(text.lines().any(|l| l.contains(&pull_line) && l.contains("would be copied")), "{text}");
    assert!(
        cluster.kubectl(&["get", "namespace", NAMESPACE]).status.success(),
        "the dry run deleted the namespace"
    );
    let webhook = ["get", "mutatingwebhookconfiguration", "nano-gpu-allocator"];
    assert!(cluster.kubectl(&webhook).status.success(), "the dry run deleted the webhook");
    assert!(stale.exists() && !keys(&nodes.get("node-1").await.unwrap()).is_empty());

    let out = cluster.kubectl_plugin(&["uninstall", "--timeout", "180"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("uninstall:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "uninstall failed");
    assert!(text.lines().any(|l| l.contains(&pull_line) && l.contains("pull with a copy of it")), "{text}");

    // No object of the install is left, inside its namespace or out of it.
    for o in OUTSIDE {
        let kind = if o.group.is_empty() { o.plural.to_owned() } else { format!("{}.{}", o.plural, o.group) };
        let mut args = vec!["get", kind.as_str(), o.name, "--ignore-not-found", "-o", "name"];
        if !o.namespace.is_empty() {
            args.extend(["-n", o.namespace]);
        }
        // Every kind is served (the suite's oldest Kubernetes is 1.35): a wrong group or plural fails here.
        let out = cluster.kubectl(&args);
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "", "{} {} is left", o.kind, o.name);
    }
    for ns in [NAMESPACE, "nano-gpu-uninstall"] {
        let left = cluster.ok(&["get", "namespace", ns, "--ignore-not-found", "-o", "name"]);
        assert_eq!(left.trim(), "", "namespace {ns} is left");
    }
    // Nor a key on the Node, nor a file on the node.
    assert_eq!(keys(&nodes.get("node-1").await.unwrap()), Vec::<String>::new());
    assert!(!stale.exists(), "the killed agent's socket is left");
    // The harness's nodes share this machine's /run (see hack/cluster.sh).
    assert!(!std::path::Path::new("/run/nano-gpu").exists(), "/run/nano-gpu is left");
    let sockets: Vec<String> = std::fs::read_dir(&plugins)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("nano-gpu"))
        .collect();
    assert_eq!(sockets, Vec::<String>::new());

    // The running share keeps running, never restarted; the waiting pod is told why it waits.
    let share = pods.get("share").await.unwrap();
    let status = share.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Running"));
    assert!(status.container_statuses.unwrap().iter().all(|c| c.restart_count == 0));
    wait_until("the Event on the waiting pod", Duration::from_secs(30), || async {
        let events = cluster.ok(&[
            "get",
            "events",
            "-n",
            NS,
            "--field-selector",
            "reason=Uninstalled,involvedObject.name=waits",
            "-o",
            "jsonpath={.items[*].message}",
        ]);
        events.contains("no scheduler serves nano-gpu-scheduler")
    })
    .await;

    // Again: nothing is left to do, and that is no failure.
    let out = cluster.kubectl_plugin(&["uninstall"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("uninstall again:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    assert!(
        !text.contains("deleted (") && !text.contains("clean-node") && !text.contains("removed"),
        "{text}"
    );
    cluster.down();
}
