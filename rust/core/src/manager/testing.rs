//! Helpers shared by the manager's unit tests.

use crate::events::EventKind;
use crate::{BlockId, BlockManager, Config, Error, Plan, PoolKind, SeqId};

pub(super) fn manager(
    num_blocks: u32,
    block_size: u32,
    edit: impl FnOnce(&mut Config),
) -> BlockManager {
    let mut config = Config::new(num_blocks, block_size);
    config.watermark = 0.0;
    edit(&mut config);
    BlockManager::new(config).unwrap()
}

/// Plans every uncomputed token of each sequence (a prefill), returning the plan.
pub(super) fn prefill(mgr: &BlockManager, seqs: &[SeqId]) -> Plan {
    let lens: Vec<u32> = seqs
        .iter()
        .map(|&s| (mgr.num_tokens(s).unwrap() - mgr.num_computed(s).unwrap()) as u32)
        .collect();
    let mut plan = Plan::new();
    mgr.plan(seqs, &lens, &mut plan).unwrap();
    mgr.check().unwrap();
    plan
}

pub(super) fn is_invalid<T: std::fmt::Debug>(result: Result<T, Error>) -> bool {
    matches!(result, Err(Error::InvalidArgument(_)))
}

/// `(medium, block_id, stored)` of each recorded event.
pub(super) fn event_blocks(mgr: &BlockManager) -> Vec<(PoolKind, BlockId, bool)> {
    mgr.take_events()
        .into_iter()
        .map(|e| match e.kind {
            EventKind::BlockStored {
                block_id, medium, ..
            } => (medium, block_id, true),
            EventKind::BlockRemoved {
                block_id, medium, ..
            } => (medium, block_id, false),
            EventKind::AllBlocksCleared => panic!("nobody reset the cache"),
        })
        .collect()
}
