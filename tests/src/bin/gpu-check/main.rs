//! `gpu-check`: what a real NVIDIA card and driver answer to the agent's own code paths, as one JSON
//! report (`hack/gpu-check.sh` runs it on a machine with a card; a test runs it against the fake
//! NVML, where the parts that need CUDA are skipped with the reason).
//!
//! Each section runs on its own, and one that fails says why without stopping the others:
//! - `environment`: kernel, driver, NVML and CUDA versions, the user, cgroup v2;
//! - `inventory`: the agent's NVML inventory (the node's code path) beside `nvidia-smi --query-gpu`;
//! - `xid`: whether critical-XID events can be registered on every card (the agent's watcher);
//! - `usage`: a CUDA process (PyTorch, `client.py`) holding a known allocation and running a known
//!   load, as the agent's sampler sees it under its PID, and gone after it exits; the sampler's own
//!   CPU and memory;
//! - `memory_limit`: whether the driver's NVML has `nvmlDeviceSetMemoryLimits_v1`, and if it has, an
//!   allocation past a cgroup's limit fails in that cgroup;
//! - `mps`: the agent's MPS supervisor starts a control daemon for the card, two clients with the
//!   device plugin's MPS envs run side by side, and what a tenant could do: raise its limits above
//!   the daemon's defaults, command the daemon as another user, run beside another user's client;
//!   and whether a client still reaches its card through MPS, its limits held, in a mount namespace
//!   of its own as a share's container is: a `/dev/shm` of its own, then its pipe directory read-only.

use nano_gpu_agent::cards::inventory::{GpuInventory, NvmlInventory};
use nano_gpu_agent::node::enforce::{Enforcement, Share, mps};
use nano_gpu_proto::annotations::{NodeInventory, node_labels};
use nano_gpu_proto::kubelet::deviceplugin::ContainerAllocateResponse;
use nano_gpu_proto::units::MiB;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const CLIENT: &str = include_str!("client.py");
/// The user the unprivileged tries run as (`nobody`).
const NOBODY: u32 = 65534;

struct Args {
    nvml_lib: PathBuf,
    out: PathBuf,
    python: String,
    nvidia_smi: String,
    mps_control: Option<PathBuf>,
    work: PathBuf,
    /// Whether the MPS part may put the card in `EXCLUSIVE_PROCESS` compute mode for a while (it is
    /// set back to `DEFAULT`): only on a machine nobody else uses.
    exclusive: bool,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        nvml_lib: PathBuf::from("libnvidia-ml.so.1"),
        out: PathBuf::from("gpu-check-out"),
        python: "python3".into(),
        nvidia_smi: "nvidia-smi".into(),
        mps_control: None,
        work: std::env::temp_dir().join("nano-gpu-check"),
        exclusive: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--nvml-lib" => a.nvml_lib = value()?.into(),
            "--out" => a.out = value()?.into(),
            "--python" => a.python = value()?,
            "--nvidia-smi" => a.nvidia_smi = value()?,
            "--mps-control" => a.mps_control = Some(value()?.into()),
            "--work" => a.work = value()?.into(),
            "--try-exclusive-mode" => a.exclusive = true,
            other => {
                return Err(format!(
                    "unknown argument {other}; takes --nvml-lib, --out, --python, --nvidia-smi, \
                     --mps-control, --work, --try-exclusive-mode"
                ));
            }
        }
    }
    Ok(a)
}

/// Where the raw outputs go (`raw.log` under `--out`): every client's lines, every control command.
#[derive(Clone)]
struct Raw(std::sync::Arc<std::sync::Mutex<std::fs::File>>);

impl Raw {
    fn line(&self, what: &str, text: &str) {
        if let Ok(mut f) = self.0.lock() {
            let _ = writeln!(f, "[{what}] {text}");
        }
    }
}

fn main() {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu-check: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = std::fs::create_dir_all(&args.out).and_then(|_| std::fs::create_dir_all(&args.work)) {
        eprintln!("gpu-check: {} or {}: {e}", args.out.display(), args.work.display());
        std::process::exit(2);
    }
    let raw = match std::fs::File::create(args.out.join("raw.log")) {
        Ok(f) => Raw(std::sync::Arc::new(std::sync::Mutex::new(f))),
        Err(e) => {
            eprintln!("gpu-check: raw.log: {e}");
            std::process::exit(2);
        }
    };
    nano_gpu_runtime::init_logging(false);
    let started = Instant::now();
    let client = args.work.join("client.py");
    let torch = std::fs::write(&client, CLIENT)
        .map_err(|e| format!("{}: {e}", client.display()))
        .and_then(|_| torch_version(&args.python));
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(args.nvml_lib.as_os_str())
        .init()
        .map_err(|e| format!("NVML from {}: {e}", args.nvml_lib.display()));
    let ctx = Ctx { args: &args, raw, client, torch: torch.clone(), nvml };
    let mut report = serde_json::Map::new();
    report.insert("torch".into(), json!(torch.clone().map_err(|e| json!({"error": e})).map(Value::from)));
    let sections: [(&str, Section); 6] = [
        ("environment", environment),
        ("inventory", inventory),
        ("xid", xid),
        ("usage", usage),
        ("memory_limit", memory_limit),
        ("mps", mps_section),
    ];
    for (name, section) in sections {
        let at = Instant::now();
        eprintln!("gpu-check: {name}…");
        let mut value = match section(&ctx) {
            Ok(v) => v,
            Err(e) if e.starts_with("skipped") => json!({"ok": null, "reason": e}),
            Err(e) => json!({"ok": false, "error": e}),
        };
        if let Value::Object(o) = &mut value {
            o.insert("seconds".into(), json!(at.elapsed().as_secs_f64()));
        }
        eprintln!("gpu-check: {name}: {value}");
        report.insert(name.into(), value);
        // Kept as it grows: a check cut off at its time limit still leaves what it found.
        let _ = std::fs::write(args.out.join("report.json"), Value::Object(report.clone()).to_string());
    }
    report.insert("seconds".into(), json!(started.elapsed().as_secs_f64()));
    let text = serde_json::to_string_pretty(&Value::Object(report)).unwrap_or_default();
    let _ = std::fs::write(args.out.join("report.json"), &text);
    println!("{text}");
}

/// One part of the report: its JSON, or why it could not run.
type Section = fn(&Ctx) -> Result<Value, String>;

