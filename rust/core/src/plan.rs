//! The per-step attention plan: FlashInfer's paged-KV CSR plus slot mapping and positions, built
//! in one pass into buffers reused across steps. The padded block table some kernels take is
//! derived from the CSR on request, never built by default: it is `batch x longest`, which one
//! long sequence makes huge.

use std::collections::TryReserveError;

use crate::block::BlockSize;
use crate::config::Attention;
use crate::BlockId;

/// Inputs of one attention step for a batch, in batch order. All arrays are int32.
///
/// For sequence `b`: its KV pages are `kv_indices[kv_indptr[b]..kv_indptr[b+1]]`, the last page
/// holds `kv_last_page_len[b]` tokens (`1..=block_size`), its query tokens are
/// `qo_indptr[b]..qo_indptr[b+1]` with `positions` and KV `slot_mapping`
/// (`block * block_size + offset`). `block_size` is that of the manager that wrote the plan, so
/// a consumer can refuse a plan meant for another cache layout.
///
/// With windowed `attention`, a sequence's pages start at the first block its queries still
/// read (a block boundary, and a chunk boundary for chunked attention), so its `kv_len` keys
/// are its last ones: key `j` is at position `len - kv_len + j`, `len` being one past its last
/// query's position.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// `[B + 1]` offsets into `kv_indices`.
    pub kv_indptr: Vec<i32>,
    /// `[nnz]` physical blocks of every sequence, concatenated.
    pub kv_indices: Vec<i32>,
    /// `[B]` tokens in each sequence's last block.
    pub kv_last_page_len: Vec<i32>,
    /// `[B + 1]` offsets of each sequence's query tokens.
    pub qo_indptr: Vec<i32>,
    /// `[num_query_tokens]` KV slot of each new token; -1 for a token whose KV is cached
    /// already (a state group recomputing its state over a KV hit): write nothing for it.
    pub slot_mapping: Vec<i32>,
    /// `[num_query_tokens]` position of each new token in its sequence.
    pub positions: Vec<i32>,
    /// `[n, 2]` row-major copy-on-write pairs `(src, dst)` this batch must apply to the KV
    /// cache, in order, before its forward pass writes any KV.
    pub copies: Vec<i32>,
    /// Token slots per block of the manager that wrote the plan (0 before the first write).
    pub block_size: u32,
    /// What the queries attend to (the manager's [`Attention`]).
    pub attention: Attention,
    /// `[B]` each row's recurrent-state slot (a hybrid manager with a state group writes the
    /// `state_*` fields into group 0's plan; they are empty otherwise).
    pub state_slots: Vec<i32>,
    /// `[n, 2]` row-major state copies `(src, dst)` to apply, in order, before the pass.
    pub state_copies: Vec<i32>,
    /// `[n]` state slots to reset to the initial state before the pass (after the copies).
    pub state_resets: Vec<i32>,
    /// `[n, 3]` row-major `(row, tokens, slot)`: during the pass, save row `row`'s state after
    /// its first `tokens` query tokens into `slot` (a checkpoint once the pass is committed).
    pub state_saves: Vec<i32>,
}

impl Plan {
    /// An empty plan; pass it to `step` or `plan` again and again to reuse its buffers.
    pub fn new() -> Plan {
        Plan::default()
    }

    /// Number of sequences in the batch.
    pub fn batch_size(&self) -> usize {
        self.kv_last_page_len.len()
    }

    /// Total query tokens of the batch.
    pub fn num_query_tokens(&self) -> usize {
        self.positions.len()
    }

    /// Pages of the longest sequence: the width of [`Plan::block_tables`].
    pub fn max_blocks(&self) -> usize {
        self.kv_indptr
            .windows(2)
            .map(|row| (row[1] - row[0]) as usize)
            .max()
            .unwrap_or(0)
    }

    /// The `[B, max_blocks]` row-major block tables padded with -1, for kernels that take them
    /// instead of the CSR. Built on each call; fails, rather than aborting, when `B x
    /// max_blocks` entries cannot be allocated.
    pub fn block_tables(&self) -> Result<Vec<i32>, TryReserveError> {
        let width = self.max_blocks();
        let mut tables = Vec::new();
        tables.try_reserve_exact(self.batch_size().saturating_mul(width))?;
        for row in self.kv_indptr.windows(2) {
            let pages = &self.kv_indices[row[0] as usize..row[1] as usize];
            tables.extend_from_slice(pages);
            tables.extend(std::iter::repeat_n(-1, width - pages.len()));
        }
        Ok(tables)
    }

    /// Clears the buffers for a batch of `batch_size` sequences of blocks of `bs` tokens and
    /// reserves room for `nnz` pages (the sum over the batch) and `num_query_tokens` query
    /// tokens (more is fine, just slower).
    pub(crate) fn begin(
        &mut self,
        batch_size: usize,
        nnz: usize,
        num_query_tokens: usize,
        bs: BlockSize,
    ) {
        self.clear();
        for (buffer, len) in [
            (&mut self.kv_indptr, batch_size + 1),
            (&mut self.kv_indices, nnz),
            (&mut self.kv_last_page_len, batch_size),
            (&mut self.qo_indptr, batch_size + 1),
            (&mut self.slot_mapping, num_query_tokens),
            (&mut self.positions, num_query_tokens),
        ] {
            buffer.reserve(len);
        }
        self.block_size = bs.get() as u32;
    }

