//! `HybridManager`: a model whose layers attend differently (full, sliding-window and
//! chunked-local attention) kept as KV-cache groups over one pool of equal-sized pages.
//!
//! Each group is a [`BlockManager`] with its own block table per sequence; the groups share the
//! GPU and CPU pools, the prefix cache (each group's blocks keyed apart) and the event log.
//! Every operation runs on all groups under one lock: it checks every group and reserves every
//! group's blocks before any group changes, so it succeeds everywhere or changes nothing.

use crate::batch::Batch;
use crate::config::{Attention, Config};
use crate::error::invalid;
use crate::keys::HashKeys;
use crate::manager::admission::{check_prompt, Admission};
use crate::manager::step::{DecodeRows, Listed};
use crate::manager::BlockManager;
use crate::plan::Plan;
use crate::stats::Stats;
use crate::sync::{lock, Mutex};
use crate::{BlockHash, BlockId, Error, PoolKind, SeqId, Token};

/// A KV-cache manager for a hybrid model: one group per attention kind (or per set of layers
/// of one kind), each with its own block table per sequence, all drawing pages from one pool.
/// Group 0 should be a full-attention group: its blocks are what events announce.
pub struct HybridManager {
    groups: Vec<BlockManager>,
    /// Held by every operation, so what one operation counted and reserved for all groups is
    /// still there when it takes it.
    lock: Mutex<()>,
}

