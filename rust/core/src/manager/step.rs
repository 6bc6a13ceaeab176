//! Appending and planning: `append`, `step` (one decode token per sequence), `step_batch` (the
//! same for a persistent [`Batch`]), `verify_batch` (a speculative step: each row's drafts too)
//! and `plan` (any batch), with the copy-on-write of a shared last block.

use crate::batch::Batch;
use crate::block::BlockSize;
use crate::error::invalid;
use crate::keys::{check_spans, ExtraKey};
use crate::manager::{
    check_room, no_gap, not_loading, one_each, visit, visit_hinted, BlockManager, Taken,
};
use crate::plan::Plan;
use crate::sequence::{LockedBatch, PendingCopy, Place, Sequence};
use crate::stats::Counters;
use crate::{Error, SeqId, Token};

impl BlockManager {
    /// Appends tokens to a running sequence, copying a shared last block on write. The tokens'
    /// KV is pending until a plan computes it; the copy comes back with that plan.
    pub fn append(&self, seq: SeqId, tokens: &[Token]) -> Result<(), Error> {
        self.append_keyed(seq, tokens, &[])
    }

    /// [`BlockManager::append`] with extra keys over spans of the new tokens (positions in the
    /// sequence).
    pub fn append_keyed(
        &self,
        seq: SeqId,
        tokens: &[Token],
        extra_keys: &[ExtraKey],
    ) -> Result<(), Error> {
        let mut one = self.seqs.lock_one(seq);
        let s = self.check_append(one.get(), seq, tokens, extra_keys)?;
        let needed = self.blocks_to_append(s, tokens.len());
        self.reserve_gpu(needed)?;
        let mut taken = Taken::default();
        let prompt = s.prompt_len == s.tokens.len();
        self.append_reserved(s, tokens, &mut taken);
        if prompt {
            // A prompt admitted in chunks: it ends where the decode steps begin.
            s.prompt_len = s.tokens.len();
        }
        s.extra.spans.extend_from_slice(extra_keys);
        self.finish_taking(needed, taken);
        self.gpu.add_stored(tokens.len());
        Counters::add(&self.counters.pending_tokens, tokens.len() as u64);
        Ok(())
    }

    /// The blocks `append(seq, tokens)` would take (after the sequence's auto-commit), or why
    /// it would fail.
    pub(super) fn append_needs(&self, seq: SeqId, tokens: &[Token]) -> Result<usize, Error> {
        let mut one = self.seqs.lock_one(seq);
        let s = self.check_append(one.get(), seq, tokens, &[])?;
        Ok(self.blocks_to_append(s, tokens.len()))
    }

