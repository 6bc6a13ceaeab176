//! `rollback`: drops a sequence's last tokens (a speculative step's rejected drafts) as if they
//! had never been appended.

use crate::batch::Batch;
use crate::error::invalid;
use crate::manager::{not_loading, one_each, visit, BlockManager};
use crate::sequence::Sequence;
use crate::stats::Counters;
use crate::{Error, SeqId};

impl BlockManager {
    /// Drops the last `counts[i]` tokens of each `seqs[i]` (all or nothing): the drafts a
    /// verification rejected. Each sequence's tokens, blocks and last page become what they
    /// would be had those tokens never been appended, and blocks only they filled go back to
    /// the pool. Only tokens whose KV is not committed can be dropped, so nothing was ever
    /// shared from them. Costs `O(dropped tokens)`.
    pub fn rollback(&self, seqs: &[SeqId], counts: &[usize]) -> Result<(), Error> {
        self.roll_back(seqs, counts, |_, _, _| {})
    }

    /// [`BlockManager::rollback`] of row `r`'s sequence by `counts[r]` tokens, for every row of
    /// a persistent batch (all or nothing), whose table rows drop the blocks their sequences
    /// dropped: `O(dropped tokens)`, where a rollback outside the batch makes its next step
    /// copy those rows whole.
    pub fn rollback_batch(&self, batch: &mut Batch, counts: &[usize]) -> Result<(), Error> {
        let seqs = batch.seqs().to_vec();
        self.roll_back(&seqs, counts, |row, s, before| {
            batch.trim_row(row, &s.table, before, s.version)
        })
    }

    /// [`BlockManager::rollback`], then `rolled(i, s, before)` for each sequence `seqs[i]`,
    /// whose table had version `before`.
    fn roll_back(
        &self,
        seqs: &[SeqId],
        counts: &[usize],
        mut rolled: impl FnMut(usize, &Sequence, u64),
    ) -> Result<(), Error> {
        one_each("rollback", seqs.len(), counts.len(), "counts")?;
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        let mut places = Vec::with_capacity(seqs.len());
        for (&id, &count) in seqs.iter().zip(counts) {
            let place = visit(&mut batch, id, stamp, false)?;
            let s = batch.at(place);
            not_loading(id, s)?;
            if s.swap_source.is_some() {
                return Err(invalid(format!(
                    "sequence {id}: confirm its swap-in before rolling it back"
                )));
            }
            let (len, uncommitted) = (s.tokens.len(), s.tokens.len() - s.computed);
            if count > uncommitted || count == len {
                return Err(invalid(format!(
                    "sequence {id}: cannot roll back {count} of its {len} tokens: only its last \
                     {uncommitted} are not committed, and a sequence keeps at least one token"
                )));
            }
            places.push(place);
        }
        for (i, (&place, &count)) in places.iter().zip(counts).enumerate() {
            let s = batch.at(place);
            let before = s.version;
            self.drop_tokens(s, count);
            rolled(i, s, before);
        }
        Ok(())
    }

