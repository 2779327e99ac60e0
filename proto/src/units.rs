//! Newtypes for every unit that crosses a boundary, so a percent is never mistaken for MiB.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Sub, SubAssign};

/// Addition and subtraction within one unit (never across units), as on the integer inside:
/// subtraction below zero is a bug (it panics in debug builds), so callers that may go below use
/// `saturating_sub`.
macro_rules! same_unit_arithmetic {
    ($unit:ident) => {
        impl Add for $unit {
            type Output = $unit;
            fn add(self, other: $unit) -> $unit {
                $unit(self.0 + other.0)
            }
        }
        impl Sub for $unit {
            type Output = $unit;
            fn sub(self, other: $unit) -> $unit {
                $unit(self.0 - other.0)
            }
        }
        impl AddAssign for $unit {
            fn add_assign(&mut self, other: $unit) {
                self.0 += other.0;
            }
        }
        impl SubAssign for $unit {
            fn sub_assign(&mut self, other: $unit) {
                self.0 -= other.0;
            }
        }
        impl Sum for $unit {
            fn sum<I: Iterator<Item = $unit>>(iter: I) -> $unit {
                $unit(iter.map(|u| u.0).sum())
            }
        }
        impl<'a> Sum<&'a $unit> for $unit {
            fn sum<I: Iterator<Item = &'a $unit>>(iter: I) -> $unit {
                $unit(iter.map(|u| u.0).sum())
            }
        }
        impl $unit {
            /// Zero of this unit.
            pub const ZERO: $unit = $unit(0);

            /// `self - other`, or zero if `other` is larger.
            pub fn saturating_sub(self, other: $unit) -> $unit {
                $unit(self.0.saturating_sub(other.0))
            }
        }
    };
}

same_unit_arithmetic!(Percent);
same_unit_arithmetic!(MiB);
same_unit_arithmetic!(CpuMilli);

/// A share of one GPU card in whole percent; `100` is the whole card.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Percent(pub u32);

impl Percent {
    /// A whole card.
    pub const FULL: Percent = Percent(100);

    /// This share of `memory`, rounded down: the GPU memory a share that asks no memory holds on a
    /// card of `memory` (the one rule the allocator's accounting, its views and the agent's
    /// `NANO_GPU_MEMORY_MIB` all follow).
    pub fn of(self, memory: MiB) -> MiB {
        MiB(memory.0 * u64::from(self.0) / 100)
    }
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
