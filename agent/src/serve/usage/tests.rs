//! Attribution against a fake `/proc` tree and pods as the watch shows them.

use super::procs::tests::{temp_dir, write_process};
use super::*;
use nano_gpu_proto::annotations::CardGrant;

const POD_A: &str = "11111111-2222-3333-4444-555555555555";
const POD_B: &str = "66666666-7777-8888-9999-000000000000";

fn id(c: char) -> String {
    c.to_string().repeat(64)
}

fn resident(
    uid: &str,
    name: &str,
    containers: &[(char, &str)],
    grants: &[(&str, &str, u32, Option<u64>)],
) -> Resident {
    let mut r = Resident {
        namespace: "ml".into(),
        name: name.into(),
        uid: uid.into(),
        containers: containers.iter().map(|(c, n)| (id(*c), (*n).to_owned())).collect(),
        grants: BTreeMap::new(),
        claims: BTreeMap::new(),
        mark: None,
    };
    for (container, uuid, percent, memory) in grants {
        r.grants.entry((*container).to_owned()).or_default().push(CardGrant {
            uuid: (*uuid).into(),
            index: uuid.trim_start_matches("GPU-").parse().unwrap_or(0),
            percent: Percent(*percent),
            memory_mib: memory.map(MiB),
        });
    }
    r
}

fn sample(uuid: &str, processes: &[(u32, u64, Option<u32>)]) -> CardSample {
    CardSample {
        uuid: uuid.into(),
        index: uuid.trim_start_matches("GPU-").parse().unwrap_or(0),
        memory_used: MiB(processes.iter().map(|p| p.1).sum()),
        memory_total: MiB(16_000),
        utilization: Some(processes.iter().filter_map(|p| p.2).sum()),
        processes: processes
            .iter()
            .map(|&(pid, mib, sm)| ProcessSample { pid, memory: Some(MiB(mib)), sm })
            .collect(),
        ..Default::default()
    }
}

/// A row as compared: pod, container, card, granted percent and MiB, used MiB, utilisation, PIDs.
type Row<'a> = (&'a str, &'a str, &'a str, u32, u64, u64, u32, Vec<u32>);

fn rows(report: &Report) -> Vec<Row<'_>> {
    let row = |r: &ContainerUsage| {
        (r.granted.0, r.granted_memory.0, r.memory_used.0, r.utilization, r.pids.clone())
    };
    report
        .containers
        .iter()
        .map(|r| {
            let (granted, granted_mib, used, sm, pids) = row(r);
            (r.pod.as_str(), r.container.as_str(), r.uuid.as_str(), granted, granted_mib, used, sm, pids)
        })
        .collect()
}

