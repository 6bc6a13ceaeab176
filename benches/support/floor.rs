//! The memory-bound floor of a decode step, measured on the same machine as the step.

use std::hint::black_box;
use std::time::{Duration, Instant};

use crate::decoding::{Decoding, BATCH, MAX_STEPS};
use crate::splitmix64::SplitMix64;
use crate::BLOCK_SIZE;
use pagedkv::Token;

/// The least memory traffic of a decode step, in the layout a manager needs anyway: each
/// sequence's tokens and block table in allocations of their own, one token appended and the
/// last block read per sequence, a new block recorded every `BLOCK_SIZE` tokens, and the four
/// per-sequence arrays of the attention inputs written. No bookkeeping, hashing or locking.
/// With a [`Registry`], also what prefix caching must touch, as the manager's steps do it.
pub struct Floor {
    tokens: Vec<Vec<Token>>,
    tables: Vec<Vec<u32>>,
    inputs: [Vec<i32>; 4],
    registry: Option<Registry>,
    /// Each sequence's tokens and blocks when the batch was prefilled.
    prompt_lens: Vec<usize>,
    table_lens: Vec<usize>,
    /// Steps taken since the batch was prefilled (as `Decoding` counts them).
    steps: usize,
}

/// The least memory traffic of prefix caching, in structures of the manager's sizes: a new block
/// evicts a cached one (reads its key, clears its map slot), and a filled block is registered
/// (its key, parent and chaining value written in one line, its tokens in another, its map slot
/// set). The first step of a batch registers every prompt's full blocks, as the manager's
/// first step commits the prefill. Keys are drawn at random (no hashing), blocks are evicted in
/// a fixed random order, and nothing is locked or linked.
pub struct Registry {
    registrations: Vec<Registration>,
    /// The map: two slots per block, each a block id and the key's low half.
    slots: Vec<u64>,
    evictions: Vec<u32>,
    next_eviction: usize,
    keys: SplitMix64,
}

/// A block's registration: key, parent key and chaining value in one cache line, its tokens in
/// the next (one 128-byte unit, as the manager lays them out).
#[derive(Clone, Copy)]
#[repr(C, align(128))]
struct Registration {
    line: [u64; 8],
    tokens: [Token; BLOCK_SIZE as usize],
}

impl Registry {
    /// A registry of `num_blocks` blocks, every one cached (registered under a random key).
    pub fn new(num_blocks: u32) -> Registry {
        let n = num_blocks as usize;
        let mut keys = SplitMix64(7);
        let mut evictions: Vec<u32> = (0..num_blocks).collect();
        for i in (1..n).rev() {
            evictions.swap(i, keys.next() as usize % (i + 1));
        }
        let mut registry = Registry {
            registrations: vec![
                Registration {
                    line: [0; 8],
                    tokens: [0; BLOCK_SIZE as usize],
                };
                n
            ],
            slots: vec![u64::MAX; (2 * n).next_power_of_two()],
            evictions,
            next_eviction: 0,
            keys,
        };
        for block in 0..num_blocks {
            registry.register(block, &[0; BLOCK_SIZE as usize]);
        }
        registry
    }

    fn slot(&self, key: u64) -> usize {
        key as usize & (self.slots.len() - 1)
    }

    /// The next cached block, evicted: its key read and its map slot cleared.
    fn evict(&mut self) -> u32 {
        let block = self.evictions[self.next_eviction];
        self.next_eviction = (self.next_eviction + 1) % self.evictions.len();
        let slot = self.slot(self.registrations[block as usize].line[0]);
        self.slots[slot] = u64::MAX;
        block
    }

    /// Registers `block`: its line (the key stands for all of it), its tokens, its map slot.
    fn register(&mut self, block: u32, tokens: &[Token]) {
        let key = self.keys.next();
        let registration = &mut self.registrations[block as usize];
        registration.line = [key; 8];
        registration.tokens.copy_from_slice(tokens);
        let slot = self.slot(key);
        self.slots[slot] = key << 32 | u64::from(block);
    }
}

