//! `rollback`: drops a sequence's last tokens (a speculative step's rejected drafts) as if they
//! had never been appended.

use crate::batch::Batch;
use crate::error::invalid;
use crate::manager::{not_loading, one_each, visit, BlockManager};
use crate::sequence::{LockedBatch, Place, Sequence};
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
        let mut batch = self.seqs.lock(seqs);
        let places = self.check_rolled_back(&mut batch, seqs, counts)?;
        let mut unstored = 0;
        for (i, (&place, &count)) in places.iter().zip(counts).enumerate() {
            let s = batch.at(place);
            let before = s.version;
            unstored += self.drop_tokens(s, count);
            rolled(i, s, before);
        }
        // The gauges move once per call, not per sequence.
        self.gpu.remove_stored(unstored);
        let dropped: usize = counts.iter().sum();
        Counters::sub(&self.counters.pending_tokens, dropped as u64);
        Ok(())
    }

    /// Fails unless `rollback(seqs, counts)` can run. Changes nothing.
    pub(super) fn check_rollback(&self, seqs: &[SeqId], counts: &[usize]) -> Result<(), Error> {
        let mut batch = self.seqs.lock(seqs);
        self.check_rolled_back(&mut batch, seqs, counts).map(|_| ())
    }

    /// Checks a rollback of the locked `seqs`; returns where they are.
    fn check_rolled_back(
        &self,
        batch: &mut LockedBatch<'_>,
        seqs: &[SeqId],
        counts: &[usize],
    ) -> Result<Vec<Place>, Error> {
        one_each("rollback", seqs.len(), counts.len(), "counts")?;
        let stamp = self.next_stamp();
        let mut places = Vec::with_capacity(seqs.len());
        for (&id, &count) in seqs.iter().zip(counts) {
            let place = visit(batch, id, stamp, false)?;
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
            let attention = self.config.attention;
            if self.bs.index(attention.first_key(len - count)) < s.first {
                return Err(invalid(format!(
                    "sequence {id}: cannot roll back {count} tokens: its next query would read \
                     blocks that left the attention window"
                )));
            }
            places.push(place);
        }
        Ok(places)
    }

    /// Drops the last `count` tokens of `s` (all uncommitted): blocks past its new length are
    /// released, last first, and the table gets a new version if it lost any (a block pushed
    /// later may differ from the one dropped). Returns the tokens dropped from the block it
    /// keeps last, for the caller to uncount from the stored tokens.
    fn drop_tokens(&self, s: &mut Sequence, count: usize) -> usize {
        let (old, len) = (s.tokens.len(), s.tokens.len() - count);
        let pages = self.bs.pages(len);
        // Held by `s` alone: a block that holds an uncommitted token has one holder.
        self.release_gpu_blocks(&s.table, s.first, pages, old);
        s.tokens.truncate(len);
        s.extra.truncate(len);
        if pages - s.first < s.table.len() {
            s.table.truncate(pages - s.first);
            s.table_changed();
        }
        let full = self.bs.index(len);
        s.hashes.truncate(full);
        s.keys.truncate(full);
        s.planned = s.planned.min(len);
        for copy in &mut s.copying {
            copy.until = copy.until.min(len);
        }
        old.min(pages * self.bs.get()) - len
    }
}
