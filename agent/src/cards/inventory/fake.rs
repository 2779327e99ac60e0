//! Cards described by a JSON file in the `nano-gpu/gpus` format, for local clusters and demos.

use super::{Card, GpuInventory, InventoryError};
use nano_gpu_proto::annotations::NodeInventory;
use std::path::PathBuf;

/// Cards from a JSON file (`{"v":1,"gpus":[…]}`), re-read on every call.
pub struct FakeFile {
    /// The file.
    pub path: PathBuf,
}

impl GpuInventory for FakeFile {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn cards(&self) -> Result<Vec<Card>, InventoryError> {
        let text = std::fs::read_to_string(&self.path)
            .map_err(|source| InventoryError::Io { path: self.path.clone(), source })?;
        let inv = NodeInventory::decode(&text)
            .map_err(|e| InventoryError::Invalid { path: self.path.clone(), message: e.to_string() })?;
        Ok(inv
            .gpus
            .into_iter()
            .map(|info| Card { info, device_nodes: Vec::new(), pci_address: None, fault: None, mig: false })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fake_file_lists_its_cards_and_a_bad_one_names_the_field() {
        let dir = std::env::temp_dir().join(format!("nano-gpu-fake-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gpus.json");
        std::fs::write(&path, r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-a","vendor":"nvidia","model":"Tesla T4","memoryMiB":15360,"healthy":true}]}"#).unwrap();
        let cards = FakeFile { path: path.clone() }.cards().unwrap();
        assert_eq!((cards.len(), cards[0].info.uuid.as_str()), (1, "GPU-a"));
        std::fs::write(&path, r#"{"v":1,"gpus":[{"index":0}]}"#).unwrap();
        let e = FakeFile { path: path.clone() }.cards().unwrap_err();
        assert!(e.to_string().contains("missing field `uuid`"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
