//! Recurrent-state slots (Mamba, linear attention) of a [`crate::HybridManager`]: one working
//! slot per sequence and checkpoints, the state after a block-aligned prefix, keyed by that
//! prefix's chained block key so a later prompt resumes from them. Lives under the hybrid
//! manager's lock.
//!
//! The engine's state tensors are indexed by slot. A plan tells the engine, before its pass,
//! which slots to copy (a hit's checkpoint or a fork's parent into a working slot) and to reset
//! (a new sequence), and, during the pass, after which query token of a row to save the state
//! into which slot. A save becomes a checkpoint when that pass is committed. A speculative
//! pass also saves the state after each of its drafts (draft states), so a rollback makes the
//! state of the last accepted token the working state.

use std::collections::{HashMap, VecDeque};

use crate::error::invalid;
use crate::lru::Lru;
use crate::plan::Plan;
use crate::prefix::MapKey;
use crate::{Error, SeqId, Token};

/// An index into the engine's state tensors.
pub type SlotId = u32;

/// How a hybrid manager keeps recurrent states: `num_slots` slots of the state pool (a working
/// slot per live sequence; the rest hold checkpoints), of which at most `max_checkpoints` hold
/// checkpoints. A checkpoint is saved at the last block boundary of each prompt, where a prompt
/// branched off a cached prefix and, with `checkpoint_interval` > 0 (a multiple of the block
/// size), every that many tokens; a sequence keeps its last `checkpoints_per_sequence` (its
/// branch point aside: other prompts branch there). A speculative pass also takes a slot per
/// draft state until it is committed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateConfig {
    /// Slots of the state pool.
    pub num_slots: u32,
    /// The most slots that hold checkpoints (the checkpoint budget).
    pub max_checkpoints: u32,
    /// Tokens between interval checkpoints (0: prompt ends and branch points only).
    pub checkpoint_interval: u32,
    /// Checkpoints one sequence keeps along its path (its branch point aside).
    pub checkpoints_per_sequence: u32,
    /// Slots of the CPU state pool, where swapped-out sequences keep their states.
    pub num_cpu_slots: u32,
}

impl StateConfig {
    /// `num_slots` slots, any a live sequence does not hold a checkpoint (admissions evict
    /// them), saved at prompt ends and branch points only.
    pub fn new(num_slots: u32) -> StateConfig {
        StateConfig {
            num_slots,
            max_checkpoints: num_slots.saturating_sub(1),
            checkpoint_interval: 0,
            checkpoints_per_sequence: 1,
            num_cpu_slots: 0,
        }
    }

    /// Fails naming the first bad field.
    pub fn validate(&self, block_size: u32) -> Result<(), Error> {
        if self.num_slots == 0 || self.num_slots >= i32::MAX as u32 {
            return Err(invalid(format!(
                "state.num_slots must be in 1..{}, not {}",
                i32::MAX,
                self.num_slots
            )));
        }
        if self.max_checkpoints >= self.num_slots {
            return Err(invalid(format!(
                "state.max_checkpoints ({}) must leave working slots: below num_slots ({})",
                self.max_checkpoints, self.num_slots
            )));
        }
        if self.num_cpu_slots >= i32::MAX as u32 {
            return Err(invalid(format!(
                "state.num_cpu_slots must be below {}, not {}",
                i32::MAX,
                self.num_cpu_slots
            )));
        }
        if !self.checkpoint_interval.is_multiple_of(block_size) {
            return Err(invalid(format!(
                "state.checkpoint_interval ({}) must be a multiple of the block size ({block_size})",
                self.checkpoint_interval
            )));
        }
        Ok(())
    }
}

/// A snapshot of the state pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateStats {
    /// Slots of the pool.
    pub num_slots: usize,
    /// Slots free.
    pub num_free: usize,
    /// Working slots of live sequences.
    pub num_working: usize,
    /// Slots holding committed checkpoints.
    pub num_checkpoints: usize,
    /// Slots a planned pass writes a checkpoint into (not committed yet).
    pub num_saving: usize,
    /// Slots holding draft states of speculative passes not committed yet.
    pub num_drafts: usize,
    /// Slots of the CPU state pool.
    pub num_cpu_slots: usize,
    /// Free slots of the CPU state pool.
    pub num_cpu_free: usize,
    /// Prompt tokens a checkpoint could have resumed (what the state group alone allowed).
    pub prefix_allowed_tokens: u64,
    /// Prompt tokens resumed from a checkpoint.
    pub prefix_hit_tokens: u64,
    /// Checkpoints registered.
    pub saved: u64,
    /// Checkpoint saves skipped: the budget was full of checkpoints in use.
    pub skipped: u64,
    /// Checkpoints evicted to make room.
    pub evictions: u64,
    /// Checkpoints dropped by the per-sequence cap.
    pub dropped: u64,
}

