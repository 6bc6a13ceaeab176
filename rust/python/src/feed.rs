//! The `Registration` Python class: one entry of a hybrid manager's block feed.

use pyo3::prelude::*;

use pagedkv as core;

/// One change of a group's registered blocks: kind "stored" (with the block's hash in its
/// group), "removed" (evicted) or "cleared" (every registration dropped; no group or block).
#[pyclass(frozen, get_all, module = "pagedkv._core")]
pub(crate) struct Registration {
    kind: &'static str,
    group: Option<u8>,
    block_id: Option<u32>,
    block_hash: Option<u128>,
}

impl From<core::Registration> for Registration {
    fn from(change: core::Registration) -> Registration {
        let (kind, group, block_id, block_hash) = match change {
            core::Registration::Stored { group, block, hash } => {
                ("stored", Some(group), Some(block), Some(hash))
            }
            core::Registration::Removed { group, block } => {
                ("removed", Some(group), Some(block), None)
            }
            core::Registration::Cleared => ("cleared", None, None, None),
        };
        Registration {
            kind,
            group,
            block_id,
            block_hash,
        }
    }
}

#[pymethods]
impl Registration {
    fn __repr__(&self) -> String {
        format!(
            "Registration(kind={:?}, group={:?}, block_id={:?}, block_hash={:?})",
            self.kind, self.group, self.block_id, self.block_hash
        )
    }
}