struct Ctx<'a> {
    args: &'a Args,
    raw: Raw,
    client: PathBuf,
    /// PyTorch's version, or why the CUDA client cannot run.
    torch: Result<String, String>,
    /// NVML, read directly where the check compares the agent's answers with the driver's.
    nvml: Result<nvml_wrapper::Nvml, String>,
}

impl Ctx<'_> {
    /// Why the CUDA client cannot run, if it cannot.
    fn need_torch(&self) -> Result<(), String> {
        self.torch.as_ref().map(|_| ()).map_err(|e| format!("skipped: {e}"))
    }

    fn nvml(&self) -> Result<&nvml_wrapper::Nvml, String> {
        self.nvml.as_ref().map_err(Clone::clone)
    }
}

fn torch_version(python: &str) -> Result<String, String> {
    let out = Command::new(python)
        .args(["-c", "import torch; print(torch.__version__, torch.cuda.is_available())"])
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    match text.split_once(' ') {
        Some((v, "True")) => Ok(v.to_owned()),
        Some((v, _)) => Err(format!("{python}'s torch {v} sees no CUDA device")),
        None => Err(format!("{python} has no torch: {}", String::from_utf8_lossy(&out.stderr).trim())),
    }
}

fn environment(ctx: &Ctx) -> Result<Value, String> {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_owned()).unwrap_or_default();
    let uid = nano_gpu_tests::own_uid();
    let nvml = ctx.nvml()?;
    let text =
        |r: Result<String, nvml_wrapper::error::NvmlError>| r.unwrap_or_else(|e| format!("error: {e}"));
    Ok(json!({
        "ok": true,
        "kernel": read("/proc/sys/kernel/osrelease"),
        "machine": std::env::consts::ARCH,
        "uid": uid,
        "cgroup_v2": Path::new("/sys/fs/cgroup/cgroup.controllers").is_file(),
        "cgroup": read("/proc/self/cgroup"),
        "driver": text(nvml.sys_driver_version()),
        "nvml": text(nvml.sys_nvml_version()),
        "cuda_driver": text(nvml.sys_cuda_driver_version().map(|v| v.to_string())),
    }))
}

/// `nvidia-smi --query-gpu` rows, by index: (field, value).
fn smi_rows(program: &str, raw: &Raw) -> Result<Vec<HashMap<&'static str, String>>, String> {
    const FIELDS: [&str; 7] =
        ["index", "uuid", "name", "memory.total", "pci.bus_id", "compute_cap", "mig.mode.current"];
    let out = Command::new(program)
        .arg(format!("--query-gpu={}", FIELDS.join(",")))
        .args(["--format=csv,noheader,nounits"])
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    raw.line("nvidia-smi", &format!("{text}{}", String::from_utf8_lossy(&out.stderr)));
    if !out.status.success() {
        return Err(format!("{program} --query-gpu: {}", out.status));
    }
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| FIELDS.iter().copied().zip(l.split(',').map(|v| v.trim().to_owned())).collect())
        .collect())
}

fn inventory(ctx: &Ctx) -> Result<Value, String> {
    let agent = NvmlInventory::new(ctx.args.nvml_lib.clone()).with_sysfs(PathBuf::from("/sys"));
    let cards = agent.cards().map_err(|e| e.to_string())?;
    let nvml = ctx.nvml()?;
    let smi = smi_rows(&ctx.args.nvidia_smi, &ctx.raw);
    let mut differences = Vec::new();
    let mut listed = Vec::new();
    for card in &cards {
        let i = &card.info;
        let device = nvml.device_by_index(i.index).map_err(|e| e.to_string())?;
        let cc = device.cuda_compute_capability().map(|c| format!("{}.{}", c.major, c.minor)).ok();
        let bytes = device.memory_info().map(|m| m.total).ok();
        listed.push(json!({
            "index": i.index, "uuid": i.uuid, "model": i.model, "memory_mib": i.memory_mib.0,
            "memory_bytes": bytes, "pci": card.pci_address, "numa": i.numa, "mig": card.mig,
            "healthy": i.healthy, "fault": card.fault, "compute_capability": cc,
        }));
        let Ok(rows) = &smi else { continue };
        let Some(row) = rows.iter().find(|r| r.get("index") == Some(&i.index.to_string())) else {
            differences.push(format!("card {}: nvidia-smi does not list it", i.index));
            continue;
        };
        let mut compare = |field: &str, ours: String| {
            let theirs = row.get(field).cloned().unwrap_or_default();
            if theirs != ours {
                differences.push(format!("card {} {field}: agent {ours:?}, nvidia-smi {theirs:?}", i.index));
            }
        };
        compare("uuid", i.uuid.clone());
        compare("name", i.model.clone());
        compare("memory.total", i.memory_mib.0.to_string());
        compare("pci.bus_id", card.pci_address.clone().unwrap_or_default());
        compare("compute_cap", cc.unwrap_or_default());
        // A card without MIG says `[N/A]`, one with MIG turned off `Disabled`: both are "not in MIG mode".
        let mig = row.get("mig.mode.current").map(String::as_str);
        if mig != Some("[N/A]") || card.mig {
            compare("mig.mode.current", if card.mig { "Enabled" } else { "Disabled" }.into());
        }
    }
    if let Ok(rows) = &smi
        && rows.len() != cards.len()
    {
        differences.push(format!("the agent lists {} cards, nvidia-smi {}", cards.len(), rows.len()));
    }
    // What a node with these cards publishes (`nano-gpu-agent inventory` prints the same).
    let published = NodeInventory::new(cards.iter().map(|c| c.info.clone()).collect());
    Ok(json!({
        "ok": smi.is_ok() && differences.is_empty() && !cards.is_empty(),
        "annotation": published.encode(),
        "labels": node_labels(&published),
        "cards": listed,
        "nvidia_smi": smi.as_ref().map(|_| "compared").map_err(|e| e.clone()),
        "differences": differences,
    }))
}

