//! The names nano-gpu's DRA driver and its allocator agree on: the driver (also the DeviceClass's
//! name), the capacities a share consumes, a card's device name in its node's ResourceSlice, and the
//! finalizer an allocation carries.

/// The DRA driver's name: the ResourceSlices', the DeviceClass's and the claims' `driver`.
pub const DRIVER: &str = "gpu.nano-gpu.io";
/// The DeviceClass claims name to get nano-gpu's cards (the driver's name).
pub const CLASS: &str = DRIVER;
/// The capacity of a card that shares consume, in percent of its compute (1 to 100).
pub const PERCENT: &str = "percent";
/// The capacity of a card that shares consume, in card memory.
pub const MEMORY: &str = "memory";
/// A device's name in the node's ResourceSlice: `gpu-<index>`.
pub const DEVICE_PREFIX: &str = "gpu-";
/// The finalizer of an allocated claim (Kubernetes' own, `resource.kubernetes.io/delete-protection`):
/// with it, the ResourceClaim controller clears the allocation once no pod uses the claim.
pub const ALLOCATED_FINALIZER: &str = "resource.kubernetes.io/delete-protection";

/// The device name of the card of `index`.
pub fn device_name(index: u32) -> String {
    format!("{DEVICE_PREFIX}{index}")
}

/// The card index a device name stands for, if it is one of the driver's names.
pub fn card_index(device: &str) -> Option<u32> {
    let digits = device.strip_prefix(DEVICE_PREFIX)?;
    // `gpu-01` or `gpu-+1` would name card 1 too: only the canonical spelling is a name.
    let index: u32 = digits.parse().ok()?;
    (device_name(index) == device).then_some(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip_and_only_canonical_ones_parse() {
        assert_eq!(device_name(3), "gpu-3");
        assert_eq!(card_index("gpu-3"), Some(3));
        assert_eq!(card_index("gpu-12"), Some(12));
        for bad in ["gpu-", "gpu-01", "gpu-+1", "gpu--1", "card-1", "gpu-1x", "gpu-4294967296"] {
            assert_eq!(card_index(bad), None, "{bad}");
        }
    }
}
