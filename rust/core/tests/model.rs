//! Model-based property test: the real `BlockManager` and `HybridManager` against a plain
//! single-threaded model of SEMANTICS.md.
//!
//! The model uses the most obvious data structures (a `Vec` as the free stack, a `VecDeque` as the
//! cached queue, a `HashMap` from `(group, salt, token prefix)` to block, refcount vectors, each
//! sequence's `computed <= planned <= len` with its copies, swap source and external loads, and
//! one block table per group starting at the group's `first` block), so that a reader can check
//! it against SEMANTICS.md line by line. Random operation sequences run on both; after every
//! operation the test compares results, errors, every live sequence's tokens, every group's block
//! table (exact physical ids) and first block, the computed count, every group's stats, plans
//! (copies and attention included) and events (block ids and media included), and runs `check()`.
//! At the end of a case, after freeing everything, one-token prompts take every block, which
//! compares the free stack and the cached queue whole (exact eviction order). A quarter of the
//! cases run without auto-commit. Three kinds of layout run: a full-attention `BlockManager`, a
//! windowed one (a random sliding window, within a block or wider, or a chunk of one to three
//! blocks), and `HybridManager`s with a full-attention group 0 and one or two windowed groups
//! over one pool, half of them with a state group of 1 to 16 slots (a random `StateConfig`),
//! half of those with full-attention KV groups alone (the state recomputed over KV hits).
//! The state model is a slot array with a `Vec` as the free stack, a `VecDeque` as the LRU of
//! unpinned checkpoints, a `HashMap` from group 0's key to checkpoint, the queue of copies and
//! resets and a `Vec` as the CPU slots' free stack; after every operation the test also
//! compares the plans' `state_*` inputs (exact slot ids) and slot -1s, every `state_slot` and
//! `state_stats`, and runs every plan and swap on a model of the engine's state tensors (GPU
//! and CPU), where each pass must start from the state after exactly the tokens before its
//! query. At the end each test asserts that the run
//! really exercised prefix hits, copies, forks, swaps, evictions, CPU-tier events, external
//! loads and both commit modes, and with windows: releases out of the window (cached at the
//! front and, resuming a prompt, at the back), evictions of front blocks, window hits, refused
//! plans and rollbacks, and (hybrid) hits a group shortened; with states: checkpoint hits,
//! saves, skips, evictions and cap drops, branch points, KV hits past the state's checkpoint
//! and the rows recomputing it, forks of queued states, draining slots, swaps of states,
//! passes refused off the state point, OutOfStateSlots, the loads a state group refuses, and
//! rollbacks to draft states and past them.
//!
//! Where SEMANTICS.md leaves an order open (which of several validation errors wins), the model
//! returns every error that applies and the real one must be among them; capacity errors
//! (`OutOfBlocks`, `OutOfStateSlots`) are exact. Set `PROPTEST_CASES` to change the number of
//! cases.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use pagedkv::{
    Attention, Batch as PersistentBatch, BlockId, BlockManager, Config, Error, Event, EventKind,
    HybridManager, Plan, PoolKind, SeqId, SlotId, StateConfig, StateStats, Stats, Token,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestRunner;

/// Cases when `PROPTEST_CASES` is unset, for the full-attention manager at small block sizes
/// (the other layouts run a share of it): together about a minute on two cores optimized (the
/// intended way to run this test), and a smoke run in unoptimized builds, which are some twenty
/// times slower.
const DEFAULT_CASES: u32 = if cfg!(optimized) { 8_000 } else { 300 };
/// Sequence ids the operations draw from (a few more than the pools can usually hold).
const NUM_IDS: u64 = 8;
/// System prompts that many prompts start with, over the same small alphabet as the suffixes.
const SYSTEM_PREFIXES: [&[Token]; 4] = [
    &[],
    &[1, 2, 3, 1, 2, 3, 1, 2],
    &[1, 2, 3, 1, 0, 0, 0, 0, 0, 0],
    &[3, 3, 3, 3, 3, 3],
];
/// Tenant salts; `None` most often. (An empty salt is avoided: SEMANTICS.md does not say whether
/// it equals no salt.)
const SALTS: [Option<&[u8]>; 3] = [None, Some(b"tenant-a"), Some(b"tenant-b")];

// ---------------------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------------------

/// What a block's hash stands for: its group, the salt and every token up to the block's end.
type Key = (usize, Option<Vec<u8>>, Vec<Token>);

/// The first token a query at `position` reads (SEMANTICS.md's `first_key`).
fn first_key(attention: Attention, position: usize) -> usize {
    match attention {
        Attention::Full => 0,
        Attention::SlidingWindow(w) => (position + 1).saturating_sub(w as usize),
        Attention::ChunkedLocal(c) => position - position % c as usize,
    }
}

/// A copy-on-write copy a sequence still holds the source of.
#[derive(Clone, Debug)]
struct Copy {
    src: BlockId,
    dst: BlockId,
    /// Tokens of `src` the copy carries.
    fill: usize,
    /// Done once the sequence is computed up to here (set when a plan delivers it).
    until: usize,
}

/// A sequence's state in one group.
#[derive(Clone, Debug)]
struct GroupSeq {
    /// GPU block ids, or CPU block ids while swapped out, of logical blocks `first..`.
    table: Vec<BlockId>,
    /// Logical blocks `0..first` left the attention window and were released.
    first: usize,
    computed: usize,
    planned: usize,
    /// Full blocks `0..registered` were offered to the prefix cache.
    registered: usize,
    /// Copies recorded by appends, not yet in a plan.
    copies: Vec<Copy>,
    /// Copies delivered by a plan, not yet committed.
    copying: Vec<Copy>,
    /// The other pool's table of an unconfirmed swap (GPU while swapped out, else CPU).
    swap_source: Option<Vec<BlockId>>,
}

#[derive(Clone, Debug)]
struct ModelSeq {
    tokens: Vec<Token>,
    salt: Option<Vec<u8>>,
    swapped: bool,
    /// External loads: logical blocks `first..first + count`.
    loading: Option<(usize, usize)>,
    /// Length of the prompt it was admitted with.
    prompt_len: usize,
    /// Its state in each group; the groups' lifecycles move together.
    groups: Vec<GroupSeq>,
}

impl ModelSeq {
    fn swap_in_pending(&self) -> bool {
        !self.swapped && self.groups[0].swap_source.is_some()
    }

    fn computed(&self) -> usize {
        self.groups[0].computed
    }

    fn planned(&self) -> usize {
        self.groups[0].planned
    }
}

#[derive(Clone, Debug)]
enum ModelEvent {
    Stored {
        key: Key,
        token_ids: Vec<Token>,
        block_id: BlockId,
        medium: PoolKind,
    },
    Removed {
        key: Key,
        block_id: BlockId,
        medium: PoolKind,
    },
    Cleared,
}

/// A model result: `Err` lists every error SEMANTICS.md allows for the call.
type Expect<T> = Result<T, Vec<Error>>;

/// What a run exercised, counted on successful operations.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    copies: u64,
    swap_outs: u64,
    swap_ins: u64,
    cpu_events: u64,
    commits: u64,
    forks: u64,
    out_of_blocks: u64,
    /// Successful `step_batch` calls, and those whose rows carried copies.
    batch_steps: u64,
    batch_copies: u64,
    /// Successful `verify_batch` calls with drafts, and tokens rolled back.
    verify_steps: u64,
    rolled_back: u64,
    /// Blocks released out of a window, and those of them that became CACHED at the front
    /// or at the back of the eviction order.
    window_releases: u64,
    front_cached: u64,
    back_cached: u64,
    /// Evictions of blocks a window release put at the front.
    front_evictions: u64,
    /// Admissions whose hit skipped released blocks (a windowed group's table starts past 0).
    window_hits: u64,
    /// Admissions where a group alone could have served more than the hit.
    shortened_hits: u64,
    /// Plans and rollbacks refused because they would read released blocks.
    window_refusals: u64,
    /// Confirmed loads that extended a hit through a window group handed out only the blocks
    /// its next query reads, and loads whose hit a window group's short run shortened (the
    /// groups loading from the hit alone would have served more).
    window_loads: u64,
    window_short_loads: u64,
    /// State group: admissions and forks refused for want of a slot, loads refused (no
    /// store holds states), rollbacks that restored a draft state and rollbacks refused for
    /// want of one, admissions that set a branch point, forks of a parent whose own copy was
    /// still queued, frees that left a DRAINING slot, and rows whose working state the engine
    /// model checked.
    out_of_state_slots: u64,
    state_refusals: u64,
    state_rollbacks: u64,
    draft_refusals: u64,
    branch_points: u64,
    chained_forks: u64,
    draining: u64,
    exact_rows: u64,
    /// State group: admissions whose KV hit is past the state's, plan rows that recompute
    /// the state over cached KV (slot -1), passes refused for not starting at the state
    /// point, confirmed swap-outs of states and swap-ins of states.
    recomputed_hits: u64,
    recomputed_rows: u64,
    resume_refusals: u64,
    state_swap_outs: u64,
    state_swap_ins: u64,
}

/// One group's counters (SEMANTICS.md's stats that differ between groups).
#[derive(Clone, Copy, Debug, Default)]
struct GroupCounters {
    query_tokens: u64,
    hit_tokens: u64,
    allowed_tokens: u64,
    evictions: u64,
    external_query: u64,
    external_hit: u64,
    external_failures: u64,
}

/// What a state slot holds (SEMANTICS.md, "State group").
#[derive(Clone, Debug)]
enum StateSlot {
    Free,
    Working(SeqId),
    Saving(SeqId),
    Draft(SeqId),
    /// A committed checkpoint: group 0's key of the prefix it is the state after, the queued
    /// copies reading it, and which registration it is (for the per-sequence cap).
    Checkpoint {
        key: Key,
        pins: u32,
        registration: u64,
    },
    Draining,
}

/// A live sequence's slots.
#[derive(Clone, Debug)]
struct StateSeq {
    working: SlotId,
    /// The CPU slot of a swapped sequence, and whether it still holds `working` (until its
    /// swap-out is confirmed, and again from its swap-in on).
    swap: Option<(SlotId, bool)>,
    prompt_point: usize,
    /// 0: none.
    branch: usize,
    /// The state point: the tokens its working state holds once the planned passes ran.
    resume: usize,
    /// Saves of planned passes, in the order they were planned: (point, slot).
    saving: Vec<(usize, SlotId)>,
    /// Draft states of planned speculative passes, by increasing point: (point, slot).
    drafts: Vec<(usize, SlotId)>,
    /// The checkpoints it registered but its branch point's, oldest first: (slot,
    /// registration).
    kept: VecDeque<(SlotId, u64)>,
}

impl StateSeq {
    /// The GPU slot it holds, if any.
    fn gpu(&self) -> Option<SlotId> {
        match self.swap {
            Some((_, false)) => None,
            _ => Some(self.working),
        }
    }
}

/// The state group: a slot array, the free stack, the LRU of unpinned checkpoints, the map
/// from keys to checkpoints and the queue of copies and resets.
struct StateModel {
    config: StateConfig,
    bs: usize,
    slots: Vec<StateSlot>,
    /// The free stack; the top is the end.
    free: Vec<SlotId>,
    /// Unpinned checkpoints; the head is the next victim.
    lru: VecDeque<SlotId>,
    map: HashMap<Key, SlotId>,
    seqs: BTreeMap<SeqId, StateSeq>,
    copies: Vec<[SlotId; 2]>,
    resets: Vec<SlotId>,
    /// The CPU free stack; the top is the end.
    cpu_free: Vec<SlotId>,
    registrations: u64,
    /// The counters (the slot counts are computed by `stats`).
    counters: StateStats,
}

impl StateModel {
    fn new(config: StateConfig, bs: usize) -> StateModel {
        let n = config.num_slots;
        StateModel {
            slots: vec![StateSlot::Free; n as usize],
            free: (0..n).rev().collect(),
            lru: VecDeque::new(),
            map: HashMap::new(),
            seqs: BTreeMap::new(),
            copies: Vec::new(),
            resets: Vec::new(),
            cpu_free: (0..config.num_cpu_slots).rev().collect(),
            registrations: 0,
            counters: StateStats::default(),
            config,
            bs,
        }
    }

    fn num_saving(&self) -> usize {
        (self.slots.iter())
            .filter(|s| matches!(s, StateSlot::Saving(_)))
            .count()
    }

    /// Slots a working slot could be taken from: FREE ones and unpinned checkpoints but
    /// `keep`.
    fn available(&self, keep: Option<SlotId>) -> usize {
        let kept = keep.is_some_and(|slot| self.lru.contains(&slot));
        self.free.len() + self.lru.len() - usize::from(kept)
    }

    fn release(&mut self, slot: SlotId) {
        self.slots[slot as usize] = StateSlot::Free;
        self.free.push(slot);
    }

    /// Evicts the LRU checkpoint; returns its slot, not yet reused.
    fn evict(&mut self) -> Option<SlotId> {
        let slot = self.lru.pop_front()?;
        let StateSlot::Checkpoint { key, .. } = &self.slots[slot as usize] else {
            panic!("model: the LRU holds checkpoints");
        };
        assert_eq!(self.map.remove(key), Some(slot));
        self.counters.evictions += 1;
        Some(slot)
    }

    /// A FREE slot, else the LRU checkpoint's.
    fn take(&mut self) -> Option<SlotId> {
        self.free.pop().or_else(|| self.evict())
    }

    fn pin(&mut self, slot: SlotId) {
        let StateSlot::Checkpoint { pins, .. } = &mut self.slots[slot as usize] else {
            panic!("model: pinning a checkpoint");
        };
        if *pins == 0 {
            let at = self.lru.iter().position(|&s| s == slot).expect("unpinned");
            self.lru.remove(at);
        }
        *pins += 1;
    }

    /// A queued copy out of `slot` was handed out or dropped.
    fn unpin(&mut self, slot: SlotId) {
        match &mut self.slots[slot as usize] {
            StateSlot::Checkpoint { pins, .. } => {
                *pins -= 1;
                if *pins == 0 {
                    self.lru.push_back(slot);
                }
            }
            StateSlot::Draining if !self.copies.iter().any(|&[src, _]| src == slot) => {
                self.release(slot);
            }
            _ => {}
        }
    }

    /// Admits `seq` (a slot was checked available), from the checkpoint in `hit` or reset;
    /// its state point is `resume`.
    fn admit(
        &mut self,
        seq: SeqId,
        hit: Option<SlotId>,
        prompt_len: usize,
        branch: usize,
        resume: usize,
    ) {
        if let Some(src) = hit {
            self.pin(src);
        }
        let working = self.take().expect("model: checked available");
        self.slots[working as usize] = StateSlot::Working(seq);
        match hit {
            Some(src) => self.copies.push([src, working]),
            None => self.resets.push(working),
        }
        let state = StateSeq {
            working,
            swap: None,
            prompt_point: prompt_len / self.bs * self.bs,
            branch,
            resume,
            saving: Vec::new(),
            drafts: Vec::new(),
            kept: VecDeque::new(),
        };
        self.seqs.insert(seq, state);
    }

