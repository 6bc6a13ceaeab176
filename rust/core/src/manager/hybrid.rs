//! `HybridManager`: a model whose layers attend differently (full, sliding-window and
//! chunked-local attention) kept as KV-cache groups over one pool of equal-sized pages.
//!
//! Each group is a [`BlockManager`] with its own block table per sequence; the groups share the
//! GPU and CPU pools, the prefix cache (each group's blocks keyed apart) and the event log.
//! Every operation runs on all groups under one lock: it checks every group and reserves every
//! group's blocks before any group changes, so it succeeds everywhere or changes nothing.
//! Recurrent layers (Mamba, linear attention) form an optional state group: a working slot per
//! sequence and checkpoints (see [`crate::StateConfig`]), kept under the same lock.

use crate::batch::Batch;
use crate::config::{Attention, Config};
use crate::error::invalid;
use crate::keys::HashKeys;
use crate::manager::admission::{check_prompt, Admission};
use crate::manager::step::{DecodeRows, Listed, PreparedPlan};
use crate::manager::BlockManager;
use crate::plan::Plan;
use crate::prefix::MapKey;
use crate::sequence::Sequence;
use crate::state::{SavedPrefix, SlotId, StateCache, StateConfig, StateRow, StateStats};
use crate::stats::Stats;
use crate::sync::{lock, Mutex, MutexGuard};
use crate::{BlockHash, BlockId, Error, PoolKind, SeqId, Token};

/// A KV-cache manager for a hybrid model: one group per attention kind (or per set of layers
/// of one kind), each with its own block table per sequence, all drawing pages from one pool.
/// Group 0 should be a full-attention group: its blocks are what events announce.
pub struct HybridManager {
    groups: Vec<BlockManager>,
    /// Held by every operation, so what one operation counted and reserved for all groups is
    /// still there when it takes it; it guards the state group's slots, if any.
    lock: Mutex<Option<Box<StateCache>>>,
}

impl HybridManager {
    /// Groups attending as `groups` (at most 255) over one pool built as `config` says
    /// (`config.attention` must be `Full`; each group's attention is in `groups`).
    pub fn new(config: Config, groups: &[Attention]) -> Result<HybridManager, Error> {
        HybridManager::with_state(config, groups, None)
    }

    /// [`HybridManager::new`] with a state group for the model's recurrent layers, whose
    /// states are checkpointed at block boundaries keyed by group 0's block keys.
    pub fn with_state(
        config: Config,
        groups: &[Attention],
        state: Option<StateConfig>,
    ) -> Result<HybridManager, Error> {
        if groups.is_empty() || groups.len() > usize::from(u8::MAX) {
            return Err(invalid(format!(
                "groups: a hybrid manager has 1 to 255 groups, not {}",
                groups.len()
            )));
        }
        if config.attention != Attention::Full {
            return Err(invalid(
                "config.attention: give each group's attention in `groups`",
            ));
        }
        let shared = BlockManager::shared(&config, groups[0])?;
        let mut built = Vec::with_capacity(groups.len());
        for (g, &attention) in groups.iter().enumerate() {
            let group_config = Config {
                attention,
                ..config.clone()
            };
            group_config.validate().map_err(|e| match e {
                Error::InvalidArgument(msg) => invalid(format!("groups[{g}]: {msg}")),
                e => e,
            })?;
            built.push(BlockManager::in_group(group_config, &shared, g as u8));
        }
        let state = match state {
            Some(state) => Some(Box::new(StateCache::new(state, config.block_size)?)),
            None => None,
        };
        Ok(HybridManager {
            groups: built,
            lock: Mutex::new(state),
        })
    }

    /// Whether the manager has a state group.
    pub fn has_state(&self) -> bool {
        lock(&self.lock).is_some()
    }

    /// The state group's working slot of the sequence.
    pub fn state_slot(&self, seq: SeqId) -> Result<SlotId, Error> {
        let held = lock(&self.lock);
        let state = held.as_ref().ok_or_else(missing_state)?;
        state.working(seq).ok_or(Error::UnknownSequence(seq))
    }

