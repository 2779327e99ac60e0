//! Unit tests of the plugin's pure parts: advertised IDs, derived cards, container edits, card packing.

use super::*;
use nano_gpu_proto::annotations::GpuInfo;
use nano_gpu_proto::annotations::Vendor;
use nano_gpu_proto::device_id;
use nano_gpu_proto::units::MiB;

fn card(uuid: &str, vendor: Vendor) -> Card {
    Card {
        info: GpuInfo {
            index: 0,
            uuid: uuid.into(),
            vendor,
            model: "m".into(),
            memory_mib: MiB(1),
            healthy: true,
            numa: Some(1),
        },
        device_nodes: if vendor == Vendor::Intel {
            vec!["/dev/dri/card1".into(), "/dev/dri/renderD129".into()]
        } else {
            vec![]
        },
        pci_address: None,
        fault: None,
        mig: false,
    }
}

fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| device_id::encode(uuid, n)).collect()
}

#[test]
fn every_card_advertises_100_ids_with_its_numa_node() {
    let d = devices(&[card("GPU-a", Vendor::Nvidia), card("GPU-b", Vendor::Nvidia)], Resource::Percent);
    assert_eq!(d.len(), 200);
    assert_eq!(d[0].id, "GPU-a-00");
    assert_eq!(d[199].id, "GPU-b-99");
    assert_eq!(d[0].topology.as_ref().unwrap().nodes[0].id, 1);
}

#[test]
fn allocate_derives_the_cards_from_the_ids() {
    let cards = [card("GPU-a", Vendor::Nvidia), card("intel-0000:03:00.0", Vendor::Intel)];
    let r = allocate(&cards, &ids("GPU-a", 0..30), None, Resource::Percent, &Edits::default()).unwrap();
    assert!(r.cdi_devices.is_empty());
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    assert_eq!(r.envs["NANO_GPU_PERCENT"], "30");
    let r = allocate(
        &cards,
        &ids("intel-0000:03:00.0", 0..50),
        None,
        Resource::Percent,
        &Edits { devices: "envvar,volume-mounts,cdi".parse().unwrap(), ..Default::default() },
    )
    .unwrap();
    assert!(!r.envs.contains_key("NVIDIA_VISIBLE_DEVICES") && r.cdi_devices.is_empty());
    assert_eq!(
        r.devices.iter().map(|d| d.host_path.as_str()).collect::<Vec<_>>(),
        ["/dev/dri/card1", "/dev/dri/renderD129"]
    );
    let r = allocate(
        &cards,
        &ids("GPU-a", 0..100),
        None,
        Resource::Percent,
        &Edits { devices: "envvar,volume-mounts,cdi".parse().unwrap(), ..Default::default() },
    )
    .unwrap();
    assert_eq!(r.cdi_devices[0].name, "nvidia.com/gpu=GPU-a");
}