fn xid(ctx: &Ctx) -> Result<Value, String> {
    let health = nano_gpu_agent::cards::health::Health::new(Duration::from_secs(60));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let lib = ctx.args.nvml_lib.clone();
    let result = std::thread::scope(|s| {
        let watcher = s.spawn(|| nano_gpu_agent::cards::health::watch_xids(&lib, &health, &stop));
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until && !watcher.is_finished() {
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        watcher.join().unwrap_or_else(|_| Err("the watcher panicked".into()))
    });
    Ok(match result {
        Ok(()) => json!({"ok": true, "registered": "critical XID events on every card; 2 s waited"}),
        Err(e) => json!({"ok": false, "registered": false, "error": e}),
    })
}

/// A running CUDA client and the lines it printed, each with when it arrived.
struct Client {
    name: String,
    child: Child,
    lines: mpsc::Receiver<(Instant, Value)>,
    seen: Vec<(Instant, Value)>,
}

impl Client {
    fn start(
        ctx: &Ctx,
        name: &str,
        spec: Value,
        env: &[(String, String)],
        uid: Option<u32>,
    ) -> Result<Client, String> {
        Self::spawn(ctx, name, Self::command(ctx, spec, env, uid))
    }

    /// The client's command line: `client.py` with `spec`, `env` added, as `uid` (root: `None`).
    fn command(ctx: &Ctx, spec: Value, env: &[(String, String)], uid: Option<u32>) -> Command {
        let mut cmd = Command::new(&ctx.args.python);
        cmd.arg(&ctx.client).arg(spec.to_string()).envs(env.iter().cloned());
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(uid).env("HOME", "/tmp");
        }
        cmd
    }

    fn spawn(ctx: &Ctx, name: &str, mut cmd: Command) -> Result<Client, String> {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| format!("{name}: {e}"))?;
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let tag = format!("{name} pid {}", child.id());
        let (t1, t2) = (tag.clone(), tag);
        let (log_out, log_err) = (ctx.raw.clone(), ctx.raw.clone());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                log_out.line(&t1, &line);
                let value =
                    serde_json::from_str(&line).unwrap_or_else(|_| json!({"event": "text", "text": line}));
                let _ = tx.send((Instant::now(), value));
            }
        });
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                log_err.line(&format!("{t2} stderr"), &line);
            }
        });
        Ok(Client { name: name.into(), child, lines, seen: Vec::new() })
    }

    /// Started and run to its end (killed past 40 s): what it printed.
    fn run(
        ctx: &Ctx,
        name: &str,
        spec: Value,
        env: &[(String, String)],
        uid: Option<u32>,
    ) -> Result<Client, String> {
        let mut client = Client::start(ctx, name, spec, env, uid)?;
        let _ = client.finish(Duration::from_secs(40));
        Ok(client)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `within` for a line with `event` (or `error`), keeping every line.
    fn wait_for(&mut self, event: &str, within: Duration) -> Result<Value, String> {
        let until = Instant::now() + within;
        if let Some((_, v)) = self.seen.iter().find(|(_, v)| v["event"] == event) {
            return Ok(v.clone());
        }
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((at, v)) => {
                    self.seen.push((at, v.clone()));
                    if v["event"] == event {
                        return Ok(v);
                    }
                    if v["event"] == "error" {
                        return Err(format!("{}: {}", self.name, v["error"]));
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(format!("{}: no {event:?} within {within:?}", self.name));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                    return Err(format!("{}: ended ({status}) before {event:?}", self.name));
                }
            }
        }
    }

    /// When the line with `event` arrived.
    fn arrived(&self, event: &str) -> Option<Instant> {
        self.seen.iter().find(|(_, v)| v["event"] == event).map(|(at, _)| *at)
    }

    /// Every `try` line: (MiB, ok).
    fn tries(&self) -> Vec<Value> {
        self.seen.iter().filter(|(_, v)| v["event"] == "try").map(|(_, v)| v.clone()).collect()
    }

    /// Waits for the end (killing it after `within`) and keeps what it printed.
    fn finish(&mut self, within: Duration) -> Result<(), String> {
        let _ = self.wait_for("done", within);
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        Err(format!("{} did not end; killed", self.name))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// This process's CPU time so far (user and system), in seconds (USER_HZ, 100 on Linux).
fn cpu_seconds() -> f64 {
    nano_gpu_tests::cpu_ticks(std::process::id()) as f64 / 100.0
}

/// One sampling pass of the agent's sampler, as JSON: per card, its use and its processes.
fn sampled(samples: &[nano_gpu_agent::cards::inventory::CardSample]) -> Value {
    json!(samples
        .iter()
        .map(|s| json!({
            "uuid": s.uuid, "memory_used_mib": s.memory_used.0, "utilization": s.utilization,
            "temperature": s.temperature, "power_mw": s.power_mw,
            "processes": s.processes.iter().map(|p| json!({"pid": p.pid, "memory_mib": p.memory.map(|m| m.0), "sm": p.sm})).collect::<Vec<_>>(),
        }))
        .collect::<Vec<_>>())
}

/// NVML's own process lists of every card, read directly (not through the agent): which PIDs the
/// compute list, the MPS list and the utilisation samples name, and `nvidia-smi`'s compute apps.
fn nvml_lists(ctx: &Ctx) -> Value {
    let Ok(nvml) = ctx.nvml() else { return Value::Null };
    let count = nvml.device_count().unwrap_or(0);
    let cards: Vec<Value> = (0..count)
        .map(|i| {
            let Ok(d) = nvml.device_by_index(i) else { return Value::Null };
            let list = |r: Result<
                Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>,
                nvml_wrapper::error::NvmlError,
            >| match r {
                Ok(ps) => json!(
                    ps.iter()
                        .map(|p| json!({"pid": p.pid, "used": format!("{:?}", p.used_gpu_memory)}))
                        .collect::<Vec<_>>()
                ),
                Err(e) => json!({"error": e.to_string()}),
            };
            let samples = match d.process_utilization_stats(None) {
                Ok(ss) => json!(
                    ss.iter()
                        .map(|s| json!({"pid": s.pid, "sm": s.sm_util, "mem": s.mem_util, "ts": s.timestamp}))
                        .collect::<Vec<_>>()
                ),
                Err(e) => json!({"error": e.to_string()}),
            };
            json!({
                "compute": list(d.running_compute_processes()),
                "mps": list(d.mps_running_compute_processes()),
                "utilization_samples": samples,
            })
        })
        .collect();
    let smi = Command::new(&ctx.args.nvidia_smi)
        .args(["--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|e| e.to_string());
    json!({"cards": cards, "nvidia_smi_compute_apps": smi})
}

/// The files in `/dev/shm`, where an MPS server and its clients share memory (share containers get
/// the MPS pod's bounded `/dev/shm`): name -> (length, bytes the tmpfs holds for it).
fn shm_files() -> HashMap<String, (u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let entries = std::fs::read_dir("/dev/shm").into_iter().flatten().flatten();
    entries
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            Some((e.file_name().to_string_lossy().into_owned(), (meta.len(), meta.blocks() * 512)))
        })
        .collect()
}

/// What appeared or grew in `/dev/shm` since `before` (a [`shm_files`] snapshot): the files, and the
/// tmpfs bytes they added, in MiB.
fn shm_grown(before: &HashMap<String, (u64, u64)>) -> Value {
    let now = shm_files();
    let mut files = Vec::new();
    let mut held = 0;
    for (name, (len, bytes)) in &now {
        let was = before.get(name).map_or(0, |b| b.1);
        if *bytes > was || !before.contains_key(name) {
            held += bytes.saturating_sub(was);
            files.push(json!({"name": name, "length": len, "held_bytes": bytes}));
        }
    }
    json!({"added_mib": held as f64 / 1_048_576.0, "files": files})
}

/// The process `pid` in a sampling pass: (memory MiB, SM %).
fn process_in(
    samples: &[nano_gpu_agent::cards::inventory::CardSample],
    pid: u32,
) -> Option<(Option<u64>, Option<u32>)> {
    samples.iter().flat_map(|s| &s.processes).find(|p| p.pid == pid).map(|p| (p.memory.map(|m| m.0), p.sm))
}

fn usage(ctx: &Ctx) -> Result<Value, String> {
    ctx.need_torch()?;
    const HELD: u64 = 1024;
    let sampler = NvmlInventory::new(ctx.args.nvml_lib.clone());
    let before = sampler.sample().map_err(|e| e.to_string())?;
    let mut client = Client::start(ctx, "usage", json!({"alloc_mib": HELD, "load_s": 8}), &[], None)?;
    let init = client.wait_for("init", Duration::from_secs(90))?;
    client.wait_for("loaded", Duration::from_secs(30))?;
    let pid = client.pid();
    let (cpu0, wall0) = (cpu_seconds(), Instant::now());
    let mut passes = Vec::new();
    let mut pass_ms = Vec::new();
    let (mut memory, mut sm, mut card_util) = (None::<u64>, 0u32, 0u32);
    let mut all_pids = std::collections::BTreeSet::new();
    for _ in 0..12 {
        let at = Instant::now();
        let s = sampler.sample().map_err(|e| e.to_string())?;
        pass_ms.push(at.elapsed().as_secs_f64() * 1000.0);
        all_pids.extend(s.iter().flat_map(|c| c.processes.iter().map(|p| p.pid)));
        if let Some((m, u)) = process_in(&s, pid) {
            memory = memory.max(m);
            sm = sm.max(u.unwrap_or(0));
        }
        card_util = card_util.max(s.iter().filter_map(|c| c.utilization).max().unwrap_or(0));
        passes.push(sampled(&s));
        std::thread::sleep(Duration::from_millis(500));
    }
    // The sampler's own cost: these 12 passes and the sleeps between them, nothing else.
    let resources = json!({
        "passes": pass_ms.len(), "pass_ms": pass_ms, "cpu_seconds": cpu_seconds() - cpu0,
        "wall_seconds": wall0.elapsed().as_secs_f64(),
        "peak_rss_mib": nano_gpu_tests::peak_rss_mib(std::process::id()),
    });
    let lists = nvml_lists(ctx);
    let _ = client.finish(Duration::from_secs(30));
    let ended = Instant::now();
    let mut gone_after = None;
    while ended.elapsed() < Duration::from_secs(10) {
        let s = sampler.sample().map_err(|e| e.to_string())?;
        if process_in(&s, pid).is_none() {
            gone_after = Some(ended.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let in_range = memory.is_some_and(|m| (HELD..HELD + 2048).contains(&m));
    Ok(json!({
        "ok": in_range && sm > 0 && gone_after.is_some(),
        "client": init, "host_pid": pid,
        "seen_memory_mib": memory, "held_mib": HELD, "seen_sm_max": sm, "card_utilization_max": card_util,
        "pids_seen": all_pids, "gone_after_s": gone_after,
        "before": sampled(&before), "passes": passes, "sampler": resources, "nvml_lists": lists,
    }))
}

/// What the driver's per-cgroup memory limit does here.
fn memory_limit(ctx: &Ctx) -> Result<Value, String> {
    let lib = match nano_gpu_nvml_limits::Library::open(&ctx.args.nvml_lib) {
        Ok(l) => l,
        Err(e) => return Ok(json!({"ok": null, "available": false, "reason": e})),
    };
    let root = Path::new("/sys/fs/cgroup");
    if !root.join("cgroup.controllers").is_file() {
        return Ok(json!({"ok": null, "available": true, "reason": "no cgroup v2 at /sys/fs/cgroup"}));
    }
    let cgroup = root.join(format!("nano-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&cgroup).map_err(|e| format!("{}: {e}", cgroup.display()))?;
    let uuid = NvmlInventory::new(ctx.args.nvml_lib.clone())
        .cards()
        .map_err(|e| e.to_string())?
        .first()
        .map(|c| c.info.uuid.clone())
        .ok_or("no card")?;
    const LIMIT: u64 = 2048 << 20;
    let set = lib.set(&uuid, &cgroup, LIMIT, LIMIT);
    let mut result = json!({"available": true, "cgroup": cgroup, "limit_mib": LIMIT >> 20, "set": set.clone().map(|_| "accepted")});
    if set.is_ok() && ctx.need_torch().is_ok() {
        // The client enters the cgroup before CUDA starts: a shell writes itself there, then runs it.
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
            .arg(&cgroup)
            .arg(&ctx.args.python)
            .arg(&ctx.client)
            .arg(json!({"try_mib": [1024, 4096]}).to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut client = Client::spawn(ctx, "memory-limit", cmd)?;
        let init = client.wait_for("init", Duration::from_secs(90));
        let _ = client.finish(Duration::from_secs(60));
        let tries = client.tries();
        let held =
            tries.first().is_some_and(|t| t["ok"] == true) && tries.get(1).is_some_and(|t| t["ok"] == false);
        result["client"] = json!(init);
        result["tries"] = json!(tries);
        result["ok"] = json!(held);
    } else {
        result["ok"] = json!(set.is_ok());
    }
    let _ = std::fs::remove_dir(&cgroup);
    Ok(result)
}

/// `nvidia-cuda-mps-control`: the one asked for, else the first on the PATH or in the driver's usual
/// folders.
fn find_mps_control(asked: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = asked {
        return Some(p.to_owned());
    }
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin", "/usr/local/cuda/bin"])
        .map(|d| Path::new(d).join("nvidia-cuda-mps-control"))
        .find(|p| p.is_file())
}

/// The MPS part: the control program, the layout, the card.
struct Mps<'a> {
    ctx: &'a Ctx<'a>,
    program: PathBuf,
    layout: mps::Layout,
    uuid: String,
}

impl Mps<'_> {
    /// The env the device plugin gave a container (`response`), as a process on this machine takes it:
    /// in a container the card's pipe directory is mounted where the env says; here it is read where
    /// it is.
    fn client_env(&self, response: ContainerAllocateResponse) -> Vec<(String, String)> {
        let pipe = self.layout.pipe(&self.uuid).display().to_string();
        let mut env: Vec<(String, String)> =
            response.envs.into_iter().filter(|(k, _)| k != "CUDA_MPS_PIPE_DIRECTORY").collect();
        env.push(("CUDA_MPS_PIPE_DIRECTORY".into(), pipe));
        env
    }

    /// The control program run as `uid` (root: `None`) with `commands` on its input; its answer.
    fn control(&self, commands: &str, uid: Option<u32>) -> Value {
        let mut cmd = Command::new(&self.program);
        cmd.envs(self.layout.control_env(&self.uuid))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(uid);
        }
        let answer = (|| {
            let mut child = cmd.spawn().map_err(|e| e.to_string())?;
            if let Some(mut input) = child.stdin.take() {
                let _ = input.write_all(commands.as_bytes());
            }
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                    let mut out = String::new();
                    let mut err = String::new();
                    use std::io::Read;
                    if let Some(mut o) = child.stdout.take() {
                        let _ = o.read_to_string(&mut out);
                    }
                    if let Some(mut e) = child.stderr.take() {
                        let _ = e.read_to_string(&mut err);
                    }
                    return Ok(json!({"status": status.code(), "stdout": out.trim(), "stderr": err.trim()}));
                }
                if Instant::now() > until {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err("no answer in 10 s; killed".to_owned());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })();
        let value = match answer {
            Ok(v) => v,
            Err(e) => json!({"error": e}),
        };
        self.ctx.raw.line("mps-control", &format!("uid {uid:?} {commands:?} -> {value}"));
        json!({"commands": commands.trim(), "uid": uid.unwrap_or(0), "answer": value})
    }

    /// A client with the device plugin's MPS environment for a share of `percent` and `memory` MiB.
    fn client(&self, name: &str, share: (u32, u64), spec: Value, uid: Option<u32>) -> Result<Client, String> {
        Client::start(self.ctx, name, spec, &self.share_env(share), uid)
    }

    /// The env of a share of `percent` and `memory` MiB.
    fn share_env(&self, (percent, memory): (u32, u64)) -> Vec<(String, String)> {
        let mut response = ContainerAllocateResponse::default();
        let share = Share { percent, memory: MiB(memory) };
        Enforcement::Mps(self.layout.clone()).limit(&self.uuid, share, &mut response);
        self.client_env(response)
    }

    /// [`Mps::run`] as root in a share's mount namespace ([`confined`]).
    fn run_confined(
        &self,
        name: &str,
        share: (u32, u64),
        spec: Value,
        read_only: bool,
    ) -> Result<Client, String> {
        let cmd = Client::command(self.ctx, spec, &self.share_env(share), None);
        let mut client =
            Client::spawn(self.ctx, name, confined(&cmd, &self.layout.pipe(&self.uuid), read_only))?;
        let _ = client.finish(Duration::from_secs(40));
        Ok(client)
    }

    /// [`Mps::client`], run to its end (killed past 40 s).
    fn run(&self, name: &str, share: (u32, u64), spec: Value, uid: Option<u32>) -> Result<Client, String> {
        let mut client = self.client(name, share, spec, uid)?;
        let _ = client.finish(Duration::from_secs(40));
        Ok(client)
    }

    /// The MPS servers the daemon lists (`get_server_list`).
    fn servers(&self) -> Vec<String> {
        let answer = self.control("get_server_list\n", None);
        answer["answer"]["stdout"].as_str().unwrap_or("").split_whitespace().map(str::to_owned).collect()
    }

    /// Shuts every server down and waits (up to 15 s) until none is listed.
    fn shut_servers(&self) -> Value {
        let servers = self.servers();
        for s in &servers {
            self.control(&format!("shutdown_server {s}\n"), None);
        }
        let until = Instant::now() + Duration::from_secs(15);
        while !self.servers().is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(250));
        }
        json!({"shut": servers, "left": self.servers()})
    }
}

fn mps_section(ctx: &Ctx) -> Result<Value, String> {
    let Some(program) = find_mps_control(ctx.args.mps_control.as_deref()) else {
        return Ok(
            json!({"ok": null, "reason": "no nvidia-cuda-mps-control on the PATH or in the driver's folders"}),
        );
    };
    let uuid = NvmlInventory::new(ctx.args.nvml_lib.clone())
        .cards()
        .map_err(|e| e.to_string())?
        .into_iter()
        .find(|c| !c.mig)
        .map(|c| c.info.uuid)
        .ok_or("no card outside MIG mode")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let (layout, stop, supervised) = supervise(ctx, "mps", &program, false, &runtime);
    let m = Mps { ctx, program, layout: layout.clone(), uuid: uuid.clone() };
    let mut report = json!({"program": m.program, "card": uuid});
    let daemon = wait_until(Duration::from_secs(15), || layout.daemon(&uuid).ok());
    report["daemon_pid"] = json!(daemon);
    if daemon.is_none() {
        report["error"] = json!(layout.daemon(&uuid).err());
    } else {
        report["pipe_dir_daemon_alone"] = entries(&layout.pipe(&uuid));
        report["confinement"] = confinement(&layout.pipe(&uuid));
        mps_tries(&m, &mut report);
    }
    let _ = stop.send(true);
    let ended = runtime.block_on(async { tokio::time::timeout(Duration::from_secs(15), supervised).await });
    report["supervisor_stopped"] = json!(match ended {
        Ok(Ok(Ok(()))) => "stopped; its daemon told to quit".to_owned(),
        Ok(Ok(Err(e))) => e,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "did not stop in 15 s".into(),
    });
    report["daemon_after_stop"] = json!(layout.daemon(&uuid).map_err(|_| "gone"));
    if let Ok(text) = std::fs::read_to_string(layout.log(&uuid).join("control.log")) {
        ctx.raw.line("mps control.log", &text);
    }
    if let Ok(text) = std::fs::read_to_string(layout.log(&uuid).join("server.log")) {
        ctx.raw.line("mps server.log", &text);
    }
    if ctx.args.exclusive {
        report["exclusive_supervisor"] = exclusive_supervisor(ctx, &m.program, &uuid, &runtime);
    }
    Ok(report)
}

/// The agent's MPS supervisor (`mps-control`, `exclusive` as `--mps-exclusive-process`) on `runtime`,
/// its daemons under a fresh `<work>/<dir>`: their layout, the stop signal, the task.
fn supervise(
    ctx: &Ctx,
    dir: &str,
    program: &Path,
    exclusive: bool,
    runtime: &tokio::runtime::Runtime,
) -> (mps::Layout, tokio::sync::watch::Sender<bool>, tokio::task::JoinHandle<Result<(), String>>) {
    let layout = mps::Layout::new(ctx.args.work.join(dir), PathBuf::from("/proc"));
    let _ = std::fs::remove_dir_all(&layout.root);
    let supervisor = mps::Supervisor {
        layout: layout.clone(),
        program: program.to_owned(),
        backends: vec![Box::new(NvmlInventory::new(ctx.args.nvml_lib.clone()))],
        every: Duration::from_secs(1),
        exclusive: exclusive.then(|| ctx.args.nvml_lib.clone()),
        shm_source: None,
        pipe_source: None,
        card_index: None,
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    (layout, stop, runtime.spawn(mps::supervise(supervisor, stopped)))
}

/// The supervisor as `mps-control --mps-exclusive-process` runs it: the card in `EXCLUSIVE_PROCESS`
/// mode and a server up before any client, marked for the agent; a process around MPS refused, a
/// share and a whole card (the device plugin's envs) served through MPS; `DEFAULT` again at the end.
fn exclusive_supervisor(ctx: &Ctx, program: &Path, uuid: &str, runtime: &tokio::runtime::Runtime) -> Value {
    use nvml_wrapper::enum_wrappers::device::ComputeMode;
    let shm_before = shm_files();
    let (layout, stop, supervised) = supervise(ctx, "mps-exclusive", program, true, runtime);
    let m = Mps { ctx, program: program.to_owned(), layout: layout.clone(), uuid: uuid.to_owned() };
    let mode = || -> Value {
        let read = ctx.nvml().and_then(|n| {
            n.device_by_uuid(uuid)
                .and_then(|d| d.compute_mode())
                .map(|c| format!("{c:?}"))
                .map_err(|e| e.to_string())
        });
        json!(read)
    };
    let marked = wait_until(Duration::from_secs(20), || layout.exclusive(uuid).then_some(()));
    let mut report = json!({
        "marked": marked.is_some(), "compute_mode": mode(), "servers_before_any_client": m.servers(),
        "shm_server_alone": shm_grown(&shm_before),
    });
    if marked.is_some() && ctx.need_torch().is_ok() {
        let tries = (|| -> Result<Value, String> {
            let outside = Client::run(ctx, "xs-around", json!({"try_mib": [1024]}), &around_mps(ctx), None)?;
            let share = m.run("xs-share", (30, 2048), json!({"try_mib": [1024, 3072]}), None)?;
            // A whole card: the device plugin's MPS client envs without limits.
            let mut response = ContainerAllocateResponse::default();
            Enforcement::Mps(layout.clone()).mps_client(uuid, &mut response);
            let env = m.client_env(response);
            let whole = Client::run(ctx, "xs-whole", json!({"try_mib": [8192]}), &env, None)?;
            let refused =
                outcome(&outside)["error"].as_str().is_some_and(|e| e.contains("busy or unavailable"));
            let share_held = tries_as(&share, &[(1024, true), (3072, false)]);
            let whole_ran = tries_as(&whole, &[(8192, true)]);
            Ok(json!({
                "ok": refused && share_held && whole_ran,
                "around_refused": refused, "share_limits_held": share_held, "whole_card_ran": whole_ran,
                "around": outcome(&outside), "share": outcome(&share), "whole": outcome(&whole),
            }))
        })();
        report["clients"] = tries.unwrap_or_else(|e| json!({"ok": false, "error": e}));
    }
    let _ = stop.send(true);
    let ended = runtime.block_on(async { tokio::time::timeout(Duration::from_secs(20), supervised).await });
    report["stopped"] = json!(matches!(ended, Ok(Ok(Ok(())))));
    report["compute_mode_after_stop"] = mode();
    report["mark_after_stop"] = json!(layout.exclusive(uuid));
    let default = matches!(
        ctx.nvml()
            .and_then(|n| n.device_by_uuid(uuid).and_then(|d| d.compute_mode()).map_err(|e| e.to_string())),
        Ok(ComputeMode::Default)
    );
    report["ok"] = json!(report["clients"]["ok"] == true && default && !layout.exclusive(uuid));
    report
}

/// The env of a process that goes around MPS: its pipe directory an empty one, so it finds no daemon
/// and opens the card itself.
fn around_mps(ctx: &Ctx) -> Vec<(String, String)> {
    let around = ctx.args.work.join("no-mps");
    let _ = std::fs::create_dir_all(&around);
    vec![("CUDA_MPS_PIPE_DIRECTORY".to_owned(), around.display().to_string())]
}

/// `cmd` run as a share's container runs it: in a mount namespace of its own, where `/dev/shm` is a
/// fresh 64 MiB tmpfs (not the one the daemon and the other clients see) and, with `read_only`, the
/// card's pipe directory `pipe` cannot be written (`unshare` and `mount`, as root).
fn confined(cmd: &Command, pipe: &Path, read_only: bool) -> Command {
    const SCRIPT: &str = "set -e; mount -t tmpfs -o size=64m,mode=1777 nano-gpu-check-shm /dev/shm; \
        if [ \"$1\" = ro ]; then mount --bind \"$2\" \"$2\"; mount -o remount,bind,ro \"$2\"; fi; \
        shift 2; exec \"$@\"";
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "--", "sh", "-c", SCRIPT, "sh"])
        .arg(if read_only { "ro" } else { "rw" })
        .arg(pipe)
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(v) => c.env(key, v),
            None => c.env_remove(key),
        };
    }
    c
}

