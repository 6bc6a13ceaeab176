//! The decode loop the step benches time: 256 running sequences of ~500-token prompts,
//! prefilled, that grow by up to `MAX_GROWTH` tokens each and are then freed and replaced
//! outside the timed part. A speculative verify step appends `DRAFTS + 1` tokens per row and
//! rolls back a pseudo-random number of them.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::splitmix64::SplitMix64;
use crate::tokens::Tokens;
use crate::BLOCK_SIZE;
use pagedkv::{Batch, BlockManager, HybridManager, Plan, SeqId, Token};

/// Sequences in the batch.
const BATCH: usize = 256;
/// Prompt tokens of each sequence (give or take 8).
const PROMPT: usize = 500;
/// Tokens a sequence may grow by (appended, before any rollback) before the batch is replaced.
const MAX_GROWTH: usize = 256;
/// Draft tokens per row of a verify step.
const DRAFTS: usize = 4;

/// How a step is taken: the one-shot `step` into a `Plan` (the whole CSR each step),
/// `step_batch` on a persistent `Batch` (only what changed), or a speculative verify step on
/// the `Batch`: `verify_batch` of each row's last token and `DRAFTS` drafts, then
/// `rollback_batch` of 0..=`DRAFTS` rejected drafts per row.
#[derive(Clone, Copy, PartialEq)]
pub enum Stepping {
    OneShot,
    Persistent,
    #[allow(dead_code)] // each bench includes this file; the admission bench does not verify
    Verify,
}

impl Stepping {
    /// Tokens a row appends in a step.
    fn tokens(self) -> usize {
        if self == Stepping::Verify {
            DRAFTS + 1
        } else {
            1
        }
    }
}

/// The manager a decode batch runs on: one group, or the groups of a hybrid model (which the
/// benches step only through persistent batches).
pub enum Managed {
    One(Arc<BlockManager>),
    #[allow(dead_code)] // each bench includes this file; only the manager bench has groups
    Groups(Arc<HybridManager>),
}

impl Managed {
    fn groups(&self) -> usize {
        match self {
            Managed::One(_) => 1,
            Managed::Groups(mgr) => mgr.num_groups(),
        }
    }

    fn free(&self, seq: SeqId) {
        match self {
            Managed::One(mgr) => mgr.free(seq).unwrap(),
            Managed::Groups(mgr) => mgr.free(seq).unwrap(),
        }
    }

    fn allocate(&self, seq: SeqId, prompt: &[Token]) {
        match self {
            Managed::One(mgr) => mgr.allocate(seq, prompt, None).map(drop).unwrap(),
            Managed::Groups(mgr) => mgr.allocate(seq, prompt, None).map(drop).unwrap(),
        }
    }

    fn plan(&self, seqs: &[SeqId], lens: &[u32], plans: &mut [Plan]) {
        match self {
            Managed::One(mgr) => mgr.plan(seqs, lens, &mut plans[0]).unwrap(),
            Managed::Groups(mgr) => mgr.plan(seqs, lens, plans).unwrap(),
        }
    }

    fn step_batch(&self, batches: &mut [Batch], tokens: &[Token]) {
        match self {
            Managed::One(mgr) => mgr.step_batch(&mut batches[0], tokens).unwrap(),
            Managed::Groups(mgr) => mgr.step_batch(batches, tokens).unwrap(),
        }
    }

    fn one(&self) -> &BlockManager {
        match self {
            Managed::One(mgr) => mgr,
            Managed::Groups(_) => panic!("groups step only through persistent batches"),
        }
    }
}

/// A decode batch on a manager, stepped by the benches.
pub struct Decoding {
    mgr: Managed,
    seqs: Vec<SeqId>,
    plans: Vec<Plan>,
    batches: Vec<Batch>,
    tokens: Tokens,
    /// Draws each verify step's rejected drafts.
    rejections: SplitMix64,
    next_id: SeqId,
    /// Tokens each running sequence appended so far (at most; rollbacks not counted).
    grown: usize,
}

impl Decoding {
    /// Blocks the batch holds at most: a manager with twice as many keeps freed blocks cached
    /// (so steps evict, as in a serving steady state).
    pub fn blocks() -> u32 {
        let per_seq = (PROMPT + MAX_GROWTH).div_ceil(BLOCK_SIZE as usize) as u32 + 1;
        BATCH as u32 * per_seq
    }

