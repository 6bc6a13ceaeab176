//! The persistent decode batch: rows that stay across steps, a padded block table that a step
//! only writes where it changed, and the per-step attention inputs (`O(batch)`). The CSR
//! `kv_indices` is derived from the table where it is needed (on the device, or with
//! [`Batch::write_kv_indices`]).

use std::collections::HashMap;

use crate::block::BlockSize;
use crate::error::invalid;
use crate::plan::Plan;
use crate::sequence::Place;
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
/// Each row remembers the version of its sequence's block table it mirrors: while the version
/// is unchanged only blocks pushed since are new, so a step writes `O(rows)` entries however
/// long the sequences are. The input arrays describe the last step; adding or removing a row
/// empties them until the next step.
#[derive(Debug)]
pub struct Batch {
    ids: Vec<SeqId>,
    row_of: HashMap<SeqId, usize>,
    /// The table version each row mirrors (0: none yet).
    versions: Vec<u64>,
    /// Where each row's sequence was found by the last step (checked before use).
    pub(crate) places: Vec<Option<Place>>,
    /// Entries of each row that hold blocks; the rest are -1.
    pages: Vec<usize>,
    width: usize,
    table: Vec<i32>,
    updates: TableUpdates,
    pub(crate) inputs: Plan,
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
    /// An empty batch, 16 columns wide; its inputs are those of an empty step
    /// (`kv_indptr == [0]`).
    pub fn new() -> Batch {
        let mut inputs = Plan::new();
        inputs.clear();
        Batch {
            ids: Vec::new(),
            row_of: HashMap::new(),
            versions: Vec::new(),
            places: Vec::new(),
            pages: Vec::new(),
            width: MIN_WIDTH,
            table: Vec::new(),
            updates: TableUpdates::default(),
            inputs,
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
        self.versions.push(0);
        self.places.push(None);
        self.pages.push(0);
        self.table.resize(self.table.len() + self.width, PAD);
        self.inputs.clear();
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
        let moved = self.pages[last];
        if row != last {
            for col in 0..moved.max(self.pages[row]) {
                let value = if col < moved {
                    self.table[last * self.width + col]
                } else {
                    PAD
                };
                self.set(row, col, value);
            }
            self.ids[row] = self.ids[last];
            self.versions[row] = self.versions[last];
            self.places[row] = self.places[last];
            self.pages[row] = moved;
            self.row_of.insert(self.ids[row], row);
        }
        // The vacated row is cleared (and logged), so a copy's rows past the length stay -1.
        for col in 0..moved {
            self.set(last, col, PAD);
        }
        self.ids.pop();
        self.versions.pop();
        self.places.pop();
        self.pages.pop();
        self.table.truncate(self.ids.len() * self.width);
        self.inputs.clear();
        Ok(())
    }

    /// Removes every row.
    pub fn clear(&mut self) {
        self.ids.clear();
        self.row_of.clear();
        self.versions.clear();
        self.places.clear();
        self.pages.clear();
        self.table.clear();
        self.log_full();
        self.inputs.clear();
    }

    /// Columns of the block table (at least 16, a power of two).
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
    /// from the table: [`Batch::write_kv_indices`]): one query token per row after a decode
    /// step, each row's appended tokens after a verify step. Empty after a row was added or
    /// removed, until the next step.
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

    /// Widens the table, before a step changes anything, so every row fits `pages` entries.
    /// Fails, leaving the batch as it was, when the wider table cannot be allocated.
    pub(crate) fn fit(&mut self, pages: usize) -> Result<(), Error> {
        if pages <= self.width {
            return Ok(());
        }
        let width = pages.next_power_of_two().max(2 * self.width);
        let entries = self.ids.len().saturating_mul(width);
        let mut table = Vec::new();
        table
            .try_reserve_exact(entries)
            .map_err(|_| Error::TooLarge {
                what: format!(
                    "the batch's block table of {} rows x {width} blocks",
                    self.ids.len()
                ),
            })?;
        for (&pages, old) in self.pages.iter().zip(self.table.chunks(self.width)) {
            table.extend_from_slice(&old[..pages]);
            table.resize(table.len() + width - pages, PAD);
        }
        self.table = table;
        self.width = width;
        self.log_full();
        Ok(())
    }

    /// Starts a step's inputs for every row: `queries` query tokens in all, blocks of `bs`
    /// tokens.
    pub(crate) fn begin(&mut self, queries: usize, bs: BlockSize) {
        let (n, inputs) = (self.ids.len(), &mut self.inputs);
        inputs.clear();
        inputs.block_size = bs.get() as u32;
        inputs.qo_indptr.resize(n + 1, 0);
        inputs.kv_indptr.resize(n + 1, 0);
        inputs.kv_last_page_len.resize(n, 0);
        inputs.positions.resize(queries, 0);
        inputs.slot_mapping.resize(queries, 0);
    }

    /// Writes row `row`'s inputs for its sequence of `len` tokens in `blocks` (logical blocks
    /// `first_block..`, a table of version `version`), the last `q` of them queries, after rows `0..row`, and makes its
    /// table row mirror `blocks`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &mut self,
        row: usize,
        blocks: &[BlockId],
        first_block: usize,
        version: u64,
        len: usize,
        q: usize,
        bs: BlockSize,
    ) {
        self.sync_row(row, blocks, version);
        let inputs = &mut self.inputs;
        inputs.kv_indptr[row + 1] = inputs.kv_indptr[row] + blocks.len() as i32;
        inputs.kv_last_page_len[row] = bs.offset(len - 1) as i32 + 1;
        let first = inputs.qo_indptr[row] as usize;
        inputs.qo_indptr[row + 1] = (first + q) as i32;
        for (i, position) in (len - q..len).enumerate() {
            let slot =
                blocks[bs.index(position) - first_block] as usize * bs.get() + bs.offset(position);
            inputs.positions[first + i] = position as i32;
            inputs.slot_mapping[first + i] = slot as i32;
        }
    }

