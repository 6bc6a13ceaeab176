//! The persistent decode batch: rows that stay across steps, a padded block table that a step
//! only writes where it changed, and the per-step attention inputs (`O(batch)`). A decode step
//! through it ([`crate::BlockManager::step_batch`]) costs `O(batch)` host work however long the
//! sequences are; the CSR `kv_indices` is derived from the table where it is needed (on the
//! device, or with [`Batch::write_kv_indices`]).

use std::collections::HashMap;

use crate::block::BlockSize;
use crate::error::invalid;
use crate::plan::Plan;
use crate::sequence::{shard_bit, LockedBatch, Member, ShardLocks};
use crate::{BlockId, Error, SeqId};

/// The narrowest table a batch lays out (columns); it doubles when a row needs more.
const MIN_WIDTH: usize = 16;

/// Table entries past a row's pages.
const PAD: i32 = -1;

/// A decode batch that persists across steps (like vLLM v1's `InputBatch` and `BlockTable`).
///
/// Rows are added with [`Batch::add`] and removed with [`Batch::remove`] (the last row moves
/// into the hole); [`crate::BlockManager::step_batch`] appends one token to every row's sequence
/// and fills the attention inputs, in row order. The block table is `[len, width]` row-major,
/// each row its sequence's blocks padded with -1; a step writes only entries that changed and
/// logs them in [`Batch::updates`], so a device copy of the table stays in sync with a scatter
/// of a few entries per step.
///
/// The input arrays describe the last step; adding or removing a row empties them until the
/// next step.
///
/// A step checks each row's sequence as [`crate::BlockManager::step`] does, reading it in the
/// manager, except a row whose sequence the batch's last step left with nothing in flight and
/// that no other operation could have touched since (no other call locked its shard of the
/// manager's sequences): its checks are made on what the batch kept. A batch stepped alone
/// (its rows' shards untouched between steps) reads most sequences once per step.
#[derive(Debug)]
pub struct Batch {
    ids: Vec<SeqId>,
    /// Where each row's sequence was last found (a hint: checked before use).
    members: Vec<Option<Member>>,
    /// The table version each row mirrors (0: none yet, the row was not stepped).
    epochs: Vec<u64>,
    ends: RowEnds,
    row_of: HashMap<SeqId, usize>,
    /// Shards of the rows' sequences, as `SequenceMap::lock_shards` takes them; `None` after a
    /// removal, until the next step recomputes it.
    shards: Option<u32>,
    width: usize,
    table: Vec<i32>,
    updates: TableUpdates,
    pub(crate) inputs: Plan,
    /// The lock counts of the shards the last step locked: a shard nothing else locked since
    /// holds its rows' sequences exactly as that step left them.
    locks: Option<ShardLocks>,
    /// What the next step's settled rows append if every shard is untouched, counted by the
    /// last step ([`Batch::write_inputs`], which also flagged those rows settled); `None` once
    /// a row was added or removed, or a step used or passed over it.
    ahead: Option<Appends>,
}

/// Each row's length and blocks as of the last step, one array per field, so a step writes
/// the attention inputs from them in one vectorized pass.
#[derive(Clone, Debug, Default)]
struct RowEnds {
    /// Tokens of each row's sequence (at most `MAX_TOKENS`, which fits).
    len: Vec<u32>,
    /// Entries of each row that hold blocks; the rest are -1.
    pages: Vec<u32>,
    /// Each row's last block (its entry `pages - 1`), which the step's slot is in.
    last: Vec<BlockId>,
    /// The row's sequence decodes as settled while it is shorter than this (0: never; the
    /// last step left something in flight, or none stepped the row, so a row with more has
    /// a member). Set by the manager that stepped the row, from the sequence's state and its
    /// own configuration: with prefix caching, one more than the length at which its step
    /// registers its next block ([`Batch::may_register`]).
    below: Vec<u32>,
    /// The bit of the row's sequence's shard (as `SequenceMap::lock_shards` takes them).
    shard: Vec<u32>,
    /// Whether the row is settled in this step: its second pass appends to it as one, and its
    /// length grows by the token once the step's appends are done. Between steps: whether it
    /// is in the next one if that finds every shard untouched.
    settled: Vec<bool>,
    /// Whether a settled row's token takes a new block (its last block is full), likewise.
    /// A settled row that registers a block takes one: its length is a block boundary.
    takes: Vec<bool>,
}

/// What a decode step's second pass reads of every row, moved out of the batch while that
/// pass writes the rest ([`Batch::take_pass`]): the pass then reads it from locals, without a
/// bounds check, rather than through the batch again after each store to a sequence.
#[derive(Debug)]
pub(crate) struct RowPass {
    pub(crate) members: Vec<Option<Member>>,
    pub(crate) settled: Vec<bool>,
    pub(crate) takes: Vec<bool>,
}

impl RowPass {
    /// The first row from `row` on that the second pass checks in full or that takes a block.
    #[inline(always)]
    pub(crate) fn next_to_check(&self, row: usize) -> Option<usize> {
        first_flagged(&self.settled, &self.takes, row, true)
    }
}