    /// Drops the last `count` tokens of `s` (all uncommitted): blocks past its new length are
    /// released, last first, and the table gets a new version if it lost any (a block pushed
    /// later may differ from the one dropped).
    fn drop_tokens(&self, s: &mut Sequence, count: usize) {
        let (old, len) = (s.tokens.len(), s.tokens.len() - count);
        let pages = self.bs.pages(len);
        // Held by `s` alone: a block that holds an uncommitted token has one holder.
        self.release_gpu_blocks(&s.table, pages, old);
        let kept_before = old.min(pages * self.bs.get());
        self.gpu.remove_stored(kept_before - len);
        s.tokens.truncate(len);
        if pages < s.table.len() {
            s.table.truncate(pages);
            s.table_changed();
        }
        let full = self.bs.index(len);
        s.hashes.truncate(full);
        s.keys.truncate(full);
        s.planned = s.planned.min(len);
        for copy in &mut s.copying {
            copy.until = copy.until.min(len);
        }
        Counters::sub(&self.counters.pending_tokens, count as u64);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::manager::testing::*;
    use crate::{Batch, Error, Plan, Token};

    /// A rollback leaves the sequence, its blocks and the pool as if only the kept tokens had
    /// been appended.
    #[test]
    fn a_rollback_undoes_the_rejected_appends() {
        let [rolled, plain] = [(); 2].map(|_| manager(16, 4, |_| {}));
        let prompt: Vec<Token> = (1..=6).collect();
        for mgr in [&rolled, &plain] {
            mgr.allocate(1, &prompt, None).unwrap();
            prefill(mgr, &[1]);
        }
        rolled.append(1, &[7, 8, 9, 10, 11]).unwrap();
        let mut plan = Plan::new();
        rolled.plan(&[1], &[5], &mut plan).unwrap();
        rolled.rollback(&[1], &[3]).unwrap();
        plain.append(1, &[7, 8]).unwrap();
        plain.plan(&[1], &[2], &mut plan).unwrap();
        for mgr in [&rolled, &plain] {
            assert_eq!(mgr.tokens(1).unwrap(), (1..=8).collect::<Vec<_>>());
            assert_eq!(mgr.block_table(1).unwrap(), vec![0, 1]);
            mgr.check().unwrap();
        }
        assert_eq!(rolled.stats(), plain.stats());
        // The block a rollback freed is the next one taken.
        rolled.append(1, &[9]).unwrap();
        assert_eq!(rolled.block_table(1).unwrap(), vec![0, 1, 2]);
    }

    #[test]
    fn committed_tokens_cannot_be_rolled_back() {
        let mgr = manager(16, 4, |c| c.auto_commit = false);
        mgr.allocate(1, &[1, 2, 3, 4, 5], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.commit(&[1], Some(&[4])).unwrap();
        assert!(is_invalid(mgr.rollback(&[1], &[2])));
        assert!(is_invalid(mgr.rollback(&[1, 1], &[1, 1])));
        assert!(is_invalid(mgr.rollback(&[1], &[1, 1])));
        assert_eq!(mgr.rollback(&[2], &[1]), Err(Error::UnknownSequence(2)));
        assert_eq!(mgr.num_tokens(1).unwrap(), 5);
        mgr.rollback(&[1], &[1]).unwrap();
        assert_eq!(mgr.num_tokens(1).unwrap(), 4);
        mgr.check().unwrap();
        // A sequence keeps at least one token.
        mgr.allocate(3, &[1], None).unwrap();
        assert!(is_invalid(mgr.rollback(&[3], &[1])));
    }

    /// A batch's rows follow a `rollback_batch` at once, and a plain `rollback` at the next
    /// step: either way the table is what a fresh batch would hold.
    #[test]
    fn batch_rows_follow_a_rollback() {
        for in_batch in [true, false] {
            let mgr = manager(32, 4, |_| {});
            for seq in 1..=2 {
                mgr.allocate(seq, &[1, 2, 3, 4], None).unwrap();
            }
            prefill(&mgr, &[1, 2]);
            let mut batch = Batch::new();
            batch.add(1).unwrap();
            batch.add(2).unwrap();
            mgr.verify_batch(&mut batch, &[5, 6, 7, 8, 9, 9, 9], &[5, 2])
                .unwrap();
            assert_eq!(batch.inputs().qo_indptr, vec![0, 5, 7]);
            if in_batch {
                mgr.rollback_batch(&mut batch, &[4, 0]).unwrap();
            } else {
                mgr.rollback(&[1, 2], &[4, 0]).unwrap();
            }
            // Sequence 2 takes the block sequence 1 dropped.
            mgr.step_batch(&mut batch, &[7, 7]).unwrap();
            let mut fresh = Batch::new();
            fresh.add(1).unwrap();
            fresh.add(2).unwrap();
            mgr.rollback(&[1, 2], &[1, 1]).unwrap();
            mgr.step_batch(&mut fresh, &[7, 7]).unwrap();
            mgr.rollback(&[1, 2], &[1, 1]).unwrap();
            mgr.step_batch(&mut batch, &[7, 7]).unwrap();
            assert_eq!(
                batch.block_table(),
                fresh.block_table(),
                "in batch {in_batch}"
            );
            mgr.check().unwrap();
        }
    }
}
