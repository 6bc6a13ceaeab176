//! The block feed: every group's registrations in the GPU prefix cache and their removals, in
//! order, for an external KV tier that saves each computed block of every group.
//!
//! Events announce group 0 alone (a router's tree cannot follow a window); the feed is the
//! tier's own record, recorded only when `Config.enable_block_feed` asks for it, so nothing
//! grows unread, and it leaves the event stream and its numbering untouched.

use crate::prefix::BlockHash;
use crate::sync::{lock, Mutex};
use crate::BlockId;

/// One change of a group's registered blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registration {
    /// Group `group`'s computed full block `block` is registered under its published hash
    /// `hash` (the group's chain: [`crate::HybridManager::group_block_hashes`]).
    Stored {
        /// The KV-cache group (0 for a `BlockManager`).
        group: u8,
        /// The GPU block.
        block: BlockId,
        /// The block's published hash in its group.
        hash: BlockHash,
    },
    /// Group `group`'s block `block` was evicted: it may hold other KV from now on.
    Removed {
        /// The KV-cache group.
        group: u8,
        /// The GPU block.
        block: BlockId,
    },
    /// `reset_prefix_cache` dropped every registration.
    Cleared,
}

/// The pending registrations, recorded only when enabled.
pub(crate) struct BlockFeed {
    enabled: bool,
    log: Mutex<Vec<Registration>>,
}

impl BlockFeed {
    /// A feed that records iff `enabled`.
    pub(crate) fn new(enabled: bool) -> BlockFeed {
        BlockFeed {
            enabled,
            log: Mutex::new(Vec::new()),
        }
    }

    /// Whether registrations are recorded.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records the registration `change` builds (not called at all when disabled).
    pub(crate) fn record(&self, change: impl FnOnce() -> Registration) {
        if self.enabled {
            let change = change();
            lock(&self.log).push(change);
        }
    }

    /// Removes and returns the pending registrations.
    pub(crate) fn take(&self) -> Vec<Registration> {
        std::mem::take(&mut lock(&self.log))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Registration;
    use crate::{Attention, Config, HybridManager, Plan, Token};

    fn hybrid(feed: bool) -> HybridManager {
        let mut config = Config::new(12, 4);
        config.watermark = 0.0;
        config.hash_key = Some([3; 32]);
        config.enable_events = true;
        config.enable_block_feed = feed;
        let groups = [Attention::Full, Attention::SlidingWindow(4)];
        HybridManager::new(config, &groups).unwrap()
    }

    fn prefill(mgr: &HybridManager, seq: u64, prompt: &[Token]) {
        mgr.allocate(seq, prompt, None).unwrap();
        let mut plans = [Plan::new(), Plan::new()];
        let q = (prompt.len() - mgr.num_computed(seq).unwrap()) as u32;
        mgr.plan(&[seq], &[q], &mut plans).unwrap();
        mgr.commit(&[seq], None).unwrap();
    }

    /// Every group's registrations with their group's hashes, then the evictions and the reset;
    /// the events are the same with and without the feed.
    #[test]
    fn the_feed_records_every_groups_blocks_and_leaves_events_alone() {
        let (mgr, plain) = (hybrid(true), hybrid(false));
        let prompt: Vec<Token> = (1..=9).collect();
        for m in [&mgr, &plain] {
            prefill(m, 1, &prompt);
        }
        assert_eq!(mgr.take_events(), plain.take_events());
        assert!(plain.take_registrations().is_empty());
        let stored: Vec<Registration> = (0..2u8)
            .flat_map(|g| {
                let hashes = mgr.group_block_hashes(g.into(), &prompt, None).unwrap();
                let table = mgr.block_table(1, g.into()).unwrap();
                (0..2).map(move |i| Registration::Stored {
                    group: g,
                    block: table[i],
                    hash: hashes[i],
                })
            })
            .collect();
        assert_eq!(mgr.take_registrations(), stored);
        assert_ne!(
            mgr.group_block_hashes(1, &prompt, None).unwrap(),
            mgr.block_hashes(&prompt, None).unwrap()
        );
        // Freed, the four registered blocks are cached; a long prompt evicts them all.
        mgr.free(1).unwrap();
        mgr.allocate(2, &(100..124).collect::<Vec<_>>(), None)
            .unwrap();
        let removed = mgr.take_registrations();
        assert_eq!(removed.len(), 4);
        assert!(removed
            .iter()
            .all(|r| matches!(r, Registration::Removed { .. })));
        mgr.reset_prefix_cache();
        assert_eq!(mgr.take_registrations(), vec![Registration::Cleared]);
        mgr.check().unwrap();
    }
}
