//! The agent's pod-resources client against a kubelet that rate-limits it (the kubelet allows 100
//! calls a second in bursts of 10): the call waits and asks again instead of failing.

use nano_gpu_agent::node::podresources::{Lister, PodResourcesSocket};
use nano_gpu_proto::resources::GPU_PERCENT;
use nano_gpu_tests::fake_kubelet::{Allocated, FakeKubelet};

#[tokio::test]
async fn a_rate_limited_list_is_asked_again_not_given_up() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-podresources-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let kubelet = FakeKubelet::start(&dir).unwrap();
    let p = Allocated {
        namespace: "ns".into(),
        pod: "p".into(),
        container: "c".into(),
        resource: GPU_PERCENT.into(),
        ids: vec![],
    };
    kubelet.pod_resources.put(p);
    kubelet.pod_resources.rate_limit(3);
    let lister = PodResourcesSocket::new(kubelet.pod_resources_socket.clone());
    let answer = lister.list().await.expect("the list after the limiter let it through");
    assert_eq!(answer.pod_resources[0].name, "p");
    assert_eq!(kubelet.pod_resources.calls(), 4);
    let _ = std::fs::remove_dir_all(&dir);
}