    /// Checks an append of `tokens` (with `extra_keys`) to `seq` (found as `s`), then
    /// auto-commits the sequence.
    fn check_append<'s>(
        &self,
        s: Option<&'s mut Sequence>,
        seq: SeqId,
        tokens: &[Token],
        extra_keys: &[ExtraKey],
    ) -> Result<&'s mut Sequence, Error> {
        if tokens.is_empty() {
            return Err(invalid("append needs at least one token"));
        }
        let s = s.ok_or(Error::UnknownSequence(seq))?;
        if s.swapped {
            return Err(Error::SwappedOut(seq));
        }
        not_loading(seq, s)?;
        check_room(s.tokens.len(), tokens.len())?;
        let len = s.tokens.len();
        check_spans(extra_keys, len, len + tokens.len())?;
        self.count_computed(self.auto_commit(s));
        Ok(s)
    }

    /// One decode step: appends `tokens[i]` to `seqs[i]` for the whole batch (all or nothing),
    /// then writes the plan for one query token per sequence into `plan`. On an error `plan`
    /// is left empty.
    pub fn step(&self, seqs: &[SeqId], tokens: &[Token], plan: &mut Plan) -> Result<(), Error> {
        let mut rows = Listed {
            seqs,
            places: vec![None; seqs.len()],
            plan,
        };
        self.decode(&mut rows, tokens, None)
            .inspect_err(|_| rows.plan.begin(0, 0, 0, self.bs))
    }

    /// One decode step of a persistent batch: appends `tokens[r]` to row `r`'s sequence for
    /// every row (all or nothing), then writes the rows' attention inputs
    /// ([`Batch::inputs`]) and the table entries that changed ([`Batch::updates`]). Host work
    /// is `O(rows)` plus the blocks that changed, however long the sequences. Same semantics
    /// and errors as [`BlockManager::step`] for the rows in order; on an error the manager
    /// and the table's entries are as they were (the table may have been widened).
    pub fn step_batch(&self, batch: &mut Batch, tokens: &[Token]) -> Result<(), Error> {
        self.decode(batch, tokens, None)
    }

    /// A speculative decoding step of a persistent batch: row `r` appends its next
    /// `counts[r]` tokens of `tokens` (its last sampled token, then its drafts), all of them
    /// planned as queries, so one forward pass verifies every row's drafts. Otherwise as
    /// [`BlockManager::step_batch`]. Drop the rejected drafts with [`BlockManager::rollback`].
    pub fn verify_batch(
        &self,
        batch: &mut Batch,
        tokens: &[Token],
        counts: &[u32],
    ) -> Result<(), Error> {
        self.decode(batch, tokens, Some(counts))
    }

    /// Writes the plan for any batch into `plan`: sequence `seqs[i]`'s last `query_lens[i]`
    /// tokens are the queries (prefill, chunked prefill, decode or a mix). On an error `plan` is
    /// left empty.
    pub fn plan(&self, seqs: &[SeqId], query_lens: &[u32], plan: &mut Plan) -> Result<(), Error> {
        self.fill_plan(seqs, query_lens, plan)
            .inspect_err(|_| plan.begin(0, 0, 0, self.bs))
    }

    /// The decode step shared by `step`, `step_batch` and `verify_batch`: each row appends one
    /// token, or `counts[r]`. A first pass checks every row and counts the blocks the step
    /// takes; once they are reserved, a second pass commits each row's previous step, appends
    /// its tokens and writes its inputs.
    fn decode<R: DecodeRows>(
        &self,
        rows: &mut R,
        tokens: &[Token],
        counts: Option<&[u32]>,
    ) -> Result<(), Error> {
        let mut prepared = self.prepare_decode(rows, tokens, counts)?;
        self.reserve_gpu(prepared.needed)?;
        self.apply_decode(&mut prepared, rows, tokens, counts);
        Ok(())
    }

    /// The first pass of a decode step: locks and checks every row and counts the blocks the
    /// step takes (none taken yet).
    pub(super) fn prepare_decode<R: DecodeRows>(
        &self,
        rows: &mut R,
        tokens: &[Token],
        counts: Option<&[u32]>,
    ) -> Result<Prepared<'_>, Error> {
        let n = rows.seqs().len();
        match counts {
            None => one_each(R::CALL, n, tokens.len(), "tokens")?,
            Some(counts) => check_counts(n, tokens.len(), counts)?,
        }
        let count = |row: usize| counts.map_or(1, |counts| counts[row] as usize);
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(rows.seqs());
        let (mut copying, mut needed, mut widest) = (false, 0, 0);
        for row in 0..n {
            let id = rows.seqs()[row];
            let place = visit_hinted(&mut batch, id, rows.hint(row), stamp, false)?;
            rows.remember(row, place);
            let (s, more) = (batch.at(place), count(row));
            not_loading(id, s)?;
            check_room(s.tokens.len(), more)?;
            no_gap(id, s, s.tokens.len())?;
            copying |= !s.copying.is_empty();
            needed += self.blocks_to_append(s, more);
            widest = widest.max(self.bs.pages(s.tokens.len() + more) - s.first);
        }
        // Completing a copy releases its source, which may be another row's tail that then
        // needs no copy-on-write: the blocks are counted again after those commits.
        if copying {
            for row in 0..n {
                let s = batch.at(rows.place(row));
                if !s.copying.is_empty() {
                    self.count_computed(self.auto_commit(s));
                }
            }
            needed = (0..n)
                .map(|row| self.blocks_to_append(batch.at(rows.place(row)), count(row)))
                .sum();
        }
        rows.fit(widest)?;
        Ok(Prepared { batch, needed })
    }

    /// The second pass of a decode step, once `prepared.needed` blocks are reserved.
    pub(super) fn apply_decode<R: DecodeRows>(
        &self,
        prepared: &mut Prepared<'_>,
        rows: &mut R,
        tokens: &[Token],
        counts: Option<&[u32]>,
    ) {
        let count = |row: usize| counts.map_or(1, |counts| counts[row] as usize);
        let batch = &mut prepared.batch;
        rows.begin(tokens.len(), self.bs);
        rows.plan().attention = self.config.attention;
        let (mut taken, mut computed, mut next) = (Taken::default(), 0, 0);
        for row in 0..rows.seqs().len() {
            let s = batch.at(rows.place(row));
            computed += self.auto_commit(s);
            let start = s.tokens.len();
            let appended = &tokens[next..next + count(row)];
            next += appended.len();
            self.append_reserved(s, appended, &mut taken);
            self.release_behind(s, start);
            rows.push(row, s, appended.len(), self.bs);
            hand_over_copies(s, rows.plan());
        }
        self.count_computed(computed);
        self.finish_taking(prepared.needed, taken);
        self.gpu.add_stored(tokens.len());
        Counters::add(&self.counters.pending_tokens, tokens.len() as u64);
    }

    fn fill_plan(&self, seqs: &[SeqId], query_lens: &[u32], plan: &mut Plan) -> Result<(), Error> {
        let mut prepared = self.prepare_plan(seqs, query_lens)?;
        self.apply_plan(&mut prepared, query_lens, plan);
        Ok(())
    }

    /// The first pass of `plan`: locks and checks every sequence (nothing changed yet).
    pub(super) fn prepare_plan(
        &self,
        seqs: &[SeqId],
        query_lens: &[u32],
    ) -> Result<PreparedPlan<'_>, Error> {
        one_each("plan", seqs.len(), query_lens.len(), "query lengths")?;
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        let (mut nnz, mut queries) = (0, 0);
        let mut places: Vec<Place> = Vec::with_capacity(seqs.len());
        for (&id, &q) in seqs.iter().zip(query_lens) {
            let place = visit(&mut batch, id, stamp, false)?;
            places.push(place);
            let s = batch.at(place);
            not_loading(id, s)?;
            let len = s.tokens.len();
            if q == 0 || q as usize > len {
                return Err(invalid(format!(
                    "query length {q} of sequence {id} must be in 1..={len}"
                )));
            }
            let start = len - q as usize;
            no_gap(id, s, start)?;
            if self.bs.index(self.config.attention.first_key(start)) < s.first {
                return Err(invalid(format!(
                    "sequence {id}: its queries from position {start} read blocks that left the \
                     attention window"
                )));
            }
            nnz += self.bs.pages(len) - s.first;
            queries += q as usize;
        }
        Ok(PreparedPlan {
            batch,
            places,
            nnz,
            queries,
        })
    }

    /// The second pass of `plan`: writes every sequence's inputs.
    pub(super) fn apply_plan(
        &self,
        prepared: &mut PreparedPlan<'_>,
        query_lens: &[u32],
        plan: &mut Plan,
    ) {
        plan.begin(
            prepared.places.len(),
            prepared.nnz,
            prepared.queries,
            self.bs,
        );
        plan.attention = self.config.attention;
        let mut computed = 0;
        for (&place, &q) in prepared.places.iter().zip(query_lens) {
            let s = prepared.batch.at(place);
            computed += self.auto_commit(s);
            let start = s.tokens.len() - q as usize;
            self.release_behind(s, start);
            plan.push(&s.table, s.first, s.tokens.len(), q as usize, self.bs);
            hand_over_copies(s, plan);
        }
        self.count_computed(computed);
    }

    /// Blocks an append of `count` tokens takes: a copy-on-write of a shared partial last
    /// block, plus the new blocks.
    #[inline(always)]
    fn blocks_to_append(&self, s: &Sequence, count: usize) -> usize {
        let bs = self.bs;
        usize::from(self.must_copy_tail(s)) + bs.pages(s.tokens.len() + count)
            - s.first
            - s.table.len()
    }

    /// Whether the last block is partial and shared (by another sequence, or as the source of
    /// a copy not yet done), so writing to it needs a private copy.
    #[inline(always)]
    fn must_copy_tail(&self, s: &Sequence) -> bool {
        s.shared_tail
            && self.bs.offset(s.tokens.len()) != 0
            && self
                .gpu
                .state(*s.table.last().expect("a sequence has a block"))
                .refcount()
                > 1
    }

    /// Appends with blocks already reserved. The caller counts the appended tokens into the
    /// pool's stored tokens (once per batch).
    #[inline(always)]
    fn append_reserved(&self, s: &mut Sequence, tokens: &[Token], taken: &mut Taken) {
        if s.shared_tail {
            // A partial block gains holders only through forks and swaps of sequences holding
            // it, so one this sequence held alone when the blocks were counted is still
            // private here: a copy is never taken without a reserved block.
            if self.must_copy_tail(s) {
                self.copy_tail(s, taken);
            }
            s.shared_tail = false;
        }
        for &token in tokens {
            s.tokens.push(token);
        }
        let pages = self.bs.pages(s.tokens.len()) - s.first;
        while s.table.len() < pages {
            s.table.push(self.take(taken));
        }
    }

    /// Replaces the shared partial last block by a fresh (reserved) block that a copy will fill;
    /// the sequence's reference to the old block now belongs to the copy, until it is done.
    fn copy_tail(&self, s: &mut Sequence, taken: &mut Taken) {
        let fill = self.bs.offset(s.tokens.len()) as u32;
        let dst = self.take(taken);
        let last = s.table.last_mut().expect("a sequence has a block");
        let src = *last;
        s.copies.push(PendingCopy {
            src,
            dst,
            fill,
            until: 0,
        });
        *last = dst;
        s.table_changed();
        self.gpu.add_stored(fill as usize);
    }
}

