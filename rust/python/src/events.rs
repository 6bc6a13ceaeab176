//! The `Event` Python class: one change of a tier, mirrored from the core's event.

use pyo3::prelude::*;

use pagedkv as core;

/// One change of a tier: kind "stored", "removed" or "cleared"; medium "GPU" or "CPU"; for a
/// stored block, its sequence's salt (wire form) and LoRA adapter, and its own extra keys.
#[pyclass(frozen, get_all, module = "pagedkv._core")]
pub(crate) struct Event {
    kind: &'static str,
    seq_no: u64,
    block_hash: Option<u128>,
    parent_hash: Option<u128>,
    token_ids: Vec<u32>,
    block_id: Option<u32>,
    medium: &'static str,
    cache_salt: Option<String>,
    lora_name: Option<String>,
    extra_keys: Vec<String>,
}

/// How events name a pool.
fn medium(pool: core::PoolKind) -> &'static str {
    match pool {
        core::PoolKind::Gpu => "GPU",
        core::PoolKind::Cpu => "CPU",
    }
}

impl From<core::Event> for Event {
    fn from(event: core::Event) -> Event {
        let (mut cache_salt, mut lora_name, mut extra_keys) = (None, None, Vec::new());
        let (kind, block_hash, parent_hash, token_ids, block_id, medium) = match event.kind {
            core::EventKind::BlockStored {
                block_hash,
                parent_hash,
                token_ids,
                block_id,
                medium: pool,
                salt,
                lora_name: lora,
                extra_keys: keys,
            } => {
                cache_salt = salt.as_deref().map(core::cache_salt);
                lora_name = lora.as_deref().map(str::to_owned);
                extra_keys = keys;
                (
                    "stored",
                    Some(block_hash),
                    parent_hash,
                    token_ids,
                    Some(block_id),
                    medium(pool),
                )
            }
            core::EventKind::BlockRemoved {
                block_hash,
                block_id,
                medium: pool,
            } => (
                "removed",
                Some(block_hash),
                None,
                Vec::new(),
                Some(block_id),
                medium(pool),
            ),
            core::EventKind::AllBlocksCleared => ("cleared", None, None, Vec::new(), None, "GPU"),
        };
        Event {
            kind,
            seq_no: event.seq_no,
            block_hash,
            parent_hash,
            token_ids,
            block_id,
            medium,
            cache_salt,
            lora_name,
            extra_keys,
        }
    }
}

#[pymethods]
impl Event {
    fn __repr__(&self) -> String {
        format!(
            "Event(kind={:?}, seq_no={}, medium={:?}, block_id={:?}, block_hash={:?}, \
             parent_hash={:?}, token_ids={:?}, cache_salt={:?}, lora_name={:?}, \
             extra_keys={:?})",
            self.kind,
            self.seq_no,
            self.medium,
            self.block_id,
            self.block_hash,
            self.parent_hash,
            self.token_ids,
            self.cache_salt,
            self.lora_name,
            self.extra_keys
        )
    }
}
