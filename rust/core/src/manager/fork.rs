//! `fork`: a child sequence that shares all its computed parent's blocks, copy-on-write.

use crate::error::invalid;
use crate::manager::{not_loading, BlockManager};
use crate::sequence::{LockedBatch, Sequence};
use crate::stats::Counters;
use crate::{Error, SeqId};

impl BlockManager {
    /// Makes `child` a copy of `parent` that shares all its blocks (copy-on-write). The
    /// parent's KV must be computed (after its auto-commit), so shared blocks never hold
    /// pending tokens.
    pub fn fork(&self, parent: SeqId, child: SeqId) -> Result<(), Error> {
        let mut batch = self.seqs.lock(&[parent, child]);
        self.check_fork_locked(&mut batch, parent, child)?;
        let p = batch.get(parent).expect("checked above");
        p.shared_tail = true;
        let mut copy = Sequence::new(
            p.tokens.clone(),
            p.table.clone(),
            p.keys.clone(),
            p.hashes.clone(),
            p.root,
            p.computed,
            p.registered,
        );
        copy.shared_tail = true;
        copy.first = p.first;
        copy.prompt_len = p.prompt_len;
        copy.extra = p.extra.clone();
        for &block in &copy.table {
            self.gpu.share_held(block);
        }
        Counters::add(&self.counters.computed_tokens, copy.computed as u64);
        batch.insert(child, copy);
        Ok(())
    }

    /// Every check of [`BlockManager::fork`], after the parent's auto-commit, forking
    /// nothing: a hybrid manager runs it before it takes the child's state slot.
    pub(crate) fn check_fork(&self, parent: SeqId, child: SeqId) -> Result<(), Error> {
        let mut batch = self.seqs.lock(&[parent, child]);
        self.check_fork_locked(&mut batch, parent, child)
    }