    /// Empties the plan to a batch of no sequences, keeping its block size.
    pub(crate) fn clear(&mut self) {
        for buffer in [
            &mut self.kv_indptr,
            &mut self.kv_indices,
            &mut self.kv_last_page_len,
            &mut self.qo_indptr,
            &mut self.slot_mapping,
            &mut self.positions,
            &mut self.copies,
            &mut self.state_slots,
            &mut self.state_copies,
            &mut self.state_resets,
            &mut self.state_saves,
        ] {
            buffer.clear();
        }
        self.kv_indptr.push(0);
        self.qo_indptr.push(0);
    }

    /// Adds the next sequence: `kv_len` tokens in `table` (logical blocks `first..`), the last
    /// `query_len` of them new.
    pub(crate) fn push(
        &mut self,
        table: &[BlockId],
        first: usize,
        kv_len: usize,
        query_len: usize,
        bs: BlockSize,
    ) {
        debug_assert_eq!(
            bs.get(),
            self.block_size as usize,
            "begun with another size"
        );
        let pages = bs.pages(kv_len);
        let table = &table[..pages - first];
        self.kv_indices.extend(table.iter().map(|&b| b as i32));
        self.kv_indptr.push(self.kv_indices.len() as i32);
        self.kv_last_page_len
            .push((kv_len - (pages - 1) * bs.get()) as i32);
        let start = kv_len - query_len;
        if query_len == 1 {
            // A decode query: one position, one slot.
            self.positions.push(start as i32);
            let block = table[bs.index(start) - first] as usize;
            self.slot_mapping
                .push((block * bs.get() + bs.offset(start)) as i32);
        } else {
            self.positions.extend((start..kv_len).map(|p| p as i32));
            // Block by block: each block's slots are a range, which extends like a `memcpy`.
            let mut p = start;
            while p < kv_len {
                let end = kv_len.min((bs.index(p) + 1) * bs.get());
                let slot = table[bs.index(p) - first] as usize * bs.get() + bs.offset(p);
                self.slot_mapping
                    .extend((slot..slot + (end - p)).map(|s| s as i32));
                p = end;
            }
        }
        self.qo_indptr.push(self.positions.len() as i32);
    }

    /// Adds a copy-on-write pair the batch must apply first.
    pub(crate) fn push_copy(&mut self, src: BlockId, dst: BlockId) {
        self.copies.extend([src as i32, dst as i32]);
    }

    /// Number of copy-on-write pairs in `copies`.
    pub fn num_copies(&self) -> usize {
        self.copies.len() / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_sequences_by_hand() {
        let mut plan = Plan::new();
        let bs = BlockSize::new(4);
        plan.begin(2, 4, 5, bs);
        plan.push(&[7, 2, 5], 0, 9, 2, bs); // positions 7, 8 in blocks 2 and 5
        plan.push(&[1], 0, 3, 3, bs);
        assert_eq!(plan.block_size, 4);
        assert_eq!(plan.kv_indptr, vec![0, 3, 4]);
        assert_eq!(plan.kv_indices, vec![7, 2, 5, 1]);
        assert_eq!(plan.kv_last_page_len, vec![1, 3]);
        assert_eq!(plan.qo_indptr, vec![0, 2, 5]);
        assert_eq!(plan.positions, vec![7, 8, 0, 1, 2]);
        assert_eq!(plan.slot_mapping, vec![2 * 4 + 3, 5 * 4, 4, 5, 6]);
        assert_eq!(plan.max_blocks(), 3);
        assert_eq!(plan.block_tables().unwrap(), vec![7, 2, 5, 1, -1, -1]);
        assert_eq!(plan.batch_size(), 2);
        assert_eq!(plan.num_query_tokens(), 5);
    }

    #[test]
    fn an_empty_plan_has_empty_tables() {
        let plan = Plan::new();
        assert_eq!(plan.max_blocks(), 0);
        assert!(plan.block_tables().unwrap().is_empty());
    }

    #[test]
    fn pages_are_reserved_by_their_sum() {
        // One long sequence and many short ones: room for the pages they have, not for
        // batch x longest.
        let mut plan = Plan::new();
        let bs = BlockSize::new(1);
        let long: Vec<BlockId> = (0..1000).collect();
        plan.begin(101, 1100, 101, bs);
        plan.push(&long, 0, 1000, 1, bs);
        for b in 0..100 {
            plan.push(&[b], 0, 1, 1, bs);
        }
        assert_eq!(plan.kv_indices.len(), 1100);
        assert!(plan.kv_indices.capacity() < 101 * 1000);
        assert_eq!(plan.block_tables().unwrap().len(), 101 * 1000);
    }
}