    /// The state group's slot counts and checkpoint counters.
    pub fn state_stats(&self) -> Result<StateStats, Error> {
        Ok(lock(&self.lock).as_ref().ok_or_else(missing_state)?.stats())
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// What group `group`'s layers attend to.
    pub fn attention(&self, group: usize) -> Result<Attention, Error> {
        Ok(self.group(group)?.config.attention)
    }

    /// The pool's configuration (each group's attention aside).
    pub fn config(&self) -> &Config {
        &self.groups[0].config
    }

    fn group(&self, group: usize) -> Result<&BlockManager, Error> {
        self.groups.get(group).ok_or_else(|| {
            invalid(format!(
                "group {group} out of range: the manager has {} groups",
                self.groups.len()
            ))
        })
    }

    /// Admits `seq` in every group; returns the prompt tokens reused: the longest prefix every
    /// group serves from its cache (full attention: every block before the hit point; a window:
    /// the blocks the next query reads).
    pub fn allocate(
        &self,
        seq: SeqId,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Result<usize, Error> {
        Ok(self.admit(seq, tokens, salt, None)?.0)
    }

    /// [`BlockManager::allocate_loading`] in every group: returns the reused tokens and, per
    /// group, the blocks to fill from the external store.
    pub fn allocate_loading(
        &self,
        seq: SeqId,
        tokens: &[Token],
        loadable_blocks: usize,
        salt: Option<&[u8]>,
    ) -> Result<(usize, Vec<Vec<BlockId>>), Error> {
        self.admit(seq, tokens, salt, Some(loadable_blocks))
    }

    fn admit(
        &self,
        seq: SeqId,
        tokens: &[Token],
        salt: Option<&[u8]>,
        loadable: Option<usize>,
    ) -> Result<(usize, Vec<Vec<BlockId>>), Error> {
        let keys = HashKeys::salt(salt);
        let hittable = check_prompt(tokens, self.groups[0].bs, &keys)?;
        let mut held = lock(&self.lock);
        if held.is_some() && loadable.is_some() {
            return Err(invalid(
                "allocate_loading: an external store holds no recurrent states",
            ));
        }
        if self.groups[0].contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let mut prompts: Vec<Admission> = (self.groups.iter())
            .map(|g| g.hash_prompt(tokens, &keys))
            .collect();
        let (hits, allowed, tables) = loop {
            // Each group's own longest hit, then the longest every group serves.
            let allowed: Vec<usize> = (self.groups.iter().zip(&mut prompts))
                .map(|(g, p)| g.find_hits(p, tokens, hittable))
                .collect();
            let lowest = allowed.iter().copied().min().expect("at least one group");
            let hits = self.hits(held.as_deref(), &mut prompts, tokens, lowest);
            if let Some(state) = held.as_ref() {
                state.check_available(1, checkpoint_key(&prompts, hits.resume))?;
            }
            let needed: usize = (self.groups.iter().zip(&prompts))
                .map(|(g, p)| g.admission_needs(tokens, p))
                .sum();
            self.groups[0].reserve_gpu(needed)?;
            // Every group's hits are taken before any group takes a fresh block, which could
            // evict another group's hit.
            let mut tables = Vec::with_capacity(self.groups.len());
            for (g, p) in self.groups.iter().zip(&prompts) {
                match g.acquire_hits(p) {
                    Ok(acquired) => tables.push(acquired),
                    Err(used) => {
                        // Hits are full blocks, released as a table of that many.
                        let bs = g.bs.get();
                        for (g, (table, _)) in self.groups.iter().zip(&tables) {
                            g.release_gpu_blocks(table, 0, 0, table.len() * bs);
                        }
                        let used: usize = used + tables.iter().map(|(_, u)| u).sum::<usize>();
                        self.groups[0].gpu.unreserve(needed - used);
                        break;
                    }
                }
            }
            if tables.len() == self.groups.len() {
                break (hits, allowed, tables);
            }
        };
        let bs = self.groups[0].bs.get();
        // What the state group alone allowed, and the checkpoint the state resumes from.
        let resumed = held.as_ref().map(|state| {
            let state_allowed = (prompts[0].keys()).map_or(0, |(keys, root)| {
                state.find_hit(keys, root, tokens, hittable)
            });
            (state_allowed, checkpoint_key(&prompts, hits.resume))
        });
        let mut loads = Vec::with_capacity(self.groups.len());
        for (((g, p), (table, used)), allowed) in
            (self.groups.iter().zip(prompts)).zip(tables).zip(allowed)
        {
            let needed = g.admission_needs(tokens, &p) - used;
            let mut one = g.seqs.lock_one(seq);
            let admitted = (tokens, &keys, p, hits.kv, allowed);
            let (_, blocks) = g.admit_locked(&mut one, admitted, table, needed, loadable);
            loads.push(blocks);
        }
        if let (Some(state), Some((allowed, key))) = (held.as_mut(), resumed) {
            state.count_lookup(allowed * bs, hits.resume * bs);
            let branch = if hits.common > hits.resume {
                hits.common * bs
            } else {
                0
            };
            state.admit(seq, key, tokens.len(), branch, hits.resume * bs);
        }
        Ok((hits.resume * bs, loads))
    }

    /// [`BlockManager::confirm_loads`] in every group: each group's first `loaded` blocks
    /// handed out to load (all of them, where it was handed fewer) hold their KV. See
    /// [`HybridManager::confirm_group_loads`].
    pub fn confirm_loads(&self, seq: SeqId, loaded: usize) -> Result<(), Error> {
        self.no_state("confirm_loads")?;
        self.confirm_runs(seq, Runs::Each(loaded))
    }

    /// Appends tokens to a running sequence in every group (see [`BlockManager::append`]).
    pub fn append(&self, seq: SeqId, tokens: &[Token]) -> Result<(), Error> {
        let mut held = lock(&self.lock);
        let mut needed = 0;
        for g in &self.groups {
            needed += g.append_needs(seq, tokens)?;
        }
        self.check_available(needed)?;
        self.each(|g| g.append(seq, tokens))?;
        if let Some(state) = held.as_mut() {
            let mut one = self.groups[0].seqs.lock_one(seq);
            let s = one.get().expect("appended to a live sequence");
            state.set_prompt_len(seq, s.prompt_len);
        }
        Ok(())
    }

    /// One decode step in every group: `plans[g]` receives group `g`'s plan (see
    /// [`BlockManager::step`]).
    pub fn step(&self, seqs: &[SeqId], tokens: &[Token], plans: &mut [Plan]) -> Result<(), Error> {
        self.one_plan_each(plans)?;
        let mut rows: Vec<Listed<'_>> = plans
            .iter_mut()
            .map(|plan| Listed {
                seqs,
                places: vec![None; seqs.len()],
                plan,
            })
            .collect();
        let result = self.decode(&mut rows, tokens, None);
        if result.is_err() {
            for (g, rows) in self.groups.iter().zip(&mut rows) {
                rows.plan.begin(0, 0, 0, g.bs);
            }
        }
        result
    }

    /// One decode step of a persistent batch per group (`batches[g]` for group `g`, all
    /// listing the same sequences in the same rows): see [`BlockManager::step_batch`].
    pub fn step_batch(&self, batches: &mut [Batch], tokens: &[Token]) -> Result<(), Error> {
        self.same_rows(batches)?;
        self.decode(batches, tokens, None)
    }

    /// A speculative step of a persistent batch per group: see [`BlockManager::verify_batch`].
    /// With a state group, row `r` keeps the states after its first `counts[r] - 1` tokens
    /// (the last sampled token and all drafts but the last) for a rollback.
    pub fn verify_batch(
        &self,
        batches: &mut [Batch],
        tokens: &[Token],
        counts: &[u32],
    ) -> Result<(), Error> {
        self.same_rows(batches)?;
        self.decode(batches, tokens, Some(counts))
    }

    /// Writes every group's plan for any batch (see [`BlockManager::plan`]).
    pub fn plan(
        &self,
        seqs: &[SeqId],
        query_lens: &[u32],
        plans: &mut [Plan],
    ) -> Result<(), Error> {
        self.plan_rows(seqs, query_lens, None, plans)
    }

    /// [`HybridManager::plan`] of a speculative pass: the last `drafts[r]` query tokens of row
    /// `r` are drafts (fewer than its query). With a state group, the state after each token
    /// before a draft is kept, so a rollback of up to `drafts[r]` tokens restores it.
    pub fn plan_with_drafts(
        &self,
        seqs: &[SeqId],
        query_lens: &[u32],
        drafts: &[u32],
        plans: &mut [Plan],
    ) -> Result<(), Error> {
        self.plan_rows(seqs, query_lens, Some(drafts), plans)
    }

    fn plan_rows(
        &self,
        seqs: &[SeqId],
        query_lens: &[u32],
        drafts: Option<&[u32]>,
        plans: &mut [Plan],
    ) -> Result<(), Error> {
        self.one_plan_each(plans)?;
        let mut held = lock(&self.lock);
        let prepared = self.prepare_plans(seqs, query_lens, drafts, held.as_deref());
        let mut prepared = match prepared {
            Ok(prepared) => prepared,
            Err(e) => {
                for (g, plan) in self.groups.iter().zip(plans.iter_mut()) {
                    plan.begin(0, 0, 0, g.bs);
                }
                return Err(e);
            }
        };
        // Queries over KV that is cached already (a state recomputed over a KV hit) write none.
        let cached: Vec<usize> = match held.as_deref() {
            Some(_) => (0..seqs.len())
                .map(|row| {
                    let s = prepared[0].row(row);
                    let start = s.tokens.len() - query_lens[row] as usize;
                    s.planned.saturating_sub(start)
                })
                .collect(),
            None => Vec::new(),
        };
        for ((g, p), plan) in self.groups.iter().zip(&mut prepared).zip(plans.iter_mut()) {
            g.apply_plan(p, query_lens, plan);
            skip_cached_writes(plan, &cached);
        }
        if let Some(state) = held.as_mut() {
            let g = &self.groups[0];
            let rows: Vec<StateRow> = (seqs.iter().zip(query_lens).enumerate())
                .map(|(row, (&seq, &q))| {
                    let s = prepared[0].row(row);
                    g.commit_states(state, seq, s);
                    let drafts = drafts.map_or(0, |d| d[row] as usize);
                    state_row(seq, s, q as usize, drafts)
                })
                .collect();
            state.plan(&rows, &mut plans[0]);
        }
        Ok(())
    }

    /// Every group's first pass of `plan`. With a state group, each query must start where
    /// the sequence's state ends (its working state holds the tokens before it: they may be
    /// neither skipped nor applied twice), and the draft states need slots.
    fn prepare_plans(
        &self,
        seqs: &[SeqId],
        query_lens: &[u32],
        drafts: Option<&[u32]>,
        state: Option<&StateCache>,
    ) -> Result<Vec<PreparedPlan<'_>>, Error> {
        if let Some(drafts) = drafts {
            check_drafts(seqs, query_lens, drafts)?;
        }
        let mut prepared = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            prepared.push(g.prepare_plan(seqs, query_lens)?);
        }
        if let Some(state) = state {
            for (row, (&seq, &q)) in seqs.iter().zip(query_lens).enumerate() {
                let s = prepared[0].row(row);
                state.check_resume(seq, s.tokens.len() - q as usize)?;
            }
            let needed = drafts.map_or(0, |d| d.iter().map(|&d| d as usize).sum());
            state.check_available(needed, None)?;
        }
        Ok(prepared)
    }

