//! Forwards TCP ports on this machine's loopback into the network namespace the test harness made
//! for a cluster (`hack/cluster.sh`): the control plane, the nodes and their pods live there, and
//! tests and the README's `kubectl` reach them through these ports, with no route or interface added
//! to the machine's own network.
//!
//! Usage: `netns-forward --netns FILE [--faults FAULTS] LISTEN=TARGET...`, e.g.
//! `netns-forward --netns /tmp/c/netns 127.0.0.1:16443=10.201.0.254:6443`.
//!
//! The listening sockets are made first, in the namespace this process starts in; then the process
//! joins FILE's namespace, so every connection it opens to a TARGET starts from inside it (a socket
//! belongs to the namespace it was created in, whichever the process later joins).
//!
//! With `--faults FAULTS` it is also the fault suite's network between some pods and the API server
//! (`tests/tests/faults.rs`): FAULTS holds one fault, read again every 100 ms (a missing file is
//! `pass`):
//! - `pass`: bytes go through as they come;
//! - `delay MS`: every chunk read, either way, is written MS milliseconds later, in order (latency,
//!   not a narrower pipe: a slow network or a slow API server);
//! - `cut`: every open connection is closed, and each new one closed as soon as it is accepted (the
//!   target unreachable; clients see their connections reset, as when the server restarts).

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    const USAGE: &str = "usage: netns-forward --netns FILE [--faults FAULTS] LISTEN=TARGET...";
    let netns = nano_gpu_tests::flag_value("--netns").context(USAGE)?;
    let faults_file = nano_gpu_tests::flag_value("--faults");
    let forwards = std::env::args()
        .skip(1)
        .filter(|a| a.contains('=') && *a != netns && Some(a) != faults_file.as_ref())
        .map(|a| parse_forward(&a))
        .collect::<Result<Vec<_>>>()?;
    if forwards.is_empty() {
        bail!("no LISTEN=TARGET given; {USAGE}");
    }
    let listeners = forwards
        .iter()
        .map(|(listen, target)| {
            TcpListener::bind(listen).with_context(|| format!("listening on {listen}")).map(|l| (l, *target))
        })
        .collect::<Result<Vec<_>>>()?;
    join_netns(&netns)?;
    let faults = Arc::new(Faults::default());
    if let Some(file) = faults_file {
        let faults = faults.clone();
        thread::spawn(move || faults.follow(PathBuf::from(file)));
    }
    let threads: Vec<_> = listeners
        .into_iter()
        .map(|(listener, target)| {
            let faults = faults.clone();
            thread::spawn(move || serve(listener, target, faults))
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

fn parse_forward(arg: &str) -> Result<(SocketAddr, SocketAddr)> {
    let (listen, target) = arg
        .split_once('=')
        .with_context(|| format!("{arg:?}: expected LISTEN=TARGET (host:port=host:port)"))?;
    let parse =
        |s: &str| s.parse::<SocketAddr>().with_context(|| format!("{arg:?}: {s:?} is not an IP:port"));
    Ok((parse(listen)?, parse(target)?))
}

/// Moves this thread, and so every thread it starts later, into the network namespace FILE names.
fn join_netns(file: &str) -> Result<()> {
    let ns = File::open(file).with_context(|| format!("opening {file}"))?;
    rustix::thread::move_into_link_name_space(ns.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))
        .with_context(|| format!("joining the network namespace {file}"))
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
enum Fault {
    #[default]
    Pass,
    Delay(Duration),
    Cut,
}

fn parse_fault(text: &str) -> Result<Fault> {
    let words: Vec<&str> = text.split_whitespace().collect();
    match words.as_slice() {
        [] | ["pass"] => Ok(Fault::Pass),
        ["cut"] => Ok(Fault::Cut),
        ["delay", ms] => {
            let ms: u64 =
                ms.parse().with_context(|| format!("delay {ms:?}: not a number of milliseconds"))?;
            Ok(Fault::Delay(Duration::from_millis(ms)))
        }
        _ => bail!("{text:?}: expected pass, delay MS or cut"),
    }
}

/// The fault in force, and every open connection (both its sockets), to close at a cut.
#[derive(Default)]
struct Faults {
    now: Mutex<Fault>,
    open: Mutex<HashMap<u64, [TcpStream; 2]>>,
    next: AtomicU64,
}

impl Faults {
    fn fault(&self) -> Fault {
        *self.now.lock().unwrap()
    }

    /// Reads `file` every 100 ms; a fault it cannot read leaves the one in force (and says so).
    fn follow(&self, file: PathBuf) {
        let mut complained = String::new();
        loop {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            match parse_fault(&text) {
                Ok(fault) => {
                    let was = std::mem::replace(&mut *self.now.lock().unwrap(), fault);
                    if was != fault {
                        eprintln!("netns-forward: {fault:?} (was {was:?})");
                        if fault == Fault::Cut {
                            self.cut_all();
                        }
                    }
                }
                Err(e) if e.to_string() != complained => {
                    eprintln!("netns-forward: {}: {e}", file.display());
                    complained = e.to_string();
                }
                Err(_) => {}
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    fn cut_all(&self) {
        for sockets in self.open.lock().unwrap().values() {
            for s in sockets {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

fn serve(listener: TcpListener, target: SocketAddr, faults: Arc<Faults>) {
    for client in listener.incoming() {
        let client = match client {
            Ok(c) => c,
            Err(e) => {
                eprintln!("netns-forward: accept for {target}: {e}");
                continue;
            }
        };
        if faults.fault() == Fault::Cut {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        match TcpStream::connect(target) {
            Ok(upstream) => splice(client, upstream, faults.clone()),
            // The client sees its connection closed, as it would with nothing listening.
            Err(e) => eprintln!("netns-forward: connecting to {target}: {e}"),
        }
    }
}

/// Copies both ways until each side has closed its half (or a cut closed both).
fn splice(a: TcpStream, b: TcpStream, faults: Arc<Faults>) {
    let clones = || Some([a.try_clone().ok()?, b.try_clone().ok()?]);
    let (Some([a2, b2]), Some(held)) = (clones(), clones()) else {
        return;
    };
    let id = faults.next.fetch_add(1, Ordering::Relaxed);
    faults.open.lock().unwrap().insert(id, held);
    // A cut that came in after the accept and went through the open connections before this one was
    // among them: this one goes too.
    if faults.fault() == Fault::Cut {
        let _ = (a.shutdown(Shutdown::Both), b.shutdown(Shutdown::Both));
    }
    thread::spawn(move || {
        let up = {
            let faults = faults.clone();
            thread::spawn(move || pipe(a, b2, &faults))
        };
        pipe(b, a2, &faults);
        let _ = up.join();
        faults.open.lock().unwrap().remove(&id);
    });
}

/// Copies `from` to `to`; each chunk waits out the delay in force when it was read (a writer thread
/// keeps the order and lets reading go on meanwhile). When `to` fails, `from` is closed for reading.
fn pipe(mut from: TcpStream, mut to: TcpStream, faults: &Faults) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let reader = from.try_clone();
    let writer = thread::spawn(move || {
        for (due, chunk) in rx {
            thread::sleep(due.saturating_duration_since(Instant::now()));
            if to.write_all(&chunk).is_err() {
                if let Ok(r) = &reader {
                    let _ = r.shutdown(Shutdown::Read);
                }
                return;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = match faults.fault() {
            Fault::Delay(d) => d,
            Fault::Pass | Fault::Cut => Duration::ZERO,
        };
        if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_or_are_refused() {
        assert_eq!(parse_fault("").unwrap(), Fault::Pass);
        assert_eq!(parse_fault("pass\n").unwrap(), Fault::Pass);
        assert_eq!(parse_fault("cut").unwrap(), Fault::Cut);
        assert_eq!(parse_fault("delay 1500\n").unwrap(), Fault::Delay(Duration::from_millis(1500)));
        for bad in ["delay", "delay x", "slow 5", "cut now"] {
            assert!(parse_fault(bad).is_err(), "{bad}");
        }
    }

    /// An echo server behind the forwarder, its faults set through a file as the suite sets them.
    #[test]
    fn delays_in_order_and_cuts_what_is_open() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap();
        thread::spawn(move || {
            for c in echo.incoming().flatten() {
                let mut w = c.try_clone().unwrap();
                thread::spawn(move || std::io::copy(&mut &c, &mut w));
            }
        });
        let front = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = front.local_addr().unwrap();
        let dir = std::env::temp_dir().join(format!("netns-forward-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("faults");
        let faults = Arc::new(Faults::default());
        {
            let faults = faults.clone();
            let file = file.clone();
            thread::spawn(move || faults.follow(file));
        }
        {
            let faults = faults.clone();
            thread::spawn(move || serve(front, target, faults));
        }
        let set = |fault: &str, want: Fault| {
            std::fs::write(&file, fault).unwrap();
            let start = Instant::now();
            while faults.fault() != want {
                assert!(start.elapsed() < Duration::from_secs(5), "{fault} not taken up");
                thread::sleep(Duration::from_millis(20));
            }
        };
        let round_trip = |conn: &mut TcpStream, what: &[u8]| {
            let start = Instant::now();
            conn.write_all(what).unwrap();
            let mut back = vec![0u8; what.len()];
            conn.read_exact(&mut back).unwrap();
            assert_eq!(back, what);
            start.elapsed()
        };

        let mut conn = TcpStream::connect(addr).unwrap();
        assert!(round_trip(&mut conn, b"fast") < Duration::from_millis(200));
        set("delay 300", Fault::Delay(Duration::from_millis(300)));
        // Both ways delayed, chunks in the order sent.
        let start = Instant::now();
        conn.write_all(b"one ").unwrap();
        thread::sleep(Duration::from_millis(50));
        conn.write_all(b"two").unwrap();
        let mut back = [0u8; 7];
        conn.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"one two");
        assert!(start.elapsed() >= Duration::from_millis(650), "{:?}", start.elapsed());
        set("cut", Fault::Cut);
        let mut buf = [0u8; 16];
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(matches!(conn.read(&mut buf), Ok(0) | Err(_)), "an open connection outlived the cut");
        let mut late = TcpStream::connect(addr).unwrap();
        late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = late.write_all(b"x");
        assert!(matches!(late.read(&mut buf), Ok(0) | Err(_)), "a new connection was served during the cut");
        set("pass", Fault::Pass);
        let mut again = TcpStream::connect(addr).unwrap();
        assert!(round_trip(&mut again, b"back") < Duration::from_millis(200));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