    fn check_fork_locked(
        &self,
        batch: &mut LockedBatch<'_>,
        parent: SeqId,
        child: SeqId,
    ) -> Result<(), Error> {
        let p = batch.get(parent).ok_or(Error::UnknownSequence(parent))?;
        if p.swapped {
            return Err(Error::SwappedOut(parent));
        }
        if batch.contains(child) {
            return Err(Error::DuplicateSequence(child));
        }
        let p = batch.get(parent).expect("checked above");
        not_loading(parent, p)?;
        if p.swap_in_pending() {
            return Err(invalid(format!(
                "sequence {parent}: confirm its swap-in before forking it"
            )));
        }
        self.count_computed(self.auto_commit(p));
        if p.computed != p.tokens.len() {
            return Err(invalid(format!(
                "sequence {parent}: only {} of its {} tokens have computed KV; commit its forward \
                 pass before forking it",
                p.computed,
                p.tokens.len()
            )));
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::manager::testing::*;
    use crate::{Error, Plan, PoolKind};

    #[test]
    fn a_copy_comes_with_its_plan_and_holds_its_source_until_committed() {
        let mgr = manager(6, 4, |c| {
            c.num_cpu_blocks = 4;
            c.auto_commit = false;
        });
        mgr.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.commit(&[1], None).unwrap();
        mgr.fork(1, 2).unwrap();
        assert_eq!(mgr.block_table(2).unwrap(), vec![0, 1]);
        // The shared partial block 1 is copied to a fresh block 2 on write.
        mgr.append(2, &[7]).unwrap();
        assert_eq!(mgr.block_table(2).unwrap(), vec![0, 2]);
        mgr.check().unwrap();
        assert!(
            is_invalid(mgr.swap_out(&[2])),
            "a copy not yet planned blocks a swap-out"
        );
        mgr.free(1).unwrap();
        mgr.check().unwrap();
        // Block 1 is still held by the copy: filling the pool never hands it out.
        mgr.allocate(3, &(100..112).collect::<Vec<_>>(), None)
            .unwrap();
        assert_eq!(mgr.block_table(3).unwrap(), vec![3, 4, 5]);
        let full = Err(Error::OutOfBlocks {
            pool: PoolKind::Gpu,
            needed: 1,
            available: 0,
        });
        assert_eq!(mgr.allocate(4, &[9], None), full);
        let mut plan = Plan::new();
        mgr.plan(&[2], &[1], &mut plan).unwrap();
        assert_eq!(plan.copies, vec![1, 2]);
        assert_eq!(plan.num_copies(), 1);
        assert_eq!(plan.slot_mapping, vec![2 * 4 + 2]);
        mgr.check().unwrap();
        // Delivered but not committed: the source is still held.
        assert_eq!(mgr.allocate(4, &[9], None), full);
        // A later plan does not deliver it again.
        mgr.plan(&[2], &[1], &mut plan).unwrap();
        assert!(plan.copies.is_empty());
        mgr.commit(&[2], Some(&[6])).unwrap();
        assert_eq!(mgr.allocate(4, &[9], None), full);
        mgr.commit(&[2], None).unwrap();
        mgr.check().unwrap();
        mgr.allocate(4, &[9], None).unwrap();
        assert_eq!(mgr.block_table(4).unwrap(), vec![1]);
        mgr.check().unwrap();
    }

    #[test]
    fn with_auto_commit_the_next_call_completes_a_copy() {
        let mgr = manager(4, 4, |_| {});
        mgr.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        let mut plan = Plan::new();
        mgr.step(&[2], &[7], &mut plan).unwrap();
        assert_eq!(plan.copies, vec![1, 2]);
        mgr.free(1).unwrap();
        assert_eq!(mgr.stats().num_held, 3, "the source is held");
        mgr.step(&[2], &[8], &mut plan).unwrap();
        assert!(plan.copies.is_empty());
        assert_eq!(mgr.stats().num_held, 2, "the step committed the copy");
        mgr.check().unwrap();
    }

    #[test]
    fn freeing_a_copier_releases_its_sources() {
        let mgr = manager(6, 4, |_| {});
        mgr.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        mgr.append(2, &[7]).unwrap();
        let mut plan = Plan::new();
        mgr.plan(&[2], &[1], &mut plan).unwrap();
        assert_eq!(plan.copies, vec![1, 2]);
        mgr.free(1).unwrap();
        mgr.free(2).unwrap();
        mgr.check().unwrap();
        let st = mgr.stats();
        assert_eq!((st.num_held, st.stored_tokens), (0, 0));
        assert_eq!(st.num_cached, 1, "block 0 was computed and registered");
    }

    #[test]
    fn a_step_commits_every_member_before_counting_blocks() {
        let mgr = manager(3, 4, |_| {});
        mgr.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        let mut plan = Plan::new();
        mgr.step(&[2], &[7], &mut plan).unwrap();
        assert_eq!(plan.copies, vec![1, 2]);
        assert_eq!(mgr.stats().num_free, 0);
        // Sequence 2's auto-commit completes its copy, so sequence 1's tail (block 1) is its
        // own again and needs no copy: the full pool is enough, in either batch order.
        mgr.step(&[1, 2], &[7, 8], &mut plan).unwrap();
        assert!(plan.copies.is_empty());
        assert_eq!(mgr.block_table(1).unwrap(), vec![0, 1]);
        mgr.check().unwrap();
    }

    #[test]
    fn fork_needs_a_computed_parent() {
        for auto_commit in [true, false] {
            let mgr = manager(8, 4, |c| c.auto_commit = auto_commit);
            mgr.allocate(1, &[1, 2, 3, 4, 5], None).unwrap();
            assert!(is_invalid(mgr.fork(1, 2)));
            prefill(&mgr, &[1]);
            if !auto_commit {
                assert!(is_invalid(mgr.fork(1, 2)));
                mgr.commit(&[1], None).unwrap();
            }
            mgr.fork(1, 2).unwrap();
            assert!(!mgr.contains(3));
            assert_eq!(mgr.block_table(2).unwrap(), mgr.block_table(1).unwrap());
            assert_eq!(mgr.num_computed(2).unwrap(), 5);
            mgr.check().unwrap();
        }
    }
}
