//! What the MPS stand-ins share (`nvidia-cuda-mps-control`, the control daemon; `gpu-use`, a CUDA
//! process that finds one and becomes its client): the daemon's defaults, kept in its pipe directory,
//! and the limits a client ends up with. As NVIDIA documents, and as an H200 showed
//! (`hack/gpu-check.sh`), the daemon's defaults are ceilings: a client's own
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` may lower them, never
//! raise them. Both come from the client's own environment, which its process may change. And MPS
//! serves one user at a time per card: a client of another user waits until the clients of the user
//! being served have ended (an H100 and an H200 showed it; an idle server, no client, gives way at
//! once).

use std::fs::File;
use std::path::Path;
use std::time::Duration;

/// The daemon's record of its clients, in its pipe directory (made by the daemon, mode 1777, as any
/// user may be a client): a file `<uid>.<tag>` per client, locked for as long as the client runs.
pub const CLIENTS: &str = "clients";

/// The user whose clients the card's MPS server serves now: the UID of a client whose file is still
/// locked, if any (a file left unlocked is a client that ended, and is removed).
pub fn serving(pipe: &Path) -> Option<u32> {
    let entries = std::fs::read_dir(pipe.join(CLIENTS)).ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(uid) = name.split('.').next().and_then(|u| u.parse::<u32>().ok()) else { continue };
        let Ok(file) = File::open(entry.path()) else { continue };
        match file.try_lock() {
            Err(std::fs::TryLockError::WouldBlock) => return Some(uid),
            Ok(()) => {
                let _ = std::fs::remove_file(entry.path());
            }
            Err(_) => {}
        }
    }
    None
}

/// Becomes a client of the daemon in `pipe` as user `uid` (`tag` names the client): while another
/// user's clients run, waits, calling `waiting` once with that user. The file returned holds the
/// client's place until it is dropped (the process ends).
pub fn connect(pipe: &Path, uid: u32, tag: &str, mut waiting: impl FnMut(u32)) -> std::io::Result<File> {
    let dir = pipe.join(CLIENTS);
    let mut told = false;
    loop {
        // One client at a time decides, so two users never both find the card free.
        // (Another user's gate file is read-only to this one: a lock needs no write.)
        let path = dir.join(".connect");
        let gate = File::open(&path)
            .or_else(|_| std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path))?;
        gate.lock()?;
        match serving(pipe) {
            Some(other) if other != uid => {
                drop(gate);
                if !told {
                    waiting(other);
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            _ => {
                let file = File::create(dir.join(format!("{uid}.{tag}")))?;
                file.lock()?;
                return Ok(file);
            }
        }
    }
}

/// The daemon's default active-thread percentage, in its pipe directory (absent: 100).
pub const DEFAULT_THREADS: &str = "default-active-thread-percentage";

/// The daemon's default pinned memory limit, `DEV VALUE` as it was set, in its pipe directory
/// (absent: none).
pub const DEFAULT_MEMORY: &str = "default-device-pinned-mem-limit";

/// A limit as MPS spells it (`2048M`, `2G`, `1024K`, or bytes), in MiB.
pub fn mib(value: &str) -> Option<u64> {
    let value = value.trim();
    let (digits, unit) = value.split_at(value.find(|c: char| !c.is_ascii_digit()).unwrap_or(value.len()));
    let n: u64 = digits.parse().ok()?;
    match unit {
        "G" | "g" => n.checked_mul(1024),
        "M" | "m" => Some(n),
        "K" | "k" => Some(n / 1024),
        "" => Some(n >> 20),
        _ => None,
    }
}

/// What an MPS client of the daemon in `pipe` gets: its active-thread percentage and its pinned
/// memory limit on device 0 in MiB (`None`: unlimited), from the daemon's defaults lowered by
/// `threads_env` and `memory_env` (the client's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and
/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, e.g. `0=2048M`).
pub fn client_limits(pipe: &Path, threads_env: Option<&str>, memory_env: Option<&str>) -> (f64, Option<u64>) {
    let default_threads = std::fs::read_to_string(pipe.join(DEFAULT_THREADS))
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(100.0);
    let threads = threads_env
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(default_threads, |t| t.min(default_threads));
    let default_memory = std::fs::read_to_string(pipe.join(DEFAULT_MEMORY)).ok().and_then(|v| {
        let mut words = v.split_whitespace();
        (words.next() == Some("0")).then(|| words.next().and_then(mib)).flatten()
    });
    let own =
        memory_env.and_then(|v| v.split(',').find_map(|entry| entry.trim().strip_prefix("0=").and_then(mib)));
    let memory = match (own, default_memory) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    (threads, memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_of_another_user_waits_until_the_served_users_clients_end() {
        let pipe = std::env::temp_dir().join(format!("nano-gpu-mps-users-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&pipe);
        std::fs::create_dir_all(pipe.join(CLIENTS)).unwrap();
        assert_eq!(serving(&pipe), None, "no client: any user is served at once");
        let first = connect(&pipe, 1000, "a", |u| panic!("waited for {u} on an idle card")).unwrap();
        let second =
            connect(&pipe, 1000, "b", |u| panic!("a client of the served user waited for {u}")).unwrap();
        assert_eq!(serving(&pipe), Some(1000));
        let (tx, rx) = std::sync::mpsc::channel();
        let root = {
            let pipe = pipe.clone();
            std::thread::spawn(move || {
                let held = connect(&pipe, 0, "c", |u| tx.send(u).unwrap()).unwrap();
                drop(held);
            })
        };
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(1000), "root did not wait for user 1000");
        drop(first);
        std::thread::sleep(Duration::from_millis(300));
        assert!(!root.is_finished(), "root was served while a client of user 1000 still ran");
        drop(second);
        root.join().unwrap();
        assert_eq!(serving(&pipe), None, "every client ended");
        let _ = std::fs::remove_dir_all(&pipe);
    }

    #[test]
    fn the_daemons_defaults_are_ceilings_the_clients_env_may_only_lower() {
        let pipe = std::env::temp_dir().join(format!("nano-gpu-mps-standin-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&pipe);
        std::fs::create_dir_all(&pipe).unwrap();
        // No defaults: the env is the limit, or nothing.
        assert_eq!(client_limits(&pipe, None, None), (100.0, None));
        assert_eq!(client_limits(&pipe, Some("30"), Some("0=2048M")), (30.0, Some(2048)));
        assert_eq!(client_limits(&pipe, Some("100"), None), (100.0, None));
        // Defaults set: a higher env value is capped, a lower one is kept.
        std::fs::write(pipe.join(DEFAULT_THREADS), "50").unwrap();
        std::fs::write(pipe.join(DEFAULT_MEMORY), "0 4G").unwrap();
        assert_eq!(client_limits(&pipe, Some("100"), Some("0=8192M")), (50.0, Some(4096)));
        assert_eq!(client_limits(&pipe, Some("20"), Some("0=1024M")), (20.0, Some(1024)));
        assert_eq!(client_limits(&pipe, None, None), (50.0, Some(4096)));
        assert_eq!(
            (mib("2G"), mib("512M"), mib("1048576"), mib("lots")),
            (Some(2048), Some(512), Some(1), None)
        );
        let _ = std::fs::remove_dir_all(&pipe);
    }
}