/// A decode step after its first pass: the rows' locked shards and the blocks it takes.
pub(super) struct Prepared<'a> {
    batch: LockedBatch<'a>,
    pub(super) needed: usize,
}

impl Prepared<'_> {
    /// The locked sequence at `place`.
    pub(super) fn at(&mut self, place: Place) -> &mut Sequence {
        self.batch.at(place)
    }
}

/// A plan after its first pass: the sequences' locked shards and where they are.
pub(super) struct PreparedPlan<'a> {
    batch: LockedBatch<'a>,
    places: Vec<Place>,
    nnz: usize,
    queries: usize,
}

impl PreparedPlan<'_> {
    /// The locked sequence of row `row`.
    pub(super) fn row(&mut self, row: usize) -> &mut Sequence {
        self.batch.at(self.places[row])
    }
}

/// Fails unless a verify step got one count per row, each at least 1, adding up to its tokens.
fn check_counts(rows: usize, tokens: usize, counts: &[u32]) -> Result<(), Error> {
    one_each("verify_batch", rows, counts.len(), "counts")?;
    if let Some(row) = counts.iter().position(|&c| c == 0) {
        return Err(invalid(format!(
            "verify_batch: row {row} appends 0 tokens; every row appends at least its last token"
        )));
    }
    let sum: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    if sum != tokens as u64 {
        return Err(invalid(format!(
            "verify_batch got {tokens} tokens but its counts add up to {sum}"
        )));
    }
    Ok(())
}

