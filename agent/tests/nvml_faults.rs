//! One card NVML cannot read (the fake library answers `GPU_IS_LOST` for it, through the real
//! nvml-wrapper FFI path) is served as unhealthy with the reason, and the node's other cards stay
//! served; it comes back healthy once it reads again. A card never read yet is left out.

use nano_gpu_agent::cards::inventory::{GpuInventory, NvmlInventory};

const TEST: &str = "a_lost_card_is_unhealthy_with_the_reason_and_the_others_stay_served";

#[test]
fn a_lost_card_is_unhealthy_with_the_reason_and_the_others_stay_served() {
    let Some(lost) = std::env::var_os("FAKE_NVML_LOST") else {
        // The fake reads its configuration from the environment: run this test again in a child
        // process that has it.
        let dir = std::env::temp_dir().join(format!("nano-gpu-nvml-faults-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("nvml.json");
        std::fs::write(&config, r#"{"cards":[{"uuid":"GPU-a"},{"uuid":"GPU-b"},{"uuid":"GPU-c"}]}"#).unwrap();
        let lost = dir.join("lost");
        nano_gpu_tests::run_test_in_child(
            TEST,
            &[("FAKE_NVML_CONFIG", config.as_os_str()), ("FAKE_NVML_LOST", lost.as_os_str())],
        );
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    };
    let lib = nano_gpu_tests::fake_nvml();
    let health = |cards: &[nano_gpu_agent::cards::inventory::Card]| -> Vec<(String, bool, Option<String>)> {
        cards.iter().map(|c| (c.info.uuid.clone(), c.info.healthy, c.fault.clone())).collect()
    };

    let nvml = NvmlInventory::new(lib.clone());
    let all = nvml.cards().unwrap();
    assert_eq!(health(&all).iter().filter(|c| c.1).count(), 3);

    // Card 1 falls off the bus: it stays listed, unhealthy, with NVML's error; the others are served.
    std::fs::write(&lost, "1").unwrap();
    let cards = nvml.cards().unwrap();
    let seen = health(&cards);
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!((seen[0].1, seen[2].1), (true, true));
    let (uuid, healthy, fault) = &seen[1];
    assert_eq!((uuid.as_str(), *healthy), ("GPU-b", false));
    let fault = fault.as_deref().unwrap_or_default();
    assert!(fault.contains("device 1") && fault.contains("fell off the bus"), "{fault}");

    // It reads again: healthy, no fault.
    std::fs::remove_file(&lost).unwrap();
    assert_eq!(nvml.cards().unwrap(), all);

    // A fresh agent that has never read card 2 leaves it out and serves the other two.
    std::fs::write(&lost, "2").unwrap();
    let fresh = NvmlInventory::new(lib).cards().unwrap();
    let uuids: Vec<_> = fresh.iter().map(|c| c.info.uuid.as_str()).collect();
    assert_eq!(uuids, ["GPU-a", "GPU-b"]);
}
