//! Which computed block hashes the CPU swap pool holds, so that `BlockStored` / `BlockRemoved`
//! events with medium CPU describe it exactly: a hash is announced when its first CPU copy
//! appears (a confirmed swap-out) and withdrawn when its last copy leaves (a confirmed swap-in,
//! or a swapped-out sequence freed). Kept only while events are recorded.

use std::collections::HashMap;

use crate::prefix::BlockHash;
use crate::sync::{lock, Mutex};
use crate::BlockId;

/// Announced CPU blocks and how many of them hold each hash.
#[derive(Default)]
pub(crate) struct CpuTier {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    hash_of: HashMap<BlockId, BlockHash>,
    copies: HashMap<BlockHash, u32>,
}

impl CpuTier {
    /// Records that CPU `block` holds `hash`; `announce` runs (under the lock, so events stay
    /// ordered) when it is the hash's first copy. A block already recorded (shared by several
    /// sequences of one swap) is left alone.
    pub(crate) fn add(&self, block: BlockId, hash: BlockHash, announce: impl FnOnce()) {
        let mut inner = lock(&self.inner);
        if inner.hash_of.contains_key(&block) {
            return;
        }
        inner.hash_of.insert(block, hash);
        let copies = inner.copies.entry(hash).or_insert(0);
        *copies += 1;
        if *copies == 1 {
            announce();
        }
    }

    /// Drops one reference to CPU `block` through `release`, which says whether the block is now
    /// free; a freed block is forgotten, and `withdraw` runs with its hash when that was the
    /// hash's last copy. All under the lock: another thread cannot take the freed block and
    /// record it again before its old entry is gone.
    pub(crate) fn release(
        &self,
        block: BlockId,
        release: impl FnOnce() -> bool,
        withdraw: impl FnOnce(BlockHash),
    ) {
        let mut inner = lock(&self.inner);
        if !release() {
            return;
        }
        let Some(hash) = inner.hash_of.remove(&block) else {
            return;
        };
        let copies = inner.copies.get_mut(&hash).expect("counted when added");
        *copies -= 1;
        if *copies == 0 {
            inner.copies.remove(&hash);
            withdraw(hash);
        }
    }

    /// Forgets everything (a prefix-cache reset clears both tiers), running `cleared` under the
    /// lock so no announcement is ordered across it.
    pub(crate) fn clear(&self, cleared: impl FnOnce()) {
        let mut inner = lock(&self.inner);
        inner.hash_of.clear();
        inner.copies.clear();
        cleared();
    }

    /// The hashes the CPU pool holds.
    pub(crate) fn hashes(&self) -> Vec<BlockHash> {
        lock(&self.inner).copies.keys().copied().collect()
    }

    /// The announced CPU blocks and their hashes, for `check`.
    pub(crate) fn blocks(&self) -> Vec<(BlockId, BlockHash)> {
        let inner = lock(&self.inner);
        let mut counted: HashMap<BlockHash, u32> = HashMap::new();
        for &hash in inner.hash_of.values() {
            *counted.entry(hash).or_insert(0) += 1;
        }
        debug_assert_eq!(counted, inner.copies);
        inner.hash_of.iter().map(|(&b, &h)| (b, h)).collect()
    }
}