    /// The decode step of every group: every group's rows checked and counted, every group's
    /// blocks reserved at once, then every group's rows appended.
    fn decode<R: DecodeRows>(
        &self,
        rows: &mut [R],
        tokens: &[Token],
        counts: Option<&[u32]>,
    ) -> Result<(), Error> {
        let mut held = lock(&self.lock);
        let mut prepared = Vec::with_capacity(self.groups.len());
        for (g, rows) in self.groups.iter().zip(rows.iter_mut()) {
            prepared.push(g.prepare_decode(rows, tokens, counts)?);
        }
        if let Some(state) = held.as_deref() {
            for row in 0..rows[0].seqs().len() {
                let (seq, place) = (rows[0].seqs()[row], rows[0].place(row));
                state.check_resume(seq, prepared[0].at(place).tokens.len())?;
            }
            let drafts = counts.map_or(0, |c| c.iter().map(|&c| c as usize - 1).sum());
            state.check_available(drafts, None)?;
        }
        let needed = prepared.iter().map(|p| p.needed).sum();
        self.groups[0].reserve_gpu(needed)?;
        for ((g, rows), p) in self.groups.iter().zip(rows.iter_mut()).zip(&mut prepared) {
            g.apply_decode(p, rows, tokens, counts);
        }
        if let Some(state) = held.as_mut() {
            let (g, rows) = (&self.groups[0], &mut rows[0]);
            let states: Vec<StateRow> = (0..rows.seqs().len())
                .map(|row| {
                    let (seq, s) = (rows.seqs()[row], prepared[0].at(rows.place(row)));
                    g.commit_states(state, seq, s);
                    let q = counts.map_or(1, |c| c[row] as usize);
                    state_row(seq, s, q, q - 1)
                })
                .collect();
            state.plan(&states, rows.plan());
        }
        Ok(())
    }