/// What a slot holds.
enum Slot {
    Free,
    /// A live sequence's working state.
    Working(SeqId),
    /// Written by a planned pass of the sequence; a checkpoint once that pass is committed.
    Saving(SeqId),
    /// A draft state of the sequence's speculative pass: its working state if a rollback
    /// ends there, FREE once the pass is committed.
    Draft(SeqId),
    /// A committed checkpoint; in the eviction order unless a queued copy reads it.
    Checkpoint(Checkpoint),
    /// A freed sequence's working slot that a queued copy still reads.
    Draining,
}

/// The prefix a checkpoint is the state after: its last block's key, parent key and tokens
/// (verified on a hit, as the prefix cache verifies blocks).
struct Checkpoint {
    key: MapKey,
    parent: MapKey,
    tokens: Box<[Token]>,
    /// Queued copies reading it.
    pins: u32,
    /// Which registration it is: a sequence's cap drops only the checkpoints it registered,
    /// not a later one in the same slot under the same key.
    registration: u64,
}

/// A live sequence's slots.
struct SeqState {
    /// The GPU slot (stale once a swap-out is confirmed: see `swap`).
    working: SlotId,
    /// The CPU slot of a swapped sequence, and whether it still holds `working` (between
    /// `swap_out` and its confirmation, and again from `swap_in` on).
    swap: Option<Swap>,
    /// The last block boundary of the prompt, where a checkpoint is saved.
    prompt_point: usize,
    /// Where the sequence branched off a cached prefix its state could not resume (0: none).
    branch: usize,
    /// The tokens the working state holds once the passes planned so far have run: the next
    /// plan's queries start there.
    resume: usize,
    /// Saves of planned passes: (tokens the state is after, slot).
    saving: Vec<(usize, SlotId)>,
    /// Draft states of planned speculative passes, by increasing point: (tokens the state is
    /// after, slot).
    drafts: Vec<(usize, SlotId)>,
    /// The checkpoints this sequence registered but its branch point's, oldest first: slot,
    /// registration.
    kept: VecDeque<(SlotId, u64)>,
}

/// A swapped sequence's CPU slot.
#[derive(Clone, Copy)]
struct Swap {
    cpu: SlotId,
    holds_gpu: bool,
}

impl SeqState {
    /// The GPU slot the sequence holds, if any.
    fn gpu(&self) -> Option<SlotId> {
        match self.swap {
            Some(Swap {
                holds_gpu: false, ..
            }) => None,
            _ => Some(self.working),
        }
    }
}

/// The prefix a save is registered under once committed: the key, parent key and tokens of
/// the block that ends at the save point.
pub(crate) struct SavedPrefix<'a> {
    pub(crate) key: MapKey,
    pub(crate) parent: MapKey,
    pub(crate) tokens: &'a [Token],
}

/// One row of a planned pass: the sequence, the positions its query covers and how many of
/// its last tokens are drafts (whose states are kept for a rollback).
pub(crate) struct StateRow {
    pub(crate) seq: SeqId,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) drafts: usize,
}

/// A sequence's record, holding `working`, with no saves or checkpoints yet.
fn new_seq(working: SlotId, prompt_point: usize, branch: usize, resume: usize) -> SeqState {
    SeqState {
        working,
        swap: None,
        branch,
        resume,
        prompt_point,
        saving: Vec::new(),
        drafts: Vec::new(),
        kept: VecDeque::new(),
    }
}

/// Orders one row's `(row, tokens, slot)` saves by `tokens`, stably (a draft state before a
/// checkpoint at the same point).
fn sort_saves(saves: &mut [i32]) {
    if saves.len() <= 3 {
        return;
    }
    let mut triples: Vec<[i32; 3]> = saves.chunks_exact(3).map(|t| [t[0], t[1], t[2]]).collect();
    triples.sort_by_key(|t| t[1]);
    for (dst, t) in saves.chunks_exact_mut(3).zip(triples) {
        dst.copy_from_slice(&t);
    }
}