/// Whether [`confined`] confines here (it needs no CUDA): inside, the pipe directory refuses a new
/// file and `/dev/shm` is the fresh 64 MiB one.
fn confinement(pipe: &Path) -> Value {
    let mut probe = Command::new("sh");
    probe.arg("-c").arg(
        "if (: > \"$0/nano-gpu-check-probe\") 2>/dev/null; then echo writable; else echo read-only; fi; \
         df -k /dev/shm | tail -n 1",
    );
    probe.arg(pipe);
    let out = match confined(&probe, pipe, true).output() {
        Ok(out) => out,
        Err(e) => return json!({"ok": false, "error": format!("unshare: {e}")}),
    };
    let _ = std::fs::remove_file(pipe.join("nano-gpu-check-probe"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let pipe_was = lines.next().unwrap_or_default().to_owned();
    let shm_kib: Option<u64> = lines.next().and_then(|l| l.split_whitespace().nth(1)?.parse().ok());
    json!({
        "ok": out.status.success() && pipe_was == "read-only" && shm_kib == Some(65536),
        "pipe": pipe_was, "shm_kib": shm_kib,
        "stderr": String::from_utf8_lossy(&out.stderr).trim(),
    })
}

/// The entries of a card's pipe directory: name -> kind (what the daemon, its server and clients
/// leave there, which decides whether a container may get the directory read-only).
fn entries(dir: &Path) -> Value {
    let names: serde_json::Map<String, Value> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            use std::os::unix::fs::FileTypeExt;
            let kind = match e.file_type() {
                Ok(t) if t.is_socket() => "socket",
                Ok(t) if t.is_fifo() => "fifo",
                Ok(t) if t.is_dir() => "dir",
                Ok(t) if t.is_symlink() => "symlink",
                Ok(t) if t.is_file() => "file",
                _ => "other",
            };
            (e.file_name().to_string_lossy().into_owned(), json!(kind))
        })
        .collect();
    Value::Object(names)
}