    /// The child's working slot receives what the parent's will hold; returns whether that
    /// is a queued copy's source (a chain of forks before a plan).
    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        let p = self.seqs[&parent].clone();
        let working = self.take().expect("model: checked available");
        self.slots[working as usize] = StateSlot::Working(child);
        let mut chained = false;
        if self.resets.contains(&p.working) {
            self.resets.push(working);
        } else {
            let queued = self.copies.iter().find(|&&[_, dst]| dst == p.working);
            chained = queued.is_some();
            let src = queued.map_or(p.working, |&[src, _]| src);
            if let StateSlot::Checkpoint { pins, .. } = &mut self.slots[src as usize] {
                *pins += 1;
            }
            self.copies.push([src, working]);
        }
        let state = StateSeq {
            working,
            swap: None,
            saving: Vec::new(),
            drafts: Vec::new(),
            kept: VecDeque::new(),
            ..p
        };
        self.seqs.insert(child, state);
        chained
    }

    /// Ends `seq`; returns whether its working slot is DRAINING.
    fn free(&mut self, seq: SeqId) -> bool {
        let s = self.seqs.remove(&seq).expect("model: live");
        for &(_, slot) in &s.saving {
            let saving = &self.slots[slot as usize];
            assert!(
                matches!(saving, StateSlot::Saving(w) if *w == seq),
                "model: {saving:?}"
            );
            self.release(slot);
        }
        for &(_, slot) in &s.drafts {
            let draft = &self.slots[slot as usize];
            assert!(
                matches!(draft, StateSlot::Draft(w) if *w == seq),
                "model: {draft:?}"
            );
            self.release(slot);
        }
        if let Some((cpu, _)) = s.swap {
            self.cpu_free.push(cpu);
        }
        s.gpu()
            .is_some_and(|working| self.release_working(seq, working))
    }

    /// Releases the working slot `seq` no longer holds: queued copies and resets into it are
    /// dropped; it is DRAINING (returns true) if a queued copy reads it, else FREE.
    fn release_working(&mut self, seq: SeqId, working: SlotId) -> bool {
        let held = &self.slots[working as usize];
        assert!(
            matches!(held, StateSlot::Working(w) if *w == seq),
            "model: {held:?}"
        );
        let mut unpinned = Vec::new();
        self.copies.retain(|&[src, dst]| {
            if dst == working {
                unpinned.push(src);
            }
            dst != working
        });
        self.resets.retain(|&slot| slot != working);
        for src in unpinned {
            self.unpin(src);
        }
        let draining = self.copies.iter().any(|&[src, _]| src == working);
        if draining {
            self.slots[working as usize] = StateSlot::Draining;
        } else {
            self.release(working);
        }
        draining
    }

    /// Why `seqs` cannot swap out (`to_gpu`: in), checked after the KV groups' checks.
    fn swap_error(&self, seqs: &[SeqId], to_gpu: bool) -> Option<Error> {
        if to_gpu {
            let available = self.available(None);
            return (available < seqs.len()).then_some(Error::OutOfStateSlots {
                needed: seqs.len(),
                available,
            });
        }
        let written = |seq: &SeqId| {
            let working = self.seqs[seq].working;
            self.resets.contains(&working) || self.copies.iter().any(|&[_, dst]| dst == working)
        };
        if seqs.iter().any(written) {
            return Some(invalid());
        }
        let available = self.cpu_free.len();
        (available < seqs.len()).then_some(Error::OutOfStateSlots {
            needed: seqs.len(),
            available,
        })
    }

    /// Moves the states of `seqs` (their due saves committed) to CPU slots: the rest of their
    /// saves are FREE; returns the `[working, cpu]` pairs.
    fn swap_out(&mut self, seqs: &[SeqId]) -> Vec<[BlockId; 2]> {
        let mut pairs = Vec::new();
        for seq in seqs {
            let cpu = self.cpu_free.pop().expect("model: checked available");
            let s = self.seqs.get_mut(seq).expect("model: live");
            s.swap = Some((cpu, true));
            pairs.push([s.working, cpu]);
            let drafts = std::mem::take(&mut s.drafts);
            for (_, slot) in std::mem::take(&mut s.saving).into_iter().chain(drafts) {
                self.release(slot);
            }
        }
        pairs
    }

    /// Returns how many working slots went DRAINING.
    fn confirm_swap_out(&mut self, seqs: &[SeqId]) -> u64 {
        let mut draining = 0;
        for &seq in seqs {
            let s = self.seqs.get_mut(&seq).expect("model: live");
            let (cpu, _) = s.swap.expect("model: swapped");
            s.swap = Some((cpu, false));
            let working = s.working;
            draining += u64::from(self.release_working(seq, working));
        }
        draining
    }

    /// New working slots for `seqs` (checked available); returns the `[cpu, working]` pairs.
    fn swap_in(&mut self, seqs: &[SeqId]) -> Vec<[BlockId; 2]> {
        let mut pairs = Vec::new();
        for &seq in seqs {
            let working = self.take().expect("model: checked available");
            self.slots[working as usize] = StateSlot::Working(seq);
            let s = self.seqs.get_mut(&seq).expect("model: live");
            let (cpu, _) = s.swap.expect("model: swapped");
            s.swap = Some((cpu, true));
            s.working = working;
            pairs.push([cpu, working]);
        }
        pairs
    }

    fn confirm_swap_in(&mut self, seqs: &[SeqId]) {
        for seq in seqs {
            let s = self.seqs.get_mut(seq).expect("model: live");
            let (cpu, _) = s.swap.take().expect("model: swapped");
            self.cpu_free.push(cpu);
        }
    }

    /// Commits the saves of `seq` at points up to `computed`, registered under `key(point)`
    /// (none: unknown).
    fn commit(&mut self, seq: SeqId, computed: usize, key: impl Fn(usize) -> Option<Key>) {
        // First the draft states the commit reaches are FREE, in increasing points.
        let s = self.seqs.get_mut(&seq).expect("model: live");
        let (done, left): (Vec<_>, Vec<_>) =
            (s.drafts.drain(..)).partition(|&(point, _)| point <= computed);
        s.drafts = left;
        for (_, slot) in done {
            self.release(slot);
        }
        let s = self.seqs.get_mut(&seq).expect("model: live");
        let (mut done, left): (Vec<_>, Vec<_>) =
            (s.saving.drain(..)).partition(|&(point, _)| point <= computed);
        s.saving = left;
        let branch = s.branch;
        done.sort_by_key(|&(point, _)| point);
        for (point, slot) in done {
            match key(point).filter(|k| !self.map.contains_key(k)) {
                Some(key) => {
                    self.registrations += 1;
                    let registration = self.registrations;
                    self.map.insert(key.clone(), slot);
                    self.slots[slot as usize] = StateSlot::Checkpoint {
                        key,
                        pins: 0,
                        registration,
                    };
                    self.lru.push_back(slot);
                    self.counters.saved += 1;
                    if point != branch {
                        self.keep(seq, slot, registration);
                    }
                }
                None => self.release(slot),
            }
        }
    }

    /// The per-sequence cap: beyond it, the sequence's oldest checkpoint is dropped if it is
    /// still that checkpoint and unpinned.
    fn keep(&mut self, seq: SeqId, slot: SlotId, registration: u64) {
        let s = self.seqs.get_mut(&seq).expect("model: live");
        s.kept.push_back((slot, registration));
        if s.kept.len() <= self.config.checkpoints_per_sequence as usize {
            return;
        }
        let (slot, registration) = s.kept.pop_front().expect("over the cap");
        if let StateSlot::Checkpoint {
            key,
            pins: 0,
            registration: r,
        } = &self.slots[slot as usize]
        {
            if *r == registration {
                assert_eq!(self.map.remove(key), Some(slot));
                let at = self.lru.iter().position(|&s| s == slot).expect("unpinned");
                self.lru.remove(at);
                self.release(slot);
                self.counters.dropped += 1;
            }
        }
    }

    /// The state inputs of a pass over `rows` (sequence, query start, query end, drafts),
    /// after their saves were committed: the queue, every row's draft states, then each row's
    /// working slot and its saves.
    fn plan(&mut self, rows: &[(SeqId, usize, usize, usize)], plan: &mut Plan) {
        let queued = std::mem::take(&mut self.copies);
        plan.state_copies = (queued.iter())
            .flat_map(|&[src, dst]| [src as i32, dst as i32])
            .collect();
        for &[src, _] in &queued {
            self.unpin(src);
        }
        plan.state_resets = (self.resets.drain(..)).map(|s| s as i32).collect();
        let mut drafted: Vec<Vec<i32>> = Vec::new();
        for (row, &(seq, start, end, drafts)) in rows.iter().enumerate() {
            let mut saves = Vec::new();
            for point in end - drafts..end {
                let slot = self.take().expect("model: draft slots checked");
                self.slots[slot as usize] = StateSlot::Draft(seq);
                let s = self.seqs.get_mut(&seq).expect("model: live");
                s.drafts.push((point, slot));
                saves.extend([row as i32, (point - start) as i32, slot as i32]);
            }
            drafted.push(saves);
        }
        let (bs, interval) = (self.bs, self.config.checkpoint_interval as usize);
        for (row, &(seq, start, end, _)) in rows.iter().enumerate() {
            let s = self.seqs.get_mut(&seq).expect("model: live");
            s.resume = end;
            plan.state_slots.push(s.working as i32);
            // The prompt point, the branch point, then the last interval multiples the cap
            // keeps, latest first; none already being saved.
            let in_query = |p: usize| p > start && p <= end;
            let mut points: Vec<usize> = Vec::new();
            for p in [s.prompt_point, s.branch] {
                if in_query(p) && !points.contains(&p) {
                    points.push(p);
                }
            }
            if interval > 0 {
                let marked = [s.prompt_point, s.branch];
                let multiples = ((start / bs + 1) * bs..=end)
                    .rev()
                    .filter(|&p| p % interval == 0 && !marked.contains(&p))
                    .take(self.config.checkpoints_per_sequence as usize);
                points.extend(multiples);
            }
            points.retain(|&p| s.saving.iter().all(|&(q, _)| q != p));
            let first_save = plan.state_saves.len();
            plan.state_saves.append(&mut drafted[row]);
            for point in points {
                let budget = self.map.len() + self.num_saving();
                let slot = if budget >= self.config.max_checkpoints as usize {
                    self.evict()
                } else {
                    self.take()
                };
                let Some(slot) = slot else {
                    self.counters.skipped += 1;
                    continue;
                };
                self.slots[slot as usize] = StateSlot::Saving(seq);
                let s = self.seqs.get_mut(&seq).expect("model: live");
                s.saving.push((point, slot));
                plan.state_saves
                    .extend([row as i32, (point - start) as i32, slot as i32]);
            }
            let mut saves: Vec<[i32; 3]> = (plan.state_saves[first_save..].chunks(3))
                .map(|t| [t[0], t[1], t[2]])
                .collect();
            saves.sort_by_key(|t| t[1]);
            plan.state_saves.truncate(first_save);
            plan.state_saves.extend(saves.into_iter().flatten());
        }
    }

    /// Whether `seq` can roll back to `len` tokens: at or past its state point, or to a draft
    /// state.
    fn can_roll_back(&self, seq: SeqId, len: usize) -> bool {
        let s = &self.seqs[&seq];
        len >= s.resume || s.drafts.iter().any(|&(point, _)| point == len)
    }

    /// Rolls `seq` back to `len` tokens: below its state point, its saves past `len` (in the
    /// order planned), then its draft states past `len` (increasing), then its working slot
    /// are released, and the draft state at `len` is its working slot. Returns whether it
    /// restored a draft state.
    fn rollback(&mut self, seq: SeqId, len: usize) -> bool {
        let s = self.seqs.get_mut(&seq).expect("model: live");
        if len >= s.resume {
            return false;
        }
        s.resume = len;
        let (saving, dropped): (Vec<_>, Vec<_>) =
            (s.saving.drain(..)).partition(|&(point, _)| point <= len);
        s.saving = saving;
        let (drafts, past): (Vec<_>, Vec<_>) =
            (s.drafts.drain(..)).partition(|&(point, _)| point <= len);
        s.drafts = drafts;
        let (point, adopted) = s.drafts.pop().expect("model: checked");
        assert_eq!(point, len);
        let working = std::mem::replace(&mut s.working, adopted);
        for (_, slot) in dropped.into_iter().chain(past) {
            self.release(slot);
        }
        self.slots[adopted as usize] = StateSlot::Working(seq);
        self.release_working(seq, working);
        true
    }

    /// `reset_prefix_cache`: every unpinned checkpoint is FREE, in LRU order.
    fn reset(&mut self) {
        while let Some(slot) = self.lru.pop_front() {
            let StateSlot::Checkpoint { key, .. } = &self.slots[slot as usize] else {
                panic!("model: the LRU holds checkpoints");
            };
            assert_eq!(self.map.remove(key), Some(slot));
            self.release(slot);
        }
    }

    fn stats(&self) -> StateStats {
        StateStats {
            num_slots: self.slots.len(),
            num_free: self.free.len(),
            num_working: self.seqs.values().filter(|s| s.gpu().is_some()).count(),
            num_checkpoints: self.map.len(),
            num_saving: self.num_saving(),
            num_drafts: self.seqs.values().map(|s| s.drafts.len()).sum(),
            num_cpu_slots: self.config.num_cpu_slots as usize,
            num_cpu_free: self.cpu_free.len(),
            ..self.counters
        }
    }
}

/// SEMANTICS.md executed literally, one plain data structure per concept.
struct Model {
    bs: usize,
    num_blocks: usize,
    caching: bool,
    events_on: bool,
    auto_commit: bool,
    watermark: f64,
    /// Each group's attention (one group for a `BlockManager`).
    attention: Vec<Attention>,
    /// The GPU free stack; the top is the end.
    free: Vec<BlockId>,
    /// CACHED blocks; the head is the least recently released (the next victim).
    cached: VecDeque<BlockId>,
    /// Whether a CACHED block was put at the front by a window release (for `Seen`).
    at_front: Vec<bool>,
    refcount: Vec<u32>,
    /// The key a block is registered under (hashed), if any.
    hash: Vec<Option<Key>>,
    /// The prefix map.
    prefix: HashMap<Key, BlockId>,
    cpu_free: Vec<BlockId>,
    cpu_refcount: Vec<u32>,
    /// The CPU tier: announced CPU blocks and how many hold each key.
    cpu_tier: HashMap<BlockId, Key>,
    cpu_copies: HashMap<Key, u32>,
    seqs: BTreeMap<SeqId, ModelSeq>,
    events: Vec<ModelEvent>,
    counters: Vec<GroupCounters>,
    /// The state group, if the manager has one.
    state: Option<StateModel>,
    seen: Seen,
}

fn invalid() -> Error {
    Error::InvalidArgument(String::new())
}

fn has_repeats(seqs: &[SeqId]) -> bool {
    let mut seen = HashSet::new();
    !seqs.iter().all(|s| seen.insert(*s))
}

impl Model {
    fn new(cfg: &Config, attention: &[Attention], state: Option<StateConfig>) -> Model {
        let n = cfg.num_blocks as usize;
        Model {
            bs: cfg.block_size as usize,
            num_blocks: n,
            caching: cfg.enable_prefix_caching,
            // Only a full-attention group 0 announces its blocks (a windowed one could not keep
            // the stream a tree).
            events_on: cfg.enable_events && attention[0] == Attention::Full,
            auto_commit: cfg.auto_commit,
            watermark: cfg.watermark,
            attention: attention.to_vec(),
            free: (0..cfg.num_blocks).rev().collect(),
            cached: VecDeque::new(),
            at_front: vec![false; n],
            refcount: vec![0; n],
            hash: vec![None; n],
            prefix: HashMap::new(),
            cpu_free: (0..cfg.num_cpu_blocks).rev().collect(),
            cpu_refcount: vec![0; cfg.num_cpu_blocks as usize],
            cpu_tier: HashMap::new(),
            cpu_copies: HashMap::new(),
            seqs: BTreeMap::new(),
            events: Vec::new(),
            counters: vec![GroupCounters::default(); attention.len()],
            state: state.map(|c| StateModel::new(c, cfg.block_size as usize)),
            seen: Seen::default(),
        }
    }

    fn groups(&self) -> std::ops::Range<usize> {
        0..self.attention.len()
    }

    fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    /// The first logical block group `g`'s query at `position` reads.
    fn first_block(&self, g: usize, position: usize) -> usize {
        first_key(self.attention[g], position) / self.bs
    }

    fn emit(&mut self, event: ModelEvent) {
        if self.events_on {
            if let ModelEvent::Stored {
                medium: PoolKind::Cpu,
                ..
            }
            | ModelEvent::Removed {
                medium: PoolKind::Cpu,
                ..
            } = event
            {
                self.seen.cpu_events += 1;
            }
            self.events.push(event);
        }
    }

