//! Critical XID events travel from NVML (the fake library, through the real nvml-wrapper FFI path) to
//! the card's health; application XIDs do not.

use nano_gpu_agent::cards::health::Health;
use nano_gpu_agent::cards::health::watch_xids_retrying;
use nano_gpu_agent::cards::inventory::Card;
use nano_gpu_proto::units::MiB;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const TEST: &str = "critical_xids_mark_the_card_unhealthy_through_the_real_ffi_path";

fn card(uuid: &str) -> Card {
    Card::nvidia(0, uuid, "m", MiB(1), None)
}

#[test]
fn critical_xids_mark_the_card_unhealthy_through_the_real_ffi_path() {
    if std::env::var_os("NANO_GPU_XID_CHILD").is_none() {
        // The fake reads its configuration from the environment at init: run this test again in a
        // child process that has it.
        let dir = std::env::temp_dir().join(format!("nano-gpu-xid-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("nvml.json");
        std::fs::write(&config, r#"{"cards":[{"uuid":"GPU-a"},{"uuid":"GPU-b"}],"xids":[{"card":1,"xid":43},{"card":0,"xid":79}]}"#).unwrap();
        nano_gpu_tests::run_test_in_child(
            TEST,
            &[("NANO_GPU_XID_CHILD", "1".as_ref()), ("FAKE_NVML_CONFIG", config.as_os_str())],
        );
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    }
    let health = Arc::new(Health::new(Duration::from_secs(300)));
    let stop = Arc::new(AtomicBool::new(false));
    // The library appears only after the watcher has started (a driver that loads late): the
    // watcher keeps trying and then delivers the events.
    let late = std::env::temp_dir().join(format!("nano-gpu-xid-late-{}", std::process::id()));
    std::fs::create_dir_all(&late).unwrap();
    let lib = late.join("libnvidia-ml.so.1");
    let watcher = {
        let (health, stop, lib) = (health.clone(), stop.clone(), lib.clone());
        std::thread::spawn(move || watch_xids_retrying(&lib, &health, &stop, Duration::from_millis(100)))
    };
    std::thread::sleep(Duration::from_millis(300));
    std::os::unix::fs::symlink(nano_gpu_tests::fake_nvml(), &lib).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    runtime
        .block_on(async { tokio::time::timeout(Duration::from_secs(5), health.changed.notified()).await })
        .expect("a critical XID within 5 s");
    let mut cards = vec![card("GPU-a"), card("GPU-b")];
    health.apply(&mut cards, Instant::now());
    assert_eq!(
        (cards[0].info.healthy, cards[1].info.healthy),
        (false, true),
        "XID 79 counts, application XID 43 does not"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().unwrap();
    std::fs::remove_dir_all(&late).unwrap();
}
