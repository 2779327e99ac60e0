//! Benchmark of an agent rollout's handover on a kubelet before 1.36: two real `nano-gpu-agent`
//! processes (fake inventory) against a fake kubelet over real unix sockets, as the DaemonSet's
//! surge runs them: the old one serves and registered, the new one starts, serves and registers on
//! its own socket; then the old one gets SIGTERM. Such a kubelet has no healthy device of the resource
//! from the end of the old agent's ListAndWatch stream (held open here, as the kubelet holds it)
//! until the new agent registers anew. Per round: that window (stream end → new registration) and
//! the settle re-registration after it. Prints one JSON line:
//! `{"rounds":N,"window_p50_ms":…,"window_max_ms":…,"settle_p50_ms":…}`.
//!
//! Usage: `bench-rollout [--rounds N] [--agent PATH]`.

use anyhow::{Context, Result, bail};
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::{Empty, RegisterRequest};
use nano_gpu_tests::Killed;
use nano_gpu_tests::fake_kubelet::FakeKubelet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

/// The next registration, within 10 s.
async fn registered(rx: &mut UnboundedReceiver<RegisterRequest>) -> Result<(RegisterRequest, Instant)> {
    let r =
        tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.context("no registration in 10 s")?;
    Ok((r.context("the fake kubelet stopped")?, Instant::now()))
}

fn agent(program: &Path, fake: &FakeKubelet, gpus: &Path, instance: &str) -> Result<Killed> {
    let child = std::process::Command::new(program)
        .arg("--plugin-dir")
        .arg(&fake.plugin_dir)
        .arg("--fake-inventory")
        .arg(gpus)
        .args(["--instance", instance, "--probe-listen", "", "--usage-seconds", "0"])
        .env("RUST_LOG", "warn")
        .spawn()
        .context("starting the agent")?;
    Ok(Killed(child))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let rounds: usize = value("--rounds").map_or(Ok(10), |v| v.parse()).context("--rounds")?;
    let program = value("--agent")
        .map(PathBuf::from)
        .unwrap_or_else(|| nano_gpu_tests::workspace_binary("nano-gpu-agent"));
    let dir = std::env::temp_dir().join(format!("nano-gpu-bench-rollout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let gpus = dir.join("gpus.json");
    std::fs::write(
        &gpus,
        r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-a","vendor":"nvidia","model":"Tesla T4","memoryMiB":15360,"healthy":true}]}"#,
    )?;
    let mut fake = FakeKubelet::start(&dir)?;
    let (mut windows, mut settles) = (Vec::new(), Vec::new());
    let mut old = agent(&program, &fake, &gpus, "r0")?;
    registered(&mut fake.registrations).await?;
    for round in 1..=rounds {
        let new_name = format!("r{round}");
        let new = agent(&program, &fake, &gpus, &new_name)?;
        let (first, _) = registered(&mut fake.registrations).await?;
        if first.endpoint != format!("nano-gpu.{new_name}.sock") {
            bail!("round {round}: the new agent registered {}", first.endpoint);
        }
        // The kubelet's stream from the old agent (the old agent's newest socket).
        let old_socket = std::fs::read_dir(&fake.plugin_dir)?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(&format!("nano-gpu.r{}.", round - 1)))
            .max()
            .context("the old agent's socket")?;
        let channel = nano_gpu_runtime::unix_channel(fake.plugin_dir.join(&old_socket)).await?;
        let mut stream = DevicePluginClient::new(channel).list_and_watch(Empty {}).await?.into_inner();
        stream.message().await?;
        // A rollout stops the old agent once the new pod is Ready, seconds after its registration:
        // no phase with the new agent's checks (killing right after it registered would always
        // land just after one).
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.subsec_nanos();
        tokio::time::sleep(Duration::from_millis(200 + u64::from(nanos % 300))).await;
        let watched = fake.plugin_dir.join(&old_socket);
        let gone = tokio::spawn(async move {
            while watched.exists() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Instant::now()
        });
        let kill = std::process::Command::new("kill").args(["-TERM", &old.0.id().to_string()]).status()?;
        if !kill.success() {
            bail!("kill -TERM of the old agent failed");
        }
        // The stream ends (the kubelet's device manager marks the resource unhealthy here).
        let ended = loop {
            match tokio::time::timeout(Duration::from_secs(10), stream.message()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(_) => break Instant::now(),
                Err(_) => bail!("round {round}: the old agent's stream did not end in 10 s"),
            }
        };
        let (again, at) = registered(&mut fake.registrations).await?;
        if again.endpoint != format!("nano-gpu.{new_name}.1.sock") {
            bail!("round {round}: registered {} after the old agent stopped", again.endpoint);
        }
        let gone = gone.await?;
        let ms = |a: Instant, b: Instant| {
            if a >= b {
                a.duration_since(b).as_secs_f64() * 1000.0
            } else {
                -(b.duration_since(a).as_secs_f64() * 1000.0)
            }
        };
        eprintln!(
            "round {round}: its socket file gone {:.1} ms and the new agent registered anew {:.1} ms after the \
             old agent's stream ended",
            ms(gone, ended),
            ms(at, ended)
        );
        windows.push(at.saturating_duration_since(ended).as_secs_f64() * 1000.0);
        let (settle, settled) = registered(&mut fake.registrations).await?;
        if settle.endpoint != format!("nano-gpu.{new_name}.2.sock") {
            bail!("round {round}: the settle registration was {}", settle.endpoint);
        }
        settles.push(settled.saturating_duration_since(ended).as_secs_f64() * 1000.0);
        let _ = old.0.wait();
        old = new;
    }
    drop(old);
    let _ = std::fs::remove_dir_all(&dir);
    let max = windows.iter().copied().fold(0.0, f64::max);
    println!(
        "{}",
        serde_json::json!({
            "rounds": rounds,
            "window_p50_ms": (median(windows.clone()) * 10.0).round() / 10.0,
            "window_max_ms": (max * 10.0).round() / 10.0,
            "settle_p50_ms": (median(settles) * 10.0).round() / 10.0,
        })
    );
    Ok(())
}