    /// Confirms forward passes in every group (see [`BlockManager::commit`]).
    pub fn commit(&self, seqs: &[SeqId], upto: Option<&[usize]>) -> Result<(), Error> {
        let mut held = lock(&self.lock);
        self.each(|g| g.commit(seqs, upto))?;
        if let Some(state) = held.as_mut() {
            let g = &self.groups[0];
            for &seq in seqs {
                let mut one = g.seqs.lock_one(seq);
                let s = one.get().expect("committed a live sequence");
                g.commit_states(state, seq, s);
            }
        }
        Ok(())
    }

    /// Drops each sequence's last `counts[i]` tokens in every group (see
    /// [`BlockManager::rollback`]); refused where a window already released what the sequence
    /// would read again. With a state group, a rollback into a planned pass ends at one of its
    /// kept draft states, which becomes the working state (the pass must have run).
    pub fn rollback(&self, seqs: &[SeqId], counts: &[usize]) -> Result<(), Error> {
        let mut held = lock(&self.lock);
        let lens = self.check_rollback(held.as_deref(), seqs, counts)?;
        self.each(|g| g.rollback(seqs, counts))?;
        roll_back_states(held.as_deref_mut(), seqs, &lens);
        Ok(())
    }

    /// [`HybridManager::rollback`] of every row of each group's persistent batch.
    pub fn rollback_batch(&self, batches: &mut [Batch], counts: &[usize]) -> Result<(), Error> {
        self.same_rows(batches)?;
        let mut held = lock(&self.lock);
        let seqs = batches[0].seqs().to_vec();
        let lens = self.check_rollback(held.as_deref(), &seqs, counts)?;
        for (g, batch) in self.groups.iter().zip(batches) {
            g.rollback_batch(batch, counts)?;
        }
        roll_back_states(held.as_deref_mut(), &seqs, &lens);
        Ok(())
    }