impl HybridManager {
    /// Groups attending as `groups` (at most 255) over one pool built as `config` says
    /// (`config.attention` must be `Full`; each group's attention is in `groups`).
    pub fn new(config: Config, groups: &[Attention]) -> Result<HybridManager, Error> {
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
        Ok(HybridManager {
            groups: built,
            lock: Mutex::new(()),
        })
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
        let _held = lock(&self.lock);
        if self.groups[0].contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let mut prompts: Vec<Admission> = (self.groups.iter())
            .map(|g| g.hash_prompt(tokens, &keys))
            .collect();
        let (hit, allowed, tables) = loop {
            // Each group's own longest hit, then the longest every group serves.
            let allowed: Vec<usize> = (self.groups.iter().zip(&mut prompts))
                .map(|(g, p)| g.find_hits(p, tokens, hittable))
                .collect();
            let lowest = allowed.iter().copied().min().expect("at least one group");
            let hit = self.common_hit(&mut prompts, tokens, lowest);
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
                break (hit, allowed, tables);
            }
        };
        let bs = self.groups[0].bs.get();
        let mut loads = Vec::with_capacity(self.groups.len());
        for (((g, p), (table, used)), allowed) in
            (self.groups.iter().zip(prompts)).zip(tables).zip(allowed)
        {
            let needed = g.admission_needs(tokens, &p) - used;
            let mut one = g.seqs.lock_one(seq);
            let admitted = (tokens, &keys, p, hit, allowed);
            let (_, blocks) = g.admit_locked(&mut one, admitted, table, needed, loadable);
            loads.push(blocks);
        }
        Ok((hit * bs, loads))
    }

    /// [`BlockManager::confirm_loads`] in every group (each loaded its first `loaded` blocks).
    pub fn confirm_loads(&self, seq: SeqId, loaded: usize) -> Result<(), Error> {
        let _held = lock(&self.lock);
        self.each(|g| g.confirm_loads(seq, loaded))
    }

    /// Appends tokens to a running sequence in every group (see [`BlockManager::append`]).
    pub fn append(&self, seq: SeqId, tokens: &[Token]) -> Result<(), Error> {
        let _held = lock(&self.lock);
        let mut needed = 0;
        for g in &self.groups {
            needed += g.append_needs(seq, tokens)?;
        }
        self.check_available(needed)?;
        self.each(|g| g.append(seq, tokens))
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
        self.one_plan_each(plans)?;
        let _held = lock(&self.lock);
        let mut prepared = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            match g.prepare_plan(seqs, query_lens) {
                Ok(p) => prepared.push(p),
                Err(e) => {
                    drop(prepared);
                    for (g, plan) in self.groups.iter().zip(plans.iter_mut()) {
                        plan.begin(0, 0, 0, g.bs);
                    }
                    return Err(e);
                }
            }
        }
        for ((g, mut p), plan) in self.groups.iter().zip(prepared).zip(plans) {
            g.apply_plan(&mut p, query_lens, plan);
        }
        Ok(())
    }

    /// The decode step of every group: every group's rows checked and counted, every group's
    /// blocks reserved at once, then every group's rows appended.
    fn decode<R: DecodeRows>(
        &self,
        rows: &mut [R],
        tokens: &[Token],
        counts: Option<&[u32]>,
    ) -> Result<(), Error> {
        let _held = lock(&self.lock);
        let mut prepared = Vec::with_capacity(self.groups.len());
        for (g, rows) in self.groups.iter().zip(rows.iter_mut()) {
            prepared.push(g.prepare_decode(rows, tokens, counts)?);
        }
        let needed = prepared.iter().map(|p| p.needed).sum();
        self.groups[0].reserve_gpu(needed)?;
        for ((g, rows), mut p) in self.groups.iter().zip(rows).zip(prepared) {
            g.apply_decode(&mut p, rows, tokens, counts);
        }
        Ok(())
    }

    /// Confirms forward passes in every group (see [`BlockManager::commit`]).
    pub fn commit(&self, seqs: &[SeqId], upto: Option<&[usize]>) -> Result<(), Error> {
        let _held = lock(&self.lock);
        self.each(|g| g.commit(seqs, upto))
    }

    /// Drops each sequence's last `counts[i]` tokens in every group (see
    /// [`BlockManager::rollback`]); refused where a window already released what the sequence
    /// would read again.
    pub fn rollback(&self, seqs: &[SeqId], counts: &[usize]) -> Result<(), Error> {
        let _held = lock(&self.lock);
        for g in &self.groups {
            g.check_rollback(seqs, counts)?;
        }
        self.each(|g| g.rollback(seqs, counts))
    }

    /// [`HybridManager::rollback`] of every row of each group's persistent batch.
    pub fn rollback_batch(&self, batches: &mut [Batch], counts: &[usize]) -> Result<(), Error> {
        self.same_rows(batches)?;
        let _held = lock(&self.lock);
        let seqs = batches[0].seqs().to_vec();
        for g in &self.groups {
            g.check_rollback(&seqs, counts)?;
        }
        for (g, batch) in self.groups.iter().zip(batches) {
            g.rollback_batch(batch, counts)?;
        }
        Ok(())
    }

    /// Makes `child` a copy-on-write copy of `parent` in every group.
    pub fn fork(&self, parent: SeqId, child: SeqId) -> Result<(), Error> {
        let _held = lock(&self.lock);
        self.each(|g| g.fork(parent, child))
    }

    /// Ends a sequence in every group.
    pub fn free(&self, seq: SeqId) -> Result<(), Error> {
        let _held = lock(&self.lock);
        self.each(|g| g.free(seq))
    }

    /// Moves the sequences to the CPU pool in every group; returns each group's `[gpu, cpu]`
    /// pairs to copy.
    pub fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<Vec<[BlockId; 2]>>, Error> {
        self.swap(seqs, false)
    }

    /// Brings swapped-out sequences back in every group; returns each group's `[cpu, gpu]`
    /// pairs to copy.
    pub fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<Vec<[BlockId; 2]>>, Error> {
        self.swap(seqs, true)
    }

    fn swap(&self, seqs: &[SeqId], to_gpu: bool) -> Result<Vec<Vec<[BlockId; 2]>>, Error> {
        let _held = lock(&self.lock);
        let mut needed = 0;
        for g in &self.groups {
            needed += g.swap_needs(seqs, to_gpu)?;
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
        let mut pairs = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            pairs.push(if to_gpu {
                g.swap_in(seqs)?
            } else {
                g.swap_out(seqs)?
            });
        }
        Ok(pairs)
    }

    /// The engine copied the pairs of `swap_out(seqs)` for every group.
    pub fn confirm_swap_out(&self, seqs: &[SeqId]) -> Result<(), Error> {
        let _held = lock(&self.lock);
        self.each(|g| g.confirm_swap_out(seqs))
    }

    /// The engine copied the pairs of `swap_in(seqs)` for every group.
    pub fn confirm_swap_in(&self, seqs: &[SeqId]) -> Result<(), Error> {
        let _held = lock(&self.lock);
        self.each(|g| g.confirm_swap_in(seqs))
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
        let _held = lock(&self.lock);
        self.lookup(tokens, salt).map_or(0, |(hit, _)| hit)
    }

    /// Whether a prompt could be admitted now while keeping the watermark in reserve.
    pub fn can_allocate(&self, tokens: &[Token], salt: Option<&[u8]>) -> bool {
        let _held = lock(&self.lock);
        let g = &self.groups[0];
        self.lookup(tokens, salt)
            .is_some_and(|(_, needed)| g.gpu.available() >= needed + g.watermark_blocks)
    }

    /// The prompt's hit in blocks and the blocks admitting it would take (none for a prompt
    /// that cannot be admitted). Read-only.
    fn lookup(&self, tokens: &[Token], salt: Option<&[u8]>) -> Option<(usize, usize)> {
        let keys = HashKeys::salt(salt);
        let hittable = check_prompt(tokens, self.groups[0].bs, &keys).ok()?;
        let mut prompts: Vec<Admission> = (self.groups.iter())
            .map(|g| g.hash_prompt(tokens, &keys))
            .collect();
        let hit = self.common_hit(&mut prompts, tokens, hittable);
        let needed = (self.groups.iter().zip(&prompts))
            .map(|(g, p)| g.admission_needs(tokens, p))
            .sum();
        Some((hit, needed))
    }

    /// The longest hit of at most `upto` blocks every group serves, with each group's hits
    /// found for it: a window may serve a shorter prefix without serving a longer one, so the
    /// hit is lowered until all groups agree.
    fn common_hit(&self, prompts: &mut [Admission], tokens: &[Token], upto: usize) -> usize {
        let mut hit = upto;
        loop {
            let lowest = (self.groups.iter().zip(prompts.iter_mut()))
                .map(|(g, p)| g.find_hits(p, tokens, hit))
                .min()
                .expect("at least one group");
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
        let _held = lock(&self.lock);
        self.groups[0].reset_prefix_cache();
    }

    /// Verifies every invariant of every group and of the shared pools.
    pub fn check(&self) -> Result<(), Error> {
        let _held = lock(&self.lock);
        let groups: Vec<&BlockManager> = self.groups.iter().collect();
        BlockManager::check_groups(&groups)
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
}
