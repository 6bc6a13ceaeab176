//! Prefix-cache events for KV-aware routers: which computed blocks entered and left each tier
//! (the GPU pool and the CPU swap pool), in order.

use std::sync::Arc;

use crate::prefix::BlockHash;
use crate::sync::{lock, Mutex};
use crate::{BlockId, PoolKind, Token};

/// One change of the prefix cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Position in the manager's event stream, starting at 0, one per event.
    pub seq_no: u64,
    /// What happened.
    pub kind: EventKind,
}

/// The kinds of prefix-cache change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A full block whose KV is computed now holds `block_hash` in `medium`: registered in the
    /// GPU prefix cache, or copied to the CPU pool by a confirmed swap-out.
    BlockStored {
        /// The block's chained hash.
        block_hash: BlockHash,
        /// The previous block's hash, `None` for a sequence's first block.
        parent_hash: Option<BlockHash>,
        /// The block's tokens.
        token_ids: Vec<Token>,
        /// The physical block in `medium`.
        block_id: BlockId,
        /// The tier: `Gpu` or `Cpu`.
        medium: PoolKind,
        /// The salt of the sequence that stored it (bound into its hash).
        salt: Option<Arc<[u8]>>,
        /// The LoRA adapter of the sequence that stored it (bound into its hash).
        lora_name: Option<Arc<str>>,
        /// The block's extra keys (bound into its hash), in order.
        extra_keys: Vec<String>,
    },
    /// `medium` no longer holds `block_hash`: a cached GPU block was evicted, or the last CPU
    /// copy of the hash left the CPU pool.
    BlockRemoved {
        /// The hash it was stored under.
        block_hash: BlockHash,
        /// The physical block in `medium`.
        block_id: BlockId,
        /// The tier: `Gpu` or `Cpu`.
        medium: PoolKind,
    },
    /// `reset_prefix_cache` dropped every registration, in both tiers.
    AllBlocksCleared,
}

/// The pending events, recorded only when enabled (so nothing grows unread).
pub(crate) struct EventLog {
    enabled: bool,
    log: Mutex<(u64, Vec<Event>)>,
}

impl EventLog {
    /// A log that records iff `enabled`.
    pub(crate) fn new(enabled: bool) -> EventLog {
        EventLog {
            enabled,
            log: Mutex::new((0, Vec::new())),
        }
    }

    /// Whether events are recorded.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records an event built by `kind` (not called at all when disabled).
    pub(crate) fn record(&self, kind: impl FnOnce() -> EventKind) {
        if self.enabled {
            let kind = kind();
            let mut log = lock(&self.log);
            let seq_no = log.0;
            log.0 += 1;
            log.1.push(Event { seq_no, kind });
        }
    }

    /// Removes and returns the pending events.
    pub(crate) fn take(&self) -> Vec<Event> {
        std::mem::take(&mut lock(&self.log).1)
    }
}