/// The first row from `row` on not `settled` or, with `taking`, whose token `takes` a block.
/// Eight rows a word: a batch of settled rows is scanned in a few dozen instructions, not a few
/// for each row.
#[inline(always)]
fn first_flagged(settled: &[bool], takes: &[bool], row: usize, taking: bool) -> Option<usize> {
    const ALL: u64 = u64::from_le_bytes([1; 8]);
    let word = |flags: &[bool]| u64::from_le_bytes(std::array::from_fn(|b| u8::from(flags[b])));
    let (settled, takes) = (settled.get(row..)?, &takes[row..]);
    let taking_word = if taking { ALL } else { 0 };
    let mut words = settled.chunks_exact(8).zip(takes.chunks_exact(8));
    for (i, (settled, takes)) in words.by_ref().enumerate() {
        let visits = (!word(settled) | word(takes) & taking_word) & ALL;
        if visits != 0 {
            return Some(row + 8 * i + visits.trailing_zeros() as usize / 8);
        }
    }
    let done = settled.len() / 8 * 8;
    let mut tail = settled[done..].iter().zip(&takes[done..]);
    let first = tail.position(|(&settled, &takes)| !settled | takes & taking)?;
    Some(row + done + first)
}

impl RowEnds {
    fn push(&mut self, shard: u32) {
        self.len.push(0);
        self.pages.push(0);
        self.last.push(0);
        self.below.push(0);
        self.shard.push(shard);
        self.settled.push(false);
        self.takes.push(false);
    }

    /// Moves row `from` into row `to`, then drops the last row.
    fn move_and_pop(&mut self, from: usize, to: usize) {
        for array in [
            &mut self.len,
            &mut self.pages,
            &mut self.last,
            &mut self.below,
            &mut self.shard,
        ] {
            array[to] = array[from];
            array.pop();
        }
        self.settled.pop();
        self.takes.pop();
    }

    fn clear(&mut self) {
        self.len.clear();
        self.pages.clear();
        self.last.clear();
        self.below.clear();
        self.shard.clear();
        self.settled.clear();
        self.takes.clear();
    }

    fn pages(&self, row: usize) -> usize {
        self.pages[row] as usize
    }

    /// Flags the rows settled in a step that finds the shards `untouched` (those whose sequence
    /// is shorter than their `below` and whose shard is in it), and those of them that take a
    /// block; returns what their appends take (blocks of `bs` tokens). `AFTER_STEP`: at the
    /// end of a step, which first adds its token to the length of each row it flagged, for the
    /// next step if it finds every shard untouched (`untouched` is not read).
    fn flag_settled<const AFTER_STEP: bool>(&mut self, untouched: u32, bs: BlockSize) -> Appends {
        let (lens, settled, takes) = (&mut self.len, &mut self.settled, &mut self.takes);
        let ends = (&self.pages[..], &self.below[..], &self.shard[..]);
        flag_settled::<AFTER_STEP>(lens, settled, takes, ends, untouched, bs)
    }
}

/// [`RowEnds::flag_settled`] on the arrays: branch-free, in `i32` (lengths and pages are at most
/// `MAX_TOKENS`, `i32::MAX`), and out of line so that the compiler knows the arrays apart: it
/// vectorizes it, with AVX2 where the CPU has it (half the instructions of the x86-64
/// baseline's SSE2, which has no 32-bit maximum). The written arrays are separate arguments:
/// inside a tuple, the compiler checks at run time that they do not overlap.
#[inline(never)]
fn flag_settled<const AFTER_STEP: bool>(
    lens: &mut [u32],
    settled: &mut [bool],
    takes: &mut [bool],
    ends: (&[u32], &[u32], &[u32]),
    untouched: u32,
    bs: BlockSize,
) -> Appends {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    if crate::simd::has_avx2() {
        #[allow(unsafe_code)]
        // SAFETY: the CPU has AVX2, the only target feature the copy is compiled with.
        return unsafe {
            flag_settled_avx2::<AFTER_STEP>(lens, settled, takes, ends, untouched, bs)
        };
    }
    flag_rows::<AFTER_STEP>(lens, settled, takes, ends, untouched, bs)
}

/// [`flag_settled`] compiled with AVX2.
#[cfg(all(target_arch = "x86_64", not(loom)))]
#[target_feature(enable = "avx2")]
fn flag_settled_avx2<const AFTER_STEP: bool>(
    lens: &mut [u32],
    settled: &mut [bool],
    takes: &mut [bool],
    ends: (&[u32], &[u32], &[u32]),
    untouched: u32,
    bs: BlockSize,
) -> Appends {
    flag_rows::<AFTER_STEP>(lens, settled, takes, ends, untouched, bs)
}

