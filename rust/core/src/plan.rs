//! The per-step attention plan: FlashInfer's paged-KV CSR plus slot mapping, positions and a
//! padded block table, built in one pass into buffers reused across steps.

use crate::block::BlockSize;
use crate::BlockId;

/// Inputs of one attention step for a batch, in batch order. All arrays are int32.
///
/// For sequence `b`: its KV pages are `kv_indices[kv_indptr[b]..kv_indptr[b+1]]`, the last page
/// holds `kv_last_page_len[b]` tokens (`1..=block_size`), its query tokens are
/// `qo_indptr[b]..qo_indptr[b+1]` with `positions` and KV `slot_mapping`
/// (`block * block_size + offset`), and `block_tables[b * max_blocks..][..max_blocks]` is its
/// block table padded with -1.
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
    /// `[num_query_tokens]` KV slot of each new token.
    pub slot_mapping: Vec<i32>,
    /// `[num_query_tokens]` position of each new token in its sequence.
    pub positions: Vec<i32>,
    /// `[B, max_blocks]` row-major block tables padded with -1.
    pub block_tables: Vec<i32>,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    /// `[n, 2]` row-major copy-on-write pairs `(src, dst)` this batch must apply to the KV
    /// cache, in order, before its forward pass writes any KV.
    pub copies: Vec<i32>,
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

    /// Clears the buffers for a batch of `batch_size` sequences and reserves room for `nnz`
    /// pages and `num_query_tokens` query tokens (more is fine, just slower).
    pub(crate) fn begin(&mut self, batch_size: usize, nnz: usize, num_query_tokens: usize) {
        for (buffer, len) in [
            (&mut self.kv_indptr, batch_size + 1),
            (&mut self.kv_indices, nnz),
            (&mut self.kv_last_page_len, batch_size),
            (&mut self.qo_indptr, batch_size + 1),
            (&mut self.slot_mapping, num_query_tokens),
            (&mut self.positions, num_query_tokens),
            (&mut self.block_tables, 0),
            (&mut self.copies, 0),
        ] {
            buffer.clear();
            buffer.reserve(len);
        }
        self.kv_indptr.push(0);
        self.qo_indptr.push(0);
        self.max_blocks = 0;
    }

    /// Adds the next sequence: `kv_len` tokens in `table`, the last `query_len` of them new.
    pub(crate) fn push(
        &mut self,
        table: &[BlockId],
        kv_len: usize,
        query_len: usize,
        bs: BlockSize,
    ) {
        let pages = bs.pages(kv_len);
        let table = &table[..pages];
        self.kv_indices.extend(table.iter().map(|&b| b as i32));
        self.kv_indptr.push(self.kv_indices.len() as i32);
        self.kv_last_page_len
            .push((kv_len - (pages - 1) * bs.get()) as i32);
        for p in kv_len - query_len..kv_len {
            self.positions.push(p as i32);
            let block = table[bs.index(p)] as usize;
            self.slot_mapping
                .push((block * bs.get() + bs.offset(p)) as i32);
        }
        self.qo_indptr.push(self.positions.len() as i32);
        self.max_blocks = self.max_blocks.max(pages);
    }

    /// Adds a copy-on-write pair the batch must apply first.
    pub(crate) fn push_copy(&mut self, src: BlockId, dst: BlockId) {
        self.copies.extend([src as i32, dst as i32]);
    }

    /// Number of copy-on-write pairs in `copies`.
    pub fn num_copies(&self) -> usize {
        self.copies.len() / 2
    }

    /// Builds the padded block tables from the pages, once every sequence is in.
    pub(crate) fn finish(&mut self) {
        let width = self.max_blocks;
        self.block_tables.reserve(self.batch_size() * width);
        for row in self.kv_indptr.windows(2) {
            let pages = &self.kv_indices[row[0] as usize..row[1] as usize];
            self.block_tables.extend_from_slice(pages);
            self.block_tables
                .extend(std::iter::repeat_n(-1, width - pages.len()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_sequences_by_hand() {
        let mut plan = Plan::new();
        plan.begin(2, 4, 5);
        plan.push(&[7, 2, 5], 9, 2, BlockSize::new(4)); // positions 7, 8 in blocks 2 and 5
        plan.push(&[1], 3, 3, BlockSize::new(4));
        plan.finish();
        assert_eq!(plan.kv_indptr, vec![0, 3, 4]);
        assert_eq!(plan.kv_indices, vec![7, 2, 5, 1]);
        assert_eq!(plan.kv_last_page_len, vec![1, 3]);
        assert_eq!(plan.qo_indptr, vec![0, 2, 5]);
        assert_eq!(plan.positions, vec![7, 8, 0, 1, 2]);
        assert_eq!(plan.slot_mapping, vec![2 * 4 + 3, 5 * 4, 4, 5, 6]);
        assert_eq!(plan.block_tables, vec![7, 2, 5, 1, -1, -1]);
        assert_eq!(plan.batch_size(), 2);
        assert_eq!(plan.num_query_tokens(), 5);
    }
}