    /// Fails unless every group, and the state group, can roll `seqs` back by `counts`;
    /// returns the lengths they roll back to.
    fn check_rollback(
        &self,
        state: Option<&StateCache>,
        seqs: &[SeqId],
        counts: &[usize],
    ) -> Result<Vec<usize>, Error> {
        for g in &self.groups {
            g.check_rollback(seqs, counts)?;
        }
        let mut lens = Vec::with_capacity(seqs.len());
        for (&seq, &count) in seqs.iter().zip(counts) {
            let len = self.groups[0].num_tokens(seq)? - count;
            if let Some(state) = state {
                state.check_rollback(seq, len)?;
            }
            lens.push(len);
        }
        Ok(lens)
    }

    /// Makes `child` a copy-on-write copy of `parent` in every group.
    pub fn fork(&self, parent: SeqId, child: SeqId) -> Result<(), Error> {
        let mut held = lock(&self.lock);
        if let Some(state) = held.as_ref() {
            // Every check, and the parent's auto-commit, before the slot's.
            self.each(|g| g.check_fork(parent, child))?;
            state.check_available(1, None)?;
        }
        self.each(|g| g.fork(parent, child))?;
        if let Some(state) = held.as_mut() {
            state.fork(parent, child);
        }
        Ok(())
    }

    /// Ends a sequence in every group.
    pub fn free(&self, seq: SeqId) -> Result<(), Error> {
        let mut held = lock(&self.lock);
        self.each(|g| g.free(seq))?;
        if let Some(state) = held.as_mut() {
            state.free(seq);
        }
        Ok(())
    }

    /// Moves the sequences to the CPU pool in every group; returns each group's `[gpu, cpu]`
    /// pairs to copy and, with a state group, one more entry: the state slots' pairs.
    pub fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<Vec<[BlockId; 2]>>, Error> {
        self.swap(seqs, false)
    }

    /// Brings swapped-out sequences back in every group; returns each group's `[cpu, gpu]`
    /// pairs to copy and, with a state group, one more entry: the state slots' pairs.
    pub fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<Vec<[BlockId; 2]>>, Error> {
        self.swap(seqs, true)
    }

    fn swap(&self, seqs: &[SeqId], to_gpu: bool) -> Result<Vec<Vec<[BlockId; 2]>>, Error> {
        let mut held = lock(&self.lock);
        let mut needed = 0;
        for g in &self.groups {
            needed += g.swap_needs(seqs, to_gpu)?;
        }
        if let Some(state) = held.as_deref() {
            state.check_swap(seqs, to_gpu)?;
        }
        let (pool, kind) = if to_gpu {
            (&self.groups[0].gpu, PoolKind::Gpu)
        } else {
            (&self.groups[0].cpu, PoolKind::Cpu)
        };
        if pool.available() < needed {
            return Err(Error::OutOfBlocks {
                pool: kind,
                needed,
                available: pool.available(),
            });
        }
        let mut pairs = Vec::with_capacity(self.groups.len() + 1);
        for g in &self.groups {
            pairs.push(if to_gpu {
                g.swap_in(seqs)?
            } else {
                g.swap_out(seqs)?
            });
        }
        if let Some(state) = held.as_mut() {
            let g = &self.groups[0];
            pairs.push(if to_gpu {
                state.swap_in(seqs)
            } else {
                for &seq in seqs {
                    let mut one = g.seqs.lock_one(seq);
                    let s = one.get().expect("swapped a live sequence");
                    g.commit_states(state, seq, s);
                }
                state.swap_out(seqs)
            });
        }
        Ok(pairs)
    }

    /// The engine copied the pairs of `swap_out(seqs)` for every group.
    pub fn confirm_swap_out(&self, seqs: &[SeqId]) -> Result<(), Error> {
        let mut held = lock(&self.lock);
        self.each(|g| g.confirm_swap_out(seqs))?;
        if let Some(state) = held.as_mut() {
            state.confirm_swap_out(seqs);
        }
        Ok(())
    }

    /// The engine copied the pairs of `swap_in(seqs)` for every group.
    pub fn confirm_swap_in(&self, seqs: &[SeqId]) -> Result<(), Error> {
        let mut held = lock(&self.lock);
        self.each(|g| g.confirm_swap_in(seqs))?;
        if let Some(state) = held.as_mut() {
            state.confirm_swap_in(seqs);
        }
        Ok(())
    }

    /// Group `group`'s block table of the sequence (from its [`HybridManager::first_block`]).
    pub fn block_table(&self, seq: SeqId, group: usize) -> Result<Vec<BlockId>, Error> {
        self.group(group)?.block_table(seq)
    }

    /// The logical block group `group`'s table of the sequence starts at.
    pub fn first_block(&self, seq: SeqId, group: usize) -> Result<usize, Error> {
        self.group(group)?.first_block(seq)
    }

    /// Number of tokens in the sequence.
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize, Error> {
        self.groups[0].num_tokens(seq)
    }