/// The loop of [`flag_settled`], inlined into each of its copies.
#[inline(always)]
fn flag_rows<const AFTER_STEP: bool>(
    lens: &mut [u32],
    settled: &mut [bool],
    takes: &mut [bool],
    (pages, below, shard): (&[u32], &[u32], &[u32]),
    untouched: u32,
    bs: BlockSize,
) -> Appends {
    let (size, mask) = (bs.get() as i32, bs.get() as i32 - 1);
    let pow2 = size.count_ones() == 1;
    let (mut new_blocks, mut widest) = (0i32, 0i32);
    let flags = lens.iter_mut().zip(settled.iter_mut().zip(takes));
    let ends = (pages.iter().zip(below)).zip(shard);
    for ((len, (settled, takes)), ((&pages, &below), &shard)) in flags.zip(ends) {
        let now = *len as i32 + i32::from(*settled & AFTER_STEP);
        *len = now as u32;
        *settled = (now < below as i32) & (AFTER_STEP || shard & untouched != 0);
        let offset = if pow2 { now & mask } else { now % size };
        let fresh = i32::from(*settled & (offset == 0));
        *takes = fresh != 0;
        let pages_after = if *settled { pages as i32 + fresh } else { 0 };
        new_blocks += fresh;
        widest = widest.max(pages_after);
    }
    Appends {
        new_blocks: new_blocks as usize,
        widest: widest as usize,
    }
}

/// What a decode step's appends take, counted in its first pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Appends {
    /// Rows whose token takes a new block (their last one is full).
    pub(crate) new_blocks: usize,
    /// Pages of the widest row after the step.
    pub(crate) widest: usize,
}

impl Appends {
    /// Counts the append of one token to a sequence of `len` tokens in `pages` blocks of `bs`
    /// tokens: a table has exactly the pages of its tokens, so the token takes a new block
    /// exactly when the last one is full. Returns the sequence's pages after it.
    #[inline(always)]
    pub(crate) fn add(&mut self, len: usize, pages: usize, bs: BlockSize) -> usize {
        let new_block = usize::from(bs.offset(len) == 0);
        self.new_blocks += new_block;
        self.widest = self.widest.max(pages + new_block);
        pages + new_block
    }
}

/// The table entries written since the log was last cleared: flat positions `row * width +
/// column` and their new values, or `full` when the layout changed (the width grew) or so many
/// entries changed that copying the whole table is cheaper. A removal logs the vacated last
/// row's clearing, so positions may reach one row past the length; a copy applying every log
/// equals the table, with -1 in the rows past it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableUpdates {
    /// The whole table must be copied; `index` and `blocks` are empty.
    pub full: bool,
    /// Flat positions written, in order (a position may repeat; the last write wins).
    pub index: Vec<i64>,
    /// The value written at each position.
    pub blocks: Vec<i32>,
}

impl Default for Batch {
    fn default() -> Batch {
        Batch::new()
    }
}