#[test]
fn processes_are_put_beside_their_containers_grants() {
    let root = temp_dir("attribute");
    // Pod A's trainer (two processes) on card 0, its sidecar on card 1 (which it was not given); pod
    // B's server on card 1; a host process on card 0; a process of a pod on another node.
    write_process(&root, 100, 1, &format!("4:memory:/kubepods/burstable/pod{POD_A}/{}\n", id('a')));
    write_process(&root, 101, 2, &format!("0::/kubepods/burstable/pod{POD_A}/{}\n", id('a')));
    write_process(&root, 102, 3, &format!("0::/kubepods/burstable/pod{POD_A}/{}\n", id('c')));
    let uid_b = POD_B.replace('-', "_");
    write_process(
        &root,
        200,
        4,
        &format!("0::/kubepods.slice/kubepods-pod{uid_b}.slice/cri-containerd-{}.scope\n", id('b')),
    );
    write_process(&root, 300, 5, "0::/system.slice/xorg.service\n");
    write_process(
        &root,
        400,
        6,
        &format!("0::/kubepods/pod99999999-2222-3333-4444-555555555555/{}\n", id('d')),
    );
    let residents: BTreeMap<String, Resident> = [
        resident(POD_A, "train", &[('a', "trainer"), ('c', "sidecar")], &[("trainer", "GPU-0", 30, None)]),
        resident(POD_B, "serve", &[('b', "server")], &[("server", "GPU-1", 50, Some(2000))]),
    ]
    .into_iter()
    .map(|r| (r.uid.clone(), r))
    .collect();
    let cards = vec![
        Card::nvidia(0, "GPU-0", "Tesla T4", MiB(15_360), None),
        Card::nvidia(1, "GPU-1", "Tesla T4", MiB(15_360), None),
    ];
    let samples = [
        sample("GPU-0", &[(100, 3000, Some(20)), (101, 1000, None), (300, 500, Some(5)), (400, 100, None)]),
        sample("GPU-1", &[(102, 700, Some(1)), (200, 2500, Some(40))]),
    ];
    let mut procs = procs::Procs::new(&*root);
    let report = attribute(&samples, &cards, &residents, &Default::default(), &mut procs, |u| {
        if u == "GPU-1" { 2 } else { 0 }
    });
    assert_eq!(
        rows(&report),
        [
            // Percent-only: holds 30 % of 15,360 MiB.
            ("train", "sidecar", "GPU-1", 0, 0, 700, 1, vec![102]),
            ("train", "trainer", "GPU-0", 30, 4608, 4000, 20, vec![100, 101]),
            ("serve", "server", "GPU-1", 50, 2000, 2500, 40, vec![200]),
        ]
    );
    assert!(
        report.containers.iter().filter(|r| r.over_memory()).map(|r| &r.container).eq(["sidecar", "server"])
    );
    let unattributed: Vec<(u32, u64)> = report.unattributed.iter().map(|u| (u.pid, u.memory.0)).collect();
    assert_eq!(unattributed, [(300, 500), (400, 100)]);
    assert_eq!(
        report.cards.iter().map(|c| (c.granted, c.xids, c.healthy)).collect::<Vec<_>>(),
        [(30, 0, true), (50, 2, true)]
    );
}

#[test]
fn a_dra_pods_containers_are_granted_what_their_claims_hold() {
    use crate::node::pods::ClaimUse;
    use crate::serve::usage::claims::{ClaimGrant, Held};
    let root = temp_dir("claims");
    // Pod A (DRA): its trainer names both requests of claim `c1` (a 30 % share of card 0 with 2,000
    // MiB, a whole card 1), its sidecar only the share; pod B's server names the share too (a claim
    // reserved for two pods). Pod A's trainer uses 1,500 MiB of card 0: within what the claim holds.
    write_process(&root, 100, 1, &format!("0::/kubepods/pod{POD_A}/{}\n", id('a')));
    let mut a = resident(POD_A, "train", &[('a', "trainer"), ('c', "sidecar")], &[]);
    let all = ClaimUse { claim: "c1".into(), request: None };
    let share = ClaimUse { claim: "c1".into(), request: Some("share".into()) };
    a.claims = [("trainer".to_owned(), vec![all]), ("sidecar".to_owned(), vec![share.clone()])].into();
    let mut b = resident(POD_B, "serve", &[('b', "server")], &[]);
    b.claims = [("server".to_owned(), vec![share])].into();
    let residents: BTreeMap<String, Resident> = [a, b].into_iter().map(|r| (r.uid.clone(), r)).collect();
    let grant = |request: &str, uuid: &str, index: u32, percent: u32, memory: Option<u64>| ClaimGrant {
        request: request.into(),
        grant: CardGrant { uuid: uuid.into(), index, percent: Percent(percent), memory_mib: memory.map(MiB) },
    };
    let held: Held = [(
        ("ml".to_owned(), "c1".to_owned()),
        vec![grant("share/small", "GPU-0", 0, 30, Some(2000)), grant("whole", "GPU-1", 1, 100, None)],
    )]
    .into();
    let cards = vec![
        Card::nvidia(0, "GPU-0", "Tesla T4", MiB(15_360), None),
        Card::nvidia(1, "GPU-1", "Tesla T4", MiB(15_360), None),
    ];
    let samples = [sample("GPU-0", &[(100, 1500, Some(10))]), sample("GPU-1", &[])];
    let report = attribute(&samples, &cards, &residents, &held, &mut procs::Procs::new(&*root), |_| 0);
    assert_eq!(
        rows(&report),
        [
            ("train", "sidecar", "GPU-0", 30, 2000, 0, 0, vec![]),
            ("train", "trainer", "GPU-0", 30, 2000, 1500, 10, vec![100]),
            ("train", "trainer", "GPU-1", 100, 15_360, 0, 0, vec![]),
            ("serve", "server", "GPU-0", 30, 2000, 0, 0, vec![]),
        ]
    );
    assert!(!report.containers.iter().any(|r| r.over_memory()), "{:?}", report.containers);
    assert!(report.containers.iter().all(|r| !r.grant_unread), "{:?}", report.containers);
    // Each device of the claim counts once on its card.
    assert_eq!(report.cards.iter().map(|c| c.granted).collect::<Vec<_>>(), [30, 100]);
    // Before the claim is read, the trainer's grant is not known: 0 shown, its use not judged (were it
    // judged, it would be use of a card it was not given).
    let unread = attribute(&samples, &cards, &residents, &Held::new(), &mut procs::Procs::new(&*root), |_| 0);
    let trainer = unread.containers.iter().find(|r| r.container == "trainer").unwrap();
    assert!(trainer.grant_unread && trainer.granted == Percent(0) && trainer.memory_used == MiB(1500));
    assert!(!trainer.over_memory() && trainer.memory_used > trainer.granted_memory);
}