/// Moves the sequence's recorded copies into the plan that computes its KV up to its end, and
/// marks its tokens planned.
#[inline(always)]
fn hand_over_copies(s: &mut Sequence, plan: &mut Plan) {
    let len = s.tokens.len();
    if !s.copies.is_empty() {
        for mut copy in s.copies.drain(..) {
            plan.push_copy(copy.src, copy.dst);
            copy.until = len;
            s.copying.push(copy);
        }
    }
    s.planned = len;
}

/// The rows of a decode step and where their inputs go: a one-shot [`Plan`] or a [`Batch`].
pub(crate) trait DecodeRows {
    /// The operation's name, for errors.
    const CALL: &'static str;
    /// The sequence of each row.
    fn seqs(&self) -> &[SeqId];
    /// Where row `row`'s sequence was found last, if known (a hint, checked before use).
    fn hint(&self, row: usize) -> Option<Place>;
    /// Remembers where this step found row `row`'s sequence.
    fn remember(&mut self, row: usize, place: Place);
    /// Where this step found row `row`'s sequence (once remembered).
    fn place(&self, row: usize) -> Place {
        self.hint(row).expect("the step found every row's sequence")
    }
    /// Makes room for rows of up to `pages` blocks, before anything changes.
    fn fit(&mut self, pages: usize) -> Result<(), Error>;
    /// Starts the inputs of a step of `queries` query tokens over every row.
    fn begin(&mut self, queries: usize, bs: BlockSize);
    /// Adds row `row`'s inputs after its append of `q` tokens, its queries (rows come in
    /// order).
    fn push(&mut self, row: usize, s: &Sequence, q: usize, bs: BlockSize);
    /// The plan that receives the rows' copies.
    fn plan(&mut self) -> &mut Plan;
}