    /// A prefilled batch on `mgr` (of the bench's `BLOCK_SIZE`).
    pub fn new(mgr: Managed) -> Decoding {
        let groups = mgr.groups();
        let mut decoding = Decoding {
            mgr,
            seqs: Vec::new(),
            plans: (0..groups).map(|_| Plan::new()).collect(),
            batches: (0..groups).map(|_| Batch::new()).collect(),
            tokens: Tokens::new(2),
            rejections: SplitMix64(5),
            next_id: 0,
            grown: 0,
        };
        decoding.admit();
        decoding
    }

    /// Frees the running sequences, then admits and prefills a new batch of them.
    fn admit(&mut self) {
        for &s in &self.seqs {
            self.mgr.free(s);
        }
        for batch in &mut self.batches {
            batch.clear();
        }
        let mut lens = Vec::with_capacity(BATCH);
        self.seqs = (0..BATCH)
            .map(|i| {
                self.next_id += 1;
                // Prompt lengths vary a little so last pages fill at different steps.
                let prompt = self.tokens.take(PROMPT - 8 + i % 16);
                self.mgr.allocate(self.next_id, &prompt);
                lens.push(prompt.len() as u32);
                for batch in &mut self.batches {
                    batch.add(self.next_id).unwrap();
                }
                self.next_id
            })
            .collect();
        self.mgr.plan(&self.seqs, &lens, &mut self.plans);
        self.grown = 0;
    }

    /// One decode step of every sequence; `rejected` holds each row's rejected drafts for a
    /// verify step.
    fn step(&mut self, how: Stepping, tokens: &[Token], rejected: &[usize]) {
        match how {
            Stepping::OneShot => {
                let mgr = self.mgr.one();
                mgr.step(&self.seqs, tokens, &mut self.plans[0]).unwrap();
                return;
            }
            Stepping::Persistent => self.mgr.step_batch(&mut self.batches, tokens),
            Stepping::Verify => {
                let (mgr, batch) = (self.mgr.one(), &mut self.batches[0]);
                let counts = [(DRAFTS + 1) as u32; BATCH];
                mgr.verify_batch(batch, tokens, &counts).unwrap();
                // The target's forward pass runs here; then its rejected drafts go.
                mgr.rollback_batch(batch, rejected).unwrap();
            }
        }
        // A device copy of the tables would take the logs here.
        for batch in &mut self.batches {
            batch.clear_updates();
        }
    }

    /// Each row's rejected drafts for one step (none unless it verifies).
    fn rejected(&mut self, how: Stepping) -> Vec<usize> {
        let rows = if how == Stepping::Verify { BATCH } else { 0 };
        (0..rows)
            .map(|_| (self.rejections.next() % (DRAFTS as u64 + 1)) as usize)
            .collect()
    }

    /// Steps of `how` the running batch may still take.
    fn steps_left(&self, how: Stepping) -> usize {
        (MAX_GROWTH - self.grown) / how.tokens()
    }

    /// Runs `iters` decode steps; returns the time spent stepping. Re-admissions and each
    /// batch's first step, which commits its prefill (registers every prompt block), are not
    /// timed.
    pub fn time(&mut self, iters: u64, how: Stepping) -> Duration {
        let mut elapsed = Duration::ZERO;
        let mut left = iters as usize;
        while left > 0 {
            let tokens = self.tokens.take(BATCH * how.tokens());
            if self.steps_left(how) == 0 {
                self.admit();
            }
            if self.grown == 0 {
                let rejected = self.rejected(how);
                self.step(how, &tokens, &rejected);
                self.grown += how.tokens();
                continue;
            }
            let chunk = left.min(self.steps_left(how));
            let rejected: Vec<Vec<usize>> = (0..chunk).map(|_| self.rejected(how)).collect();
            let start = Instant::now();
            for rejected in &rejected {
                self.step(how, &tokens, rejected);
            }
            elapsed += start.elapsed();
            black_box((&self.plans, &self.batches));
            left -= chunk;
            self.grown += chunk * how.tokens();
        }
        elapsed
    }
}
