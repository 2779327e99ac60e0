//! Forwards TCP ports on this machine's loopback into the network namespace the test harness made
//! for a cluster (`hack/cluster.sh`): the control plane, the nodes and their pods live there, and
//! tests and the README's `kubectl` reach them through these ports, with no route or interface added
//! to the machine's own network.
//!
//! Usage: `netns-forward --netns FILE LISTEN=TARGET...`, e.g.
//! `netns-forward --netns /tmp/c/netns 127.0.0.1:16443=10.201.0.254:6443`.
//!
//! The listening sockets are made first, in the namespace this process starts in; then the process
//! joins FILE's namespace, so every connection it opens to a TARGET starts from inside it (a socket
//! belongs to the namespace it was created in, whichever the process later joins).

use std::fs::File;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::thread;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    const USAGE: &str = "usage: netns-forward --netns FILE LISTEN=TARGET...";
    let netns = nano_gpu_tests::flag_value("--netns").context(USAGE)?;
    let forwards = std::env::args()
        .skip(1)
        .filter(|a| a.contains('=') && *a != netns)
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
    let threads: Vec<_> = listeners
        .into_iter()
        .map(|(listener, target)| thread::spawn(move || serve(listener, target)))
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

fn serve(listener: TcpListener, target: SocketAddr) {
    for client in listener.incoming() {
        let client = match client {
            Ok(c) => c,
            Err(e) => {
                eprintln!("netns-forward: accept for {target}: {e}");
                continue;
            }
        };
        match TcpStream::connect(target) {
            Ok(upstream) => splice(client, upstream),
            // The client sees its connection closed, as it would with nothing listening.
            Err(e) => eprintln!("netns-forward: connecting to {target}: {e}"),
        }
    }
}

/// Copies both ways until each side has closed its half.
fn splice(a: TcpStream, b: TcpStream) {
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else {
        return;
    };
    thread::spawn(move || pipe(a, b2));
    thread::spawn(move || pipe(b, a2));
}

fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}