    /// The sequence's tokens.
    pub fn tokens(&self, seq: SeqId) -> Result<Vec<Token>, Error> {
        self.groups[0].tokens(seq)
    }

    /// Tokens of the sequence whose KV is computed.
    pub fn num_computed(&self, seq: SeqId) -> Result<usize, Error> {
        self.groups[0].num_computed(seq)
    }

    /// Whether `seq` is live.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.groups[0].contains(seq)
    }

    /// Number of live sequences.
    pub fn len(&self) -> usize {
        self.groups[0].len()
    }

    /// Whether no sequence is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Group `group`'s stats: the pool's block counts (shared by all groups) and the group's
    /// own token and prefix counters; `prefix_allowed_tokens` says how much of each prompt
    /// the group alone could have served, so the group that shortened a hit shows.
    pub fn stats(&self, group: usize) -> Result<Stats, Error> {
        Ok(self.group(group)?.stats())
    }

    /// How many leading full blocks of the prompt every group serves now (read-only).
    pub fn cached_prefix_blocks(&self, tokens: &[Token], salt: Option<&[u8]>) -> usize {
        let held = lock(&self.lock);
        self.lookup(&held, tokens, salt).map_or(0, |(hit, ..)| hit)
    }

    /// Whether a prompt could be admitted now while keeping the watermark in reserve.
    pub fn can_allocate(&self, tokens: &[Token], salt: Option<&[u8]>) -> bool {
        let held = lock(&self.lock);
        let g = &self.groups[0];
        self.lookup(&held, tokens, salt)
            .is_some_and(|(_, needed, slot)| {
                slot && g.gpu.available() >= needed + g.watermark_blocks
            })
    }

    /// The prompt's hit in blocks, the blocks admitting it would take and whether a state
    /// slot could be taken for it (none for a prompt that cannot be admitted). Read-only.
    fn lookup(
        &self,
        held: &MutexGuard<'_, Option<Box<StateCache>>>,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Option<(usize, usize, bool)> {
        let keys = HashKeys::salt(salt);
        let hittable = check_prompt(tokens, self.groups[0].bs, &keys).ok()?;
        let mut prompts: Vec<Admission> = (self.groups.iter())
            .map(|g| g.hash_prompt(tokens, &keys))
            .collect();
        let state = held.as_deref();
        let hits = self.hits(state, &mut prompts, tokens, hittable);
        let hit = hits.resume;
        let slot = state
            .is_none_or(|state| (state.check_available(1, checkpoint_key(&prompts, hit))).is_ok());
        let needed = (self.groups.iter().zip(&prompts))
            .map(|(g, p)| g.admission_needs(tokens, p))
            .sum();
        Some((hit, needed, slot))
    }

    /// A prompt's hits of at most `upto` blocks, with each group's hits found for `kv`. With
    /// full-attention KV groups the KV is reused up to their common hit and the state resumes
    /// from its latest checkpoint at or before it (the engine recomputes the state over cached
    /// KV); with windowed groups every group, the state's too, must serve the hit.
    fn hits(
        &self,
        state: Option<&StateCache>,
        prompts: &mut [Admission],
        tokens: &[Token],
        upto: usize,
    ) -> Hits {
        let common = self.common_hit(None, prompts, tokens, upto);
        let Some(state) = state else {
            return Hits {
                common,
                kv: common,
                resume: common,
            };
        };
        if self
            .groups
            .iter()
            .all(|g| g.config.attention == Attention::Full)
        {
            let resume = (prompts[0].keys())
                .map_or(0, |(keys, root)| state.find_hit(keys, root, tokens, common));
            return Hits {
                common,
                kv: common,
                resume,
            };
        }
        let hit = self.common_hit(Some(state), prompts, tokens, common);
        Hits {
            common,
            kv: hit,
            resume: hit,
        }
    }

    /// The longest hit of at most `upto` blocks every group serves, with each group's hits
    /// found for it: a window may serve a shorter prefix without serving a longer one, so the
    /// hit is lowered until all groups agree.
    fn common_hit(
        &self,
        state: Option<&StateCache>,
        prompts: &mut [Admission],
        tokens: &[Token],
        upto: usize,
    ) -> usize {
        let mut hit = upto;
        loop {
            let mut lowest = (self.groups.iter().zip(prompts.iter_mut()))
                .map(|(g, p)| g.find_hits(p, tokens, hit))
                .min()
                .expect("at least one group");
            if let Some(state) = state {
                lowest = (prompts[0].keys())
                    .map_or(0, |(keys, root)| state.find_hit(keys, root, tokens, lowest));
            }
            if lowest == hit {
                return hit;
            }
            hit = lowest;
        }
    }

    /// The hashes group 0 publishes for the prompt's full blocks (see
    /// [`BlockManager::block_hashes`]).
    pub fn block_hashes(
        &self,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Result<Vec<BlockHash>, Error> {
        self.groups[0].block_hashes(tokens, salt)
    }

    /// The hashes of group 0's computed full blocks `medium` holds: what an index built from
    /// the events describes.
    pub fn stored_hashes(&self, medium: PoolKind) -> Vec<BlockHash> {
        self.groups[0].stored_hashes(medium)
    }

    /// Removes and returns the recorded events: group 0's blocks (routers match prompts on a
    /// full-attention group).
    pub fn take_events(&self) -> Vec<crate::Event> {
        self.groups[0].take_events()
    }

    /// Drops every group's prefix-cache registrations.
    pub fn reset_prefix_cache(&self) {
        let mut held = lock(&self.lock);
        self.groups[0].reset_prefix_cache();
        if let Some(state) = held.as_mut() {
            state.reset();
        }
    }

    /// Verifies every invariant of every group and of the shared pools.
    pub fn check(&self) -> Result<(), Error> {
        let held = lock(&self.lock);
        let groups: Vec<&BlockManager> = self.groups.iter().collect();
        BlockManager::check_groups(&groups)?;
        match held.as_ref() {
            Some(state) => state.check(self.groups[0].len()),
            None => Ok(()),
        }
    }

    /// Runs `op` on every group in order. Only for operations that fail the same way in every
    /// group (their checks depend on the sequences' tokens and states, which the groups share)
    /// and take no blocks, or whose blocks were checked to be available.
    fn each(&self, op: impl Fn(&BlockManager) -> Result<(), Error>) -> Result<(), Error> {
        self.groups.iter().try_for_each(op)
    }

    /// Fails unless `needed` GPU blocks are available.
    fn check_available(&self, needed: usize) -> Result<(), Error> {
        let available = self.groups[0].gpu.available();
        if available < needed {
            return Err(Error::OutOfBlocks {
                pool: PoolKind::Gpu,
                needed,
                available,
            });
        }
        Ok(())
    }

    /// Fails for an operation the state group does not support.
    fn no_state(&self, call: &str) -> Result<(), Error> {
        if self.has_state() {
            return Err(invalid(format!(
                "{call}: not supported with a state group (an external store holds no \
                 recurrent states)"
            )));
        }
        Ok(())
    }

    fn one_plan_each(&self, plans: &[Plan]) -> Result<(), Error> {
        if plans.len() != self.groups.len() {
            return Err(invalid(format!(
                "plans: one plan per group ({}), not {}",
                self.groups.len(),
                plans.len()
            )));
        }
        Ok(())
    }

    fn same_rows(&self, batches: &[Batch]) -> Result<(), Error> {
        if batches.len() != self.groups.len() {
            return Err(invalid(format!(
                "batches: one batch per group ({}), not {}",
                self.groups.len(),
                batches.len()
            )));
        }
        if batches.iter().any(|b| b.seqs() != batches[0].seqs()) {
            return Err(invalid(
                "batches: every group's batch lists the same sequences in the same rows",
            ));
        }
        Ok(())
    }

    /// Confirms each group's loads: group `g`'s first `loaded[g]` blocks handed out by
    /// `allocate_loading` hold their KV. The hit grows to the longest every group serves
    /// (a short run in one group shortens it for all); the rest is recomputed.
    pub fn confirm_group_loads(&self, seq: SeqId, loaded: &[usize]) -> Result<(), Error> {
        self.no_state("confirm_group_loads")?;
        if loaded.len() != self.groups.len() {
            return Err(invalid(format!(
                "loaded: one count per group ({}), not {}",
                self.groups.len(),
                loaded.len()
            )));
        }
        self.confirm_runs(seq, Runs::PerGroup(loaded))
    }

    /// The published hashes of group `group`'s chain over the prompt's full blocks: what the
    /// block feed carries for that group's blocks (group 0's are [`HybridManager::block_hashes`]).
    pub fn group_block_hashes(
        &self,
        group: usize,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Result<Vec<BlockHash>, Error> {
        self.group(group)?.block_hashes(tokens, salt)
    }

    /// A 64-bit fingerprint of the hash key (`None` without prefix caching): see
    /// [`BlockManager::hash_key_fingerprint`].
    pub fn hash_key_fingerprint(&self) -> Option<u64> {
        self.groups[0].hash_key_fingerprint()
    }

    /// Removes and returns every group's recorded registrations (empty unless
    /// `enable_block_feed`).
    pub fn take_registrations(&self) -> Vec<crate::Registration> {
        self.groups[0].take_registrations()
    }

    /// Checks every group's loads and run, then ends them with the longest hit every group
    /// serves.
    fn confirm_runs(&self, seq: SeqId, runs: Runs<'_>) -> Result<(), Error> {
        let _held = lock(&self.lock);
        let mut pending = Vec::with_capacity(self.groups.len());
        for (g, group) in self.groups.iter().enumerate() {
            let one = group.seqs.lock_one(seq);
            let s = one.get_ref().ok_or(Error::UnknownSequence(seq))?;
            let loads = group.pending_loads(seq, s)?;
            let run = match runs {
                Runs::Each(loaded) if loaded > loads.count => {
                    return Err(invalid(format!(
                        "sequence {seq} was handed {} blocks to load, not {loaded}",
                        loads.count
                    )))
                }
                Runs::Each(loaded) => loaded.min(loads.handed_out()),
                Runs::PerGroup(loaded) if loaded[g] > loads.handed_out() => {
                    return Err(invalid(format!(
                        "loaded[{g}]: sequence {seq} was handed {} blocks to load in group \
                         {g}, not {}",
                        loads.handed_out(),
                        loaded[g]
                    )))
                }
                Runs::PerGroup(loaded) => loaded[g],
            };
            pending.push((loads, run));
        }
        let (hit, count) = (pending[0].0.hit, pending[0].0.count);
        let upto = (hit..=hit + count)
            .rev()
            .find(|&upto| {
                (self.groups.iter().zip(&pending))
                    .all(|(g, (loads, run))| g.served_loads(loads, *run, upto))
            })
            .expect("the hit itself is served");
        for g in &self.groups {
            let mut one = g.seqs.lock_one(seq);
            g.finish_loads(one.get().expect("checked above"), upto);
        }
        Ok(())
    }
}

/// Fails unless `drafts` has a count per row, each below its row's query length.
fn check_drafts(seqs: &[SeqId], query_lens: &[u32], drafts: &[u32]) -> Result<(), Error> {
    if drafts.len() != seqs.len() {
        return Err(invalid(format!(
            "plan: {} sequences but {} draft counts",
            seqs.len(),
            drafts.len()
        )));
    }
    let over = (drafts.iter().zip(query_lens)).position(|(&d, &q)| d >= q);
    if let Some(row) = over {
        return Err(invalid(format!(
            "plan: row {row} has {} drafts in a query of {} tokens; drafts follow at least one \
             sampled token",
            drafts[row], query_lens[row]
        )));
    }
    Ok(())
}

fn missing_state() -> Error {
    invalid("the manager has no state group")
}

/// Group 0's key of the last block of a hit of `hit` blocks: the checkpoint it resumes from.
fn checkpoint_key(prompts: &[Admission], hit: usize) -> Option<MapKey> {
    let (keys, _) = prompts[0].keys()?;
    hit.checked_sub(1).map(|last| keys[last])
}

/// Sets the slots of each row's first `cached[row]` query tokens to -1: their KV is cached
/// (rows past `cached` keep theirs).
fn skip_cached_writes(plan: &mut Plan, cached: &[usize]) {
    for (row, &n) in cached.iter().enumerate() {
        let start = plan.qo_indptr[row] as usize;
        plan.slot_mapping[start..start + n].fill(-1);
    }
}

/// The state row of a sequence whose last `q` tokens are its query, the last `drafts` of them
/// drafts.
fn state_row(seq: SeqId, s: &Sequence, q: usize, drafts: usize) -> StateRow {
    let end = s.tokens.len();
    StateRow {
        seq,
        start: end - q,
        end,
        drafts,
    }
}

/// Rolls the states of `seqs` back to `lens` tokens (checked), in order.
fn roll_back_states(state: Option<&mut StateCache>, seqs: &[SeqId], lens: &[usize]) {
    if let Some(state) = state {
        for (&seq, &len) in seqs.iter().zip(lens) {
            state.rollback(seq, len);
        }
    }
}

impl BlockManager {
    /// Frees the draft states of `seq` (`s`, this group-0 manager's record) its computed tokens
    /// reach, then registers the state saves they reach, keyed by the block that ends at each
    /// save point.
    fn commit_states(&self, state: &mut StateCache, seq: SeqId, s: &mut Sequence) {
        state.drop_drafts(seq, s.computed);
        let Some(furthest) = state.due(seq, s.computed) else {
            return;
        };
        let bs = self.bs.get();
        if let Some(prefix) = &self.prefix {
            self.hash_blocks(prefix, s, furthest / bs);
        }
        let s = &*s;
        state.commit(seq, s.computed, |point| {
            let last = point / bs - 1;
            (s.keys.len() > last).then(|| SavedPrefix {
                key: s.keys[last],
                parent: s.parent_key(last),
                tokens: &s.tokens[last * bs..point],
            })
        });
    }
}

/// The runs of loaded blocks `confirm_loads` reports: the same count for every group, or one
/// per group.
#[derive(Clone, Copy)]
enum Runs<'a> {
    Each(usize),
    PerGroup(&'a [usize]),
}

/// A prompt's hits in blocks: what the KV groups serve together (`common`), what they take
/// (`kv`) and where the state resumes (`resume`: the tokens reused, `resume <= kv <= common`).
struct Hits {
    common: usize,
    kv: usize,
    resume: usize,
}
