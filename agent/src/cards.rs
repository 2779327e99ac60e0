//! What the node has, and which of its cards may be served: the cards themselves from their
//! backends ([`inventory`]: NVML, sysfs drm, a fake file), what the device IDs of each served
//! resource mean on them ([`resource`]), and their health ([`health`]: XID events, and the refusals
//! that keep a card from being served with a reason).

pub mod health;
pub mod inventory;
pub mod resource;