impl Floor {
    /// The batch's sequences as `decoding` has them, as if just prefilled (a batch's first step
    /// registers their full blocks), with prefix caching's traffic if `registry` is given.
    pub fn new(decoding: &Decoding, registry: Option<Registry>) -> Floor {
        let tokens: Vec<Vec<Token>> = decoding
            .seqs
            .iter()
            .map(|&s| {
                let mut t = decoding.mgr.tokens(s).unwrap();
                t.reserve(2 * MAX_STEPS);
                t
            })
            .collect();
        let tables: Vec<Vec<u32>> = decoding
            .seqs
            .iter()
            .map(|&s| {
                let mut t = decoding.mgr.block_table(s).unwrap();
                t.reserve(MAX_STEPS);
                t
            })
            .collect();
        Floor {
            prompt_lens: tokens.iter().map(Vec::len).collect(),
            table_lens: tables.iter().map(Vec::len).collect(),
            tokens,
            tables,
            inputs: std::array::from_fn(|_| Vec::with_capacity(BATCH + 1)),
            registry,
            steps: 0,
        }
    }

    /// Times `iters` floor steps; after `MAX_STEPS` of them the batch starts over, as
    /// `Decoding` replaces its batch (lengths reset outside the timed part).
    pub fn time(&mut self, iters: u64) -> Duration {
        let mut elapsed = Duration::ZERO;
        let mut left = iters as usize;
        while left > 0 {
            let chunk = left.min(MAX_STEPS - self.steps);
            let start = Instant::now();
            if self.steps == 0 {
                self.register_prompts();
            }
            for step in 0..chunk {
                self.step(step as Token);
            }
            elapsed += start.elapsed();
            left -= chunk;
            self.steps += chunk;
            if self.steps == MAX_STEPS {
                self.start_over();
            }
        }
        elapsed
    }

    /// Times the first step of `iters` fresh batches, as `Decoding::time_first_steps` times the
    /// manager's: the prefill's registrations, every row's table written out in one array (the
    /// batch's table, filled by a first step), and the step's own traffic. Each batch starts
    /// over untimed.
    pub fn time_first_steps(&mut self, iters: u64) -> Duration {
        let mut table = Vec::with_capacity(self.tables.iter().map(Vec::len).sum::<usize>() + BATCH);
        let mut elapsed = Duration::ZERO;
        for _ in 0..iters {
            self.start_over();
            table.clear();
            let start = Instant::now();
            self.register_prompts();
            for row in &self.tables {
                table.extend_from_slice(row);
            }
            self.step(0);
            elapsed += start.elapsed();
            black_box(&table);
            self.steps = 1;
        }
        elapsed
    }

    /// Cuts every sequence back to its prompt: a new batch, whose first step registers them.
    fn start_over(&mut self) {
        self.steps = 0;
        for (t, &n) in self.tokens.iter_mut().zip(&self.prompt_lens) {
            t.truncate(n);
        }
        for (t, &n) in self.tables.iter_mut().zip(&self.table_lens) {
            t.truncate(n);
        }
    }

    /// The prefill's registrations: every prompt's full blocks.
    fn register_prompts(&mut self) {
        let Some(registry) = &mut self.registry else {
            return;
        };
        let bs = BLOCK_SIZE as usize;
        let prompts = self.tokens.iter().zip(&self.tables).zip(&self.prompt_lens);
        for ((tokens, table), &len) in prompts {
            for (&block, tokens) in table.iter().zip(tokens[..len].chunks_exact(bs)) {
                registry.register(block, tokens);
            }
        }
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
                table.push(match &mut self.registry {
                    Some(registry) => registry.evict(),
                    None => len as u32,
                });
            } else if let (0, Some(registry)) = (len % bs, &mut self.registry) {
                let block = *table.last().unwrap();
                registry.register(block, &tokens[len - bs..]);
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
