//! The decode loop the step benches time: 256 running sequences of ~500-token prompts,
//! prefilled, that decode up to `MAX_STEPS` tokens each and are then freed and replaced outside
//! the timed part.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tokens::Tokens;
use crate::BLOCK_SIZE;
use pagedkv::{Batch, BlockManager, Plan, SeqId, Token};

/// Sequences in the batch.
const BATCH: usize = 256;
/// Prompt tokens of each sequence (give or take 8).
const PROMPT: usize = 500;
/// Decode steps before the batch is replaced.
const MAX_STEPS: usize = 256;

/// How a step is taken: the one-shot `step` into a `Plan` (the whole CSR each step), or
/// `step_batch` on a persistent `Batch` (only what changed).
#[derive(Clone, Copy)]
pub enum Stepping {
    OneShot,
    Persistent,
}

/// A decode batch on a manager, stepped by the benches.
pub struct Decoding {
    mgr: Arc<BlockManager>,
    seqs: Vec<SeqId>,
    plan: Plan,
    batch: Batch,
    tokens: Tokens,
    next_id: SeqId,
    steps: usize,
}

impl Decoding {
    /// Blocks the batch holds at most: a manager with twice as many keeps freed blocks cached
    /// (so steps evict, as in a serving steady state).
    pub fn blocks() -> u32 {
        let per_seq = (PROMPT + MAX_STEPS).div_ceil(BLOCK_SIZE as usize) as u32 + 1;
        BATCH as u32 * per_seq
    }

    /// A prefilled batch on `mgr` (of the bench's `BLOCK_SIZE`).
    pub fn new(mgr: Arc<BlockManager>) -> Decoding {
        let mut decoding = Decoding {
            mgr,
            seqs: Vec::new(),
            plan: Plan::new(),
            batch: Batch::new(),
            tokens: Tokens::new(2),
            next_id: 0,
            steps: 0,
        };
        decoding.admit();
        decoding
    }

    /// Frees the running sequences, then admits and prefills a new batch of them.
    fn admit(&mut self) {
        for &s in &self.seqs {
            self.mgr.free(s).unwrap();
        }
        self.batch.clear();
        let mut lens = Vec::with_capacity(BATCH);
        self.seqs = (0..BATCH)
            .map(|i| {
                self.next_id += 1;
                // Prompt lengths vary a little so last pages fill at different steps.
                let prompt = self.tokens.take(PROMPT - 8 + i % 16);
                self.mgr.allocate(self.next_id, &prompt, None).unwrap();
                lens.push(prompt.len() as u32);
                self.batch.add(self.next_id).unwrap();
                self.next_id
            })
            .collect();
        self.mgr.plan(&self.seqs, &lens, &mut self.plan).unwrap();
        self.steps = 0;
    }

    /// One decode step of every sequence.
    fn step(&mut self, how: Stepping, tokens: &[Token]) {
        match how {
            Stepping::OneShot => self.mgr.step(&self.seqs, tokens, &mut self.plan),
            Stepping::Persistent => {
                let stepped = self.mgr.step_batch(&mut self.batch, tokens);
                // A device copy of the table would take the log here.
                self.batch.clear_updates();
                stepped
            }
        }
        .unwrap();
    }

    /// Counts `steps` more steps of the running batch, replacing it once it took its last.
    fn advance(&mut self, steps: usize) {
        self.steps += steps;
        if self.steps == MAX_STEPS {
            self.admit();
        }
    }

    /// Runs `iters` decode steps; returns the time spent stepping. Re-admissions and each
    /// batch's first step, which commits its prefill (registers every prompt block), are not
    /// timed.
    pub fn time(&mut self, iters: u64, how: Stepping) -> Duration {
        let mut elapsed = Duration::ZERO;
        let mut left = iters as usize;
        while left > 0 {
            let tokens = self.tokens.take(BATCH);
            if self.steps == 0 {
                self.step(how, &tokens);
                self.advance(1);
                continue;
            }
            let chunk = left.min(MAX_STEPS - self.steps);
            let start = Instant::now();
            for _ in 0..chunk {
                self.step(how, &tokens);
            }
            elapsed += start.elapsed();
            black_box((&self.plan, &self.batch));
            left -= chunk;
            self.advance(chunk);
        }
        elapsed
    }
}
