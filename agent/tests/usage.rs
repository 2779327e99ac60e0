//! Usage sampling through the real nvml-wrapper FFI path against the fake NVML: a process listed in
//! its file and a live one (this test, holding a lock on a file of the fake's process directory) are
//! sampled on their cards, put beside their containers' grants through a fake `/proc` tree, and
//! rendered as metrics; a process that lets go of its card is gone from the next sample. The live
//! one is an MPS client, which NVML lists apart from the other processes of its card.

use nano_gpu_agent::cards::inventory::{GpuInventory, NvmlInventory};
use nano_gpu_agent::node::pods::Resident;
use nano_gpu_agent::serve::usage::{CardSample, ProcessSample, attribute, metrics, procs::Procs};
use nano_gpu_proto::annotations::CardGrant;
use nano_gpu_proto::units::{MiB, Percent};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

const TEST: &str = "processes_on_fake_cards_are_sampled_and_attributed_to_their_containers";
const POD_A: &str = "11111111-2222-3333-4444-555555555555";
const POD_B: &str = "66666666-7777-8888-9999-000000000000";

/// Writes process `pid` in container `id` of pod `uid` into a fake `/proc` tree.
fn process(root: &Path, pid: u32, uid: &str, id: char) {
    let dir = root.join(pid.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("stat"),
        format!("{pid} (python) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 777 0 0"),
    )
    .unwrap();
    let id = id.to_string().repeat(64);
    std::fs::write(dir.join("cgroup"), format!("4:memory:/kubepods/besteffort/pod{uid}/{id}\n0::/\n"))
        .unwrap();
}

fn resident(
    uid: &str,
    name: &str,
    container: &str,
    id: char,
    uuid: &str,
    index: u32,
    percent: u32,
) -> Resident {
    Resident {
        namespace: "ml".into(),
        name: name.into(),
        uid: uid.into(),
        containers: [(id.to_string().repeat(64), container.to_owned())].into(),
        grants: [(
            container.to_owned(),
            vec![CardGrant { uuid: uuid.into(), index, percent: Percent(percent), memory_mib: None }],
        )]
        .into(),
        claims: Default::default(),
        mark: None,
    }
}

#[test]
fn processes_on_fake_cards_are_sampled_and_attributed_to_their_containers() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-usage-{}", std::process::id()));
    let Some(config) = std::env::var_os("FAKE_NVML_CONFIG") else {
        let procs = dir.join("procs");
        std::fs::create_dir_all(&procs).unwrap();
        let config = dir.join("nvml.json");
        let doc = serde_json::json!({
            "cards": [
                {"uuid": "GPU-a", "name": "Tesla T4", "memoryMiB": 15360, "temperature": 51, "powerW": 33.5},
                {"uuid": "GPU-b", "name": "Tesla T4", "memoryMiB": 15360}
            ],
            "processes": [
                {"card": 0, "pid": 4242, "memoryMiB": 2048, "sm": 30},
                {"card": 1, "pid": 4343, "memoryMiB": 66, "mpsServer": true}
            ],
            "processDir": procs,
        });
        std::fs::write(&config, doc.to_string()).unwrap();
        nano_gpu_tests::run_test_in_child(TEST, &[("FAKE_NVML_CONFIG", config.as_os_str())]);
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    };
    let dir = Path::new(&config).parent().unwrap().to_owned();
    // This process takes 5,000 MiB and 10 % of card b, as long as it holds the lock, as an MPS
    // client of the card's server (4343): NVML lists both with their own memory, and samples the
    // client's work under the server's PID, as a real card does.
    let mut file = std::fs::File::create(dir.join("procs/me.json")).unwrap();
    file.lock().unwrap();
    file.write_all(br#"{"uuid":"GPU-b","memoryMiB":5000,"sm":10,"mps":true}"#).unwrap();
    let me = std::process::id();

    let nvml = NvmlInventory::new(nano_gpu_tests::fake_nvml());
    let cards = nvml.cards().unwrap();
    let samples = nvml.sample().unwrap();
    let seen = |pid, used, sm| ProcessSample { pid, memory: Some(MiB(used)), sm };
    let card = |uuid: &str, index, used, util, temperature, power_mw, processes| CardSample {
        uuid: String::from(uuid),
        index,
        memory_used: MiB(used),
        memory_total: MiB(15_360),
        utilization: Some(util),
        temperature: Some(temperature),
        power_mw: Some(power_mw),
        processes,
    };
    assert_eq!(
        samples,
        [
            card("GPU-a", 0, 2048, 30, 51, 33_500, vec![seen(4242, 2048, Some(30))]),
            card("GPU-b", 1, 5066, 10, 40, 70_000, vec![seen(4343, 66, Some(10)), seen(me, 5000, None)]),
        ]
    );

    let proc_root = dir.join("proc");
    process(&proc_root, 4242, POD_A, 'a');
    process(&proc_root, me, POD_B, 'b');
    let residents: BTreeMap<String, Resident> = [
        resident(POD_A, "train", "trainer", 'a', "GPU-a", 0, 30),
        resident(POD_B, "serve", "server", 'b', "GPU-b", 1, 20),
    ]
    .into_iter()
    .map(|r| (r.uid.clone(), r))
    .collect();
    let mut procs = Procs::new(&proc_root);
    let report = attribute(&samples, &cards, &residents, &Default::default(), &mut procs, |_| 0);
    // The MPS server runs in no pod with a share (the MPS daemons' own): its memory is nobody's.
    assert_eq!(report.unattributed.iter().map(|u| (u.pid, u.memory)).collect::<Vec<_>>(), [(4343, MiB(66))]);
    let text = metrics::render(&report, "node-1", 0.0);
    let value = |series: &str| {
        text.lines().find_map(|l| l.strip_prefix(series)).map(str::trim).unwrap_or("absent").to_owned()
    };
    let labels = |pod: &str, container: &str, gpu: u32, uuid: &str| {
        format!(
            "{{node=\"node-1\",namespace=\"ml\",pod=\"{pod}\",container=\"{container}\",gpu=\"{gpu}\",uuid=\"{uuid}\"}}"
        )
    };
    let trainer = labels("train", "trainer", 0, "GPU-a");
    let server = labels("serve", "server", 1, "GPU-b");
    assert_eq!(value(&format!("nano_gpu_container_memory_used_bytes{trainer}")), (2048u64 << 20).to_string());
    assert_eq!(value(&format!("nano_gpu_container_utilization_percent{trainer}")), "30");
    assert_eq!(value(&format!("nano_gpu_container_memory_used_bytes{server}")), (5000u64 << 20).to_string());
    // 20 % of a 15,360 MiB card holds 3,072 MiB: the server uses more than its grant.
    assert_eq!(
        value(&format!("nano_gpu_container_granted_memory_bytes{server}")),
        (3072u64 << 20).to_string()
    );
    assert!(report.containers.iter().any(|r| r.container == "server" && r.over_memory()));
    assert_eq!(
        value("nano_gpu_card_power_watts{node=\"node-1\",gpu=\"0\",uuid=\"GPU-a\",model=\"Tesla T4\"}"),
        "33.5"
    );

    // The process lets go of the card: its use is gone, as a CUDA context's is when it ends.
    file.unlock().unwrap();
    let after = nvml.sample().unwrap();
    assert_eq!(after[1].processes, [seen(4343, 66, None)], "the server stays, idle");
    assert_eq!(after[1].memory_used, MiB(66));
    assert_eq!(after[0].processes.len(), 1);
}
