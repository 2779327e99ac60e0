//! Virtual device IDs: every card advertises 100 IDs `<uuid>-<NN>` (NN = 00..=99) to the kubelet, one
//! per percent. The card of an ID is read from the ID itself, never looked up.

use thiserror::Error;

/// IDs each card advertises.
pub const IDS_PER_CARD: u32 = 100;

/// Longest ID the kubelet accepts in a checkpoint-friendly form.
pub const MAX_LEN: usize = 63;

/// A device ID that is not one of ours.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("device ID {id:?} is not <card uuid>-<00..99> (or <card uuid>-m<unit> for gpushare memory)")]
pub struct BadDeviceId {
    /// The ID as received.
    pub id: String,
}

/// The ID of slot `n` (0..=99) of card `uuid`.
pub fn encode(uuid: &str, n: u32) -> String {
    format!("{uuid}-{n:02}")
}

/// The card UUID and slot number of an ID.
pub fn decode(id: &str) -> Result<(&str, u32), BadDeviceId> {
    let bad = || BadDeviceId { id: id.to_owned() };
    let (uuid, nn) = id.rsplit_once('-').ok_or_else(bad)?;
    if uuid.is_empty() || nn.len() != 2 || !nn.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    Ok((uuid, nn.parse().map_err(|_| bad())?))
}

/// The ID of memory unit `n` of card `uuid`, for gpushare's `aliyun.com/gpu-mem` (one ID per unit).
pub fn encode_unit(uuid: &str, n: u64) -> String {
    format!("{uuid}-m{n}")
}

/// The card UUID of any nano-gpu ID: a percent slot (`<uuid>-NN`) or a memory unit (`<uuid>-mN`).
pub fn card_of(id: &str) -> Result<&str, BadDeviceId> {
    if let Some((uuid, n)) = id.rsplit_once("-m")
        && !uuid.is_empty()
        && !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
    {
        return Ok(uuid);
    }
    decode(id).map(|(uuid, _)| uuid)
}

/// Whether IDs can be made of a card UUID: not empty (an ID must name its card), with room for the
/// suffix within [`MAX_LEN`].
pub fn uuid_fits(uuid: &str) -> bool {
    !uuid.is_empty() && uuid.len() + 3 <= MAX_LEN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_names_its_card_and_slot() {
        let uuid = "GPU-4b6a1f5e-0c61-6f0e-2a5c-3e1f0bb2d9a7";
        let id = encode(uuid, 7);
        assert_eq!(id, "GPU-4b6a1f5e-0c61-6f0e-2a5c-3e1f0bb2d9a7-07");
        assert_eq!(decode(&id), Ok((uuid, 7)));
        assert!(id.len() <= MAX_LEN && uuid_fits(uuid));
    }

    #[test]
    fn foreign_ids_are_refused() {
        for id in ["", "GPU-abc", "GPU-abc-7", "GPU-abc-x7", "-07", "GPU-abc-100"] {
            assert!(decode(id).is_err(), "{id}");
        }
    }

    #[test]
    fn memory_unit_ids_name_their_card_too() {
        let id = encode_unit("GPU-a-b", 15);
        assert_eq!(id, "GPU-a-b-m15");
        assert_eq!(card_of(&id), Ok("GPU-a-b"));
        assert_eq!(card_of("GPU-a-b-07"), Ok("GPU-a-b"));
        for bad in ["GPU-a-m", "-m3", "GPU-a-mx", "GPU-a"] {
            assert!(card_of(bad).is_err(), "{bad}");
        }
    }
}