    /// After a rollback left `blocks` (version `version`) of a table of version `before`:
    /// a row that mirrored `before` clears its entries past them and mirrors `version`; any
    /// other row is copied whole by the next step.
    pub(crate) fn trim_row(&mut self, row: usize, blocks: &[BlockId], before: u64, version: u64) {
        if self.versions[row] != before {
            return;
        }
        for col in blocks.len()..self.pages[row] {
            self.set(row, col, PAD);
        }
        self.pages[row] = self.pages[row].min(blocks.len());
        self.versions[row] = version;
    }

    /// Makes row `row` mirror `blocks`, a table of version `version`: only the entries past
    /// those it has when it already mirrors that version, else the whole row.
    #[inline(always)]
    fn sync_row(&mut self, row: usize, blocks: &[BlockId], version: u64) {
        debug_assert!(blocks.len() <= self.width, "fit() widened the table");
        let pages = self.pages[row];
        let from = if self.versions[row] == version {
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
        self.versions[row] = version;
        self.pages[row] = blocks.len();
    }

    /// Writes one entry, logging it if it changed.
    #[inline(always)]
    fn set(&mut self, row: usize, col: usize, value: i32) {
        let at = row * self.width + col;
        if self.table[at] == value {
            return;
        }
        self.table[at] = value;
        let updates = &mut self.updates;
        if updates.full {
            return;
        }
        // Past half the table, copying the whole of it is cheaper than the scatter.
        if updates.index.len() >= self.table.len() / 2 {
            self.log_full();
            return;
        }
        updates.index.push(at as i64);
        updates.blocks.push(value);
    }

    fn log_full(&mut self) {
        self.updates.full = true;
        self.updates.index.clear();
        self.updates.blocks.clear();
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
        assert_eq!(batch.width(), MIN_WIDTH);
        batch.add(7).unwrap();
        batch.add(9).unwrap();
        assert!(batch.add(7).is_err());
        batch.fit(3).unwrap();
        assert_eq!(batch.width(), MIN_WIDTH);
        batch.sync_row(0, &[4, 5], 1);
        batch.sync_row(1, &[8], 1);
        assert_eq!(batch.updates().index, vec![0, 1, 16]);
        batch.clear_updates();
        // Same version, one more block: one entry.
        batch.sync_row(0, &[4, 5, 6], 1);
        assert_eq!(batch.updates().index, vec![2]);
        assert_eq!(batch.updates().blocks, vec![6]);
        batch.clear_updates();
        // A new version (a copy on write, or another sequence): the whole row, only the entries
        // that differ logged, and the shorter row padded.
        batch.sync_row(0, &[4, 3], 2);
        assert_eq!(batch.updates().index, vec![1, 2]);
        assert_eq!(batch.updates().blocks, vec![3, -1]);
        assert_eq!(&entries(&batch)[0][..4], &[4, 3, -1, -1]);
        // Past half the table, the log is full.
        batch.add(11).unwrap();
        batch.clear_updates();
        batch.sync_row(2, &[7, 2], 3);
        assert_eq!(batch.updates().index, vec![32, 33]);
        let mut two = batch_of(&[1, 2], 1);
        let ten: Vec<BlockId> = (0..10).collect();
        two.sync_row(0, &ten, 1);
        assert_eq!(two.updates().index.len(), 10);
        two.sync_row(1, &ten, 2);
        assert!(two.updates().full && two.updates().index.is_empty());
        assert_eq!(&entries(&two)[1][..11], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1]);
    }

    #[test]
    fn removing_moves_the_last_row_into_the_hole() {
        let mut batch = batch_of(&[1, 2, 3], 4);
        batch.sync_row(0, &[1, 1, 1], 1);
        batch.sync_row(1, &[2], 1);
        batch.sync_row(2, &[3, 3], 1);
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
        let bs = BlockSize::new(4);
        batch.begin(2, bs);
        for row in 0..2 {
            batch.push(row, &[row as BlockId], 0, 1, 2, 1, bs);
        }
        assert_eq!(batch.inputs().slot_mapping, vec![1, 5]);
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
        batch.sync_row(0, &[5, 6], 1);
        batch.sync_row(1, &[7], 1);
        batch.fit(40).unwrap();
        assert_eq!(batch.width(), 64);
        let rows = entries(&batch);
        assert_eq!(&rows[0][..3], &[5, 6, -1]);
        assert_eq!(&rows[1][..2], &[7, -1]);
        assert!(rows[1][2..].iter().all(|&b| b == -1));
        assert!(batch.updates().full);
    }
}
