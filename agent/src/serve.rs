//! What the agent keeps doing while it serves: its main loop and the tasks it owns ([`run`]), who
//! uses what on every card and the memory-overrun watchdog ([`usage`]), the watch on the MPS daemons
//! ([`daemons`]), the background worker that records Events and repairs starting containers
//! ([`repair`]), and the runtime canary that tells how the node's container runtime hands out cards
//! ([`canary`]).

pub mod canary;
pub mod daemons;
pub mod repair;
pub mod run;
pub mod usage;
