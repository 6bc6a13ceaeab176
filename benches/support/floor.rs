//! The memory-bound floor of a decode step, measured on the same machine as the step.

use std::hint::black_box;
use std::time::{Duration, Instant};

use crate::decoding::{Decoding, BATCH, MAX_STEPS};
use crate::BLOCK_SIZE;
use pagedkv::Token;

/// The least memory traffic of a decode step, in the layout a manager needs anyway: each
/// sequence's tokens and block table in allocations of their own, one token appended and the
/// last block read per sequence, a new block recorded every `BLOCK_SIZE` tokens, and the four
/// per-sequence arrays of the attention inputs written. No bookkeeping, hashing or locking.
pub struct Floor {
    tokens: Vec<Vec<Token>>,
    tables: Vec<Vec<u32>>,
    inputs: [Vec<i32>; 4],
}

impl Floor {
    /// The batch's sequences as of `decoding` (same lengths).
    pub fn new(decoding: &Decoding) -> Floor {
        let tokens: Vec<Vec<Token>> = decoding
            .seqs
            .iter()
            .map(|&s| {
                let mut t = decoding.mgr.tokens(s).unwrap();
                t.reserve(2 * MAX_STEPS);
                t
            })
            .collect();
        let tables = decoding
            .seqs
            .iter()
            .map(|&s| {
                let mut t = decoding.mgr.block_table(s).unwrap();
                t.reserve(MAX_STEPS);
                t
            })
            .collect();
        Floor {
            tokens,
            tables,
            inputs: std::array::from_fn(|_| Vec::with_capacity(BATCH + 1)),
        }
    }

    /// Times `iters` floor steps (lengths reset outside the timed part).
    pub fn time(&mut self, iters: u64) -> Duration {
        let mut elapsed = Duration::ZERO;
        let mut left = iters as usize;
        let token_lens: Vec<usize> = self.tokens.iter().map(Vec::len).collect();
        let table_lens: Vec<usize> = self.tables.iter().map(Vec::len).collect();
        while left > 0 {
            let chunk = left.min(MAX_STEPS);
            let start = Instant::now();
            for step in 0..chunk {
                self.step(step as Token);
            }
            elapsed += start.elapsed();
            left -= chunk;
            for (t, &n) in self.tokens.iter_mut().zip(&token_lens) {
                t.truncate(n);
            }
            for (t, &n) in self.tables.iter_mut().zip(&table_lens) {
                t.truncate(n);
            }
        }
        elapsed
    }

    fn step(&mut self, token: Token) {
        let bs = BLOCK_SIZE as usize;
        for input in &mut self.inputs {
            input.clear();
        }
        for (tokens, table) in self.tokens.iter_mut().zip(&mut self.tables) {
            tokens.push(black_box(token));
            let len = tokens.len();
            if len % bs == 1 {
                table.push(len as u32);
            }
            let last = *table.last().unwrap() as i32;
            let [positions, slots, pages, last_len] = &mut self.inputs;
            positions.push(len as i32 - 1);
            slots.push(last * bs as i32 + ((len - 1) % bs) as i32);
            pages.push(table.len() as i32);
            last_len.push(((len - 1) % bs) as i32 + 1);
        }
        black_box(&self.inputs);
    }
}
