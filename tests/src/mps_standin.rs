//! What the MPS stand-ins share (`nvidia-cuda-mps-control`, the control daemon; `gpu-use`, a CUDA
//! process that finds one and becomes its client): the daemon's defaults, kept in its pipe directory,
//! and the limits a client ends up with. As NVIDIA documents, and as an H200 showed
//! (`hack/gpu-check.sh`), the daemon's defaults are ceilings: a client's own
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` may lower them, never
//! raise them. Both come from the client's own environment, which its process may change. And MPS
//! serves one user at a time per card: a client of another user waits until the clients of the user
//! being served have ended (an H100 and an H200 showed it; an idle server, no client, gives way at
//! once).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

/// The daemon's socket for its clients, in its pipe directory. As with NVIDIA's daemon, a client
/// reaches its server through a socket there, and connecting writes nothing to the directory: a
/// client's pipe directory may be mounted read-only.
pub const CLIENT_SOCKET: &str = "standin-clients";

/// The users of one card's MPS server: it serves one user at a time, any number of that user's
/// clients.
#[derive(Default)]
pub struct Users {
    /// The user served now and how many of its clients run.
    served: Mutex<Option<(u32, usize)>>,
    changed: Condvar,
}

impl Users {
    /// Waits until a client of `uid` may be served (calling `waiting` once with the user served
    /// meanwhile), and counts it among the served user's clients.
    pub fn enter(&self, uid: u32, mut waiting: impl FnMut(u32)) {
        let mut served = self.served.lock().unwrap_or_else(|e| e.into_inner());
        let mut told = false;
        loop {
            match &mut *served {
                None => {
                    *served = Some((uid, 1));
                    return;
                }
                Some((user, clients)) if *user == uid => {
                    *clients += 1;
                    return;
                }
                Some((user, _)) => {
                    if !told {
                        waiting(*user);
                        told = true;
                    }
                    served = self.changed.wait(served).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }

    /// A client of the served user ended.
    pub fn leave(&self) {
        let mut served = self.served.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, clients)) = &mut *served {
            *clients -= 1;
            if *clients == 0 {
                *served = None;
                self.changed.notify_all();
            }
        }
    }

    /// The user served now, if any client runs.
    pub fn serving(&self) -> Option<u32> {
        self.served.lock().unwrap_or_else(|e| e.into_inner()).map(|(user, _)| user)
    }
}

/// The daemon's side: serves the clients that connect to `listener`, each on a thread of its own,
/// one user at a time. A client's user is its connection's peer credentials (as the real daemon
/// tells users apart); it is told `wait UID` while another user's clients run and `ok` once served,
/// and keeps its place until it closes the connection (its process ends).
pub fn serve(listener: UnixListener, users: Arc<Users>) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let users = users.clone();
        std::thread::spawn(move || {
            let Ok(peer) = rustix::net::sockopt::socket_peercred(&stream) else { return };
            let mut told = stream.try_clone().ok();
            users.enter(peer.uid.as_raw(), |other| {
                if let Some(told) = &mut told {
                    let _ = writeln!(told, "wait {other}");
                }
            });
            if writeln!(stream, "ok").is_ok() {
                // Held until the client closes its end (whatever it sends is ignored).
                let _ = std::io::copy(&mut stream, &mut std::io::sink());
            }
            users.leave();
        });
    }
}

/// The client's side: becomes a client of the daemon in `pipe`. While another user's clients run,
/// waits, calling `waiting` once with that user. The connection returned holds the client's place
/// until it is dropped (the process ends).
pub fn connect(pipe: &Path, mut waiting: impl FnMut(u32)) -> std::io::Result<UnixStream> {
    let stream = UnixStream::connect(pipe.join(CLIENT_SOCKET))?;
    let mut lines = BufReader::new(stream.try_clone()?).lines();
    loop {
        let line = lines.next().transpose()?.unwrap_or_default();
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["ok"] => return Ok(stream),
            ["wait", user] => waiting(user.parse().unwrap_or(u32::MAX)),
            _ => {
                return Err(std::io::Error::other(format!("the MPS daemon answered {line:?}")));
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
    use std::time::Duration;

    #[test]
    fn a_client_of_another_user_waits_until_the_served_users_clients_end() {
        let users = Arc::new(Users::default());
        assert_eq!(users.serving(), None, "no client: any user is served at once");
        users.enter(1000, |u| panic!("waited for {u} on an idle card"));
        users.enter(1000, |u| panic!("a client of the served user waited for {u}"));
        assert_eq!(users.serving(), Some(1000));
        let (tx, rx) = std::sync::mpsc::channel();
        let root = {
            let users = users.clone();
            std::thread::spawn(move || {
                users.enter(0, |u| tx.send(u).unwrap());
                users.leave();
            })
        };
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(1000), "root did not wait for user 1000");
        users.leave();
        std::thread::sleep(Duration::from_millis(300));
        assert!(!root.is_finished(), "root was served while a client of user 1000 still ran");
        users.leave();
        root.join().unwrap();
        assert_eq!(users.serving(), None, "every client ended");
    }

    #[test]
    fn clients_reach_the_daemon_through_its_socket_and_hold_their_place_while_connected() {
        let pipe = std::env::temp_dir().join(format!("nano-gpu-mps-socket-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&pipe);
        std::fs::create_dir_all(&pipe).unwrap();
        let users = Arc::new(Users::default());
        let listener = UnixListener::bind(pipe.join(CLIENT_SOCKET)).unwrap();
        std::thread::spawn({
            let users = users.clone();
            move || serve(listener, users)
        });
        let own = crate::own_uid().unwrap();
        // Two clients of one user (this process's, from the connection's credentials): both at once.
        let first = connect(&pipe, |u| panic!("waited for {u} on an idle card")).unwrap();
        let second = connect(&pipe, |u| panic!("a client of the served user waited for {u}")).unwrap();
        assert_eq!(users.serving(), Some(own));
        drop(first);
        drop(second);
        let gone = std::time::Instant::now();
        while users.serving().is_some() {
            assert!(gone.elapsed() < Duration::from_secs(5), "closed clients still counted");
            std::thread::sleep(Duration::from_millis(10));
        }
        // No daemon: no client.
        std::fs::remove_file(pipe.join(CLIENT_SOCKET)).unwrap();
        assert!(connect(&pipe, |_| {}).is_err());
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
