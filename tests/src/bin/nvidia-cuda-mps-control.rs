//! Stands in for NVIDIA's `nvidia-cuda-mps-control` on the harness's real nodes, where there is no
//! driver: the node's runtime stand-in (`nvidia-runtime-standin`) mounts it at
//! `/usr/bin/nvidia-cuda-mps-control` in containers that ask the `compute` driver capability, as
//! NVIDIA's runtime mounts the real one. Its file name makes its `/proc/<pid>/comm` the real one's
//! (`nvidia-cuda-mps`), which is how the agent knows a control daemon.
//!
//! `-f` is the daemon: in `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`) it writes its PID
//! to `nvidia-cuda-mps-control.pid`, as NVIDIA's does, and the card it serves
//! (`CUDA_VISIBLE_DEVICES`) to `card`, and in `/dev/shm` the file `nano-gpu-mps-standin-<card>`, so
//! a client can show which pipe directory and whose `/dev/shm` it was given; it runs until a client tells
//! it to quit (or it is killed). Without `-f` it is the client: it reads commands from its input
//! and passes `quit` on; `start_server`, `get_server_list` and `shutdown_server` keep one server
//! name in the pipe directory; a caller that is not root is refused `quit`, `set_*`, `start_server`
//! and `shutdown_server` with the real daemon's answers. `set_default_active_thread_percentage N`
//! and `set_default_device_pinned_mem_limit DEV VALUE` keep the daemon's defaults in the pipe
//! directory (`nano_gpu_tests::mps_standin`), which `gpu-use`, as an MPS client, takes as
//! ceilings its own environment may only lower, as NVIDIA documents and a real card showed;
//! `get_default_active_thread_percentage` answers it. Its clients connect to its socket in the pipe
//! directory (`nano_gpu_tests::mps_standin::CLIENT_SOCKET`), which writes nothing there, so a
//! client's pipe directory may be read-only, as with NVIDIA's; a client of another user than the
//! one served waits, as with NVIDIA's. Both append what they saw to `control.log` in `CUDA_MPS_LOG_DIRECTORY`
//! (default `/var/log/nvidia-mps`). No MPS server is started: nothing here runs CUDA.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Left in the pipe directory by a client told `quit`; the daemon ends when it sees it.
const QUIT: &str = "quit";
use nano_gpu_tests::mps_standin::{CLIENT_SOCKET, DEFAULT_MEMORY, DEFAULT_THREADS};

fn dir(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from)
}

fn log(dir: &Path, line: &str) {
    let _ = std::fs::create_dir_all(dir);
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("control.log")) {
        let _ = writeln!(f, "{line}");
    }
}

fn main() -> std::io::Result<()> {
    let pipe = dir("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps");
    let logs = dir("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps");
    if std::env::args().nth(1).as_deref() == Some("-f") {
        let card = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
        std::fs::create_dir_all(&pipe)?;
        let _ = std::fs::remove_file(pipe.join(QUIT));
        log(&logs, &format!("start CUDA_VISIBLE_DEVICES={card}"));
        std::fs::write(pipe.join("card"), &card)?;
        // Its clients connect to its socket (`nano_gpu_tests::mps_standin::serve`): any user may be one.
        let socket = pipe.join(CLIENT_SOCKET);
        let _ = std::fs::remove_file(&socket);
        let listener = std::os::unix::net::UnixListener::bind(&socket)?;
        std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o777))?;
        std::thread::spawn(move || nano_gpu_tests::mps_standin::serve(listener, Default::default()));
        // The daemon's /dev/shm, as its clients get it: which cards' daemons share it.
        let shm = format!("/dev/shm/nano-gpu-mps-standin-{card}");
        let _ = std::fs::write(&shm, "an MPS daemon's /dev/shm\n");
        std::fs::write(pipe.join(PID_FILE), format!("{}\n", std::process::id()))?;
        while !pipe.join(QUIT).exists() {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = std::fs::remove_file(pipe.join(PID_FILE));
        let _ = std::fs::remove_file(pipe.join(QUIT));
        let _ = std::fs::remove_file(pipe.join("server"));
        let _ = std::fs::remove_file(&socket);
        let _ = std::fs::remove_file(&shm);
        log(&logs, "stopped");
        return Ok(());
    }
    if !pipe.join(PID_FILE).exists() {
        println!("Cannot find MPS control daemon process");
        std::process::exit(1);
    }
    // As the real daemon answers a user other than root or its own (seen on an H200, driver 580).
    let uid = nano_gpu_tests::own_uid().unwrap_or(u32::MAX);
    let root = uid == 0;
    for command in std::io::stdin().lock().lines() {
        let command = command?;
        log(&logs, &format!("command {command}"));
        let word = command.split_whitespace().next().unwrap_or("");
        if !root && word == "quit" {
            println!("Not enough privilege to execute quit command");
            continue;
        }
        if !root && (word.starts_with("set_") || word == "start_server" || word == "shutdown_server") {
            println!(
                "Insufficient privileges for UID {uid}. Control deamon settings can only be modified by the user \
                 who started it or by the root user."
            );
            continue;
        }
        // One server at a time, started ahead of clients with `start_server -uid N` (no CUDA here:
        // the server is a name in the pipe directory, its "PID" the daemon's).
        match word {
            "get_server_list" => {
                if let Ok(server) = std::fs::read_to_string(pipe.join("server")) {
                    println!("{}", server.trim());
                }
                continue;
            }
            "start_server" => {
                let daemon = std::fs::read_to_string(pipe.join(PID_FILE)).unwrap_or_default();
                std::fs::write(pipe.join("server"), daemon.trim())?;
                continue;
            }
            "shutdown_server" => {
                let _ = std::fs::remove_file(pipe.join("server"));
                continue;
            }
            "set_default_active_thread_percentage" => {
                let value = command.split_whitespace().nth(1).unwrap_or_default();
                std::fs::write(pipe.join(DEFAULT_THREADS), value)?;
                println!("{value}");
                continue;
            }
            "get_default_active_thread_percentage" => {
                let value =
                    std::fs::read_to_string(pipe.join(DEFAULT_THREADS)).unwrap_or_else(|_| "100".into());
                let value: f64 = value.trim().parse().unwrap_or(100.0);
                println!("{value:.1}");
                continue;
            }
            "set_default_device_pinned_mem_limit" => {
                let rest: Vec<&str> = command.split_whitespace().skip(1).collect();
                std::fs::write(pipe.join(DEFAULT_MEMORY), rest.join(" "))?;
                continue;
            }
            _ => {}
        }
        if command.trim() == "quit" {
            std::fs::write(pipe.join(QUIT), "")?;
            for _ in 0..50 {
                if !pipe.join(PID_FILE).exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    Ok(())
}