impl Batch {
    /// An empty batch; its inputs are those of an empty step (`kv_indptr == [0]`).
    pub fn new() -> Batch {
        let mut inputs = Plan::new();
        inputs.clear();
        Batch {
            ids: Vec::new(),
            members: Vec::new(),
            epochs: Vec::new(),
            ends: RowEnds::default(),
            row_of: HashMap::new(),
            shards: Some(0),
            width: 0,
            table: Vec::new(),
            updates: TableUpdates::default(),
            inputs,
            locks: None,
            ahead: None,
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The sequence of each row, in row order.
    pub fn seqs(&self) -> &[SeqId] {
        &self.ids
    }

    /// Whether `seq` has a row.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.row_of.contains_key(&seq)
    }

    /// The row of `seq`, if it has one.
    pub fn row(&self, seq: SeqId) -> Option<usize> {
        self.row_of.get(&seq).copied()
    }

    /// Adds a row for `seq` at the end; its table row is filled by the next step. Fails if it
    /// already has one. The sequence is checked (live, on the GPU) by each step, not here.
    pub fn add(&mut self, seq: SeqId) -> Result<(), Error> {
        if self.row_of.contains_key(&seq) {
            return Err(invalid(format!("sequence {seq} is already in the batch")));
        }
        self.row_of.insert(seq, self.ids.len());
        self.ids.push(seq);
        self.members.push(None);
        self.epochs.push(0);
        let shard = shard_bit(seq);
        self.ends.push(shard);
        self.table.resize(self.table.len() + self.width, PAD);
        if let Some(shards) = &mut self.shards {
            *shards |= shard;
        }
        self.inputs.clear();
        self.ahead = None;
        Ok(())
    }

    /// Removes the row of `seq`; the last row moves into its place (its table entries are
    /// copied and logged, the vacated row cleared). Fails if `seq` has no row.
    pub fn remove(&mut self, seq: SeqId) -> Result<(), Error> {
        let row = self
            .row_of
            .remove(&seq)
            .ok_or_else(|| invalid(format!("sequence {seq} is not in the batch")))?;
        let last = self.ids.len() - 1;
        let moved = self.ends.pages(last);
        if row != last {
            for col in 0..moved.max(self.ends.pages(row)) {
                let value = if col < moved {
                    self.table[last * self.width + col]
                } else {
                    PAD
                };
                self.set(row, col, value);
            }
            self.members[row] = self.members[last];
            self.epochs[row] = self.epochs[last];
            self.ids[row] = self.ids[last];
            self.row_of.insert(self.ids[row], row);
        }
        // The vacated row is cleared (and logged), so a copy's rows past the length stay -1.
        for col in 0..moved {
            self.set(last, col, PAD);
        }
        self.ids.pop();
        self.members.pop();
        self.epochs.pop();
        self.ends.move_and_pop(last, row);
        self.table.truncate(self.ids.len() * self.width);
        self.shards = None;
        self.inputs.clear();
        self.ahead = None;
        Ok(())
    }

    /// Removes every row.
    pub fn clear(&mut self) {
        self.ids.clear();
        self.members.clear();
        self.epochs.clear();
        self.ends.clear();
        self.row_of.clear();
        self.table.clear();
        self.shards = Some(0);
        self.log_full();
        self.inputs.clear();
        self.ahead = None;
    }

    /// Columns of the block table.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The `[len, width]` row-major block table: row `r` holds its sequence's blocks as of the
    /// last step, padded with -1.
    pub fn block_table(&self) -> &[i32] {
        &self.table
    }

    /// The table entries written since [`Batch::clear_updates`].
    pub fn updates(&self) -> &TableUpdates {
        &self.updates
    }

    /// Empties the update log, once a device copy of the table has applied it.
    pub fn clear_updates(&mut self) {
        self.updates.full = false;
        self.updates.index.clear();
        self.updates.blocks.clear();
    }

    /// The last step's attention inputs, as a [`Plan`] whose `kv_indices` is empty (derive it
    /// from the table: [`Batch::write_kv_indices`]). One query token per row; empty after a
    /// row was added or removed, until the next step.
    pub fn inputs(&self) -> &Plan {
        &self.inputs
    }

    /// Writes the CSR `kv_indices` of the last step (row `r`'s first `kv_indptr[r + 1] -
    /// kv_indptr[r]` table entries, concatenated) into `out`.
    pub fn write_kv_indices(&self, out: &mut Vec<i32>) {
        out.clear();
        out.reserve(self.inputs.kv_indptr.last().map_or(0, |&n| n as usize));
        for (row, span) in self.inputs.kv_indptr.windows(2).enumerate() {
            let start = row * self.width;
            out.extend_from_slice(&self.table[start..start + (span[1] - span[0]) as usize]);
        }
    }

    /// The last step as a complete one-shot [`Plan`] (with `kv_indices`), as
    /// [`crate::BlockManager::step`] would have written it for the rows in order.
    pub fn write_plan(&self, plan: &mut Plan) {
        plan.clone_from(&self.inputs);
        self.write_kv_indices(&mut plan.kv_indices);
    }

    /// The shards to lock for a step (recomputed after a removal).
    pub(crate) fn shards(&mut self) -> u32 {
        *self
            .shards
            .get_or_insert_with(|| self.ends.shard.iter().fold(0, |mask, &bit| mask | bit))
    }

    /// Where row `row`'s sequence was last found (by this step, once it visited the row).
    pub(crate) fn member_hint(&self, row: usize) -> Option<Member> {
        self.members[row]
    }

    /// The shards of `batch` that nothing else locked since this batch's last step.
    pub(crate) fn untouched(&self, batch: &LockedBatch<'_>) -> u32 {
        self.locks
            .as_ref()
            .map_or(0, |locks| batch.untouched(locks))
    }

    /// Flags the settled rows, and those of them that take a block, for a step's second pass
    /// ([`Batch::take_pass`]): those in a shard in `untouched` whose sequence is shorter than
    /// the length the last step recorded ([`Batch::record_row`]).
    /// Returns what their appends take (blocks of `bs` tokens), from what the batch kept. When
    /// every shard of the batch is untouched, the last step already flagged and counted them.
    pub(crate) fn settle(&mut self, untouched: u32, bs: BlockSize) -> Appends {
        let all = self.shards();
        let appends = match self.ahead.take().filter(|_| untouched & all == all) {
            Some(ahead) => ahead,
            None => self.ends.flag_settled::<false>(untouched, bs),
        };
        let flagged = |row| {
            let settled = self.settles(row, untouched);
            let full = bs.offset(self.ends.len[row] as usize) == 0;
            self.ends.settled[row] == settled && self.ends.takes[row] == (settled && full)
        };
        debug_assert!((0..self.len()).all(flagged));
        debug_assert_eq!(appends, self.appends_of_settled(bs));
        appends
    }

    /// What the appends of the rows flagged settled take (a check of [`Batch::settle`]).
    fn appends_of_settled(&self, bs: BlockSize) -> Appends {
        let mut appends = Appends::default();
        for row in (0..self.len()).filter(|&row| self.ends.settled[row]) {
            appends.add(self.ends.len[row] as usize, self.ends.pages(row), bs);
        }
        appends
    }

    /// Whether row `row` is settled in a step that found the shards `untouched`, by definition
    /// (what debug builds check [`Batch::settle`]'s flags against).
    fn settles(&self, row: usize, untouched: u32) -> bool {
        self.ends.len[row] < self.ends.below[row]
            && self.members[row].is_some_and(|member| untouched & member.shard_bit() != 0)
    }

    /// Moves out what a step's second pass reads of every row (where its sequence is, whether
    /// it is settled and whether it then takes a block), until [`Batch::restore_pass`]; the
    /// rows' hints and flags are not read or written meanwhile.
    pub(crate) fn take_pass(&mut self) -> RowPass {
        RowPass {
            members: std::mem::take(&mut self.members),
            settled: std::mem::take(&mut self.ends.settled),
            takes: std::mem::take(&mut self.ends.takes),
        }
    }

    /// Puts back what [`Batch::take_pass`] moved out.
    pub(crate) fn restore_pass(&mut self, pass: RowPass) {
        self.members = pass.members;
        self.ends.settled = pass.settled;
        self.ends.takes = pass.takes;
    }

    /// The first row from `row` on that a step's first pass visits: one [`Batch::settle`] did
    /// not find settled or, with `taking`, a settled one whose token takes a block (it may
    /// register one).
    #[inline(always)]
    pub(crate) fn to_visit_from(&self, row: usize, taking: bool) -> Option<usize> {
        first_flagged(&self.ends.settled, &self.ends.takes, row, taking)
    }

    /// Whether [`Batch::settle`] found row `row` settled in this step.
    pub(crate) fn is_settled(&self, row: usize) -> bool {
        self.ends.settled[row]
    }

    /// Whether row `row`, settled in this step and taking a block, may register one: its
    /// length is one short of its `below`, where the manager records its sequence's next
    /// registration (which the manager checks on the sequence: a `below` capped at the limit
    /// of tokens is one short of no registration).
    pub(crate) fn may_register(&self, row: usize) -> bool {
        self.ends.len[row] + 1 == self.ends.below[row]
    }

    /// Records, after a step synced row `row`, that its sequence decodes as settled while
    /// shorter than `settled_below` (0: it does not).
    #[inline(always)]
    pub(crate) fn record_row(&mut self, row: usize, settled_below: usize) {
        self.ends.below[row] = settled_below as u32;
    }

    /// Records the lock counts of a step's shards, once the step succeeded.
    pub(crate) fn record_locks(&mut self, batch: &LockedBatch<'_>) {
        self.locks = Some(batch.locks());
    }

    /// Remembers where row `row`'s sequence is.
    pub(crate) fn found(&mut self, row: usize, member: Member) {
        self.members[row] = Some(member);
    }

    /// Widens the table, before a step changes anything, so every row fits `pages` entries.
    /// Fails, leaving the batch as it was, when the wider table cannot be allocated.
    pub(crate) fn fit(&mut self, pages: usize) -> Result<(), Error> {
        if pages <= self.width {
            return Ok(());
        }
        let width = pages.next_power_of_two().max(MIN_WIDTH).max(2 * self.width);
        let entries = self.ids.len().saturating_mul(width);
        let mut table = Vec::new();
        table.try_reserve_exact(entries).map_err(|_| {
            invalid(format!(
                "the batch's block table of {} rows x {width} blocks cannot be allocated",
                self.ids.len()
            ))
        })?;
        for (&pages, old) in self
            .ends
            .pages
            .iter()
            .zip(self.table.chunks(self.width.max(1)))
        {
            table.extend_from_slice(&old[..pages as usize]);
            table.resize(table.len() + width - pages as usize, PAD);
        }
        table.resize(entries, PAD);
        self.table = table;
        self.width = width;
        self.log_full();
        Ok(())
    }

    /// Makes row `row` mirror `blocks`, a table of version `epoch` for `len` tokens: only new
    /// entries when the row already mirrors that version, else the whole row.
    #[inline(always)]
    pub(crate) fn sync_row(&mut self, row: usize, blocks: &[BlockId], epoch: u64, len: usize) {
        debug_assert!(blocks.len() <= self.width, "fit() widened the table");
        self.ends.len[row] = len as u32;
        // A decode step's usual cases, which read no entry the row already has: the same
        // blocks, or one more at the end.
        let pages = self.ends.pages(row);
        if self.epochs[row] == epoch && pages == blocks.len() {
            return;
        }
        if self.epochs[row] == epoch && pages + 1 == blocks.len() {
            self.push_block(row, blocks[pages]);
            return;
        }
        self.sync_whole_row(row, blocks, epoch);
    }

    /// Adds `block` at the end of row `row` (a settled row's sync, [`Batch::settle`]: its
    /// sequence took the block, and [`Batch::write_inputs`] counts its token).
    pub(crate) fn push_block(&mut self, row: usize, block: BlockId) {
        let col = self.ends.pages(row);
        (self.ends.pages[row], self.ends.last[row]) = (col as u32 + 1, block);
        self.set(row, col, block as i32);
    }

    /// [`Batch::sync_row`] when more than the last entry may have changed.
    #[inline(never)]
    fn sync_whole_row(&mut self, row: usize, blocks: &[BlockId], epoch: u64) {
        let (seen, pages) = (self.epochs[row], self.ends.pages(row));
        if pages == 0 {
            // An empty row (all -1: one just added, or emptied): its blocks go in as one run.
            self.fill_row(row, blocks);
        } else {
            let from = if seen == epoch {
                pages.min(blocks.len())
            } else {
                0
            };
            for (col, &block) in blocks.iter().enumerate().skip(from) {
                self.set(row, col, block as i32);
            }
            for col in blocks.len()..pages {
                self.set(row, col, PAD);
            }
        }
        self.epochs[row] = epoch;
        self.ends.pages[row] = blocks.len() as u32;
        self.ends.last[row] = blocks.last().copied().unwrap_or_default();
    }

    /// Writes the blocks of an empty row (all -1) at once, logging them as a run.
    fn fill_row(&mut self, row: usize, blocks: &[BlockId]) {
        let start = row * self.width;
        let entries = &mut self.table[start..start + blocks.len()];
        for (entry, &block) in entries.iter_mut().zip(blocks) {
            *entry = block as i32;
        }
        self.log(start, blocks.len());
    }

    /// Writes one entry, logging it if it changed.
    #[inline]
    fn set(&mut self, row: usize, col: usize, value: i32) {
        let at = row * self.width + col;
        if self.table[at] == value {
            return;
        }
        self.table[at] = value;
        self.log(at, 1);
    }

    /// Logs the `len` entries written from flat position `at`, or marks the log full once it
    /// would hold more than half the table (copying the whole table is then cheaper).
    #[inline]
    fn log(&mut self, at: usize, len: usize) {
        let updates = &mut self.updates;
        if updates.full {
            return;
        }
        if updates.index.len() + len > self.table.len() / 2 {
            self.log_full();
            return;
        }
        updates.index.extend(at as i64..(at + len) as i64);
        updates.blocks.extend_from_slice(&self.table[at..at + len]);
    }

    fn log_full(&mut self) {
        self.updates.full = true;
        self.updates.index.clear();
        self.updates.blocks.clear();
    }

    /// Adds the step's token to each settled row's length, then writes the step's attention
    /// inputs from the rows' ends (their lengths, pages and last blocks), with blocks of `bs`
    /// tokens; the copies were handed over row by row. First flags the rows the next step
    /// finds settled if nothing else touches their shards, and counts their appends
    /// ([`Batch::settle`]).
    pub(crate) fn write_inputs(&mut self, bs: BlockSize) {
        let n = self.ids.len();
        self.ahead = Some(self.ends.flag_settled::<true>(u32::MAX, bs));
        let (ends, inputs) = (&self.ends, &mut self.inputs);
        inputs.block_size = bs.get() as u32;
        inputs.kv_indices.clear();
        // One query token per row: `qo_indptr` is `0..=n`, rewritten only when `n` changed
        // (the inputs are emptied whenever a row is added or removed).
        if inputs.qo_indptr.len() != n + 1 {
            inputs.qo_indptr.clear();
            inputs.qo_indptr.extend(0..=n as i32);
        }
        for (array, len) in [
            (&mut inputs.kv_indptr, n + 1),
            (&mut inputs.kv_last_page_len, n),
            (&mut inputs.positions, n),
            (&mut inputs.slot_mapping, n),
        ] {
            array.resize(len, 0);
        }
        let mut nnz = 0;
        for (end, &pages) in inputs.kv_indptr[1..].iter_mut().zip(&ends.pages) {
            nnz += pages as i32;
            *end = nnz;
        }
        let (positions, last_page_lens) = (&mut inputs.positions, &mut inputs.kv_last_page_len);
        let slots = &mut inputs.slot_mapping;
        write_rows(positions, last_page_lens, slots, &ends.len, &ends.last, bs);
    }
}

/// Writes each row's position, last page's length and slot from its length and last block:
/// out of line, a loop the compiler vectorizes, with AVX2 where the CPU has it.
#[inline(never)]
fn write_rows(
    positions: &mut [i32],
    last_page_lens: &mut [i32],
    slots: &mut [i32],
    lens: &[u32],
    lasts: &[BlockId],
    bs: BlockSize,
) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    if crate::simd::has_avx2() {
        #[allow(unsafe_code)]
        // SAFETY: the CPU has AVX2, the only target feature the copy is compiled with.
        return unsafe { write_rows_avx2(positions, last_page_lens, slots, lens, lasts, bs) };
    }
    write_each_row(positions, last_page_lens, slots, lens, lasts, bs);
}

