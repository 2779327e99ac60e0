//! Host PIDs to containers through a `/proc` tree (the host's: the agent runs with `hostPID`), cached.
//!
//! A PID is reused once its process ends, so an entry is keyed by PID *and* the process's start time
//! (`/proc/<pid>/stat` field 22): a new process with an old PID is read again. Entries of PIDs not
//! asked for in a pass are forgotten at the end of it, so the cache holds at most the GPU processes of
//! the last pass.

use super::cgroup::{ContainerRef, container_of};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

/// The resolver and its cache.
#[derive(Debug)]
pub struct Procs {
    root: PathBuf,
    known: HashMap<u32, (u64, Option<ContainerRef>)>,
    asked: HashSet<u32>,
}

impl Procs {
    /// PIDs read from the `/proc` tree at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Procs { root: root.into(), known: HashMap::new(), asked: HashSet::new() }
    }

    /// The container of process `pid`; `None` when it is in none or is gone.
    pub fn container_of(&mut self, pid: u32) -> Option<ContainerRef> {
        self.asked.insert(pid);
        let started = self.start_time(pid)?;
        if let Some((at, known)) = self.known.get(&pid)
            && *at == started
        {
            return known.clone();
        }
        let text = std::fs::read_to_string(self.root.join(pid.to_string()).join("cgroup")).ok()?;
        let container = container_of(&text);
        self.known.insert(pid, (started, container.clone()));
        container
    }

    /// Ends a pass: forgets the PIDs it did not ask for.
    pub fn end_pass(&mut self) {
        let asked = std::mem::take(&mut self.asked);
        self.known.retain(|pid, _| asked.contains(pid));
    }

    /// How many PIDs are cached.
    pub fn cached(&self) -> usize {
        self.known.len()
    }

    /// Start time of `pid` in clock ticks since boot; `None` when there is no such process.
    fn start_time(&self, pid: u32) -> Option<u64> {
        let stat = std::fs::read_to_string(self.root.join(pid.to_string()).join("stat")).ok()?;
        // `pid (comm) state ppid …`: comm may hold spaces and parentheses, so count after the last ')'.
        let (_, rest) = stat.rsplit_once(')')?;
        rest.split_whitespace().nth(19)?.parse().ok()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::Path;

    /// Writes process `pid` into a fake `/proc` tree: its `stat` (started at `start`) and `cgroup`.
    pub(crate) fn write_process(root: &Path, pid: u32, start: u64, cgroup: &str) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let stat = format!(
            "{pid} (a (weird) name) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0"
        );
        std::fs::write(dir.join("stat"), stat).unwrap();
        std::fs::write(dir.join("cgroup"), cgroup).unwrap();
    }

    pub(crate) fn temp_dir(name: &str) -> crate::Scratch {
        crate::Scratch::new(&format!("procs-{name}"))
    }

    const UID: &str = "0f3d6a1e-7b2c-4c1d-9e8f-1a2b3c4d5e6f";

    fn cgroup(id: char) -> String {
        format!("4:memory:/kubepods/pod{UID}/{}\n", id.to_string().repeat(64))
    }

    #[test]
    fn a_reused_pid_is_read_again_and_unasked_pids_are_forgotten() {
        let root = temp_dir("reuse");
        write_process(&root, 42, 1000, &cgroup('a'));
        write_process(&root, 43, 1001, "0::/system.slice/sshd.service\n");
        let mut procs = Procs::new(&*root);
        assert_eq!(procs.container_of(42).unwrap().container_id, "a".repeat(64));
        assert_eq!(procs.container_of(43), None);
        procs.end_pass();
        assert_eq!(procs.cached(), 2);
        // Same PID, same start time: the cache answers (the cgroup file is not read again).
        std::fs::write(root.join("42/cgroup"), cgroup('b')).unwrap();
        assert_eq!(procs.container_of(42).unwrap().container_id, "a".repeat(64));
        // The PID is reused by a process started later: read again.
        write_process(&root, 42, 2000, &cgroup('b'));
        assert_eq!(procs.container_of(42).unwrap().container_id, "b".repeat(64));
        procs.end_pass();
        assert_eq!(procs.cached(), 1, "43 was not asked in this pass");
        // A process that ended is in no container.
        std::fs::remove_dir_all(root.join("42")).unwrap();
        assert_eq!(procs.container_of(42), None);
    }
}