/// The state pool.
pub(crate) struct StateCache {
    config: StateConfig,
    block_size: usize,
    slots: Vec<Slot>,
    free: Vec<SlotId>,
    /// Unpinned checkpoints, least recently saved or used first.
    lru: Lru,
    map: HashMap<MapKey, SlotId>,
    seqs: HashMap<SeqId, SeqState>,
    /// `[src, dst]` copies the next plan hands out, in order.
    copies: Vec<[SlotId; 2]>,
    /// Working slots the next plan resets.
    resets: Vec<SlotId>,
    num_saving: usize,
    /// Free slots of the CPU state pool.
    cpu_free: Vec<SlotId>,
    /// Checkpoints registered so far, numbering each registration.
    registrations: u64,
    stats: StateStats,
}

impl StateCache {
    pub(crate) fn new(config: StateConfig, block_size: u32) -> Result<StateCache, Error> {
        config.validate(block_size)?;
        let n = config.num_slots;
        let lru = Lru::new(n).map_err(|e| e.naming("state slots".to_string()))?;
        Ok(StateCache {
            slots: (0..n).map(|_| Slot::Free).collect(),
            free: (0..n).rev().collect(),
            lru,
            map: HashMap::new(),
            seqs: HashMap::new(),
            copies: Vec::new(),
            resets: Vec::new(),
            num_saving: 0,
            cpu_free: (0..config.num_cpu_slots).rev().collect(),
            registrations: 0,
            stats: StateStats::default(),
            block_size: block_size as usize,
            config,
        })
    }

    /// The largest `k <= upto` whose prefix of `k` blocks has a checkpoint (0 if none), given
    /// the prompt's block keys, its root key and tokens. Read-only.
    pub(crate) fn find_hit(
        &self,
        keys: &[MapKey],
        root: MapKey,
        tokens: &[Token],
        upto: usize,
    ) -> usize {
        let bs = self.block_size;
        (1..=upto.min(keys.len()))
            .rev()
            .find(|&k| {
                let parent = if k == 1 { root } else { keys[k - 2] };
                let block = &tokens[(k - 1) * bs..k * bs];
                self.checkpoint(keys[k - 1], parent, block).is_some()
            })
            .unwrap_or(0)
    }

    fn checkpoint(&self, key: MapKey, parent: MapKey, tokens: &[Token]) -> Option<SlotId> {
        let &slot = self.map.get(&key)?;
        match &self.slots[slot as usize] {
            Slot::Checkpoint(c) if c.parent == parent && *c.tokens == *tokens => Some(slot),
            _ => None,
        }
    }

    /// Counts an admission's lookup: the group alone allowed `allowed` tokens; `hit` were used.
    pub(crate) fn count_lookup(&mut self, allowed: usize, hit: usize) {
        self.stats.prefix_allowed_tokens += allowed as u64;
        self.stats.prefix_hit_tokens += hit as u64;
    }

    /// Fails unless `needed` working slots can be taken (free, or evictable checkpoints other
    /// than `keep`).
    pub(crate) fn check_available(&self, needed: usize, keep: Option<MapKey>) -> Result<(), Error> {
        let kept = keep.is_some_and(|key| {
            let slot = self.map[&key];
            matches!(&self.slots[slot as usize], Slot::Checkpoint(c) if c.pins == 0)
        });
        let available = self.free.len() + self.lru.len() - usize::from(kept);
        if available < needed {
            return Err(Error::OutOfStateSlots { needed, available });
        }
        Ok(())
    }

    /// Admits `seq` (checked by [`StateCache::check_available`]): its working slot starts from
    /// the checkpoint under `hit`, of the first `resume` tokens (copied by the next plan), or
    /// reset. `branch` is where the KV groups could have resumed it: a checkpoint is saved
    /// there, so the next prompt that branches off at the same point resumes from it.
    pub(crate) fn admit(
        &mut self,
        seq: SeqId,
        hit: Option<MapKey>,
        prompt_len: usize,
        branch: usize,
        resume: usize,
    ) {
        let source = hit.map(|key| self.pin(key));
        let working = self.take_slot().expect("checked available");
        self.slots[working as usize] = Slot::Working(seq);
        match source {
            Some(src) => self.copies.push([src, working]),
            None => self.resets.push(working),
        }
        let prompt_point = prompt_len / self.block_size * self.block_size;
        self.seqs
            .insert(seq, new_seq(working, prompt_point, branch, resume));
    }