/// A list of sequences with a one-shot plan: the whole CSR is written each step.
pub(super) struct Listed<'a> {
    pub(super) seqs: &'a [SeqId],
    pub(super) places: Vec<Option<Place>>,
    pub(super) plan: &'a mut Plan,
}

impl DecodeRows for Listed<'_> {
    const CALL: &'static str = "step";
    fn seqs(&self) -> &[SeqId] {
        self.seqs
    }
    fn hint(&self, row: usize) -> Option<Place> {
        self.places[row]
    }
    fn remember(&mut self, row: usize, place: Place) {
        self.places[row] = Some(place);
    }
    fn fit(&mut self, _pages: usize) -> Result<(), Error> {
        Ok(())
    }
    fn begin(&mut self, queries: usize, bs: BlockSize) {
        let n = self.seqs.len();
        self.plan.begin(n, n, queries, bs);
    }
    fn push(&mut self, _row: usize, s: &Sequence, q: usize, bs: BlockSize) {
        self.plan.push(&s.table, s.first, s.tokens.len(), q, bs);
    }
    fn plan(&mut self) -> &mut Plan {
        self.plan
    }
}

/// A persistent batch: the table rows change only where blocks changed.
impl DecodeRows for Batch {
    const CALL: &'static str = "step_batch";
    fn seqs(&self) -> &[SeqId] {
        Batch::seqs(self)
    }
    #[inline(always)]
    fn hint(&self, row: usize) -> Option<Place> {
        self.places[row]
    }
    fn remember(&mut self, row: usize, place: Place) {
        self.places[row] = Some(place);
    }
    fn fit(&mut self, pages: usize) -> Result<(), Error> {
        Batch::fit(self, pages)
    }
    fn begin(&mut self, queries: usize, bs: BlockSize) {
        Batch::begin(self, queries, bs);
    }
    #[inline(always)]
    fn push(&mut self, row: usize, s: &Sequence, q: usize, bs: BlockSize) {
        Batch::push(
            self,
            row,
            &s.table,
            s.first,
            s.version,
            s.tokens.len(),
            q,
            bs,
        );
    }
    fn plan(&mut self) -> &mut Plan {
        &mut self.inputs
    }
}