/// `holder` keeps the card busy (its load running) while `newcomer` starts and runs to its end; both,
/// with what they printed.
fn holder_then(
    mut holder: Client,
    newcomer: impl FnOnce() -> Result<Client, String>,
) -> Result<(Client, Client), String> {
    holder.wait_for("loaded", Duration::from_secs(45))?;
    let newcomer = newcomer()?;
    let _ = holder.finish(Duration::from_secs(20));
    Ok((holder, newcomer))
}

fn wait_until<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let until = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A client's outcome: what it saw at start and its tries.
fn outcome(c: &Client) -> Value {
    let init = c.seen.iter().find(|(_, v)| v["event"] == "init").map(|(_, v)| v.clone());
    let error = c.seen.iter().find(|(_, v)| v["event"] == "error").map(|(_, v)| v["error"].clone());
    json!({"init": init, "tries": c.tries(), "error": error})
}

/// Whether the tries went as `expected` (MiB, should succeed).
fn tries_as(c: &Client, expected: &[(u64, bool)]) -> bool {
    let tries = c.tries();
    tries.len() == expected.len()
        && tries.iter().zip(expected).all(|(t, (mib, ok))| t["mib"] == *mib && t["ok"] == *ok)
}

fn mps_tries(m: &Mps, report: &mut Value) {
    let ctx = m.ctx;
    report["defaults_at_start"] = json!([
        m.control("get_default_active_thread_percentage\n", None),
        m.control("get_default_device_pinned_mem_limit 0\n", None),
    ]);
    if let Err(e) = ctx.need_torch() {
        report["clients"] = json!(e);
        report["ok"] = json!(null);
        report["control_as_nobody"] =
            json!(m.control("get_default_active_thread_percentage\n", Some(NOBODY)));
        return;
    }
    // Two shares side by side: each allocation below its limit works, one past it fails.
    let two = (|| -> Result<Value, String> {
        let spec = |tries: &[u64]| json!({"try_mib": tries, "load_s": 6});
        let shm_before = shm_files();
        let mut a = m.client("mps-a", (25, 2048), spec(&[1024, 3072]), None)?;
        let mut b = m.client("mps-b", (50, 4096), spec(&[3072, 6144]), None)?;
        a.wait_for("loaded", Duration::from_secs(60))?;
        b.wait_for("loaded", Duration::from_secs(30))?;
        let sampler = NvmlInventory::new(ctx.args.nvml_lib.clone());
        std::thread::sleep(Duration::from_secs(2));
        let seen = sampler.sample().map_err(|e| e.to_string())?;
        let shm = shm_grown(&shm_before);
        let pipe_dir = entries(&m.layout.pipe(&m.uuid));
        let both = process_in(&seen, a.pid()).is_some() && process_in(&seen, b.pid()).is_some();
        let lists = nvml_lists(ctx);
        let _ = (a.finish(Duration::from_secs(30)), b.finish(Duration::from_secs(30)));
        let limits =
            tries_as(&a, &[(1024, true), (3072, false)]) && tries_as(&b, &[(3072, true), (6144, false)]);
        Ok(json!({
            "ok": limits && both, "limits_held": limits, "sampler_sees_both": both,
            "a": outcome(&a), "b": outcome(&b), "a_pid": a.pid(), "b_pid": b.pid(), "sampled": sampled(&seen),
            "servers": m.servers(), "nvml_lists": lists, "shm_server_and_both": shm,
            "pipe_dir_with_both": pipe_dir,
        }))
    })();
    let clients_run = two.is_ok();
    report["two_clients"] = two.unwrap_or_else(|e| json!({"ok": false, "error": e}));
    if !clients_run {
        report["ok"] = json!(false);
        report["set_default_as_nobody"] =
            json!(m.control("set_default_active_thread_percentage 7\n", Some(NOBODY)));
        return;
    }
    // A share whose container has a `/dev/shm` of its own (not the daemon's), then also its pipe
    // directory read-only: does it still reach the card through MPS, its limits held?
    if report["confinement"]["ok"] == true {
        let confined_try = |name: &str, read_only: bool| -> Value {
            match m.run_confined(name, (25, 2048), json!({"try_mib": [1024, 3072]}), read_only) {
                Ok(c) => {
                    json!({"limits_held": tries_as(&c, &[(1024, true), (3072, false)]), "client": outcome(&c)})
                }
                Err(e) => json!({"error": e}),
            }
        };
        let own_shm = confined_try("mps-own-shm", false);
        let read_only = confined_try("mps-own-shm-ro-pipe", true);
        report["confined_clients"] = json!({
            "own_shm": own_shm, "own_shm_read_only_pipe": read_only,
            "pipe_dir_after": entries(&m.layout.pipe(&m.uuid)),
        });
    }
    // A tenant's env above the daemon's defaults: does the new server clamp it?
    let clamp = (|| -> Result<Value, String> {
        let shut = m.shut_servers();
        let set = [
            m.control("set_default_active_thread_percentage 20\n", None),
            m.control("set_default_device_pinned_mem_limit 0 2048M\n", None),
        ];
        let mut c = m.client("mps-clamp", (100, 8192), json!({"try_mib": [1024, 4096]}), None)?;
        c.wait_for("init", Duration::from_secs(45))?;
        let _ = c.finish(Duration::from_secs(60));
        let clamped = tries_as(&c, &[(1024, true), (4096, false)]);
        Ok(json!({"memory_clamped": clamped, "shut": shut, "set": set, "client": outcome(&c)}))
    })();
    report["env_above_defaults"] = clamp.unwrap_or_else(|e| json!({"error": e}));
    // Another user's commands to the control daemon.
    let before = m.control("get_default_active_thread_percentage\n", None);
    let tried = m.control("set_default_active_thread_percentage 7\n", Some(NOBODY));
    let after = m.control("get_default_active_thread_percentage\n", None);
    report["set_default_as_nobody"] = json!({
        "changed": before["answer"]["stdout"] != after["answer"]["stdout"],
        "before": before, "tried": tried, "after": after,
    });
    // Clients of two users: does the second wait until the first user's server is gone?
    let turns = (|| -> Result<Value, String> {
        m.shut_servers();
        let mut root = m.client("mps-root", (10, 1024), json!({"load_s": 10}), None)?;
        root.wait_for("loaded", Duration::from_secs(45))?;
        let mut other = m.client("mps-nobody", (50, 4096), json!({"load_s": 1}), Some(NOBODY))?;
        let other_init = other.wait_for("init", Duration::from_secs(40));
        let _ = root.finish(Duration::from_secs(30));
        let _ = other.finish(Duration::from_secs(20));
        let root_done = root.arrived("done");
        let other_at = other.arrived("init");
        let waited = match (root_done, other_at) {
            (Some(r), Some(o)) => json!(o > r),
            _ => Value::Null,
        };
        Ok(json!({
            "second_user_started_after_first_ended": waited,
            "root": outcome(&root), "nobody": outcome(&other),
            "nobody_init": other_init,
        }))
    })();
    report["two_users"] = turns.unwrap_or_else(|e| json!({"error": e}));
    if ctx.args.exclusive {
        report["exclusive_process"] = exclusive_process(m);
    }
    // `quit` from another user: does the daemon stop (and does the supervisor start it again)?
    let pid = m.layout.daemon(&m.uuid).ok();
    let quit = m.control("quit\n", Some(NOBODY));
    std::thread::sleep(Duration::from_secs(2));
    let after = m.layout.daemon(&m.uuid).ok();
    let restarted = if after.is_some() && after != pid {
        json!(after)
    } else if after.is_none() {
        json!(wait_until(Duration::from_secs(10), || m.layout.daemon(&m.uuid).ok()))
    } else {
        Value::Null
    };
    report["quit_as_nobody"] = json!({
        "daemon_before": pid, "answer": quit, "daemon_after_2s": after, "restarted_by_supervisor": restarted,
    });
    report["ok"] = report["two_clients"]["ok"].clone();
}