    /// Sets the sequence's prompt end (its prompt grew before its first decode).
    pub(crate) fn set_prompt_len(&mut self, seq: SeqId, prompt_len: usize) {
        let bs = self.block_size;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.prompt_point = prompt_len / bs * bs;
        }
    }

    /// Pins the checkpoint under `key` for a queued copy; returns its slot.
    fn pin(&mut self, key: MapKey) -> SlotId {
        let slot = self.map[&key];
        let Slot::Checkpoint(c) = &mut self.slots[slot as usize] else {
            unreachable!("a mapped slot holds a checkpoint");
        };
        if c.pins == 0 {
            self.lru.remove(slot);
        }
        c.pins += 1;
        slot
    }

    /// A free slot, or the least recently used checkpoint's, evicted.
    fn take_slot(&mut self) -> Option<SlotId> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
        }
        let slot = self.lru.pop_front()?;
        self.evict(slot);
        Some(slot)
    }

    fn evict(&mut self, slot: SlotId) {
        let Slot::Checkpoint(c) = std::mem::replace(&mut self.slots[slot as usize], Slot::Free)
        else {
            unreachable!("the eviction order holds checkpoints");
        };
        self.map.remove(&c.key);
        self.stats.evictions += 1;
    }

    /// Makes `child` a copy of `parent`'s state (copied by the next plan, before any pass of
    /// either changes it); a slot was checked available. A parent whose own state is still
    /// queued (a reset, or a copy from a checkpoint) gives the child the same, so no queued
    /// copy reads a slot a queued operation writes.
    pub(crate) fn fork(&mut self, parent: SeqId, child: SeqId) {
        let p = &self.seqs[&parent];
        let (src, prompt_point, branch, resume) = (p.working, p.prompt_point, p.branch, p.resume);
        let working = self.take_slot().expect("checked available");
        self.slots[working as usize] = Slot::Working(child);
        if self.resets.contains(&src) {
            self.resets.push(working);
        } else {
            let queued = self.copies.iter().find(|&&[_, dst]| dst == src);
            let source = queued.map_or(src, |&[from, _]| from);
            if let Slot::Checkpoint(c) = &mut self.slots[source as usize] {
                c.pins += 1;
            }
            self.copies.push([source, working]);
        }
        self.seqs
            .insert(child, new_seq(working, prompt_point, branch, resume));
    }

    /// Ends `seq`: its working slot and uncommitted saves are freed (its committed checkpoints
    /// stay cached).
    pub(crate) fn free(&mut self, seq: SeqId) {
        let Some(s) = self.seqs.remove(&seq) else {
            return;
        };
        let gpu = s.gpu();
        for (_, slot) in s.saving {
            self.release(slot);
            self.num_saving -= 1;
        }
        for (_, slot) in s.drafts {
            self.release(slot);
        }
        if let Some(swap) = s.swap {
            self.cpu_free.push(swap.cpu);
        }
        if let Some(working) = gpu {
            self.release_working(working);
        }
    }

    /// Releases a working slot no sequence holds any more: a copy or reset into it is void; a
    /// copy out of it must still happen.
    fn release_working(&mut self, working: SlotId) {
        let mut unpinned = Vec::new();
        self.copies.retain(|&[src, dst]| {
            if dst == working {
                unpinned.push(src);
            }
            dst != working
        });
        for src in unpinned {
            self.unpin(src);
        }
        self.resets.retain(|&slot| slot != working);
        if self.copies.iter().any(|&[src, _]| src == working) {
            self.slots[working as usize] = Slot::Draining;
        } else {
            self.release(working);
        }
    }

    fn release(&mut self, slot: SlotId) {
        self.slots[slot as usize] = Slot::Free;
        self.free.push(slot);
    }

    /// Fails unless `seqs` (on the GPU, none twice) can move their states to the CPU pool
    /// (`to_gpu`: back from it): a free slot each on the other side, and on the way out no
    /// queued copy or reset still to write the working slot (plan the sequence first).
    pub(crate) fn check_swap(&self, seqs: &[SeqId], to_gpu: bool) -> Result<(), Error> {
        if to_gpu {
            return self.check_available(seqs.len(), None);
        }
        for &seq in seqs {
            let working = self.seqs[&seq].working;
            let written = self.resets.contains(&working)
                || self.copies.iter().any(|&[_, dst]| dst == working);
            if written {
                return Err(invalid(format!(
                    "swap_out: sequence {seq}'s state is still to be copied or reset by the next \
                     plan; plan it before swapping it out"
                )));
            }
        }
        if self.cpu_free.len() < seqs.len() {
            return Err(Error::OutOfStateSlots {
                needed: seqs.len(),
                available: self.cpu_free.len(),
            });
        }
        Ok(())
    }

    /// Moves the states of `seqs` (checked by [`StateCache::check_swap`]) to the CPU pool;
    /// returns the `[gpu, cpu]` slot pairs to copy. Saves not committed yet and draft states
    /// are dropped.
    pub(crate) fn swap_out(&mut self, seqs: &[SeqId]) -> Vec<[SlotId; 2]> {
        let mut pairs = Vec::with_capacity(seqs.len());
        for &seq in seqs {
            let cpu = self.cpu_free.pop().expect("checked available");
            let s = self.seqs.get_mut(&seq).expect("swapped sequences are live");
            let saving = std::mem::take(&mut s.saving);
            let drafts = std::mem::take(&mut s.drafts);
            s.swap = Some(Swap {
                cpu,
                holds_gpu: true,
            });
            pairs.push([s.working, cpu]);
            for (_, slot) in saving {
                self.release(slot);
                self.num_saving -= 1;
            }
            for (_, slot) in drafts {
                self.release(slot);
            }
        }
        pairs
    }

    /// The swap-out of `seqs` was copied: their GPU slots are released.
    pub(crate) fn confirm_swap_out(&mut self, seqs: &[SeqId]) {
        for &seq in seqs {
            let s = self.seqs.get_mut(&seq).expect("swapped sequences are live");
            if let Some(swap) = &mut s.swap {
                swap.holds_gpu = false;
                let working = s.working;
                self.release_working(working);
            }
        }
    }

    /// Brings the states of `seqs` (checked by [`StateCache::check_swap`]) back to new
    /// working slots; returns the `[cpu, gpu]` slot pairs to copy.
    pub(crate) fn swap_in(&mut self, seqs: &[SeqId]) -> Vec<[SlotId; 2]> {
        let mut pairs = Vec::with_capacity(seqs.len());
        for &seq in seqs {
            let working = self.take_slot().expect("checked available");
            self.slots[working as usize] = Slot::Working(seq);
            let s = self.seqs.get_mut(&seq).expect("swapped sequences are live");
            let swap = s.swap.as_mut().expect("swapped out");
            swap.holds_gpu = true;
            s.working = working;
            pairs.push([swap.cpu, working]);
        }
        pairs
    }

    /// The swap-in of `seqs` was copied: their CPU slots are released.
    pub(crate) fn confirm_swap_in(&mut self, seqs: &[SeqId]) {
        for &seq in seqs {
            let s = self.seqs.get_mut(&seq).expect("swapped sequences are live");
            if let Some(swap) = s.swap.take() {
                self.cpu_free.push(swap.cpu);
            }
        }
    }

    /// A queued copy out of `slot` was handed out or dropped.
    fn unpin(&mut self, slot: SlotId) {
        match &mut self.slots[slot as usize] {
            Slot::Checkpoint(c) => {
                c.pins -= 1;
                if c.pins == 0 {
                    self.lru.push_back(slot);
                }
            }
            Slot::Draining if !self.copies.iter().any(|&[src, _]| src == slot) => {
                self.release(slot);
            }
            _ => {}
        }
    }

    /// Writes the state inputs of a pass over `rows` into `plan`'s `state_*` fields: each
    /// row's working slot, the queued copies and resets, and the states to save: every row's
    /// draft states (slots checked by [`StateCache::check_available`]), then the checkpoints (a
    /// slot each, while the budget allows).
    pub(crate) fn plan(&mut self, rows: &[StateRow], plan: &mut Plan) {
        let (slots, copies, resets, saves) = (
            &mut plan.state_slots,
            &mut plan.state_copies,
            &mut plan.state_resets,
            &mut plan.state_saves,
        );
        slots.clear();
        copies.clear();
        resets.clear();
        saves.clear();
        let queued = std::mem::take(&mut self.copies);
        copies.extend(
            queued
                .iter()
                .flat_map(|&[src, dst]| [src as i32, dst as i32]),
        );
        for &[src, _] in &queued {
            self.unpin(src);
        }
        resets.extend(self.resets.drain(..).map(|slot| slot as i32));
        // Draft states first: a checkpoint save may take the last slot.
        for r in rows {
            for point in r.end - r.drafts..r.end {
                let slot = self.take_slot().expect("draft slots checked available");
                self.slots[slot as usize] = Slot::Draft(r.seq);
                let s = self.seqs.get_mut(&r.seq).expect("planned rows are live");
                s.drafts.push((point, slot));
            }
        }
        for (row, r) in rows.iter().enumerate() {
            let s = self.seqs.get_mut(&r.seq).expect("planned rows are live");
            s.resume = r.end;
            slots.push(s.working as i32);
            let row_saves = saves.len();
            let drafted = &s.drafts[s.drafts.len() - r.drafts..];
            saves
                .extend((drafted.iter()).flat_map(|&(point, slot)| {
                    [row as i32, (point - r.start) as i32, slot as i32]
                }));
            for point in self.points(r) {
                let Some(slot) = self.take_checkpoint_slot() else {
                    self.stats.skipped += 1;
                    continue;
                };
                self.slots[slot as usize] = Slot::Saving(r.seq);
                self.num_saving += 1;
                let s = self.seqs.get_mut(&r.seq).expect("planned rows are live");
                s.saving.push((point, slot));
                saves.extend([row as i32, (point - r.start) as i32, slot as i32]);
            }
            sort_saves(&mut saves[row_saves..]);
        }
    }

    /// The checkpoint points a row's query passes (block boundaries in `start + 1..=end`), most
    /// valuable first: the prompt's end and the branch point, then the last
    /// `checkpoints_per_sequence` multiples of the interval (the cap would drop any earlier
    /// one at once); none the sequence is saving already.
    fn points(&self, r: &StateRow) -> Vec<usize> {
        let s = &self.seqs[&r.seq];
        let (bs, interval) = (self.block_size, self.config.checkpoint_interval as usize);
        let first = (r.start / bs + 1) * bs;
        let marked = [s.prompt_point, s.branch]
            .into_iter()
            .filter(|&p| p >= first && p <= r.end);
        let intervals = (interval > 0)
            .then(|| (first..=r.end).rev().filter(|p| p.is_multiple_of(interval)))
            .into_iter()
            .flatten()
            .filter(|&p| p != s.prompt_point && p != s.branch)
            .take(self.config.checkpoints_per_sequence as usize);
        let mut points: Vec<usize> = marked.chain(intervals).collect();
        points.dedup();
        points.retain(|&p| p > 0 && !s.saving.iter().any(|&(q, _)| q == p));
        points
    }

    /// A slot for a new checkpoint within the budget: free, or the oldest checkpoint's.
    fn take_checkpoint_slot(&mut self) -> Option<SlotId> {
        if self.map.len() + self.num_saving >= self.config.max_checkpoints as usize {
            let slot = self.lru.pop_front()?;
            self.evict(slot);
            return Some(slot);
        }
        self.take_slot()
    }

    /// Frees the draft states of `seq` at points up to `computed` (a committed pass is never
    /// rolled back into), in increasing points.
    pub(crate) fn drop_drafts(&mut self, seq: SeqId, computed: usize) {
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        let done = s.drafts.partition_point(|&(point, _)| point <= computed);
        let dropped: Vec<(usize, SlotId)> = s.drafts.drain(..done).collect();
        for (_, slot) in dropped {
            self.release(slot);
        }
    }

    /// Fails unless `seq` can be rolled back to `len` tokens: its state point is at most
    /// `len`, or a draft state holds the state after `len` tokens.
    pub(crate) fn check_rollback(&self, seq: SeqId, len: usize) -> Result<(), Error> {
        let s = &self.seqs[&seq];
        if len >= s.resume || s.drafts.iter().any(|&(point, _)| point == len) {
            return Ok(());
        }
        Err(invalid(format!(
            "sequence {seq}: cannot roll back to {len} tokens: its state after them was not \
             kept (a rollback ends within the drafts of its last speculative pass)"
        )))
    }

    /// Rolls `seq` back to `len` tokens (checked by [`StateCache::check_rollback`]): below its
    /// state point, the saves and draft states past `len` are freed and the draft state at
    /// `len` becomes its working state.
    pub(crate) fn rollback(&mut self, seq: SeqId, len: usize) {
        let s = self
            .seqs
            .get_mut(&seq)
            .expect("rolled back a live sequence");
        if len >= s.resume {
            return;
        }
        s.resume = len;
        let kept = s.drafts.partition_point(|&(point, _)| point <= len);
        let past: Vec<(usize, SlotId)> = s.drafts.drain(kept..).collect();
        let (_, adopted) = s.drafts.pop().expect("checked: a draft state at len");
        let mut freed = Vec::new();
        s.saving.retain(|&(point, slot)| {
            if point > len {
                freed.push(slot);
            }
            point <= len
        });
        let working = std::mem::replace(&mut s.working, adopted);
        self.slots[adopted as usize] = Slot::Working(seq);
        self.num_saving -= freed.len();
        freed.extend(past.into_iter().map(|(_, slot)| slot));
        for slot in freed {
            self.release(slot);
        }
        self.release_working(working);
    }

    /// The furthest save point of `seq` that `computed` tokens reach, if any.
    pub(crate) fn due(&self, seq: SeqId, computed: usize) -> Option<usize> {
        let s = self.seqs.get(&seq)?;
        s.saving
            .iter()
            .map(|&(p, _)| p)
            .filter(|&p| p <= computed)
            .max()
    }

    /// Saves of `seq` at points up to `computed` become checkpoints under the prefix
    /// `prefix(point)` names (none: the slot is freed).
    pub(crate) fn commit<'a>(
        &mut self,
        seq: SeqId,
        computed: usize,
        mut prefix: impl FnMut(usize) -> Option<SavedPrefix<'a>>,
    ) {
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        if s.saving.iter().all(|&(point, _)| point > computed) {
            return;
        }
        let mut done = Vec::new();
        s.saving.retain(|&(point, slot)| {
            if point <= computed {
                done.push((point, slot));
            }
            point > computed
        });
        let branch = s.branch;
        done.sort_unstable();
        for (point, slot) in done {
            self.num_saving -= 1;
            match prefix(point).filter(|p| !self.map.contains_key(&p.key)) {
                Some(p) => {
                    let registration = self.register(slot, &p);
                    if point != branch {
                        self.keep(seq, slot, registration);
                    }
                }
                None => self.release(slot),
            }
        }
    }

    /// Makes `slot` the checkpoint of `p`; returns which registration it is.
    fn register(&mut self, slot: SlotId, p: &SavedPrefix<'_>) -> u64 {
        self.registrations += 1;
        self.slots[slot as usize] = Slot::Checkpoint(Checkpoint {
            key: p.key,
            parent: p.parent,
            tokens: p.tokens.into(),
            pins: 0,
            registration: self.registrations,
        });
        self.map.insert(p.key, slot);
        self.lru.push_back(slot);
        self.stats.saved += 1;
        self.registrations
    }

    /// Counts a checkpoint against the sequence's cap, dropping its oldest beyond it.
    fn keep(&mut self, seq: SeqId, slot: SlotId, registration: u64) {
        let cap = self.config.checkpoints_per_sequence as usize;
        let s = self
            .seqs
            .get_mut(&seq)
            .expect("committed sequences are live");
        s.kept.push_back((slot, registration));
        if s.kept.len() <= cap {
            return;
        }
        let (slot, registration) = s.kept.pop_front().expect("over the cap");
        // Still its own (not evicted, the slot perhaps reused) and no queued copy reads it.
        let key = match &self.slots[slot as usize] {
            Slot::Checkpoint(c) if c.registration == registration && c.pins == 0 => c.key,
            _ => return,
        };
        self.lru.remove(slot);
        self.map.remove(&key);
        self.release(slot);
        self.stats.dropped += 1;
    }

    /// Drops every checkpoint no queued copy reads.
    pub(crate) fn reset(&mut self) {
        while let Some(slot) = self.lru.pop_front() {
            let Slot::Checkpoint(c) = &self.slots[slot as usize] else {
                unreachable!("the eviction order holds checkpoints");
            };
            self.map.remove(&c.key);
            self.release(slot);
        }
    }

    /// Fails unless a pass of `seq` whose queries start at token `start` continues its state.
    pub(crate) fn check_resume(&self, seq: SeqId, start: usize) -> Result<(), Error> {
        let resume = self.seqs[&seq].resume;
        if start != resume {
            return Err(invalid(format!(
                "sequence {seq}: with a state group a pass starts where its state ends (token \
                 {resume}), not at {start}"
            )));
        }
        Ok(())
    }

    /// The sequence's working slot.
    pub(crate) fn working(&self, seq: SeqId) -> Option<SlotId> {
        self.seqs.get(&seq).and_then(SeqState::gpu)
    }

    pub(crate) fn stats(&self) -> StateStats {
        let mut stats = self.stats;
        stats.num_slots = self.slots.len();
        stats.num_free = self.free.len();
        stats.num_working = self.seqs.values().filter(|s| s.gpu().is_some()).count();
        stats.num_checkpoints = self.map.len();
        stats.num_saving = self.num_saving;
        stats.num_drafts = self.seqs.values().map(|s| s.drafts.len()).sum();
        stats.num_cpu_slots = self.config.num_cpu_slots as usize;
        stats.num_cpu_free = self.cpu_free.len();
        stats
    }

    /// Verifies the slot accounting: every slot is in exactly one state and every index over
    /// the slots agrees with it; `live` is the number of live sequences.
    pub(crate) fn check(&self, live: usize) -> Result<(), Error> {
        let broken = |what: String| Err(Error::InvariantViolated(format!("state slots: {what}")));
        if self.seqs.len() != live {
            return broken(format!(
                "{} working slots for {live} sequences",
                self.seqs.len()
            ));
        }
        let mut seen = vec![0u8; self.slots.len()];
        let mut mark = |slot: SlotId| {
            seen[slot as usize] += 1;
        };
        self.free.iter().for_each(|&s| mark(s));
        self.map.values().for_each(|&s| mark(s));
        let mut saving = 0;
        let mut cpu = vec![0u8; self.config.num_cpu_slots as usize];
        self.cpu_free.iter().for_each(|&c| cpu[c as usize] += 1);
        for (&id, s) in &self.seqs {
            if let Some(swap) = s.swap {
                cpu[swap.cpu as usize] += 1;
            }
            if let Some(working) = s.gpu() {
                mark(working);
                if !matches!(self.slots[working as usize], Slot::Working(w) if w == id) {
                    return broken(format!("sequence {id}'s working slot {working}"));
                }
            }
            for &(_, slot) in &s.saving {
                mark(slot);
                saving += 1;
                if !matches!(self.slots[slot as usize], Slot::Saving(w) if w == id) {
                    return broken(format!("sequence {id}'s save slot {slot}"));
                }
            }
            for &(_, slot) in &s.drafts {
                mark(slot);
                if !matches!(self.slots[slot as usize], Slot::Draft(w) if w == id) {
                    return broken(format!("sequence {id}'s draft slot {slot}"));
                }
            }
            if !s.drafts.is_sorted_by_key(|&(point, _)| point) {
                return broken(format!("sequence {id}'s draft states out of order"));
            }
        }
        let draining = (0..self.slots.len())
            .filter(|&i| matches!(self.slots[i], Slot::Draining))
            .inspect(|&i| mark(i as SlotId))
            .count();
        if saving != self.num_saving {
            return broken(format!("{saving} saves counted as {}", self.num_saving));
        }
        if let Some(slot) = seen.iter().position(|&n| n != 1) {
            return broken(format!("slot {slot} is in {} states", seen[slot]));
        }
        if let Some(slot) = cpu.iter().position(|&n| n != 1) {
            return broken(format!("CPU slot {slot} is held {} times", cpu[slot]));
        }
        if self.map.len() + saving > self.config.max_checkpoints as usize {
            return broken(format!(
                "{} checkpoints over the budget",
                self.map.len() + saving
            ));
        }
        for (key, &slot) in &self.map {
            match &self.slots[slot as usize] {
                Slot::Checkpoint(c) if c.key == *key => {}
                _ => return broken(format!("slot {slot} is mapped but holds no checkpoint")),
            }
        }
        let pinned = self
            .copies
            .iter()
            .filter(|&&[src, _]| matches!(self.slots[src as usize], Slot::Checkpoint(_)));
        let pins: u32 = (self.slots.iter())
            .map(|s| match s {
                Slot::Checkpoint(c) => c.pins,
                _ => 0,
            })
            .sum();
        if pins as usize != pinned.count() {
            return broken(format!("{pins} pins for the queued copies"));
        }
        let unpinned = self.map.values().filter(
            |&&slot| matches!(&self.slots[slot as usize], Slot::Checkpoint(c) if c.pins == 0),
        );
        if unpinned.count() != self.lru.len() {
            return broken("the eviction order is not the unpinned checkpoints".to_string());
        }
        if draining > 0 && self.copies.is_empty() {
            return broken("a draining slot with no queued copy".to_string());
        }
        Ok(())
    }
}
