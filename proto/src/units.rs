//! Newtypes for every unit that crosses a boundary, so a percent is never mistaken for MiB.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A share of one GPU card in whole percent; `100` is the whole card.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Percent(pub u32);

impl Percent {
    /// A whole card.
    pub const FULL: Percent = Percent(100);
}

impl fmt::Display for Percent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}%", self.0)
    }
}

/// Mebibytes (2^20 bytes), the unit of GPU and host memory in every nano-gpu payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MiB(pub u64);

impl fmt::Display for MiB {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} MiB", self.0)
    }
}

/// CPU in thousandths of a core, as Kubernetes counts it (`500m` = 500).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CpuMilli(pub u64);

impl fmt::Display for CpuMilli {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}m", self.0)
    }
}