/// The card in `EXCLUSIVE_PROCESS` compute mode (NVIDIA's advice for MPS): can a process that goes
/// around MPS (its pipe directory an empty one) reach the card while an MPS server holds it, and can
/// MPS clients while such a process holds it? The mode is set back to `DEFAULT` at the end.
fn exclusive_process(m: &Mps) -> Value {
    use nvml_wrapper::enum_wrappers::device::ComputeMode;
    let ctx = m.ctx;
    let Ok(nvml) = ctx.nvml() else { return json!({"error": "NVML"}) };
    let mut device = match nvml.device_by_uuid(m.uuid.as_str()) {
        Ok(d) => d,
        Err(e) => return json!({"error": e.to_string()}),
    };
    let before = device.compute_mode().map(|c| format!("{c:?}")).map_err(|e| e.to_string());
    if let Err(e) = device.set_compute_mode(ComputeMode::ExclusiveProcess) {
        return json!({"before": before, "set": e.to_string()});
    }
    let around_env = around_mps(ctx);
    let mut result = json!({"before": before, "set": "EXCLUSIVE_PROCESS"});
    m.shut_servers();
    // An MPS client first (the server holds the card), then a process around MPS; then the other way.
    let first = m.client("excl-mps", (50, 4096), json!({"load_s": 6}), None).and_then(|holder| {
        holder_then(holder, || Client::run(ctx, "excl-around", json!({"try_mib": [1024]}), &around_env, None))
    });
    result["server_first"] = match first {
        Ok((client, around)) => json!({"mps_client": outcome(&client), "around_mps": outcome(&around)}),
        Err(e) => json!({"error": e}),
    };
    m.shut_servers();
    let second =
        Client::start(ctx, "excl-around-first", json!({"load_s": 6}), &around_env, None).and_then(|holder| {
            holder_then(holder, || m.run("excl-mps-second", (50, 4096), json!({"try_mib": [1024]}), None))
        });
    result["around_first"] = match second {
        Ok((around, client)) => json!({"around_mps": outcome(&around), "mps_client": outcome(&client)}),
        Err(e) => json!({"error": e}),
    };
    m.shut_servers();
    // A server started before any client (`start_server -uid 0`) and kept idle: is the card closed
    // to a process around MPS, and does a client of another user still get its turn?
    let eager = (|| -> Result<Value, String> {
        let started = m.control("start_server -uid 0\n", None);
        std::thread::sleep(Duration::from_secs(1));
        let servers = m.servers();
        let around = Client::run(ctx, "eager-around", json!({"try_mib": [1024]}), &around_env, None)?;
        let asked = Instant::now();
        let mut other = m.client("eager-nobody", (50, 4096), json!({"load_s": 3}), Some(NOBODY))?;
        let other_init =
            other.wait_for("init", Duration::from_secs(40)).map(|_| asked.elapsed().as_secs_f64());
        let during = m.servers();
        let around_during =
            Client::run(ctx, "eager-around-2", json!({"try_mib": [1024]}), &around_env, None)?;
        let _ = other.finish(Duration::from_secs(20));
        let after = m.servers();
        Ok(json!({
            "start_server": started, "servers_idle": servers, "around_mps_idle_server": outcome(&around),
            "other_user_seconds_to_context": other_init, "other_user": outcome(&other),
            "servers_with_other_user": during, "around_mps_other_user_server": outcome(&around_during),
            "servers_after": after,
        }))
    })();
    result["eager_server"] = eager.unwrap_or_else(|e| json!({"error": e}));
    m.shut_servers();
    result["set_back"] =
        json!(device.set_compute_mode(ComputeMode::Default).map(|_| "DEFAULT").map_err(|e| e.to_string()));
    result
}