/// [`write_rows`] compiled with AVX2.
#[cfg(all(target_arch = "x86_64", not(loom)))]
#[target_feature(enable = "avx2")]
fn write_rows_avx2(
    positions: &mut [i32],
    last_page_lens: &mut [i32],
    slots: &mut [i32],
    lens: &[u32],
    lasts: &[BlockId],
    bs: BlockSize,
) {
    write_each_row(positions, last_page_lens, slots, lens, lasts, bs);
}

/// The loop of [`write_rows`], inlined into each of its copies.
#[inline(always)]
fn write_each_row(
    positions: &mut [i32],
    last_page_lens: &mut [i32],
    slots: &mut [i32],
    lens: &[u32],
    lasts: &[BlockId],
    bs: BlockSize,
) {
    let rows = (positions.iter_mut())
        .zip(last_page_lens)
        .zip(slots)
        .zip(lens.iter().zip(lasts));
    // The block size is a power of two but for unusual configurations: the usual case is a
    // loop the compiler vectorizes.
    let (size, mask) = (bs.get() as u32, bs.get() as u32 - 1);
    let pow2 = size.is_power_of_two();
    for (((position, last_page_len), slot), (&len, &last)) in rows {
        let p = len - 1;
        let offset = if pow2 { p & mask } else { p % size };
        *position = p as i32;
        *last_page_len = offset as i32 + 1;
        *slot = last.wrapping_mul(size).wrapping_add(offset) as i32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch of rows for `seqs`, wide enough for `pages` blocks a row.
    fn batch_of(seqs: &[SeqId], pages: usize) -> Batch {
        let mut batch = Batch::new();
        for &seq in seqs {
            batch.add(seq).unwrap();
        }
        batch.fit(pages).unwrap();
        batch
    }

    fn entries(batch: &Batch) -> Vec<Vec<i32>> {
        batch
            .block_table()
            .chunks(batch.width())
            .map(|row| row.to_vec())
            .collect()
    }

    #[test]
    fn rows_sync_only_what_changed() {
        let mut batch = Batch::new();
        batch.add(7).unwrap();
        batch.add(9).unwrap();
        assert!(batch.add(7).is_err());
        batch.fit(3).unwrap();
        assert_eq!(batch.width(), MIN_WIDTH);
        assert!(batch.updates().full);
        batch.clear_updates();
        batch.sync_row(0, &[4, 5], 1, 1);
        batch.sync_row(1, &[8], 1, 1);
        assert_eq!(batch.updates().index, vec![0, 1, 16]);
        batch.clear_updates();
        // Same version, one more block: one entry.
        batch.sync_row(0, &[4, 5, 6], 1, 1);
        assert_eq!(batch.updates().index, vec![2]);
        assert_eq!(batch.updates().blocks, vec![6]);
        batch.clear_updates();
        // A new version (a copy on write, or another sequence): the whole row, only the entries
        // that differ logged, and the shorter row padded.
        batch.sync_row(0, &[4, 3], 2, 1);
        assert_eq!(batch.updates().index, vec![1, 2]);
        assert_eq!(batch.updates().blocks, vec![3, -1]);
        assert_eq!(&entries(&batch)[0][..4], &[4, 3, -1, -1]);
        // An empty row fills as one run, or marks the log full past half the table.
        batch.add(11).unwrap();
        batch.clear_updates();
        batch.sync_row(2, &[7, 2], 3, 1);
        assert_eq!(batch.updates().index, vec![32, 33]);
        assert_eq!(batch.updates().blocks, vec![7, 2]);
        batch.add(12).unwrap();
        batch.sync_row(3, &(0..10).collect::<Vec<_>>(), 4, 1);
        assert_eq!(batch.updates().index.len(), 12);
        assert_eq!(
            &entries(&batch)[3][..11],
            &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1]
        );
        let mut two = batch_of(&[1, 2], 1);
        two.clear_updates();
        let ten: Vec<BlockId> = (0..10).collect();
        two.sync_row(0, &ten, 1, 1);
        assert_eq!(two.updates().index.len(), 10);
        two.sync_row(1, &ten, 2, 1);
        assert!(two.updates().full && two.updates().index.is_empty());
        assert_eq!(&entries(&two)[1][..11], &entries(&batch)[3][..11]);
    }

    #[test]
    fn removing_moves_the_last_row_into_the_hole() {
        let mut batch = batch_of(&[1, 2, 3], 4);
        batch.sync_row(0, &[1, 1, 1], 1, 1);
        batch.sync_row(1, &[2], 1, 1);
        batch.sync_row(2, &[3, 3], 1, 1);
        batch.clear_updates();
        batch.remove(1).unwrap();
        assert_eq!(batch.seqs(), &[3, 2]);
        assert_eq!(batch.row(3), Some(0));
        assert_eq!(&entries(&batch)[0][..4], &[3, 3, -1, -1]);
        // Row 0 takes row 2's blocks; row 2 is cleared.
        assert_eq!(batch.updates().index, vec![0, 1, 2, 32, 33]);
        assert_eq!(batch.updates().blocks, vec![3, 3, -1, -1, -1]);
        assert_eq!(batch.block_table().len(), 2 * batch.width());
        assert!(batch.remove(1).is_err());
        batch.remove(2).unwrap();
        assert_eq!(batch.seqs(), &[3]);
    }

    #[test]
    fn changing_rows_empties_the_inputs() {
        let mut batch = batch_of(&[1, 2], 1);
        for row in 0..2 {
            batch.sync_row(row, &[row as BlockId], 1, 2);
        }
        batch.write_inputs(BlockSize::new(4));
        let mut pages = Vec::new();
        batch.write_kv_indices(&mut pages);
        assert_eq!(pages, vec![0, 1]);
        batch.remove(1).unwrap();
        // Two rows of inputs over a one-row table would read past it: they are gone instead.
        assert_eq!(batch.inputs().kv_indptr, vec![0]);
        assert_eq!(batch.inputs().block_size, 4);
        batch.write_kv_indices(&mut pages);
        assert!(pages.is_empty());
        batch.add(3).unwrap();
        assert!(batch.inputs().positions.is_empty());
    }

    #[test]
    fn widening_keeps_every_row() {
        let mut batch = batch_of(&[1, 2], 2);
        batch.sync_row(0, &[5, 6], 1, 1);
        batch.sync_row(1, &[7], 1, 1);
        batch.fit(40).unwrap();
        assert_eq!(batch.width(), 64);
        let rows = entries(&batch);
        assert_eq!(&rows[0][..3], &[5, 6, -1]);
        assert_eq!(&rows[1][..2], &[7, -1]);
        assert!(rows[1][2..].iter().all(|&b| b == -1));
        assert!(batch.updates().full);
    }

    /// The word-at-a-time scan for the next row to visit finds what a row-by-row scan does,
    /// from every start, with the rows' flags in thousands of patterns, of up to 19 rows.
    #[test]
    fn the_next_row_to_visit_is_found_a_word_at_a_time() {
        for n in 0..20usize {
            let seqs: Vec<SeqId> = (0..n as SeqId).collect();
            let mut batch = batch_of(&seqs, 1);
            for pattern in (0..1u64 << n.min(12)).map(|p| p.wrapping_mul(0x9E37_79B9_7F4A_7C15)) {
                for row in 0..n {
                    batch.ends.settled[row] = pattern >> (2 * row) & 1 == 1;
                    batch.ends.takes[row] = pattern >> (2 * row + 1) & 1 == 1;
                }
                for (from, taking) in (0..=n + 1).flat_map(|from| [(from, false), (from, true)]) {
                    let ends = &batch.ends;
                    let visits = |row: usize| !ends.settled[row] | ends.takes[row] & taking;
                    let expected = (from..n).find(|&row| visits(row));
                    let found = batch.to_visit_from(from, taking);
                    assert_eq!(found, expected, "{n} rows from {from}, taking {taking}");
                }
            }
        }
    }

    /// The AVX2 copies of the passes over the rows' arrays compute exactly what the baseline
    /// copies do, on arrays of every length around the vector widths (with vector bodies and
    /// scalar tails), block sizes with and without a shift, and any mix of flags.
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    #[test]
    fn avx2_row_passes_match_the_baseline() {
        if !crate::simd::has_avx2() {
            eprintln!("no AVX2 on this CPU: only the baseline copies run here");
            return;
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |bound: u32| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            ((state >> 33) as u32) % bound
        };
        for n in 0..70 {
            for size in [16, 3] {
                let bs = BlockSize::new(size);
                let lens: Vec<u32> = (0..n).map(|_| 1 + next(200)).collect();
                let pages: Vec<u32> = lens.iter().map(|&len| len.div_ceil(size as u32)).collect();
                let below: Vec<u32> = (0..n).map(|_| next(220)).collect();
                let shard: Vec<u32> = (0..n).map(|_| 1 << next(32)).collect();
                let settled: Vec<bool> = (0..n).map(|_| next(2) == 1).collect();
                let untouched = next(u32::MAX);
                let ends = (&pages[..], &below[..], &shard[..]);
                let run = |avx2: bool, after: bool| {
                    let (mut lens, mut settled) = (lens.clone(), settled.clone());
                    let mut takes = vec![false; n];
                    let (l, s, t) = (&mut lens[..], &mut settled[..], &mut takes[..]);
                    #[allow(unsafe_code)]
                    // SAFETY: the CPU has AVX2 (checked above).
                    let appends = match (avx2, after) {
                        (false, false) => flag_rows::<false>(l, s, t, ends, untouched, bs),
                        (false, true) => flag_rows::<true>(l, s, t, ends, untouched, bs),
                        (true, false) => unsafe {
                            flag_settled_avx2::<false>(l, s, t, ends, untouched, bs)
                        },
                        (true, true) => unsafe {
                            flag_settled_avx2::<true>(l, s, t, ends, untouched, bs)
                        },
                    };
                    (lens, settled, takes, appends)
                };
                for after in [false, true] {
                    assert_eq!(run(false, after), run(true, after), "{n} rows of {size}");
                }
                let lasts: Vec<BlockId> = (0..n).map(|_| next(1 << 20)).collect();
                let write = |avx2: bool| {
                    let mut out = [vec![0; n], vec![0; n], vec![0; n]];
                    let [a, b, c] = &mut out;
                    if avx2 {
                        #[allow(unsafe_code)]
                        // SAFETY: the CPU has AVX2 (checked above).
                        unsafe {
                            write_rows_avx2(a, b, c, &lens, &lasts, bs)
                        };
                    } else {
                        write_each_row(a, b, c, &lens, &lasts, bs);
                    }
                    out
                };
                assert_eq!(write(false), write(true), "{n} rows of {size}");
            }
        }
    }
}