#[test]
fn unknown_ids_are_invalid_arguments_not_a_poisoned_env() {
    let cards = [card("GPU-a", Vendor::Nvidia)];
    assert_eq!(
        allocate(&cards, &["not-ours".into()], None, Resource::Percent, &Edits::default())
            .unwrap_err()
            .code(),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        allocate(&cards, &ids("GPU-zz", 0..1), None, Resource::Percent, &Edits::default())
            .unwrap_err()
            .code(),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        allocate(&cards, &[], None, Resource::Percent, &Edits::default()).unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
}

#[test]
fn preferred_ids_come_from_one_card_when_one_can_hold_them() {
    let mut available = ids("GPU-a", 0..40);
    available.extend(ids("GPU-b", 0..100));
    let chosen = prefer(&available, &[], 30);
    assert_eq!(chosen.len(), 30);
    // The tightest card that holds all 30 (GPU-a, 40 free) rather than spreading.
    assert!(chosen.iter().all(|id| id.starts_with("GPU-a-")), "{chosen:?}");
    let chosen = prefer(&available, &[], 60);
    assert!(chosen.iter().all(|id| id.starts_with("GPU-b-")), "{chosen:?}");
    let chosen = prefer(&available, &ids("GPU-b", 0..1), 2);
    assert_eq!(chosen[0], "GPU-b-00");
}

#[test]
fn under_exclusive_mps_a_whole_card_goes_through_its_daemon_and_several_cards_are_refused() {
    let root = std::env::temp_dir().join(format!("nano-gpu-exclusive-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let layout = crate::node::enforce::mps::Layout::new(root.clone(), root.join("proc"));
    let edits =
        Edits { enforcement: crate::node::enforce::Enforcement::Mps(layout.clone()), ..Edits::default() };
    let cards = [card("GPU-a", Vendor::Nvidia), card("GPU-b", Vendor::Nvidia)];
    let two: Vec<String> = ids("GPU-a", 0..100).into_iter().chain(ids("GPU-b", 0..100)).collect();
    // Not held exclusive: a whole card is the container's as under `none`, two cards too.
    let whole = allocate(&cards, &ids("GPU-a", 0..100), None, Resource::Percent, &edits).unwrap();
    let mps_mounts = |r: &nano_gpu_proto::kubelet::deviceplugin::ContainerAllocateResponse| {
        r.mounts
            .iter()
            .filter(|m| m.host_path != "/dev/null")
            .map(|m| m.host_path.clone())
            .collect::<Vec<_>>()
    };
    assert!(mps_mounts(&whole).is_empty() && !whole.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"));
    assert!(allocate(&cards, &two, None, Resource::Percent, &edits).is_ok());

    std::fs::create_dir_all(root.join("GPU-a")).unwrap();
    std::fs::write(root.join("GPU-a").join(crate::node::enforce::mps::EXCLUSIVE_MARK), "EXCLUSIVE_PROCESS\n")
        .unwrap();
    let whole = allocate(&cards, &ids("GPU-a", 0..100), None, Resource::Percent, &edits).unwrap();
    assert_eq!(whole.envs["CUDA_MPS_PIPE_DIRECTORY"], "/tmp/nvidia-mps");
    assert!(!whole.envs.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), "a whole card is not limited");
    // Its card's pipe directory, not the daemon's /dev/shm.
    assert_eq!(mps_mounts(&whole), [layout.client_pipe("GPU-a", &layout.shm("GPU-a")).display().to_string()]);
    // A share of it keeps its limits.
    let share = allocate(&cards, &ids("GPU-a", 0..30), None, Resource::Percent, &edits).unwrap();
    assert_eq!(share.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
    // Two cards, one of them held exclusive: one process cannot be a client of two daemons.
    let refused = allocate(&cards, &two, None, Resource::Percent, &edits).unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("GPU-a") && refused.message().contains("2 cards"),
        "{}",
        refused.message()
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// The device list as mounts the NVIDIA runtime reads before any env (which the pod can override):
/// one `/dev/null` per NVIDIA card; with the env strategy off, the image's `all` is replaced by a
/// value naming no card.
#[test]
fn nvidia_cards_are_named_by_env_and_by_volume_mounts_as_asked() {
    let cards =
        [card("GPU-a", Vendor::Nvidia), card("GPU-b", Vendor::Nvidia), card("0000:03:00.0", Vendor::Intel)];
    let two: Vec<String> = ids("GPU-a", 0..100).into_iter().chain(ids("GPU-b", 0..100)).collect();
    let both = allocate(&cards, &two, None, Resource::Percent, &Edits::default()).unwrap();
    assert_eq!(both.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
    let mounts: Vec<(&str, &str, bool)> =
        both.mounts.iter().map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only)).collect();
    assert_eq!(
        mounts,
        [
            ("/dev/null", "/var/run/nvidia-container-devices/GPU-a", true),
            ("/dev/null", "/var/run/nvidia-container-devices/GPU-b", true)
        ]
    );
    let only_mounts = Edits { devices: "volume-mounts".parse().unwrap(), ..Edits::default() };
    let r = allocate(&cards, &ids("GPU-a", 0..30), None, Resource::Percent, &only_mounts).unwrap();
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "/var/run/nvidia-container-devices");
    assert_eq!(r.mounts.len(), 1);
    let only_env = Edits { devices: "envvar".parse().unwrap(), ..Edits::default() };
    let r = allocate(&cards, &ids("GPU-a", 0..30), None, Resource::Percent, &only_env).unwrap();
    assert_eq!((r.envs["NVIDIA_VISIBLE_DEVICES"].as_str(), r.mounts.len()), ("GPU-a", 0));
    // An Intel card is handed as its device nodes, named by no NVIDIA list.
    let intel =
        allocate(&cards, &ids("0000:03:00.0", 0..100), None, Resource::Percent, &Edits::default()).unwrap();
    assert!(intel.mounts.is_empty() && !intel.envs.contains_key("NVIDIA_VISIBLE_DEVICES"));
    // CDI names alone: the runtime's CDI specs give the card; the env names none.
    let only_cdi = Edits { devices: "cdi".parse().unwrap(), ..Edits::default() };
    let r = allocate(&cards, &two, None, Resource::Percent, &only_cdi).unwrap();
    let names: Vec<&str> = r.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"]);
    assert_eq!(
        (r.envs["NVIDIA_VISIBLE_DEVICES"].as_str(), r.mounts.len()),
        ("/var/run/nvidia-container-devices", 0)
    );
    assert!(both.cdi_devices.is_empty(), "CDI names only when asked");
    let err = "envvar,nvml".parse::<DeviceList>().unwrap_err();
    assert!(err.contains("\"nvml\"") && err.contains("envvar, volume-mounts and cdi"), "{err}");
}

#[test]
fn each_mode_says_what_holds_a_share_against_a_hostile_tenant() {
    let layout = crate::node::enforce::mps::Layout::new("/run/nano-gpu/mps", "/proc");
    let none = Edits::default().guarantee();
    assert_eq!(none, "shares: not limited (the scheduler's accounting only)");
    let mps =
        Edits { enforcement: crate::node::enforce::Enforcement::Mps(layout), ..Edits::default() }.guarantee();
    assert!(mps.contains("own environment") && mps.contains("advisory against a hostile tenant"), "{mps}");
    let invalid =
        Edits { enforcement: crate::node::enforce::Enforcement::Invalid("x".into()), ..Edits::default() };
    assert!(invalid.guarantee().contains("none served"));
}