#[test]
fn a_grant_without_processes_shows_zero_use_and_the_metrics_name_it() {
    let root = temp_dir("idle");
    let residents: BTreeMap<String, Resident> =
        [resident(POD_A, "idle", &[], &[("main", "GPU-0", 100, None)])]
            .into_iter()
            .map(|r| (r.uid.clone(), r))
            .collect();
    let cards = vec![Card::nvidia(0, "GPU-0", "NVIDIA \"A10\"", MiB(23_028), None)];
    let report = attribute(
        &[sample("GPU-0", &[])],
        &cards,
        &residents,
        &Default::default(),
        &mut procs::Procs::new(&*root),
        |_| 0,
    );
    assert_eq!(report.containers.len(), 1);
    assert_eq!(
        (report.containers[0].granted_memory, report.containers[0].memory_used),
        (MiB(23_028), MiB(0))
    );
    let text = metrics::render(&report, "node-1", 1.5);
    let line = |name: &str| text.lines().find(|l| l.starts_with(name)).unwrap_or_default().to_owned();
    assert_eq!(
        line("nano_gpu_container_granted_memory_bytes{"),
        format!(
            "nano_gpu_container_granted_memory_bytes{{node=\"node-1\",namespace=\"ml\",pod=\"idle\",container=\"main\",gpu=\"0\",uuid=\"GPU-0\"}} {}",
            23_028u64 << 20
        )
    );
    assert_eq!(
        line("nano_gpu_card_healthy{"),
        "nano_gpu_card_healthy{node=\"node-1\",gpu=\"0\",uuid=\"GPU-0\",model=\"NVIDIA \\\"A10\\\"\"} 1"
    );
    // Families are declared once, each with its help and type, and written whole.
    assert_eq!(text.matches("# TYPE nano_gpu_card_xid_errors_total counter").count(), 1);
    assert_eq!(nano_gpu_runtime::exposition::check_whole(&text), Ok(()));
    assert_eq!(
        line("nano_gpu_usage_sampled_timestamp_seconds{"),
        "nano_gpu_usage_sampled_timestamp_seconds{node=\"node-1\"} 1.5"
    );
}