    /// Pop the free stack, or evict the cached-queue head (counted in group `g`, the taker;
    /// announced only if the victim is a group-0 block).
    fn take(&mut self, g: usize) -> BlockId {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self
                    .cached
                    .pop_front()
                    .expect("model: capacity was checked");
                let key = self.hash[b as usize]
                    .take()
                    .expect("cached block is hashed");
                assert_eq!(self.prefix.remove(&key), Some(b));
                self.counters[g].evictions += 1;
                self.seen.front_evictions += u64::from(self.at_front[b as usize]);
                if key.0 == 0 {
                    self.emit(ModelEvent::Removed {
                        key,
                        block_id: b,
                        medium: PoolKind::Gpu,
                    });
                }
                b
            }
        };
        self.refcount[b as usize] = 1;
        b
    }

    fn release(&mut self, b: BlockId) {
        self.release_as(b, false);
    }

    /// Releases a block; one that becomes CACHED goes to the head of the queue if `front`.
    fn release_as(&mut self, b: BlockId, front: bool) -> bool {
        let rc = &mut self.refcount[b as usize];
        *rc -= 1;
        if *rc > 0 {
            return false;
        }
        if self.hash[b as usize].is_some() {
            self.at_front[b as usize] = front;
            if front {
                self.cached.push_front(b);
            } else {
                self.cached.push_back(b);
            }
            return true;
        }
        self.free.push(b);
        false
    }

    /// Releases a CPU block; a freed block leaves the CPU tier (its key's last copy: an event).
    fn release_cpu(&mut self, b: BlockId) {
        let rc = &mut self.cpu_refcount[b as usize];
        *rc -= 1;
        if *rc == 0 {
            self.cpu_free.push(b);
            if let Some(key) = self.cpu_tier.remove(&b) {
                let copies = self.cpu_copies.get_mut(&key).expect("model: counted");
                *copies -= 1;
                if *copies == 0 {
                    self.cpu_copies.remove(&key);
                    self.emit(ModelEvent::Removed {
                        key,
                        block_id: b,
                        medium: PoolKind::Cpu,
                    });
                }
            }
        }
    }

    fn acquire_hit(&mut self, b: BlockId) {
        if self.refcount[b as usize] == 0 {
            let pos = self
                .cached
                .iter()
                .position(|&c| c == b)
                .expect("hit is cached");
            self.cached.remove(pos);
        }
        self.refcount[b as usize] += 1;
    }

    fn key(&self, g: usize, salt: &Option<Vec<u8>>, tokens: &[Token], i: usize) -> Key {
        (g, salt.clone(), tokens[..(i + 1) * self.bs].to_vec())
    }

    /// Register group `g`'s full block `i` (physical `block`) of a sequence with these tokens.
    fn register(
        &mut self,
        g: usize,
        salt: &Option<Vec<u8>>,
        tokens: &[Token],
        block: BlockId,
        i: usize,
    ) {
        if !self.caching {
            return;
        }
        let key = self.key(g, salt, tokens, i);
        if self.prefix.contains_key(&key) {
            return;
        }
        assert!(
            self.hash[block as usize].is_none(),
            "model: registering a hashed block"
        );
        self.prefix.insert(key.clone(), block);
        self.hash[block as usize] = Some(key.clone());
        if g == 0 {
            let token_ids = tokens[i * self.bs..(i + 1) * self.bs].to_vec();
            self.emit(ModelEvent::Stored {
                key,
                token_ids,
                block_id: block,
                medium: PoolKind::Gpu,
            });
        }
    }

    /// Commit group `g` of `id` up to `upto`: computed, completed copies, then registration
    /// of the computed full blocks the group still holds.
    fn commit_to(&mut self, g: usize, id: SeqId, upto: usize) {
        let mut s = self.seqs.remove(&id).expect("model: validated");
        let gs = &mut s.groups[g];
        assert!(upto <= gs.planned, "model: committing past the plan");
        gs.computed = gs.computed.max(upto);
        let computed = gs.computed;
        let (done, left): (Vec<Copy>, Vec<Copy>) = std::mem::take(&mut gs.copying)
            .into_iter()
            .partition(|c| c.until <= computed);
        gs.copying = left;
        for c in done {
            self.release(c.src);
        }
        let gs = &s.groups[g];
        if !s.swapped && gs.swap_source.is_none() && s.loading.is_none() {
            let (first, registered, full) = (gs.first, gs.registered, computed / self.bs);
            // Only group 0 with full attention announces its blocks: it registers each only
            // under its own registered block, one tree (SEMANTICS.md).
            let announced = g == 0 && self.attention[0] == Attention::Full;
            for i in registered.max(first)..full {
                let block = s.groups[g].table[i - first];
                // A full-attention group holds every block from 0 (`first` is 0).
                if announced && i > 0 && self.hash[s.groups[g].table[i - 1] as usize].is_none() {
                    continue;
                }
                self.register(g, &s.salt, &s.tokens, block, i);
            }
            let gs = &mut s.groups[g];
            gs.registered = gs.registered.max(full);
        }
        self.seqs.insert(id, s);
    }

    fn auto_commit(&mut self, g: usize, id: SeqId) {
        if self.auto_commit {
            let planned = self.seqs[&id].groups[g].planned;
            self.commit_to(g, id, planned);
        }
    }

    /// Whether group `g` serves a hit of `k` blocks: the blocks a query at position `k * bs`
    /// reads (every block before it with full attention) are registered.
    fn serves(&self, g: usize, tokens: &[Token], salt: &Option<Vec<u8>>, k: usize) -> bool {
        (self.first_block(g, k * self.bs)..k)
            .all(|i| self.prefix.contains_key(&self.key(g, salt, tokens, i)))
    }

    /// The hit in blocks: the longest hit of at most `(len - 1) / bs` blocks every group
    /// serves; and each group's own longest hit.
    fn lookup(&self, tokens: &[Token], salt: &Option<Vec<u8>>) -> (usize, Vec<usize>) {
        let groups = self.attention.len();
        if !self.caching || tokens.is_empty() {
            return (0, vec![0; groups]);
        }
        let hittable = (tokens.len() - 1) / self.bs;
        let longest = |serves: &dyn Fn(usize) -> bool| (0..=hittable).rev().find(|&k| serves(k));
        let allowed: Vec<usize> = self
            .groups()
            .map(|g| longest(&|k| self.serves(g, tokens, salt, k)).expect("0 is served"))
            .collect();
        let hit = longest(&|k| self.groups().all(|g| self.serves(g, tokens, salt, k)));
        (hit.expect("0 is served"), allowed)
    }

    /// Group `g`'s hit blocks for a hit of `k` blocks: logical `first_block(k * bs)..k`.
    fn hit_blocks(
        &self,
        g: usize,
        tokens: &[Token],
        salt: &Option<Vec<u8>>,
        k: usize,
    ) -> Vec<BlockId> {
        (self.first_block(g, k * self.bs)..k)
            .map(|i| self.prefix[&self.key(g, salt, tokens, i)])
            .collect()
    }

    /// Blocks admitting `tokens` with a hit of `k` blocks takes, over every group.
    fn alloc_needed(&self, tokens: &[Token], salt: &Option<Vec<u8>>, k: usize) -> usize {
        let n = tokens.len().div_ceil(self.bs);
        self.groups()
            .map(|g| {
                let hits = self.hit_blocks(g, tokens, salt, k);
                let revived = hits
                    .iter()
                    .filter(|&&b| self.refcount[b as usize] == 0)
                    .count();
                n - k + revived
            })
            .sum()
    }

    fn out_of_blocks<T>(&mut self, pool: PoolKind, needed: usize, available: usize) -> Expect<T> {
        self.seen.out_of_blocks += 1;
        Err(vec![Error::OutOfBlocks {
            pool,
            needed,
            available,
        }])
    }

    /// Errors for a sequence that must be live and on the GPU.
    fn gpu_seq_errors(&self, seq: SeqId, errs: &mut Vec<Error>) {
        match self.seqs.get(&seq) {
            None => errs.push(Error::UnknownSequence(seq)),
            Some(s) if s.swapped => errs.push(Error::SwappedOut(seq)),
            Some(s) if s.loading.is_some() => errs.push(invalid()),
            Some(_) => {}
        }
    }

    /// Whether some group of `s` released a block a query at `position` reads.
    fn reads_released(&mut self, s: SeqId, position: usize) -> bool {
        let m = &self.seqs[&s];
        let refused = self
            .groups()
            .any(|g| self.first_block(g, position) < m.groups[g].first);
        self.seen.window_refusals += u64::from(refused);
        refused
    }

    /// `allocate` (`loadable == None`) and `allocate_loading`: the reused tokens and each
    /// group's blocks to load.
    fn admit(
        &mut self,
        seq: SeqId,
        tokens: &[Token],
        salt: Option<&[u8]>,
        loadable: Option<usize>,
    ) -> Expect<(usize, Vec<Vec<BlockId>>)> {
        if loadable.is_some() {
            self.no_state()?;
        }
        let mut errs = Vec::new();
        if self.seqs.contains_key(&seq) {
            errs.push(Error::DuplicateSequence(seq));
        }
        if tokens.is_empty() {
            errs.push(invalid());
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let salt = salt.map(<[u8]>::to_vec);
        let (common, allowed) = self.lookup(tokens, &salt);
        let (k_kv, k) = self.hits(tokens, &salt, common);
        let resumed = self.checkpoint(tokens, &salt, k);
        if let Some(state) = &self.state {
            let available = state.available(resumed);
            if available < 1 {
                self.seen.out_of_state_slots += 1;
                return Err(vec![Error::OutOfStateSlots {
                    needed: 1,
                    available,
                }]);
            }
        }
        let needed = self.alloc_needed(tokens, &salt, k_kv);
        if needed > self.available() {
            let available = self.available();
            return self.out_of_blocks(PoolKind::Gpu, needed, available);
        }
        let n = tokens.len().div_ceil(self.bs);
        // Every group's hits are acquired before any group takes a fresh block.
        let mut groups = Vec::new();
        for g in self.groups() {
            let first = self.first_block(g, k_kv * self.bs);
            let hits = self.hit_blocks(g, tokens, &salt, k_kv);
            for &b in &hits {
                self.acquire_hit(b);
            }
            self.seen.window_hits += u64::from(k_kv > 0 && first > 0);
            groups.push(GroupSeq {
                table: hits,
                first,
                computed: k_kv * self.bs,
                planned: k_kv * self.bs,
                registered: k_kv,
                copies: Vec::new(),
                copying: Vec::new(),
                swap_source: None,
            });
        }
        for (g, gs) in groups.iter_mut().enumerate() {
            for _ in k_kv..n {
                let b = self.take(g);
                gs.table.push(b);
            }
        }
        self.seen.shortened_hits += u64::from(allowed.iter().any(|&a| a > k_kv));
        let hittable = n - 1;
        let m = match loadable {
            Some(l) if self.caching => l.min(hittable).saturating_sub(k),
            _ => 0,
        };
        // A windowed group loads only the blocks the query at the extended hit reads.
        let loads = (groups.iter().enumerate())
            .map(|(g, gs)| {
                let start = self.load_start(g, k, m);
                gs.table[start - gs.first..k + m - gs.first].to_vec()
            })
            .collect();
        for (c, allowed) in self.counters.iter_mut().zip(allowed) {
            if loadable.is_some() {
                c.external_query += ((hittable - k) * self.bs) as u64;
            }
            c.query_tokens += tokens.len() as u64;
            c.hit_tokens += (k_kv * self.bs) as u64;
            c.allowed_tokens += (allowed * self.bs) as u64;
        }
        // The state group alone allowed the longest checkpointed prefix it holds.
        let state_allowed = (1..=hittable)
            .rev()
            .find(|&k| self.checkpoint(tokens, &salt, k).is_some())
            .unwrap_or(0);
        if let Some(state) = &mut self.state {
            state.counters.prefix_allowed_tokens += (state_allowed * self.bs) as u64;
            state.counters.prefix_hit_tokens += (k * self.bs) as u64;
            // The KV was cached further than the state: the next prompt branching there
            // resumes from a checkpoint saved there.
            let branch = if common > k { common * self.bs } else { 0 };
            self.seen.branch_points += u64::from(branch > 0);
            self.seen.recomputed_hits += u64::from(k_kv > k);
            state.admit(seq, resumed, tokens.len(), branch, k * self.bs);
        }
        self.seqs.insert(
            seq,
            ModelSeq {
                tokens: tokens.to_vec(),
                salt,
                swapped: false,
                loading: (m > 0).then_some((k, m)),
                prompt_len: tokens.len(),
                groups,
            },
        );
        Ok((k * self.bs, loads))
    }

    /// The first logical block group `g` loads past a hit of `k` blocks extended by `m`: the
    /// hit, or the first block a query at the extended hit reads.
    fn load_start(&self, g: usize, k: usize, m: usize) -> usize {
        if m == 0 {
            return k;
        }
        k.max(self.first_block(g, (k + m) * self.bs))
    }

    /// How many blocks each group of `seq` was handed to load (none for a sequence that
    /// waits for no loads).
    fn handed_out(&self, seq: SeqId) -> Vec<usize> {
        match self.seqs.get(&seq).and_then(|s| s.loading) {
            Some((k, m)) => (self.groups())
                .map(|g| k + m - self.load_start(g, k, m))
                .collect(),
            None => Vec::new(),
        }
    }

    /// `confirm_loads` (`each`: `loaded[0]` for every group) and `confirm_group_loads` (a
    /// count per group).
    fn confirm_loads(&mut self, seq: SeqId, loaded: &[usize], each: bool) -> Expect<()> {
        self.no_state()?;
        if !each && loaded.len() != self.attention.len() {
            return Err(vec![invalid()]);
        }
        let Some(s) = self.seqs.get(&seq) else {
            return Err(vec![Error::UnknownSequence(seq)]);
        };
        let Some((k, m)) = s.loading else {
            return Err(vec![invalid()]);
        };
        let mut runs = Vec::new();
        for g in self.groups() {
            let start = self.load_start(g, k, m);
            let handed = k + m - start;
            let loaded = if each { loaded[0] } else { loaded[g] };
            if (each && loaded > m) || (!each && loaded > handed) {
                return Err(vec![invalid()]);
            }
            runs.push((start, loaded.min(handed)));
        }
        // The longest hit every group serves: the blocks a query there reads past `k` are
        // all within the group's loaded run.
        let upto = (k..=k + m)
            .rev()
            .find(|&upto| {
                (self.groups()).all(|g| {
                    let (start, run) = runs[g];
                    let reads = self.first_block(g, upto * self.bs);
                    upto == k || (upto <= start + run && k.max(reads) >= start)
                })
            })
            .expect("model: the hit is served");
        let from_hit = (k..=k + m)
            .rev()
            .find(|&upto| {
                (self.groups())
                    .filter(|&g| runs[g].0 == k)
                    .all(|g| upto <= k + runs[g].1)
            })
            .expect("model: the hit is served");
        let windowed = runs.iter().any(|&(start, _)| start > k);
        self.seen.window_loads += u64::from(windowed && upto > k);
        self.seen.window_short_loads += u64::from(windowed && from_hit > upto);
        self.seqs.get_mut(&seq).unwrap().loading = None;
        let tokens = upto * self.bs;
        for g in self.groups() {
            let gs = &mut self.seqs.get_mut(&seq).unwrap().groups[g];
            if upto > k {
                // Blocks before the first loaded one were never filled: never registered.
                gs.registered = gs.registered.max(runs[g].0);
            }
            gs.planned = gs.planned.max(tokens);
            self.commit_to(g, seq, tokens);
            let c = &mut self.counters[g];
            c.external_hit += ((upto - k) * self.bs) as u64;
            c.hit_tokens += ((upto - k) * self.bs) as u64;
            c.external_failures += (m - (upto - k)) as u64;
        }
        Ok(())
    }

    fn can_allocate(&self, tokens: &[Token], salt: Option<&[u8]>) -> bool {
        let salt = salt.map(<[u8]>::to_vec);
        let (common, _) = self.lookup(tokens, &salt);
        let (k_kv, k) = self.hits(tokens, &salt, common);
        let needed = self.alloc_needed(tokens, &salt, k_kv) as i64;
        let reserve = (self.watermark * self.num_blocks as f64).floor() as i64;
        let slot = (self.state.as_ref())
            .is_none_or(|state| state.available(self.checkpoint(tokens, &salt, k)) >= 1);
        slot && self.available() as i64 - needed >= reserve
    }

    /// The hits in blocks given the KV groups' common hit: what the KV groups take and where
    /// the state resumes. Full-attention KV groups take `common` and the state resumes at its
    /// latest checkpoint at or before it; with a windowed group, both are the longest hit
    /// every group serves and a checkpoint resumes.
    fn hits(&self, tokens: &[Token], salt: &Option<Vec<u8>>, common: usize) -> (usize, usize) {
        if self.state.is_none() {
            return (common, common);
        }
        let all_full = self.attention.iter().all(|&a| a == Attention::Full);
        let k = (0..=common)
            .rev()
            .find(|&k| {
                k == 0
                    || ((all_full || self.groups().all(|g| self.serves(g, tokens, salt, k)))
                        && self.checkpoint(tokens, salt, k).is_some())
            })
            .expect("0 is served");
        (if all_full { common } else { k }, k)
    }

    /// `cached_prefix_blocks`: where an admission now would resume the state.
    fn hit(&self, tokens: &[Token], salt: &Option<Vec<u8>>) -> usize {
        let (common, _) = self.lookup(tokens, salt);
        self.hits(tokens, salt, common).1
    }

    /// The checkpoint of the prompt's first `k` blocks (none for `k = 0`).
    fn checkpoint(&self, tokens: &[Token], salt: &Option<Vec<u8>>, k: usize) -> Option<SlotId> {
        let state = self.state.as_ref()?;
        let last = k.checked_sub(1)?;
        state.map.get(&self.key(0, salt, tokens, last)).copied()
    }

    /// Refuses a load: no external store holds recurrent states.
    fn no_state(&mut self) -> Expect<()> {
        if self.state.is_some() {
            self.seen.state_refusals += 1;
            return Err(vec![invalid()]);
        }
        Ok(())
    }

    /// With a state group, every row's query must start at its sequence's state point.
    fn check_resume(&mut self, seqs: &[SeqId], starts: &[usize]) -> Expect<()> {
        let Some(state) = &self.state else {
            return Ok(());
        };
        if (seqs.iter().zip(starts)).any(|(s, &start)| state.seqs[s].resume != start) {
            self.seen.resume_refusals += 1;
            return Err(vec![invalid()]);
        }
        Ok(())
    }

    /// Commits the state saves of `seq` its computed tokens reach, under group 0's keys.
    fn commit_states(&mut self, seq: SeqId) {
        let (Some(state), Some(m)) = (self.state.as_mut(), self.seqs.get(&seq)) else {
            return;
        };
        let caching = self.caching;
        state.commit(seq, m.computed(), |point| {
            caching.then(|| (0, m.salt.clone(), m.tokens[..point].to_vec()))
        });
    }

    /// The state inputs of a pass whose rows are `(sequence, query start, drafts)`, into
    /// group 0's plan: every row's due saves are committed first, then the queue and rows are
    /// planned.
    fn plan_states(&mut self, rows: &[(SeqId, usize, usize)], plan: &mut Plan) {
        if self.state.is_none() {
            return;
        }
        for &(seq, ..) in rows {
            self.commit_states(seq);
        }
        let rows: Vec<(SeqId, usize, usize, usize)> = (rows.iter())
            .map(|&(seq, start, drafts)| (seq, start, self.seqs[&seq].tokens.len(), drafts))
            .collect();
        let state = self.state.as_mut().expect("checked");
        state.plan(&rows, plan);
    }

    /// Blocks group `g` takes to append `m` tokens to `s`.
    fn append_needed(&self, g: usize, s: &ModelSeq, m: usize) -> usize {
        let (len, table) = (s.tokens.len(), &s.groups[g].table);
        let cow =
            !len.is_multiple_of(self.bs) && self.refcount[*table.last().unwrap() as usize] > 1;
        usize::from(cow) + (len + m).div_ceil(self.bs) - len.div_ceil(self.bs)
    }

    /// Appends `tokens` to every group of `seq`, group by group, with capacity already checked.
    fn do_append(&mut self, seq: SeqId, tokens: &[Token]) {
        let len = self.seqs[&seq].tokens.len();
        self.seqs
            .get_mut(&seq)
            .unwrap()
            .tokens
            .extend_from_slice(tokens);
        for g in self.groups() {
            self.grow(g, seq, len);
        }
    }

    /// Group `g`'s blocks for the tokens appended to `seq` past `len`: CoW of a shared partial
    /// last block (the copy keeps the source), then the new blocks.
    fn grow(&mut self, g: usize, seq: SeqId, len: usize) {
        let mut s = self.seqs.remove(&seq).expect("model: validated");
        let new_len = s.tokens.len();
        let gs = &mut s.groups[g];
        if !len.is_multiple_of(self.bs) {
            let last = *gs.table.last().unwrap();
            if self.refcount[last as usize] > 1 {
                let dst = self.take(g);
                gs.copies.push(Copy {
                    src: last,
                    dst,
                    fill: len % self.bs,
                    until: 0,
                });
                *gs.table.last_mut().unwrap() = dst;
            }
        }
        for _ in len.div_ceil(self.bs)..new_len.div_ceil(self.bs) {
            let b = self.take(g);
            gs.table.push(b);
        }
        self.seqs.insert(seq, s);
    }

    fn append(&mut self, seq: SeqId, tokens: &[Token]) -> Expect<()> {
        let mut errs = Vec::new();
        self.gpu_seq_errors(seq, &mut errs);
        if tokens.is_empty() {
            errs.push(invalid());
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for g in self.groups() {
            self.auto_commit(g, seq);
        }
        let needed = (self.groups())
            .map(|g| self.append_needed(g, &self.seqs[&seq], tokens.len()))
            .sum();
        if needed > self.available() {
            let available = self.available();
            return self.out_of_blocks(PoolKind::Gpu, needed, available);
        }
        // A prompt admitted in chunks ends where the decode steps begin.
        let s = self.seqs.get_mut(&seq).expect("model: validated");
        let prompt = s.prompt_len == s.tokens.len();
        self.do_append(seq, tokens);
        let s = self.seqs.get_mut(&seq).expect("model: validated");
        if prompt {
            s.prompt_len = s.tokens.len();
        }
        if let Some(state) = &mut self.state {
            let point = s.prompt_len / self.bs * self.bs;
            state.seqs.get_mut(&seq).expect("model: live").prompt_point = point;
        }
        Ok(())
    }

    /// With windowed attention, releases group `g`'s blocks of `seq` that no query from
    /// `position` on reads, in logical order: to the front of the cached queue, but for the
    /// blocks a request resuming at the end of the prompt reads, which go to the back.
    fn release_behind(&mut self, g: usize, seq: SeqId, position: usize) {
        let keep = self.first_block(g, position);
        let mut s = self.seqs.remove(&seq).expect("model: validated");
        let first = s.groups[g].first;
        if keep > first {
            let resume = (s.prompt_len - 1) / self.bs;
            let kept = self.first_block(g, resume * self.bs)..resume;
            let released: Vec<BlockId> = s.groups[g].table.drain(..keep - first).collect();
            for (j, b) in released.into_iter().enumerate() {
                let front = !kept.contains(&(first + j));
                if self.release_as(b, front) {
                    self.seen.front_cached += u64::from(front);
                    self.seen.back_cached += u64::from(!front);
                }
                self.seen.window_releases += 1;
            }
            s.groups[g].first = keep;
        }
        self.seqs.insert(seq, s);
    }

    /// Group `g`'s plan row of the sequence for its last `q` tokens; delivers its copies.
    fn plan_row(&mut self, g: usize, seq: SeqId, q: usize, p: &mut Plan) {
        let bs = self.bs;
        let s = self.seqs.get_mut(&seq).expect("model: validated");
        let kv_len = s.tokens.len();
        let gs = &mut s.groups[g];
        let pages = kv_len.div_ceil(bs);
        assert_eq!(pages - gs.first, gs.table.len());
        p.kv_indptr
            .push(p.kv_indptr.last().unwrap() + gs.table.len() as i32);
        p.kv_indices.extend(gs.table.iter().map(|&b| b as i32));
        p.kv_last_page_len.push((kv_len - (pages - 1) * bs) as i32);
        p.qo_indptr.push(p.qo_indptr.last().unwrap() + q as i32);
        for pos in kv_len - q..kv_len {
            p.positions.push(pos as i32);
            p.slot_mapping
                .push((gs.table[pos / bs - gs.first] as usize * bs + pos % bs) as i32);
        }
        for mut c in gs.copies.drain(..) {
            p.copies.extend([c.src as i32, c.dst as i32]);
            c.until = kv_len;
            gs.copying.push(c);
        }
        gs.planned = kv_len;
    }

    fn begin_plan(&self, g: usize) -> Plan {
        let mut p = Plan::default();
        p.kv_indptr.push(0);
        p.qo_indptr.push(0);
        p.block_size = self.bs as u32;
        p.attention = self.attention[g];
        p
    }

    /// Counts the plan's copies once every sequence is in.
    fn finish_plan(&mut self, p: &mut Plan) {
        self.seen.copies += p.copies.len() as u64 / 2;
    }

    fn step(&mut self, seqs: &[SeqId], tokens: &[Token]) -> Expect<Vec<Plan>> {
        self.verify(seqs, tokens, &vec![1; seqs.len()])
    }

    /// `step` with `counts[i]` tokens for `seqs[i]` (`verify_batch`; `step` is all ones): one
    /// plan per group.
    fn verify(&mut self, seqs: &[SeqId], tokens: &[Token], counts: &[u32]) -> Expect<Vec<Plan>> {
        let mut errs = Vec::new();
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        if seqs.len() != counts.len()
            || total != tokens.len()
            || counts.contains(&0)
            || has_repeats(seqs)
        {
            errs.push(invalid());
        }
        for &s in seqs {
            self.gpu_seq_errors(s, &mut errs);
            if let Some(m) = self.seqs.get(&s) {
                if m.planned() != m.tokens.len() {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let starts: Vec<usize> = seqs.iter().map(|s| self.seqs[s].tokens.len()).collect();
        // A completed copy may unshare another member's tail: those commits come first.
        for g in self.groups() {
            for &s in seqs {
                if !self.seqs[&s].groups[g].copying.is_empty() {
                    self.auto_commit(g, s);
                }
            }
        }
        self.check_resume(seqs, &starts)?;
        let drafts: Vec<usize> = counts.iter().map(|&c| c as usize - 1).collect();
        self.check_draft_slots(&drafts)?;
        let needed: usize = (self.groups())
            .map(|g| {
                (seqs.iter().zip(counts))
                    .map(|(s, &c)| self.append_needed(g, &self.seqs[s], c as usize))
                    .sum::<usize>()
            })
            .sum();
        if needed > self.available() {
            let available = self.available();
            return self.out_of_blocks(PoolKind::Gpu, needed, available);
        }
        let mut starts = Vec::new();
        let mut rest = tokens;
        for (&s, &c) in seqs.iter().zip(counts) {
            let (appended, after) = rest.split_at(c as usize);
            rest = after;
            let m = self.seqs.get_mut(&s).unwrap();
            starts.push(m.tokens.len());
            m.tokens.extend_from_slice(appended);
        }
        let mut plans = Vec::new();
        for g in self.groups() {
            let mut p = self.begin_plan(g);
            for ((&s, &c), &start) in seqs.iter().zip(counts).zip(&starts) {
                self.auto_commit(g, s);
                self.grow(g, s, start);
                self.release_behind(g, s, start);
                self.plan_row(g, s, c as usize, &mut p);
            }
            self.finish_plan(&mut p);
            plans.push(p);
        }
        let rows: Vec<(SeqId, usize, usize)> = (seqs.iter().zip(starts).zip(drafts))
            .map(|((&seq, start), drafts)| (seq, start, drafts))
            .collect();
        self.plan_states(&rows, &mut plans[0]);
        Ok(plans)
    }

    /// With a state group, the draft states of a pass need slots: after the passes' other
    /// checks, before the KV pool's capacity.
    fn check_draft_slots(&mut self, drafts: &[usize]) -> Expect<()> {
        let Some(state) = &self.state else {
            return Ok(());
        };
        let (needed, available) = (drafts.iter().sum(), state.available(None));
        if needed > available {
            self.seen.out_of_state_slots += 1;
            return Err(vec![Error::OutOfStateSlots { needed, available }]);
        }
        Ok(())
    }

    /// `rollback`: drops the last `counts[i]` (uncommitted) tokens of `seqs[i]`; in each
    /// group, group by group, the blocks past the new length are released, last first.
    fn rollback(&mut self, seqs: &[SeqId], counts: &[usize]) -> Expect<()> {
        let mut errs = Vec::new();
        if seqs.len() != counts.len() || has_repeats(seqs) {
            errs.push(invalid());
        }
        for (&seq, &count) in seqs.iter().zip(counts) {
            self.gpu_seq_errors(seq, &mut errs);
            if let Some(m) = self.seqs.get(&seq) {
                let len = m.tokens.len();
                // The window is checked last (`reads_released` counts refusals).
                if m.groups[0].swap_source.is_some()
                    || count > len - m.computed()
                    || count == len
                    || self.reads_released(seq, len - count)
                {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        // The state group: a rollback below a state point ends at a draft state.
        if let Some(state) = &self.state {
            let kept = (seqs.iter().zip(counts))
                .all(|(s, &n)| state.can_roll_back(*s, self.seqs[s].tokens.len() - n));
            if !kept {
                self.seen.draft_refusals += 1;
                return Err(vec![invalid()]);
            }
        }
        for g in self.groups() {
            for (&seq, &count) in seqs.iter().zip(counts) {
                let m = self.seqs.get_mut(&seq).expect("model: validated");
                let len = m.tokens.len() - count;
                let gs = &mut m.groups[g];
                let pages = len.div_ceil(self.bs);
                let dropped: Vec<BlockId> = gs.table.drain(pages - gs.first..).rev().collect();
                gs.planned = gs.planned.min(len);
                for c in &mut gs.copying {
                    c.until = c.until.min(len);
                }
                for b in dropped {
                    self.release(b);
                }
            }
        }
        for (&seq, &count) in seqs.iter().zip(counts) {
            let m = self.seqs.get_mut(&seq).expect("model: validated");
            m.tokens.truncate(m.tokens.len() - count);
            self.seen.rolled_back += count as u64;
            let len = m.tokens.len();
            if let Some(state) = self.state.as_mut() {
                self.seen.state_rollbacks += u64::from(state.rollback(seq, len));
            }
        }
        Ok(())
    }

    /// `plan`, or `plan_with_drafts` when `drafts` are given (a hybrid manager's).
    fn plan(
        &mut self,
        seqs: &[SeqId],
        query_lens: &[u32],
        drafts: Option<&[u32]>,
    ) -> Expect<Vec<Plan>> {
        let mut errs = Vec::new();
        if seqs.len() != query_lens.len() || has_repeats(seqs) {
            errs.push(invalid());
        }
        if drafts.is_some_and(|d| {
            d.len() != seqs.len() || d.iter().zip(query_lens).any(|(&d, &q)| d >= q)
        }) {
            errs.push(invalid());
        }
        for (&s, &q) in seqs.iter().zip(query_lens) {
            self.gpu_seq_errors(s, &mut errs);
            if let Some(m) = self.seqs.get(&s) {
                let len = m.tokens.len();
                if q < 1
                    || q as usize > len
                    || len - q as usize > m.planned()
                    || self.reads_released(s, len - q as usize)
                {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let starts: Vec<usize> = (seqs.iter().zip(query_lens))
            .map(|(s, &q)| self.seqs[s].tokens.len() - q as usize)
            .collect();
        self.check_resume(seqs, &starts)?;
        let drafts: Vec<usize> = match drafts {
            Some(d) => d.iter().map(|&d| d as usize).collect(),
            None => vec![0; seqs.len()],
        };
        self.check_draft_slots(&drafts)?;
        // With a state group, queries over KV planned already (a state recomputed over a KV
        // hit) write no KV: slot -1.
        let cached: Vec<usize> = (seqs.iter().zip(&starts))
            .map(|(s, &start)| match self.state {
                Some(_) => self.seqs[s].planned().saturating_sub(start),
                None => 0,
            })
            .collect();
        self.seen.recomputed_rows += cached.iter().filter(|&&n| n > 0).count() as u64;
        let mut plans = Vec::new();
        for g in self.groups() {
            let mut p = self.begin_plan(g);
            for ((&s, &q), &start) in seqs.iter().zip(query_lens).zip(&starts) {
                self.auto_commit(g, s);
                let n = cached[p.batch_size()];
                self.release_behind(g, s, start);
                let at = p.slot_mapping.len();
                self.plan_row(g, s, q as usize, &mut p);
                p.slot_mapping[at..at + n].fill(-1);
            }
            self.finish_plan(&mut p);
            plans.push(p);
        }
        let rows: Vec<(SeqId, usize, usize)> = (seqs.iter().zip(query_lens).zip(drafts))
            .map(|((&s, &q), d)| (s, self.seqs[&s].tokens.len() - q as usize, d))
            .collect();
        self.plan_states(&rows, &mut plans[0]);
        Ok(plans)
    }

    fn commit(&mut self, seqs: &[SeqId], upto: Option<&[usize]>) -> Expect<()> {
        let mut errs = Vec::new();
        if upto.is_some_and(|u| u.len() != seqs.len()) || has_repeats(seqs) {
            errs.push(invalid());
        }
        for (b, &s) in seqs.iter().enumerate() {
            match self.seqs.get(&s) {
                None => errs.push(Error::UnknownSequence(s)),
                Some(m) if m.swapped => errs.push(Error::SwappedOut(s)),
                Some(m) => {
                    if upto
                        .and_then(|u| u.get(b))
                        .is_some_and(|&n| n > m.planned())
                    {
                        errs.push(invalid());
                    }
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for g in self.groups() {
            for (b, &s) in seqs.iter().enumerate() {
                let n = upto.map_or(self.seqs[&s].planned(), |u| u[b]);
                self.commit_to(g, s, n);
            }
        }
        for &s in seqs {
            self.commit_states(s);
        }
        self.seen.commits += 1;
        Ok(())
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> Expect<()> {
        let mut errs = Vec::new();
        self.gpu_seq_errors(parent, &mut errs);
        if self
            .seqs
            .get(&parent)
            .is_some_and(ModelSeq::swap_in_pending)
        {
            errs.push(invalid());
        }
        if self.seqs.contains_key(&child) {
            errs.push(Error::DuplicateSequence(child));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for g in self.groups() {
            self.auto_commit(g, parent);
        }
        let p = &self.seqs[&parent];
        if p.computed() != p.tokens.len() {
            return Err(vec![invalid()]);
        }
        // The child's working slot, after every other check and the parent's auto-commit.
        if let Some(state) = &self.state {
            let available = state.available(None);
            if available < 1 {
                self.seen.out_of_state_slots += 1;
                return Err(vec![Error::OutOfStateSlots {
                    needed: 1,
                    available,
                }]);
            }
        }
        let p = &self.seqs[&parent];
        let copy = ModelSeq {
            tokens: p.tokens.clone(),
            salt: p.salt.clone(),
            swapped: false,
            loading: None,
            prompt_len: p.prompt_len,
            groups: (p.groups.iter())
                .map(|gs| GroupSeq {
                    table: gs.table.clone(),
                    first: gs.first,
                    computed: gs.computed,
                    planned: gs.computed,
                    registered: gs.registered,
                    copies: Vec::new(),
                    copying: Vec::new(),
                    swap_source: None,
                })
                .collect(),
        };
        for gs in &copy.groups {
            for &b in &gs.table {
                self.refcount[b as usize] += 1;
            }
        }
        self.seqs.insert(child, copy);
        if let Some(state) = &mut self.state {
            self.seen.chained_forks += u64::from(state.fork(parent, child));
        }
        self.seen.forks += 1;
        Ok(())
    }

    fn free(&mut self, seq: SeqId) -> Expect<()> {
        let Some(s) = self.seqs.remove(&seq) else {
            return Err(vec![Error::UnknownSequence(seq)]);
        };
        for gs in &s.groups {
            for &b in gs.table.iter().rev() {
                if s.swapped {
                    self.release_cpu(b);
                } else {
                    self.release(b);
                }
            }
            if let Some(source) = &gs.swap_source {
                for &b in source.iter().rev() {
                    if s.swapped {
                        self.release(b);
                    } else {
                        self.release_cpu(b);
                    }
                }
            }
            for c in gs.copies.iter().chain(&gs.copying) {
                self.release(c.src);
            }
        }
        if let Some((_, count)) = s.loading {
            for c in &mut self.counters {
                c.external_failures += count as u64;
            }
        }
        if let Some(state) = &mut self.state {
            self.seen.draining += u64::from(state.free(seq));
        }
        Ok(())
    }

    /// Distinct blocks of group `g`'s tables of the sequences in first-appearance order, with
    /// reference counts.
    fn distinct_blocks(&self, g: usize, seqs: &[SeqId]) -> Vec<(BlockId, u32)> {
        let mut out: Vec<(BlockId, u32)> = Vec::new();
        for s in seqs {
            for &b in &self.seqs[s].groups[g].table {
                match out.iter_mut().find(|(x, _)| *x == b) {
                    Some((_, c)) => *c += 1,
                    None => out.push((b, 1)),
                }
            }
        }
        out
    }

    /// Errors of a swap or swap confirmation: the sequences must be live, distinct and
    /// swapped out (`swapped`) or not.
    fn side_errors(&self, seqs: &[SeqId], swapped: bool) -> Vec<Error> {
        let mut errs = Vec::new();
        if has_repeats(seqs) {
            errs.push(invalid());
        }
        for &s in seqs {
            match self.seqs.get(&s) {
                None => errs.push(Error::UnknownSequence(s)),
                Some(m) if m.swapped && !swapped => errs.push(Error::SwappedOut(s)),
                Some(m) if !m.swapped && swapped => errs.push(Error::NotSwappedOut(s)),
                Some(_) => {}
            }
        }
        errs
    }

    /// Moves group `g`'s tables of the sequences to fresh blocks of the other pool; the old
    /// tables become their swap sources.
    fn move_tables(&mut self, g: usize, seqs: &[SeqId], pairs: &[[BlockId; 2]], to_gpu: bool) {
        for s in seqs {
            let m = self.seqs.get_mut(s).unwrap();
            m.swapped = !to_gpu;
            let gs = &mut m.groups[g];
            gs.swap_source = Some(gs.table.clone());
            for b in &mut gs.table {
                *b = pairs.iter().find(|p| p[0] == *b).unwrap()[1];
            }
            if to_gpu {
                gs.registered = 0;
            }
        }
    }

    /// The state group's refusal of a swap, after the KV groups' checks.
    fn state_swap_error(&mut self, seqs: &[SeqId], to_gpu: bool) -> Expect<()> {
        let Some(e) = (self.state.as_ref()).and_then(|st| st.swap_error(seqs, to_gpu)) else {
            return Ok(());
        };
        if matches!(e, Error::OutOfStateSlots { .. }) {
            self.seen.out_of_state_slots += 1;
        }
        Err(vec![e])
    }

    fn swap_out(&mut self, seqs: &[SeqId]) -> Expect<Vec<Vec<[BlockId; 2]>>> {
        let mut errs = self.side_errors(seqs, false);
        for &s in seqs {
            if let Some(m) = self.seqs.get(&s).filter(|m| !m.swapped) {
                let gs = &m.groups[0];
                let in_flight =
                    !self.auto_commit && (gs.planned != gs.computed || !gs.copying.is_empty());
                if gs.swap_source.is_some()
                    || m.loading.is_some()
                    || !gs.copies.is_empty()
                    || in_flight
                {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for g in self.groups() {
            for &s in seqs {
                self.auto_commit(g, s);
            }
        }
        self.state_swap_error(seqs, false)?;
        let needed: usize = self
            .groups()
            .map(|g| self.distinct_blocks(g, seqs).len())
            .sum();
        if needed > self.cpu_free.len() {
            let available = self.cpu_free.len();
            return self.out_of_blocks(PoolKind::Cpu, needed, available);
        }
        let mut all = Vec::new();
        for g in self.groups() {
            let mut pairs = Vec::new();
            for (gpu, count) in self.distinct_blocks(g, seqs) {
                let cpu = self.cpu_free.pop().unwrap();
                self.cpu_refcount[cpu as usize] = count;
                pairs.push([gpu, cpu]);
            }
            self.move_tables(g, seqs, &pairs, false);
            all.push(pairs);
        }
        if self.state.is_some() {
            for &s in seqs {
                self.commit_states(s);
            }
            all.extend(self.state.as_mut().map(|state| state.swap_out(seqs)));
        }
        Ok(all)
    }

    fn confirm_swap_out(&mut self, seqs: &[SeqId]) -> Expect<()> {
        let mut errs = self.side_errors(seqs, true);
        for &s in seqs {
            if self
                .seqs
                .get(&s)
                .is_some_and(|m| m.swapped && m.groups[0].swap_source.is_none())
            {
                errs.push(invalid());
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for g in self.groups() {
            for &s in seqs {
                let gs = &mut self.seqs.get_mut(&s).unwrap().groups[g];
                let source = gs.swap_source.take().unwrap();
                for &b in source.iter().rev() {
                    self.release(b);
                }
                if g == 0 {
                    self.announce_cpu(s);
                }
            }
        }
        if let Some(state) = &mut self.state {
            self.seen.draining += state.confirm_swap_out(seqs);
            self.seen.state_swap_outs += 1;
        }
        self.seen.swap_outs += 1;
        Ok(())
    }

    /// The computed full blocks group 0 of a swapped-out sequence holds enter the CPU tier in
    /// logical order.
    fn announce_cpu(&mut self, seq: SeqId) {
        if !self.caching || !self.events_on {
            return;
        }
        let s = self.seqs[&seq].clone();
        let gs = &s.groups[0];
        for i in gs.first..gs.computed / self.bs {
            let block = gs.table[i - gs.first];
            if self.cpu_tier.contains_key(&block) {
                continue;
            }
            let key = self.key(0, &s.salt, &s.tokens, i);
            self.cpu_tier.insert(block, key.clone());
            let copies = self.cpu_copies.entry(key.clone()).or_insert(0);
            *copies += 1;
            if *copies == 1 {
                let token_ids = s.tokens[i * self.bs..(i + 1) * self.bs].to_vec();
                self.emit(ModelEvent::Stored {
                    key,
                    token_ids,
                    block_id: block,
                    medium: PoolKind::Cpu,
                });
            }
        }
    }

    fn swap_in(&mut self, seqs: &[SeqId]) -> Expect<Vec<Vec<[BlockId; 2]>>> {
        let mut errs = self.side_errors(seqs, true);
        for &s in seqs {
            if self
                .seqs
                .get(&s)
                .is_some_and(|m| m.swapped && m.groups[0].swap_source.is_some())
            {
                errs.push(invalid());
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        self.state_swap_error(seqs, true)?;
        let needed: usize = self
            .groups()
            .map(|g| self.distinct_blocks(g, seqs).len())
            .sum();
        if needed > self.available() {
            let available = self.available();
            return self.out_of_blocks(PoolKind::Gpu, needed, available);
        }
        let mut all = Vec::new();
        for g in self.groups() {
            let mut pairs = Vec::new();
            for (cpu, count) in self.distinct_blocks(g, seqs) {
                let gpu = self.take(g);
                self.refcount[gpu as usize] = count;
                pairs.push([cpu, gpu]);
            }
            self.move_tables(g, seqs, &pairs, true);
            all.push(pairs);
        }
        if let Some(state) = &mut self.state {
            all.push(state.swap_in(seqs));
            self.seen.state_swap_ins += 1;
        }
        Ok(all)
    }

    fn confirm_swap_in(&mut self, seqs: &[SeqId]) -> Expect<()> {
        let mut errs = self.side_errors(seqs, false);
        for &s in seqs {
            if self
                .seqs
                .get(&s)
                .is_some_and(|m| !m.swapped && m.groups[0].swap_source.is_none())
            {
                errs.push(invalid());
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for g in self.groups() {
            for &s in seqs {
                let gs = &mut self.seqs.get_mut(&s).unwrap().groups[g];
                let source = gs.swap_source.take().unwrap();
                let computed = gs.computed;
                for &b in source.iter().rev() {
                    self.release_cpu(b);
                }
                self.commit_to(g, s, computed);
            }
        }
        if let Some(state) = &mut self.state {
            state.confirm_swap_in(seqs);
        }
        self.seen.swap_ins += 1;
        Ok(())
    }

    fn reset_prefix_cache(&mut self) {
        while let Some(b) = self.cached.pop_front() {
            self.free.push(b);
        }
        self.hash.iter_mut().for_each(|h| *h = None);
        self.prefix.clear();
        self.cpu_tier.clear();
        self.cpu_copies.clear();
        self.emit(ModelEvent::Cleared);
        if let Some(state) = &mut self.state {
            state.reset();
        }
    }

    /// Group `g`'s stats: the pool's counts (shared by every group) and the group's counters.
    fn stats(&self, g: usize) -> Stats {
        let mut fill: HashMap<BlockId, usize> = HashMap::new();
        let mut hold = |b: BlockId, n: usize| {
            let prev = fill.insert(b, n);
            assert!(
                prev.is_none() || prev == Some(n),
                "model: holders disagree on the fill of block {b}"
            );
        };
        let (mut computed, mut pending) = (0, 0);
        for m in self.seqs.values() {
            let len = m.tokens.len();
            computed += m.groups[g].computed as u64;
            pending += (len - m.groups[g].computed) as u64;
            for gs in &m.groups {
                let gpu_table = if m.swapped {
                    gs.swap_source.as_ref()
                } else {
                    Some(&gs.table)
                };
                for (j, &b) in gpu_table.into_iter().flatten().enumerate() {
                    hold(b, (len - (gs.first + j) * self.bs).min(self.bs));
                }
                for c in gs.copies.iter().chain(&gs.copying) {
                    hold(c.src, c.fill);
                }
            }
        }
        let held = self.num_blocks - self.free.len() - self.cached.len();
        let stored: usize = fill.values().sum();
        let c = &self.counters[g];
        Stats {
            num_blocks: self.num_blocks,
            num_free: self.free.len(),
            num_cached: self.cached.len(),
            num_held: held,
            usage: held as f64 / self.num_blocks as f64,
            token_usage: if held == 0 {
                0.0
            } else {
                stored as f64 / (held * self.bs) as f64
            },
            stored_tokens: stored,
            prefix_query_tokens: c.query_tokens,
            prefix_hit_tokens: c.hit_tokens,
            prefix_allowed_tokens: c.allowed_tokens,
            evictions: c.evictions,
            computed_tokens: computed,
            pending_tokens: pending,
            external_query_tokens: c.external_query,
            external_hit_tokens: c.external_hit,
            external_failures: c.external_failures,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

/// Which live sequences an operation wants to name.
#[derive(Clone, Copy, Debug)]
enum Want {
    /// On the GPU.
    Resident,
    /// On the GPU with every token planned (a step or fork can succeed).
    Ready,
    /// Swapped out, the swap-out not yet confirmed.
    SwapOutPending,
    /// Swapped out and confirmed (a swap-in can succeed).
    SwappedOut,
    /// Swapped in, not yet confirmed.
    SwapInPending,
    /// Waiting for `confirm_loads`.
    Loading,
    /// Any live sequence.
    Any,
}

impl Want {
    fn matches(self, m: &ModelSeq) -> bool {
        match self {
            Want::Resident => !m.swapped,
            Want::Ready => !m.swapped && m.loading.is_none() && m.planned() == m.tokens.len(),
            Want::SwapOutPending => m.swapped && m.groups[0].swap_source.is_some(),
            Want::SwappedOut => m.swapped && m.groups[0].swap_source.is_none(),
            Want::SwapInPending => m.swap_in_pending(),
            Want::Loading => m.loading.is_some(),
            Want::Any => true,
        }
    }
}

/// A sequence id, resolved against the model's state when the operation runs (so that most
/// operations name a sequence in the right state, and shrinking keeps them meaningful).
#[derive(Clone, Debug)]
enum SeqRef {
    /// The `i`-th (mod count) live sequence in the state the operation wants.
    Live(Index),
    /// The smallest id that is not live.
    Fresh,
    /// Any id, live or not.
    Raw(SeqId),
}

/// A batch: distinct sequences in the wanted state, then maybe one bad entry.
#[derive(Clone, Debug)]
struct Batch {
    picks: Vec<Index>,
    extra: Extra,
}

#[derive(Clone, Debug)]
enum Extra {
    None,
    /// Repeat the first sequence.
    Repeat,
    /// Add any id (unknown, or live in the wrong state).
    Raw(SeqId),
}

#[derive(Clone, Debug)]
struct Prompt {
    prefix: usize,
    suffix: Vec<Token>,
    salt: usize,
}

impl Prompt {
    /// The prompt's tokens, each repeated `stretch` times.
    fn tokens(&self, stretch: usize) -> Vec<Token> {
        let mut t = SYSTEM_PREFIXES[self.prefix].to_vec();
        t.extend_from_slice(&self.suffix);
        stretched(&t, stretch)
    }

    fn salt(&self) -> Option<&'static [u8]> {
        SALTS[self.salt]
    }
}

/// A count resolved against a sequence: a query length for `plan`, a token count for `commit`
/// or a block count for `confirm_loads`.
#[derive(Clone, Debug)]
enum Count {
    /// The natural one: every unplanned token (at least 1), everything planned, every load.
    Rest,
    /// Some valid value, picked by `i`.
    Valid(u32),
    /// Any value (0 and past the end are often errors).
    Raw(u32),
}

impl Count {
    /// Resolves within the valid range `lo..=hi` (`rest` for `Rest`).
    fn resolve(&self, lo: usize, hi: usize, rest: usize) -> usize {
        match self {
            Count::Rest => rest,
            Count::Valid(i) => lo + *i as usize % (hi - lo + 1),
            Count::Raw(n) => *n as usize,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Allocate {
        seq: SeqRef,
        prompt: Prompt,
    },
    AllocateLoading {
        seq: SeqRef,
        prompt: Prompt,
        loadable: usize,
    },
    ConfirmLoads {
        seq: SeqRef,
        loaded: Count,
    },
    /// `confirm_group_loads`: a count per group (one more or fewer now and then).
    ConfirmGroupLoads {
        seq: SeqRef,
        loaded: Vec<Count>,
    },
    CanAllocate {
        prompt: Prompt,
    },
    Append {
        seq: SeqRef,
        tokens: Vec<Token>,
    },
    Step {
        batch: Batch,
        ready: bool,
        tokens: Vec<Token>,
        extra_token: bool,
        /// Through the harness's persistent batches (`step_batch`), their rows made those of
        /// `batch` first, instead of `step`.
        persistent: bool,
    },
    /// `plan`; a hybrid manager's with drafts (`plan_with_drafts`) when `drafts` is given.
    Plan {
        batch: Batch,
        query_lens: Vec<Count>,
        drafts: Option<Vec<Count>>,
    },
    /// `verify_batch` through the harness's persistent batches, their rows made those of `batch`
    /// first: each row appends its drafted tokens, 1 to 5 (or a raw, possibly bad, count).
    Verify {
        batch: Batch,
        counts: Vec<Count>,
        tokens: Vec<Token>,
        extra_token: bool,
    },
    /// `rollback` of up to each sequence's uncommitted tokens, or `rollback_batch` of the
    /// harness's persistent batches, their rows made those of `batch` first.
    Rollback {
        batch: Batch,
        counts: Vec<Count>,
        persistent: bool,
    },
    Commit {
        batch: Batch,
        upto: Option<Vec<Count>>,
        extra_count: bool,
    },
    Fork {
        parent: SeqRef,
        child: SeqRef,
    },
    Free {
        seq: SeqRef,
    },
    SwapOut {
        batch: Batch,
    },
    ConfirmSwapOut {
        batch: Batch,
    },
    SwapIn {
        batch: Batch,
    },
    ConfirmSwapIn {
        batch: Batch,
    },
    ResetPrefixCache,
    TakeEvents,
}

/// Each of `tokens` repeated `stretch` times: prompts and appends scaled to a block size, so
/// that blocks of 16 or 32 tokens fill, share and copy as often as blocks of 2 to 4.
fn stretched(tokens: &[Token], stretch: usize) -> Vec<Token> {
    (tokens.iter())
        .flat_map(|&t| std::iter::repeat_n(t, stretch))
        .collect()
}

fn token() -> impl Strategy<Value = Token> {
    prop_oneof![30 => 0u32..4, 1 => Just(u32::MAX)]
}

fn prompt() -> impl Strategy<Value = Prompt> {
    (
        0..SYSTEM_PREFIXES.len(),
        prop::collection::vec(token(), 0..=6),
        prop_oneof![6 => Just(0usize), 1 => Just(1), 1 => Just(2)],
    )
        .prop_map(|(prefix, suffix, salt)| Prompt {
            prefix,
            suffix,
            salt,
        })
}

fn live_ref() -> impl Strategy<Value = SeqRef> {
    prop_oneof![12 => any::<Index>().prop_map(SeqRef::Live), 1 => (0..NUM_IDS).prop_map(SeqRef::Raw)]
}

fn new_ref() -> impl Strategy<Value = SeqRef> {
    prop_oneof![12 => Just(SeqRef::Fresh), 1 => (0..NUM_IDS).prop_map(SeqRef::Raw)]
}

fn batch(max: usize) -> impl Strategy<Value = Batch> {
    (
        prop::collection::vec(any::<Index>(), 1..=max),
        prop_oneof![
            30 => Just(Extra::None),
            1 => Just(Extra::Repeat),
            1 => (0..NUM_IDS).prop_map(Extra::Raw),
        ],
    )
        .prop_map(|(picks, extra)| Batch { picks, extra })
}

fn count() -> impl Strategy<Value = Count> {
    prop_oneof![
        10 => Just(Count::Rest),
        5 => any::<u32>().prop_map(Count::Valid),
        1 => (0u32..20).prop_map(Count::Raw),
    ]
}

/// An operation; with a state group (`state`), the loads it refuses come less often, and
/// forks and swaps more often.
fn op(state: bool) -> impl Strategy<Value = Op> {
    let (loads, speculative, fork) = if state { (1, 4, 4) } else { (2, 4, 2) };
    let swaps = if state { 4 } else { 2 };
    let append_tokens = prop_oneof![
        15 => prop::collection::vec(token(), 1..=5),
        1 => Just(Vec::new()),
    ];
    prop_oneof![
        8 => (new_ref(), prompt()).prop_map(|(seq, prompt)| Op::Allocate { seq, prompt }),
        loads => (new_ref(), prompt(), 0usize..6)
            .prop_map(|(seq, prompt, loadable)| Op::AllocateLoading { seq, prompt, loadable }),
        loads => (live_ref(), count()).prop_map(|(seq, loaded)| Op::ConfirmLoads { seq, loaded }),
        loads => (live_ref(), prop::collection::vec(count(), 1..=4))
            .prop_map(|(seq, loaded)| Op::ConfirmGroupLoads { seq, loaded }),
        2 => prompt().prop_map(|prompt| Op::CanAllocate { prompt }),
        4 => (live_ref(), append_tokens).prop_map(|(seq, tokens)| Op::Append { seq, tokens }),
        7 => (
            batch(4),
            prop::bool::weighted(0.9),
            prop::collection::vec(token(), 4),
            prop::bool::weighted(0.03),
            any::<bool>(),
        )
            .prop_map(|(batch, ready, tokens, extra_token, persistent)| Op::Step {
                batch,
                ready,
                tokens,
                extra_token,
                persistent,
            }),
        6 => (
            batch(4),
            prop::collection::vec(count(), 5),
            prop::option::weighted(0.3, prop::collection::vec(count(), 4)),
        )
            .prop_map(|(batch, query_lens, drafts)| Op::Plan { batch, query_lens, drafts }),
        speculative => (
            batch(4),
            prop::collection::vec(count(), 4),
            prop::collection::vec(token(), 8),
            prop::bool::weighted(0.03),
        )
            .prop_map(|(batch, counts, tokens, extra_token)| Op::Verify {
                batch,
                counts,
                tokens,
                extra_token,
            }),
        speculative => (batch(3), prop::collection::vec(count(), 3), any::<bool>())
            .prop_map(|(batch, counts, persistent)| Op::Rollback { batch, counts, persistent }),
        3 => (
            batch(3),
            prop::option::weighted(0.3, prop::collection::vec(count(), 4)),
            prop::bool::weighted(0.05),
        )
            .prop_map(|(batch, upto, extra_count)| Op::Commit { batch, upto, extra_count }),
        fork => (live_ref(), new_ref()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        5 => live_ref().prop_map(|seq| Op::Free { seq }),
        swaps => batch(2).prop_map(|batch| Op::SwapOut { batch }),
        swaps => batch(2).prop_map(|batch| Op::ConfirmSwapOut { batch }),
        swaps => batch(3).prop_map(|batch| Op::SwapIn { batch }),
        swaps => batch(2).prop_map(|batch| Op::ConfirmSwapIn { batch }),
        1 => Just(Op::ResetPrefixCache),
        2 => Just(Op::TakeEvents),
    ]
}

fn config(block_size: impl Strategy<Value = u32>) -> impl Strategy<Value = Config> {
    (
        4u32..=32,
        block_size,
        prop_oneof![1 => Just(0u32), 4 => 2u32..=8],
        prop::bool::weighted(0.85),
        prop_oneof![Just(0.0), Just(0.01), Just(0.1), Just(0.3)],
        prop::option::weighted(0.2, Just([7u8; 32])),
        prop::bool::weighted(0.7),
        prop::bool::weighted(0.75),
    )
        .prop_map(
            |(num_blocks, bs, cpu, caching, watermark, hash_key, events, auto_commit)| {
                let mut c = Config::new(num_blocks, bs);
                c.num_cpu_blocks = cpu;
                c.enable_prefix_caching = caching;
                c.watermark = watermark;
                c.hash_key = hash_key;
                c.enable_events = events;
                c.auto_commit = auto_commit;
                c
            },
        )
}

/// Which manager a case runs, with its groups' attention.
#[derive(Clone, Debug)]
enum Layout {
    /// A `BlockManager` with this attention.
    One(Attention),
    /// A `HybridManager` with these groups and maybe a state group.
    Groups(Vec<Attention>, Option<StateConfig>),
}

impl Layout {
    fn attention(&self) -> Vec<Attention> {
        match self {
            Layout::One(a) => vec![*a],
            Layout::Groups(groups, _) => groups.clone(),
        }
    }

    fn state(&self) -> Option<StateConfig> {
        match self {
            Layout::One(_) => None,
            Layout::Groups(_, state) => state.clone(),
        }
    }
}

/// The layouts a test draws from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A full-attention `BlockManager`.
    Full,
    /// A `BlockManager` with a sliding window or chunked-local attention.
    Windowed,
    /// A `HybridManager`: a full-attention group 0, then one or two windowed groups; half
    /// of them with a state group, which half the time has one or two full-attention groups
    /// alone instead.
    Hybrid,
}

/// A sliding window within a block or wider than one (up to four blocks), or a chunk of one to
/// three blocks.
fn window(bs: u32) -> impl Strategy<Value = Attention> {
    prop_oneof![
        2 => (1..=bs).prop_map(Attention::SlidingWindow),
        2 => (bs + 1..=4 * bs).prop_map(Attention::SlidingWindow),
        2 => (1u32..=3).prop_map(move |n| Attention::ChunkedLocal(n * bs)),
    ]
}

/// A state group of 1 to 16 slots (often fewer than the sequences the operations name, so
/// they run out), any budget, checkpoints at prompt ends only or every one to three blocks, a
/// cap of 0 to 2 checkpoints per sequence and 0 to 4 CPU slots.
fn state_config(bs: u32) -> impl Strategy<Value = StateConfig> {
    prop_oneof![1u32..=4, 5u32..=8, 9u32..=16]
        .prop_flat_map(move |num_slots| {
            (
                Just(num_slots),
                0..num_slots,
                prop_oneof![2 => Just(0u32), 2 => Just(bs), 1 => (2u32..=3).prop_map(move |n| n * bs)],
                prop_oneof![1 => Just(0u32), 3 => 1u32..=2],
                prop_oneof![1 => Just(0u32), 4 => 1u32..=4],
            )
        })
        .prop_map(
            |(num_slots, max_checkpoints, interval, per_sequence, num_cpu_slots)| StateConfig {
                num_slots,
                max_checkpoints,
                checkpoint_interval: interval,
                checkpoints_per_sequence: per_sequence,
                num_cpu_slots,
            },
        )
}

/// A configuration and a layout of `kind`; a hybrid pool has the blocks of one pool per group.
fn setup(
    block_size: impl Strategy<Value = u32>,
    kind: Kind,
) -> impl Strategy<Value = (Config, Layout)> {
    config(block_size)
        .prop_flat_map(move |c| {
            let bs = c.block_size;
            let layout = match kind {
                Kind::Full => Just(Layout::One(Attention::Full)).boxed(),
                Kind::Windowed => window(bs).prop_map(Layout::One).boxed(),
                // With a state group, also full-attention KV groups alone (the state recomputed
                // over KV hits).
                Kind::Hybrid => (
                    window(bs),
                    prop::option::weighted(0.4, window(bs)),
                    prop::option::of(state_config(bs)),
                    prop_oneof![2 => Just(0usize), 1 => Just(1), 1 => Just(2)],
                )
                    .prop_map(|(a, b, state, full)| {
                        let groups = match (&state, full) {
                            (Some(_), 1..) => vec![Attention::Full; full],
                            _ => [Attention::Full, a].into_iter().chain(b).collect(),
                        };
                        Layout::Groups(groups, state)
                    })
                    .boxed(),
            };
            (Just(c), layout)
        })
        .prop_map(|(mut c, layout)| {
            match &layout {
                Layout::One(a) => c.attention = *a,
                Layout::Groups(groups, _) => c.num_blocks *= groups.len() as u32,
            }
            (c, layout)
        })
}

// ---------------------------------------------------------------------------------------------
// The harness: run an operation on both, compare everything
// ---------------------------------------------------------------------------------------------

/// Binds the model's keys to the real manager's hash values; the binding must be a bijection.
#[derive(Default)]
struct HashBinding {
    by_key: HashMap<Key, u128>,
    by_hash: HashMap<u128, Key>,
}

impl HashBinding {
    fn bind(&mut self, key: &Key, hash: u128) -> Result<(), TestCaseError> {
        if let Some(&h) = self.by_key.get(key) {
            prop_assert_eq!(h, hash, "one prefix, two hashes: {:?}", key);
        }
        if let Some(k) = self.by_hash.get(&hash) {
            prop_assert_eq!(k, key, "one hash {:#x}, two prefixes", hash);
        }
        self.by_key.insert(key.clone(), hash);
        self.by_hash.insert(hash, key.clone());
        Ok(())
    }
}

/// The manager under test: a `BlockManager` (one group) or a `HybridManager`, called the same
/// way (one plan, batch and list of swap pairs per group).
enum Real {
    One(Box<BlockManager>),
    Groups(HybridManager),
}

/// Calls the same method on either manager.
macro_rules! either {
    ($real:expr, $m:ident => $call:expr) => {
        match $real {
            Real::One($m) => $call,
            Real::Groups($m) => $call,
        }
    };
}

impl Real {
    fn allocate_loading(
        &self,
        seq: SeqId,
        tokens: &[Token],
        loadable: usize,
        salt: Option<&[u8]>,
    ) -> Result<(usize, Vec<Vec<BlockId>>), Error> {
        match self {
            Real::One(m) => (m.allocate_loading(seq, tokens, loadable, salt))
                .map(|(reused, loads)| (reused, vec![loads])),
            Real::Groups(m) => m.allocate_loading(seq, tokens, loadable, salt),
        }
    }

    fn step(&self, seqs: &[SeqId], tokens: &[Token], plans: &mut [Plan]) -> Result<(), Error> {
        match self {
            Real::One(m) => m.step(seqs, tokens, &mut plans[0]),
            Real::Groups(m) => m.step(seqs, tokens, plans),
        }
    }

    /// `plan`; a hybrid manager's `plan_with_drafts` when `drafts` are given.
    fn plan(
        &self,
        seqs: &[SeqId],
        qs: &[u32],
        drafts: Option<&[u32]>,
        plans: &mut [Plan],
    ) -> Result<(), Error> {
        match (self, drafts) {
            (Real::One(m), _) => m.plan(seqs, qs, &mut plans[0]),
            (Real::Groups(m), None) => m.plan(seqs, qs, plans),
            (Real::Groups(m), Some(drafts)) => m.plan_with_drafts(seqs, qs, drafts, plans),
        }
    }

    fn step_batch(&self, batches: &mut [PersistentBatch], tokens: &[Token]) -> Result<(), Error> {
        match self {
            Real::One(m) => m.step_batch(&mut batches[0], tokens),
            Real::Groups(m) => m.step_batch(batches, tokens),
        }
    }

    fn verify_batch(
        &self,
        batches: &mut [PersistentBatch],
        tokens: &[Token],
        counts: &[u32],
    ) -> Result<(), Error> {
        match self {
            Real::One(m) => m.verify_batch(&mut batches[0], tokens, counts),
            Real::Groups(m) => m.verify_batch(batches, tokens, counts),
        }
    }

    fn rollback_batch(
        &self,
        batches: &mut [PersistentBatch],
        counts: &[usize],
    ) -> Result<(), Error> {
        match self {
            Real::One(m) => m.rollback_batch(&mut batches[0], counts),
            Real::Groups(m) => m.rollback_batch(batches, counts),
        }
    }

    fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<Vec<[BlockId; 2]>>, Error> {
        match self {
            Real::One(m) => m.swap_out(seqs).map(|pairs| vec![pairs]),
            Real::Groups(m) => m.swap_out(seqs),
        }
    }

    fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<Vec<[BlockId; 2]>>, Error> {
        match self {
            Real::One(m) => m.swap_in(seqs).map(|pairs| vec![pairs]),
            Real::Groups(m) => m.swap_in(seqs),
        }
    }

    fn block_table(&self, seq: SeqId, g: usize) -> Result<Vec<BlockId>, Error> {
        match self {
            Real::One(m) => m.block_table(seq),
            Real::Groups(m) => m.block_table(seq, g),
        }
    }

    fn first_block(&self, seq: SeqId, g: usize) -> Result<usize, Error> {
        match self {
            Real::One(m) => m.first_block(seq),
            Real::Groups(m) => m.first_block(seq, g),
        }
    }

    fn stats(&self, g: usize) -> Stats {
        match self {
            Real::One(m) => m.stats(),
            Real::Groups(m) => m.stats(g).expect("a group"),
        }
    }
}

struct Harness {
    real: Real,
    model: Model,
    binding: HashBinding,
    /// Events are numbered from 0 over the manager's life.
    next_seq_no: u64,
    /// One plan per group.
    plans: Vec<Plan>,
    /// A persistent batch per group kept across operations, and a copy of each one's table
    /// kept only by applying its update logs (as a device copy would be).
    batches: Vec<PersistentBatch>,
    mirrors: Vec<Vec<i32>>,
    /// How many tokens each generated prompt or appended token stands for.
    stretch: usize,
    /// The engine's state tensors, modelled: the tokens each slot's state is after (`None`:
    /// never written).
    engine: Vec<Option<Vec<Token>>>,
    /// The engine's CPU state slots, likewise.
    cpu_engine: Vec<Option<Vec<Token>>>,
}

/// Whether a real error is one the model allows (InvalidArgument messages are free text).
fn allowed(real: &Error, expected: &[Error]) -> bool {
    expected.iter().any(|e| match (real, e) {
        (Error::InvalidArgument(_), Error::InvalidArgument(_)) => true,
        _ => real == e,
    })
}

fn same<T: PartialEq + std::fmt::Debug>(
    real: Result<T, Error>,
    model: Expect<T>,
) -> Result<(), TestCaseError> {
    match (real, model) {
        (Ok(r), Ok(m)) => prop_assert_eq!(r, m),
        (Err(r), Err(m)) => prop_assert!(allowed(&r, &m), "error {:?}, model allows {:?}", r, m),
        (r, m) => prop_assert!(false, "real {:?}, model {:?}", r, m),
    }
    Ok(())
}

fn same_plan(real: &Plan, model: &Plan) -> Result<(), TestCaseError> {
    prop_assert_eq!(&real.kv_indptr, &model.kv_indptr, "kv_indptr");
    prop_assert_eq!(&real.kv_indices, &model.kv_indices, "kv_indices");
    prop_assert_eq!(
        &real.kv_last_page_len,
        &model.kv_last_page_len,
        "kv_last_page_len"
    );
    prop_assert_eq!(&real.qo_indptr, &model.qo_indptr, "qo_indptr");
    prop_assert_eq!(&real.slot_mapping, &model.slot_mapping, "slot_mapping");
    prop_assert_eq!(&real.positions, &model.positions, "positions");
    prop_assert_eq!(real.block_size, model.block_size, "block_size");
    prop_assert_eq!(real.attention, model.attention, "attention");
    prop_assert_eq!(real.block_tables(), model.block_tables(), "block_tables");
    prop_assert_eq!(&real.copies, &model.copies, "copies");
    prop_assert_eq!(real.num_copies(), model.copies.len() / 2, "num_copies");
    prop_assert_eq!(&real.state_slots, &model.state_slots, "state_slots");
    prop_assert_eq!(&real.state_copies, &model.state_copies, "state_copies");
    prop_assert_eq!(&real.state_resets, &model.state_resets, "state_resets");
    prop_assert_eq!(&real.state_saves, &model.state_saves, "state_saves");
    prop_assert_eq!(
        real.batch_size(),
        model.kv_last_page_len.len(),
        "batch_size"
    );
    prop_assert_eq!(
        real.num_query_tokens(),
        model.positions.len(),
        "num_query_tokens"
    );
    Ok(())
}

/// The `(planned, computed, len, loads)` of a live sequence, for resolving counts.
fn progress(m: Option<&ModelSeq>) -> (usize, usize, usize, usize) {
    m.map_or((0, 0, 1, 0), |m| {
        (
            m.planned(),
            m.computed(),
            m.tokens.len(),
            m.loading.map_or(0, |l| l.1),
        )
    })
}

impl Harness {
    fn new(cfg: Config, layout: &Layout) -> Harness {
        let attention = layout.attention();
        let model = Model::new(&cfg, &attention, layout.state());
        let stretch = (cfg.block_size as usize / 4).max(1);
        let real = match layout {
            Layout::One(_) => Real::One(Box::new(BlockManager::new(cfg).expect("valid config"))),
            Layout::Groups(groups, state) => Real::Groups(
                HybridManager::with_state(cfg, groups, state.clone()).expect("valid config"),
            ),
        };
        let engine = vec![None; layout.state().map_or(0, |s| s.num_slots as usize)];
        let cpu_engine = vec![None; layout.state().map_or(0, |s| s.num_cpu_slots as usize)];
        let groups = attention.len();
        Harness {
            real,
            model,
            binding: HashBinding::default(),
            next_seq_no: 0,
            plans: (0..groups).map(|_| Plan::new()).collect(),
            batches: (0..groups).map(|_| PersistentBatch::new()).collect(),
            mirrors: vec![Vec::new(); groups],
            stretch,
            engine,
            cpu_engine,
        }
    }

    /// Live sequences of the model in the wanted state.
    fn live(&self, want: Want) -> Vec<SeqId> {
        self.model
            .seqs
            .iter()
            .filter(|(_, m)| want.matches(m))
            .map(|(&s, _)| s)
            .collect()
    }

    fn fresh(&self) -> SeqId {
        (0..).find(|s| !self.model.seqs.contains_key(s)).unwrap()
    }

    /// A sequence in the wanted state; failing that any live one; failing that a fresh id.
    fn resolve(&self, r: &SeqRef, want: Want) -> SeqId {
        match r {
            SeqRef::Live(i) => {
                let mut live = self.live(want);
                if live.is_empty() {
                    live = self.live(Want::Any);
                }
                if live.is_empty() {
                    self.fresh()
                } else {
                    live[i.index(live.len())]
                }
            }
            SeqRef::Fresh => self.fresh(),
            SeqRef::Raw(s) => *s,
        }
    }

    fn resolve_batch(&self, b: &Batch, want: Want) -> Vec<SeqId> {
        let mut pool = self.live(want);
        let mut out = Vec::new();
        for p in &b.picks {
            if pool.is_empty() {
                break;
            }
            out.push(pool.remove(p.index(pool.len())));
        }
        match b.extra {
            Extra::None => {}
            Extra::Repeat => {
                if let Some(&first) = out.first() {
                    out.push(first);
                }
            }
            Extra::Raw(s) => out.push(s),
        }
        out
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Allocate { seq, prompt } => {
                let seq = self.resolve(seq, Want::Any);
                let tokens = prompt.tokens(self.stretch);
                let real = either!(&self.real, m => m.allocate(seq, &tokens, prompt.salt()));
                let model = self.model.admit(seq, &tokens, prompt.salt(), None);
                same(real, model.map(|(reused, _)| reused))?;
            }
            Op::AllocateLoading {
                seq,
                prompt,
                loadable,
            } => {
                let seq = self.resolve(seq, Want::Any);
                let tokens = prompt.tokens(self.stretch);
                let real = (self.real).allocate_loading(seq, &tokens, *loadable, prompt.salt());
                let model = self
                    .model
                    .admit(seq, &tokens, prompt.salt(), Some(*loadable));
                same(real, model)?;
            }
            Op::ConfirmLoads { seq, loaded } => {
                let seq = self.resolve(seq, Want::Loading);
                let (.., loads) = progress(self.model.seqs.get(&seq));
                let loaded = loaded.resolve(0, loads, loads);
                same(
                    either!(&self.real, m => m.confirm_loads(seq, loaded)),
                    self.model.confirm_loads(seq, &[loaded], true),
                )?;
            }
            Op::ConfirmGroupLoads { seq, loaded } => {
                let seq = self.resolve(seq, Want::Loading);
                let handed = self.model.handed_out(seq);
                let mut loaded: Vec<usize> = (loaded.iter().enumerate())
                    .map(|(g, n)| {
                        let h = handed.get(g).copied().unwrap_or(0);
                        n.resolve(0, h, h)
                    })
                    .collect();
                match &self.real {
                    Real::One(m) => same(
                        m.confirm_loads(seq, loaded[0]),
                        self.model.confirm_loads(seq, &loaded[..1], true),
                    )?,
                    Real::Groups(m) => {
                        // Mostly one count per group, as the generated list is stretched.
                        if loaded.len() > 1 || handed.len() == 1 {
                            loaded.resize(handed.len().max(1), 0);
                        }
                        same(
                            m.confirm_group_loads(seq, &loaded),
                            self.model.confirm_loads(seq, &loaded, false),
                        )?
                    }
                }
            }
            Op::CanAllocate { prompt } => {
                let tokens = prompt.tokens(self.stretch);
                if !tokens.is_empty() {
                    prop_assert_eq!(
                        either!(&self.real, m => m.can_allocate(&tokens, prompt.salt())),
                        self.model.can_allocate(&tokens, prompt.salt()),
                        "can_allocate"
                    );
                    let salt = prompt.salt().map(<[u8]>::to_vec);
                    prop_assert_eq!(
                        either!(&self.real, m => m.cached_prefix_blocks(&tokens, prompt.salt())),
                        self.model.hit(&tokens, &salt),
                        "cached_prefix_blocks"
                    );
                }
            }
            Op::Append { seq, tokens } => {
                let seq = self.resolve(seq, Want::Resident);
                let tokens = &stretched(tokens, self.stretch);
                same(
                    either!(&self.real, m => m.append(seq, tokens)),
                    self.model.append(seq, tokens),
                )?;
            }
            Op::Step {
                batch,
                ready,
                tokens,
                extra_token,
                persistent,
            } => {
                let want = if *ready { Want::Ready } else { Want::Resident };
                let mut seqs = self.resolve_batch(batch, want);
                if seqs.is_empty() {
                    return Ok(());
                }
                let persistent = *persistent && !has_repeats(&seqs);
                if persistent {
                    seqs = self.make_rows(&seqs);
                }
                let mut tokens: Vec<Token> =
                    (0..seqs.len()).map(|i| tokens[i % tokens.len()]).collect();
                if *extra_token {
                    tokens.push(0);
                }
                let model = self.model.step(&seqs, &tokens);
                let plan = if persistent {
                    let real = self.real.step_batch(&mut self.batches, &tokens);
                    self.same_batch_step(real, model)?
                } else {
                    let real = self.real.step(&seqs, &tokens, &mut self.plans);
                    self.same_planned(real, model)?
                };
                if let Some(plan) = plan {
                    self.run_engine(&plan, &seqs)?;
                }
            }
            Op::Plan {
                batch,
                query_lens,
                drafts,
            } => {
                let seqs = self.resolve_batch(batch, Want::Resident);
                if seqs.is_empty() {
                    return Ok(());
                }
                // With a state group the natural query starts at the state point.
                let qs: Vec<u32> = seqs
                    .iter()
                    .zip(query_lens.iter().cycle())
                    .map(|(s, q)| {
                        let (planned, _, len, _) = progress(self.model.seqs.get(s));
                        let lo = (len - planned).max(1);
                        let resume = (self.model.state.as_ref())
                            .and_then(|state| state.seqs.get(s))
                            .map_or(planned, |x| x.resume);
                        q.resolve(lo, len, (len - resume.min(len)).max(1)) as u32
                    })
                    .collect();
                // Drafts of a hybrid manager's pass: mostly all but one query token, or a raw
                // (possibly bad) count.
                let drafts: Option<Vec<u32>> = match (&self.real, drafts) {
                    (Real::Groups(_), Some(drafts)) => Some(
                        (qs.iter().zip(drafts.iter().cycle()))
                            .map(|(&q, d)| {
                                let most = (q as usize).saturating_sub(1);
                                d.resolve(0, most, most) as u32
                            })
                            .collect(),
                    ),
                    _ => None,
                };
                let real = self
                    .real
                    .plan(&seqs, &qs, drafts.as_deref(), &mut self.plans);
                let model = self.model.plan(&seqs, &qs, drafts.as_deref());
                if let Some(plan) = self.same_planned(real, model)? {
                    self.run_engine(&plan, &seqs)?;
                }
            }
            Op::Verify {
                batch,
                counts,
                tokens,
                extra_token,
            } => {
                let seqs = self.resolve_batch(batch, Want::Ready);
                if seqs.is_empty() || has_repeats(&seqs) {
                    return Ok(());
                }
                let seqs = self.make_rows(&seqs);
                let counts: Vec<u32> = (counts.iter().cycle())
                    .take(seqs.len())
                    .map(|c| c.resolve(1, 5, 1) as u32)
                    .collect();
                let total: usize = counts.iter().map(|&c| c as usize).sum();
                let mut tokens: Vec<Token> = tokens.iter().copied().cycle().take(total).collect();
                if *extra_token {
                    tokens.push(0);
                }
                let model = self.model.verify(&seqs, &tokens, &counts);
                let verified = model.is_ok() && counts.iter().any(|&c| c > 1);
                let real = self.real.verify_batch(&mut self.batches, &tokens, &counts);
                if let Some(plan) = self.same_batch_step(real, model)? {
                    self.run_engine(&plan, &seqs)?;
                }
                self.model.seen.verify_steps += u64::from(verified);
            }
            Op::Rollback {
                batch,
                counts,
                persistent,
            } => {
                let mut seqs = self.resolve_batch(batch, Want::Resident);
                if seqs.is_empty() {
                    return Ok(());
                }
                let persistent = *persistent && !has_repeats(&seqs);
                if persistent {
                    seqs = self.make_rows(&seqs);
                }
                let counts: Vec<usize> = seqs
                    .iter()
                    .zip(counts.iter().cycle())
                    .map(|(s, n)| {
                        let (_, computed, len, _) = progress(self.model.seqs.get(s));
                        let uncommitted = (len - computed).min(len - 1);
                        // With a state group, mostly the drafts of a speculative pass.
                        let rest = match self.model.state {
                            Some(_) => uncommitted.saturating_sub(1),
                            None => uncommitted,
                        };
                        n.resolve(0, uncommitted, rest)
                    })
                    .collect();
                let real = if persistent {
                    self.real.rollback_batch(&mut self.batches, &counts)
                } else {
                    either!(&self.real, m => m.rollback(&seqs, &counts))
                };
                same(real, self.model.rollback(&seqs, &counts))?;
            }
            Op::Commit {
                batch,
                upto,
                extra_count,
            } => {
                let seqs = self.resolve_batch(batch, Want::Resident);
                if seqs.is_empty() {
                    return Ok(());
                }
                let upto: Option<Vec<usize>> = upto.as_ref().map(|counts| {
                    let mut upto: Vec<usize> = seqs
                        .iter()
                        .zip(counts.iter().cycle())
                        .map(|(s, n)| {
                            let (planned, ..) = progress(self.model.seqs.get(s));
                            n.resolve(0, planned, planned)
                        })
                        .collect();
                    if *extra_count {
                        upto.push(0);
                    }
                    upto
                });
                same(
                    either!(&self.real, m => m.commit(&seqs, upto.as_deref())),
                    self.model.commit(&seqs, upto.as_deref()),
                )?;
            }
            Op::Fork { parent, child } => {
                let parent = self.resolve(parent, Want::Ready);
                let child = self.resolve(child, Want::Any);
                same(
                    either!(&self.real, m => m.fork(parent, child)),
                    self.model.fork(parent, child),
                )?;
            }
            Op::Free { seq } => {
                let seq = self.resolve(seq, Want::Any);
                same(either!(&self.real, m => m.free(seq)), self.model.free(seq))?;
            }
            Op::SwapOut { batch } => {
                let seqs = self.resolve_batch(batch, Want::Resident);
                if !seqs.is_empty() {
                    let model = self.model.swap_out(&seqs);
                    let pairs = model.clone().ok();
                    same(self.real.swap_out(&seqs), model)?;
                    if let Some(pairs) = pairs {
                        self.swap_engine(&pairs, false);
                    }
                }
            }
            Op::ConfirmSwapOut { batch } => {
                let seqs = self.resolve_batch(batch, Want::SwapOutPending);
                if !seqs.is_empty() {
                    same(
                        either!(&self.real, m => m.confirm_swap_out(&seqs)),
                        self.model.confirm_swap_out(&seqs),
                    )?;
                }
            }
            Op::SwapIn { batch } => {
                let seqs = self.resolve_batch(batch, Want::SwappedOut);
                if !seqs.is_empty() {
                    let model = self.model.swap_in(&seqs);
                    let pairs = model.clone().ok();
                    same(self.real.swap_in(&seqs), model)?;
                    if let Some(pairs) = pairs {
                        self.swap_engine(&pairs, true);
                    }
                }
            }
            Op::ConfirmSwapIn { batch } => {
                let seqs = self.resolve_batch(batch, Want::SwapInPending);
                if !seqs.is_empty() {
                    same(
                        either!(&self.real, m => m.confirm_swap_in(&seqs)),
                        self.model.confirm_swap_in(&seqs),
                    )?;
                }
            }
            Op::ResetPrefixCache => {
                either!(&self.real, m => m.reset_prefix_cache());
                self.model.reset_prefix_cache();
            }
            Op::TakeEvents => self.compare_events()?,
        }
        self.compare_state()
    }

    /// Makes the persistent batch's rows exactly `seqs` (removing the others, adding the
    /// missing ones at the end) and returns them in row order.
    fn make_rows(&mut self, seqs: &[SeqId]) -> Vec<SeqId> {
        for batch in &mut self.batches {
            let stale: Vec<SeqId> = (batch.seqs().iter())
                .filter(|s| !seqs.contains(s))
                .copied()
                .collect();
            for seq in stale {
                batch.remove(seq).expect("a row");
            }
            for &seq in seqs {
                if !batch.contains(seq) {
                    batch.add(seq).expect("a new row");
                }
            }
        }
        self.batches[0].seqs().to_vec()
    }

    /// Checks a `step_batch` against the model's `step` of the rows in order, group by group:
    /// the inputs, the table (each row its sequence's blocks, padded with -1) and the table as
    /// rebuilt from the update logs alone.
    /// Returns the model's plan of group 0 (with the state inputs) if the step succeeded.
    fn same_batch_step(
        &mut self,
        real: Result<(), Error>,
        model: Expect<Vec<Plan>>,
    ) -> Result<Option<Plan>, TestCaseError> {
        let mut plans = match (real, model) {
            (Ok(()), Ok(m)) => m,
            (Err(r), Err(m)) => {
                prop_assert!(allowed(&r, &m), "error {:?}, model allows {:?}", r, m);
                return Ok(None);
            }
            (r, m) => {
                prop_assert!(false, "real {:?}, model {:?}", r, m.map(|_| "plan"));
                return Ok(None);
            }
        };
        self.model.seen.batch_steps += 1;
        let copied = plans.iter().any(|m| !m.copies.is_empty());
        self.model.seen.batch_copies += u64::from(copied);
        for ((m, batch), mirror) in plans.iter().zip(&mut self.batches).zip(&mut self.mirrors) {
            let mut plan = Plan::new();
            batch.write_plan(&mut plan);
            same_plan(&plan, m)?;
            prop_assert!(batch.inputs().kv_indices.is_empty());
            let width = batch.width();
            for (r, row) in batch.block_table().chunks(width).enumerate() {
                let pages = &m.kv_indices[m.kv_indptr[r] as usize..m.kv_indptr[r + 1] as usize];
                prop_assert_eq!(&row[..pages.len()], pages, "table row {}", r);
                prop_assert!(
                    row[pages.len()..].iter().all(|&b| b == -1),
                    "row {} padding",
                    r
                );
            }
            let (table, updates) = (batch.block_table(), batch.updates());
            if updates.full {
                *mirror = table.to_vec();
            } else {
                for (&at, &block) in updates.index.iter().zip(&updates.blocks) {
                    if at as usize >= mirror.len() {
                        mirror.resize(at as usize + 1, -1);
                    }
                    mirror[at as usize] = block;
                }
            }
            mirror.resize(mirror.len().max(table.len()), -1);
            prop_assert_eq!(&mirror[..table.len()], table, "mirror");
            prop_assert!(
                mirror[table.len()..].iter().all(|&b| b == -1),
                "mirror tail"
            );
            batch.clear_updates();
        }
        Ok(Some(plans.swap_remove(0)))
    }

    /// Returns the model's plan of group 0 (with the state inputs) if the call succeeded.
    fn same_planned(
        &self,
        real: Result<(), Error>,
        model: Expect<Vec<Plan>>,
    ) -> Result<Option<Plan>, TestCaseError> {
        match (real, model) {
            (Ok(()), Ok(mut m)) => {
                prop_assert_eq!(m.len(), self.plans.len());
                for (real, m) in self.plans.iter().zip(&m) {
                    same_plan(real, m)?;
                }
                Ok(Some(m.swap_remove(0)))
            }
            (Err(r), Err(m)) => {
                prop_assert!(allowed(&r, &m), "error {:?}, model allows {:?}", r, m);
                for plan in &self.plans {
                    prop_assert_eq!(plan.batch_size(), 0, "a failed plan is left empty");
                    prop_assert!(
                        plan.state_slots.is_empty()
                            && plan.state_copies.is_empty()
                            && plan.state_resets.is_empty()
                            && plan.state_saves.is_empty(),
                        "a failed plan has no state inputs"
                    );
                }
                Ok(None)
            }
            (r, m) => {
                prop_assert!(false, "real {:?}, model {:?}", r, m.map(|_| "plan"));
                Ok(None)
            }
        }
    }

    /// Runs a state group's plan on the modelled state tensors: the copies, the resets, then
    /// each row's pass, which must start from the state after exactly the tokens before its
    /// query, and saves where the plan says.
    fn run_engine(&mut self, plan: &Plan, seqs: &[SeqId]) -> Result<(), TestCaseError> {
        if self.engine.is_empty() {
            return Ok(());
        }
        for pair in plan.state_copies.chunks(2) {
            self.engine[pair[1] as usize] = self.engine[pair[0] as usize].clone();
        }
        for &slot in &plan.state_resets {
            self.engine[slot as usize] = Some(Vec::new());
        }
        for (row, &seq) in seqs.iter().enumerate() {
            let tokens = &self.model.seqs[&seq].tokens;
            let working = plan.state_slots[row] as usize;
            let q = (plan.qo_indptr[row + 1] - plan.qo_indptr[row]) as usize;
            let (start, end) = (tokens.len() - q, tokens.len());
            prop_assert_eq!(
                self.engine[working].as_deref(),
                Some(&tokens[..start]),
                "sequence {}'s state before its pass",
                seq
            );
            self.model.seen.exact_rows += 1;
            for save in plan.state_saves.chunks(3).filter(|s| s[0] as usize == row) {
                let after = save[1] as usize;
                prop_assert!((1..=q).contains(&after), "a save within the query");
                self.engine[save[2] as usize] = Some(tokens[..start + after].to_vec());
            }
            self.engine[working] = Some(tokens[..end].to_vec());
        }
        Ok(())
    }

    /// Copies the state pairs a successful swap returned last (`[working, cpu]` out,
    /// `[cpu, working]` in) on the modelled state tensors.
    fn swap_engine(&mut self, pairs: &[Vec<[BlockId; 2]>], to_gpu: bool) {
        if self.engine.is_empty() {
            return;
        }
        for &[src, dst] in pairs.last().expect("the state pairs") {
            let (src, dst) = (src as usize, dst as usize);
            if to_gpu {
                self.engine[dst] = self.cpu_engine[src].clone();
            } else {
                self.cpu_engine[dst] = self.engine[src].clone();
            }
        }
    }

    fn compare_events(&mut self) -> Result<(), TestCaseError> {
        let real: Vec<Event> = either!(&self.real, m => m.take_events());
        let model = std::mem::take(&mut self.model.events);
        prop_assert_eq!(
            real.len(),
            model.len(),
            "event count: real {:?} model {:?}",
            real,
            model
        );
        let bs = self.model.bs;
        for (r, m) in real.iter().zip(&model) {
            prop_assert_eq!(
                r.seq_no,
                self.next_seq_no,
                "events are numbered 0, 1, 2, ..."
            );
            self.next_seq_no += 1;
            match (&r.kind, m) {
                (
                    EventKind::BlockStored {
                        block_hash,
                        parent_hash,
                        token_ids,
                        block_id,
                        medium,
                        salt: event_salt,
                        lora_name,
                        extra_keys,
                    },
                    ModelEvent::Stored {
                        key,
                        token_ids: m_tokens,
                        block_id: m_block,
                        medium: m_medium,
                    },
                ) => {
                    prop_assert_eq!(token_ids, m_tokens);
                    prop_assert_eq!((block_id, medium), (m_block, m_medium), "stored where");
                    self.binding.bind(key, *block_hash)?;
                    let (group, salt, prefix) = key;
                    prop_assert_eq!(*group, 0, "only group 0 publishes");
                    prop_assert_eq!(event_salt.as_deref(), salt.as_deref(), "the event's salt");
                    prop_assert!(lora_name.is_none() && extra_keys.is_empty(), "no keys");
                    if prefix.len() > bs {
                        let parent = (0, salt.clone(), prefix[..prefix.len() - bs].to_vec());
                        let Some(parent_hash) = parent_hash else {
                            return Err(TestCaseError::fail(
                                "a non-first block has no parent hash",
                            ));
                        };
                        self.binding.bind(&parent, *parent_hash)?;
                    } else {
                        prop_assert_eq!(parent_hash, &None, "a first block has no parent");
                    }
                }
                (
                    EventKind::BlockRemoved {
                        block_hash,
                        block_id,
                        medium,
                    },
                    ModelEvent::Removed {
                        key,
                        block_id: m_block,
                        medium: m_medium,
                    },
                ) => {
                    prop_assert_eq!((block_id, medium), (m_block, m_medium), "removed where");
                    let stored = self.binding.by_key.get(key);
                    prop_assert_eq!(stored, Some(block_hash), "removed hash was never stored");
                }
                (EventKind::AllBlocksCleared, ModelEvent::Cleared) => {}
                (r, m) => prop_assert!(false, "event {:?}, model {:?}", r, m),
            }
        }
        Ok(())
    }

    fn compare_state(&self) -> Result<(), TestCaseError> {
        let (real, model) = (&self.real, &self.model);
        if let Err(e) = either!(real, m => m.check()) {
            return Err(TestCaseError::fail(format!("check(): {e}")));
        }
        prop_assert_eq!(either!(real, m => m.len()), model.seqs.len());
        prop_assert_eq!(either!(real, m => m.is_empty()), model.seqs.is_empty());
        for s in 0..=NUM_IDS {
            prop_assert_eq!(
                either!(real, m => m.contains(s)),
                model.seqs.contains_key(&s),
                "contains({})",
                s
            );
        }
        for (&s, m) in &model.seqs {
            if let Real::One(one) = real {
                prop_assert_eq!(one.tokens(s), Ok(m.tokens.clone()), "tokens of {}", s);
            }
            prop_assert_eq!(
                either!(real, r => r.num_tokens(s)),
                Ok(m.tokens.len()),
                "num_tokens of {}",
                s
            );
            prop_assert_eq!(
                either!(real, r => r.num_computed(s)),
                Ok(m.computed()),
                "num_computed of {}",
                s
            );
            for (g, gs) in m.groups.iter().enumerate() {
                let table = if m.swapped {
                    Err(Error::SwappedOut(s))
                } else {
                    Ok(gs.table.clone())
                };
                prop_assert_eq!(
                    real.block_table(s, g),
                    table,
                    "block table of {} in group {}",
                    s,
                    g
                );
                prop_assert_eq!(
                    real.first_block(s, g),
                    Ok(gs.first),
                    "first block of {} in group {}",
                    s,
                    g
                );
            }
        }
        for g in model.groups() {
            let (r, m) = (real.stats(g), model.stats(g));
            prop_assert_eq!(r.num_blocks, m.num_blocks);
            prop_assert_eq!(r.num_free, m.num_free, "num_free");
            prop_assert_eq!(r.num_cached, m.num_cached, "num_cached");
            prop_assert_eq!(r.num_held, m.num_held, "num_held");
            prop_assert_eq!(r.stored_tokens, m.stored_tokens, "stored_tokens");
            prop_assert_eq!(
                r.prefix_query_tokens,
                m.prefix_query_tokens,
                "prefix_query_tokens of group {}",
                g
            );
            prop_assert_eq!(
                r.prefix_hit_tokens,
                m.prefix_hit_tokens,
                "prefix_hit_tokens of group {}",
                g
            );
            prop_assert_eq!(
                r.prefix_allowed_tokens,
                m.prefix_allowed_tokens,
                "prefix_allowed_tokens of group {}",
                g
            );
            prop_assert_eq!(r.evictions, m.evictions, "evictions of group {}", g);
            prop_assert_eq!(
                r.computed_tokens,
                m.computed_tokens,
                "computed_tokens of group {}",
                g
            );
            prop_assert_eq!(
                r.pending_tokens,
                m.pending_tokens,
                "pending_tokens of group {}",
                g
            );
            prop_assert_eq!(
                r.external_query_tokens,
                m.external_query_tokens,
                "external_query_tokens"
            );
            prop_assert_eq!(
                r.external_hit_tokens,
                m.external_hit_tokens,
                "external_hit_tokens"
            );
            prop_assert_eq!(
                r.external_failures,
                m.external_failures,
                "external_failures"
            );
            prop_assert!(
                (r.usage - m.usage).abs() < 1e-9,
                "usage {} vs {}",
                r.usage,
                m.usage
            );
            prop_assert!(
                (r.token_usage - m.token_usage).abs() < 1e-9,
                "token_usage {} vs {}",
                r.token_usage,
                m.token_usage
            );
        }
        if let Real::Groups(hybrid) = real {
            match &model.state {
                Some(state) => {
                    prop_assert!(hybrid.has_state());
                    let ids = (0..=NUM_IDS).chain(model.seqs.keys().copied());
                    for s in ids {
                        let working = state.seqs.get(&s).and_then(StateSeq::gpu);
                        prop_assert_eq!(
                            hybrid.state_slot(s),
                            working.ok_or(Error::UnknownSequence(s)),
                            "state_slot({})",
                            s
                        );
                    }
                    prop_assert_eq!(hybrid.state_stats(), Ok(state.stats()), "state_stats");
                }
                None => {
                    prop_assert!(!hybrid.has_state());
                    let no_stats = hybrid.state_stats();
                    prop_assert!(matches!(no_stats, Err(Error::InvalidArgument(_))));
                }
            }
        }
        let bs = model.bs;
        for (group, salt, prefix) in model.prefix.keys() {
            let parent = (*group, salt.clone(), prefix[..prefix.len() - bs].to_vec());
            prop_assert!(
                *group != 0
                    || model.attention[0] != Attention::Full
                    || prefix.len() == bs
                    || model.prefix.contains_key(&parent),
                "a registered block's parent is registered (one tree)"
            );
        }
        Ok(())
    }

    /// Free every sequence and drain the events: the pool must end with nothing held. Then
    /// the free stack and the cached queue are compared whole: one-token prompts (which never
    /// hit) take every block, one per group each, in the order the model pops them.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        let live: Vec<SeqId> = self.model.seqs.keys().copied().collect();
        for s in live {
            same(either!(&self.real, m => m.free(s)), self.model.free(s))?;
            self.compare_state()?;
        }
        self.compare_events()?;
        for g in self.model.groups() {
            let st = self.real.stats(g);
            prop_assert_eq!((st.num_held, st.stored_tokens), (0, 0));
            prop_assert_eq!((st.computed_tokens, st.pending_tokens), (0, 0));
        }
        if let Some(state) = &self.model.state {
            let st = state.stats();
            prop_assert_eq!((st.num_working, st.num_saving), (0, 0));
            prop_assert_eq!(
                st.num_free + st.num_checkpoints,
                st.num_slots,
                "no slot drains"
            );
        }
        let groups = self.model.attention.len();
        let takers: Vec<SeqId> = (NUM_IDS + 1..)
            .take(self.model.num_blocks / groups)
            .collect();
        // With a state group the takers also take every slot (the free stack, then the LRU
        // whole); past them, a block per group goes to an append to the last taker.
        let mut admitted: Vec<SeqId> = Vec::new();
        for &seq in &takers {
            let real = either!(&self.real, m => m.allocate(seq, &[0], None));
            let model = self.model.admit(seq, &[0], None, None).map(|(r, _)| r);
            let taker = match (&model, admitted.last()) {
                (Ok(_), _) => seq,
                (Err(_), Some(&last)) => last,
                (Err(_), None) => return Err(TestCaseError::fail("no taker was admitted")),
            };
            if model.is_ok() {
                admitted.push(seq);
            }
            same(real, model)?;
            if taker != seq {
                let tokens = vec![0; self.model.bs];
                same(
                    either!(&self.real, m => m.append(taker, &tokens)),
                    self.model.append(taker, &tokens),
                )?;
            }
            for g in 0..groups {
                let table = self.real.block_table(taker, g);
                prop_assert_eq!(table, Ok(self.model.seqs[&taker].groups[g].table.clone()));
            }
        }
        self.compare_state()?;
        for &seq in &takers {
            same(either!(&self.real, m => m.free(seq)), self.model.free(seq))?;
        }
        self.compare_state()?;
        self.compare_events()
    }
}

/// What all cases together exercised.
#[derive(Debug, Default)]
struct Summary {
    cases: AtomicU64,
    manual_commit_cases: AtomicU64,
    hit_tokens: AtomicU64,
    external_hit_tokens: AtomicU64,
    evictions: AtomicU64,
    copies: AtomicU64,
    forks: AtomicU64,
    swap_outs: AtomicU64,
    swap_ins: AtomicU64,
    cpu_events: AtomicU64,
    commits: AtomicU64,
    out_of_blocks: AtomicU64,
    batch_steps: AtomicU64,
    batch_copies: AtomicU64,
    verify_steps: AtomicU64,
    rolled_back: AtomicU64,
    window_releases: AtomicU64,
    front_cached: AtomicU64,
    back_cached: AtomicU64,
    front_evictions: AtomicU64,
    window_hits: AtomicU64,
    shortened_hits: AtomicU64,
    window_refusals: AtomicU64,
    window_loads: AtomicU64,
    window_short_loads: AtomicU64,
    /// Cases with a sliding window within a block, one wider than a block, a chunk, and both
    /// a chunk and a sliding window.
    narrow_window_cases: AtomicU64,
    wide_window_cases: AtomicU64,
    chunk_cases: AtomicU64,
    chunk_and_window_cases: AtomicU64,
    /// Cases with a state group (and those with full-attention KV groups alone), and what its
    /// slots went through.
    state_cases: AtomicU64,
    full_state_cases: AtomicU64,
    state_hit_tokens: AtomicU64,
    state_saved: AtomicU64,
    state_skipped: AtomicU64,
    state_evictions: AtomicU64,
    state_dropped: AtomicU64,
    out_of_state_slots: AtomicU64,
    state_refusals: AtomicU64,
    state_rollbacks: AtomicU64,
    draft_refusals: AtomicU64,
    branch_points: AtomicU64,
    chained_forks: AtomicU64,
    draining: AtomicU64,
    exact_rows: AtomicU64,
    recomputed_hits: AtomicU64,
    recomputed_rows: AtomicU64,
    resume_refusals: AtomicU64,
    state_swap_outs: AtomicU64,
    state_swap_ins: AtomicU64,
}

impl Summary {
    fn add(&self, model: &Model) {
        let seen = model.seen;
        let c = model.counters[0];
        let evictions: u64 = model.counters.iter().map(|c| c.evictions).sum();
        let bs = model.bs as u32;
        let has = |kind: &dyn Fn(&Attention) -> bool| u64::from(model.attention.iter().any(kind));
        let narrow = has(&|a| matches!(a, Attention::SlidingWindow(w) if *w <= bs));
        let wide = has(&|a| matches!(a, Attention::SlidingWindow(w) if *w > bs));
        let chunk = has(&|a| matches!(a, Attention::ChunkedLocal(_)));
        let sliding = narrow.max(wide);
        let state = model
            .state
            .as_ref()
            .map(StateModel::stats)
            .unwrap_or_default();
        for (counter, n) in [
            (&self.cases, 1),
            (&self.manual_commit_cases, u64::from(!model.auto_commit)),
            (&self.hit_tokens, c.hit_tokens - c.external_hit),
            (&self.external_hit_tokens, c.external_hit),
            (&self.evictions, evictions),
            (&self.copies, seen.copies),
            (&self.forks, seen.forks),
            (&self.swap_outs, seen.swap_outs),
            (&self.swap_ins, seen.swap_ins),
            (&self.cpu_events, seen.cpu_events),
            (&self.commits, seen.commits),
            (&self.out_of_blocks, seen.out_of_blocks),
            (&self.batch_steps, seen.batch_steps),
            (&self.batch_copies, seen.batch_copies),
            (&self.verify_steps, seen.verify_steps),
            (&self.rolled_back, seen.rolled_back),
            (&self.window_releases, seen.window_releases),
            (&self.front_cached, seen.front_cached),
            (&self.back_cached, seen.back_cached),
            (&self.front_evictions, seen.front_evictions),
            (&self.window_hits, seen.window_hits),
            (&self.shortened_hits, seen.shortened_hits),
            (&self.window_refusals, seen.window_refusals),
            (&self.window_loads, seen.window_loads),
            (&self.window_short_loads, seen.window_short_loads),
            (&self.narrow_window_cases, narrow),
            (&self.wide_window_cases, wide),
            (&self.chunk_cases, chunk),
            (&self.chunk_and_window_cases, chunk * sliding),
            (&self.state_cases, u64::from(model.state.is_some())),
            (
                &self.full_state_cases,
                u64::from(model.state.is_some() && has(&|a| *a != Attention::Full) == 0),
            ),
            (&self.state_hit_tokens, state.prefix_hit_tokens),
            (&self.state_saved, state.saved),
            (&self.state_skipped, state.skipped),
            (&self.state_evictions, state.evictions),
            (&self.state_dropped, state.dropped),
            (&self.out_of_state_slots, seen.out_of_state_slots),
            (&self.state_refusals, seen.state_refusals),
            (&self.state_rollbacks, seen.state_rollbacks),
            (&self.draft_refusals, seen.draft_refusals),
            (&self.branch_points, seen.branch_points),
            (&self.chained_forks, seen.chained_forks),
            (&self.draining, seen.draining),
            (&self.exact_rows, seen.exact_rows),
            (&self.recomputed_hits, seen.recomputed_hits),
            (&self.recomputed_rows, seen.recomputed_rows),
            (&self.resume_refusals, seen.resume_refusals),
            (&self.state_swap_outs, seen.state_swap_outs),
            (&self.state_swap_ins, seen.state_swap_ins),
        ] {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Runs `cases` random operation lists with block sizes from `block_size` and layouts of
/// `kind` against the model, and checks that they exercised every scenario.
fn run_model(cases: u32, block_size: impl Strategy<Value = u32>, kind: Kind) {
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        // A failure prints the shrunk operation list; no regression file in the source tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let summary = Summary::default();
    let strategy = setup(block_size, kind).prop_flat_map(|(cfg, layout)| {
        let ops = prop::collection::vec(op(layout.state().is_some()), 1..=240);
        (Just((cfg, layout)), ops)
    });
    let result = runner.run(&strategy, |((cfg, layout), ops)| {
        let mut h = Harness::new(cfg, &layout);
        for op in &ops {
            h.apply(op)?;
        }
        h.finish()?;
        summary.add(&h.model);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    eprintln!("model test ({kind:?}): {summary:?}");
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    if get(&summary.cases) < 200 {
        return; // Too few cases (PROPTEST_CASES) to expect every scenario.
    }
    let mut scenarios = vec![
        ("cases without auto-commit", &summary.manual_commit_cases),
        ("prefix hits", &summary.hit_tokens),
        ("external loads", &summary.external_hit_tokens),
        ("evictions", &summary.evictions),
        ("copies delivered in plans", &summary.copies),
        ("forks", &summary.forks),
        ("confirmed swap-outs", &summary.swap_outs),
        ("confirmed swap-ins", &summary.swap_ins),
        ("explicit commits", &summary.commits),
        ("OutOfBlocks", &summary.out_of_blocks),
        ("persistent batch steps", &summary.batch_steps),
        ("copies in persistent batch steps", &summary.batch_copies),
        ("verify steps with drafts", &summary.verify_steps),
        ("rolled-back tokens", &summary.rolled_back),
    ];
    if kind == Kind::Windowed {
        // A windowed manager announces nothing (its blocks could not form a router's tree).
        assert_eq!(
            get(&summary.cpu_events),
            0,
            "a windowed manager records no events"
        );
    } else {
        scenarios.push(("CPU-tier events", &summary.cpu_events));
    }
    if kind != Kind::Full {
        scenarios.extend([
            ("blocks released out of a window", &summary.window_releases),
            ("released blocks cached at the front", &summary.front_cached),
            (
                "released blocks that resume a prompt, cached at the back",
                &summary.back_cached,
            ),
            ("evictions of front blocks", &summary.front_evictions),
            ("window hits past released blocks", &summary.window_hits),
            (
                "plans and rollbacks refused for released blocks",
                &summary.window_refusals,
            ),
            (
                "sliding windows within a block",
                &summary.narrow_window_cases,
            ),
            (
                "sliding windows wider than a block",
                &summary.wide_window_cases,
            ),
            ("chunked-local attention", &summary.chunk_cases),
            (
                "loads of only the blocks a window's next query reads",
                &summary.window_loads,
            ),
        ]);
    } else {
        assert_eq!(
            get(&summary.window_releases),
            0,
            "full attention releases nothing"
        );
    }
    if kind == Kind::Hybrid {
        scenarios.push(("hits a group shortened", &summary.shortened_hits));
        scenarios.push((
            "loads a window group's short run shortened",
            &summary.window_short_loads,
        ));
        scenarios.push((
            "chunked and sliding-window groups together",
            &summary.chunk_and_window_cases,
        ));
        scenarios.extend([
            ("state groups", &summary.state_cases),
            ("hits resumed from checkpoints", &summary.state_hit_tokens),
            ("checkpoints saved", &summary.state_saved),
            ("checkpoint saves skipped", &summary.state_skipped),
            ("checkpoints evicted", &summary.state_evictions),
            ("checkpoints dropped by the cap", &summary.state_dropped),
            ("OutOfStateSlots", &summary.out_of_state_slots),
            ("loads refused with a state group", &summary.state_refusals),
            ("rollbacks to a draft state", &summary.state_rollbacks),
            (
                "rollbacks refused past the draft states",
                &summary.draft_refusals,
            ),
            ("branch points", &summary.branch_points),
            (
                "forks of a parent with a queued copy",
                &summary.chained_forks,
            ),
            ("draining working slots", &summary.draining),
            ("passes checked on the engine's states", &summary.exact_rows),
            (
                "state groups with full-attention KV groups alone",
                &summary.full_state_cases,
            ),
            (
                "KV hits past the state's checkpoint",
                &summary.recomputed_hits,
            ),
            (
                "rows recomputing the state over cached KV (slot -1)",
                &summary.recomputed_rows,
            ),
            (
                "passes refused for not starting at the state point",
                &summary.resume_refusals,
            ),
            ("confirmed swap-outs of states", &summary.state_swap_outs),
            ("swap-ins of states", &summary.state_swap_ins),
        ]);
    } else {
        assert_eq!(
            get(&summary.state_cases),
            0,
            "only hybrid cases have states"
        );
    }
    for (what, counter) in scenarios {
        assert!(get(counter) > 0, "the run never exercised {what}");
    }
}

#[test]
fn manager_matches_model() {
    run_model(cases(), 1u32..=4, Kind::Full);
}

/// The block sizes servers use (16) and a larger one, with prompts and appends stretched to
/// match: the paths a benchmark times are checked against the model too.
#[test]
fn manager_matches_model_at_serving_block_sizes() {
    run_model(
        (cases() / 3).max(1),
        prop_oneof![Just(16u32), Just(32u32)],
        Kind::Full,
    );
}

/// A sliding window (within a block or wider) or a chunk of one to three blocks.
#[test]
fn windowed_manager_matches_model() {
    run_model(cases(), 1u32..=4, Kind::Windowed);
}

/// A full-attention group with one or two windowed groups over one pool, or full-attention
/// groups alone beside a state group.
#[test]
fn hybrid_manager_matches_model() {
    run_model(cases(), 1u32..=4, Kind::Hybrid);
}

/// Windowed groups at serving block sizes, windows and chunks stretched to match.
#[test]
fn hybrid_manager_matches_model_at_serving_block_sizes() {
    run_model(
        (cases() / 4).max(1),
        prop_oneof![Just(16u32), Just(32u32)],
        Kind::Hybrid,
    );
}
