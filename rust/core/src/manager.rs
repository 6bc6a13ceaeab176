//! `BlockManager`: sequences, prefix reuse, copy-on-write, swapping and plans on top of the
//! block pool. Exact semantics: `SEMANTICS.md` beside the crate.

use std::collections::{HashMap, HashSet};

use crate::block::{BlockSize, BlockState};
use crate::cpu_tier::CpuTier;
use crate::error::{invalid, violated};
use crate::events::{EventKind, EventLog};
use crate::plan::Plan;
use crate::pool::{BlockPool, Hit, Released};
use crate::prefix::{short, BlockHash, Chain, PrefixCache};
use crate::sequence::{Batch, Member, PendingCopy, Sequence, SequenceMap};
use crate::stats::{Counters, Stats};
use crate::sync::{AtomicU64, Ordering};
use crate::{BlockId, Error, PoolKind, SeqId, Token};

/// The most tokens one sequence may hold: positions and slots are int32.
const MAX_TOKENS: usize = i32::MAX as usize;

/// How a `BlockManager` is built.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Blocks in the GPU pool.
    pub num_blocks: u32,
    /// Token slots per block.
    pub block_size: u32,
    /// Blocks in the CPU pool that `swap_out` moves sequences to (0: no swapping).
    pub num_cpu_blocks: u32,
    /// Reuse full blocks across sequences with the same prefix.
    pub enable_prefix_caching: bool,
    /// Fraction of the GPU pool `can_allocate` keeps free for running sequences to grow.
    pub watermark: f64,
    /// Key of the block hash; `None` draws a random one (pass one to share hashes across
    /// processes, e.g. for a KV-aware router).
    pub hash_key: Option<[u8; 32]>,
    /// Record prefix-cache events for `take_events`.
    pub enable_events: bool,
    /// A call that names a sequence (`step`, `plan`, `append`, `fork`, `swap_out`) first
    /// commits that sequence's latest plan: right for an engine that runs each forward pass
    /// before its next call. Engines that plan ahead of their forward passes turn it off and
    /// call `commit`.
    pub auto_commit: bool,
}

impl Config {
    /// `num_blocks` blocks of `block_size` tokens with the defaults: no CPU pool, prefix
    /// caching on, watermark 0.01, random hash key, no events, auto-commit.
    pub fn new(num_blocks: u32, block_size: u32) -> Config {
        Config {
            num_blocks,
            block_size,
            num_cpu_blocks: 0,
            enable_prefix_caching: true,
            watermark: 0.01,
            hash_key: None,
            enable_events: false,
            auto_commit: true,
        }
    }

    fn validate(&self) -> Result<(), Error> {
        if self.num_blocks == 0 {
            return Err(invalid("num_blocks must be at least 1"));
        }
        if self.block_size == 0 {
            return Err(invalid("block_size must be at least 1"));
        }
        for (name, blocks) in [
            ("num_blocks", self.num_blocks),
            ("num_cpu_blocks", self.num_cpu_blocks),
        ] {
            if u64::from(blocks) * u64::from(self.block_size) > i32::MAX as u64 {
                return Err(invalid(format!(
                    "{name} * block_size = {} exceeds the int32 slot range",
                    u64::from(blocks) * u64::from(self.block_size)
                )));
            }
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return Err(invalid(format!(
                "watermark must be in [0, 1), got {}",
                self.watermark
            )));
        }
        Ok(())
    }
}

/// The paged KV-cache block manager. `Send + Sync`; every method takes `&self`, and different
/// sequences may be driven from different threads at once.
///
/// KV lifecycle: a sequence's tokens are *pending* (assigned to slots) until the engine reports
/// their KV *computed* (`commit`, or the next call naming the sequence with `auto_commit`).
/// Only computed full blocks are registered in the prefix cache, copied by swaps or announced
/// by events, so nothing is shared before its KV exists.
pub struct BlockManager {
    config: Config,
    bs: BlockSize,
    watermark_blocks: usize,
    gpu: BlockPool,
    cpu: BlockPool,
    prefix: Option<PrefixCache>,
    seqs: SequenceMap,
    cpu_tier: CpuTier,
    events: EventLog,
    counters: Counters,
    stamps: AtomicU64,
}

/// The outcome of a prefix lookup: every full block's hash and the verified hits.
struct Lookup {
    root: Chain,
    hashes: Vec<Chain>,
    hits: Vec<(BlockId, BlockState)>,
    cached_hits: usize,
}

impl BlockManager {
    /// A manager with every block FREE.
    pub fn new(config: Config) -> Result<BlockManager, Error> {
        config.validate()?;
        let pool = |name: &str, blocks: u32| {
            BlockPool::new(blocks).map_err(|e| e.naming(format!("{name} = {blocks}")))
        };
        let gpu = pool("num_blocks", config.num_blocks)?;
        let cpu = pool("num_cpu_blocks", config.num_cpu_blocks)?;
        let prefix = if config.enable_prefix_caching {
            let key = match config.hash_key {
                Some(key) => key,
                None => {
                    let mut key = [0u8; 32];
                    getrandom::fill(&mut key).map_err(|e| {
                        invalid(format!(
                            "no OS randomness for the hash key ({e}); pass hash_key"
                        ))
                    })?;
                    key
                }
            };
            let prefix = PrefixCache::new(key, config.num_blocks, config.block_size);
            let slots = u64::from(config.num_blocks) * u64::from(config.block_size);
            Some(prefix.map_err(|e| e.naming(format!("num_blocks * block_size = {slots}")))?)
        } else {
            None
        };
        Ok(BlockManager {
            bs: BlockSize::new(config.block_size as usize),
            watermark_blocks: (config.watermark * f64::from(config.num_blocks)) as usize,
            gpu,
            cpu,
            prefix,
            seqs: SequenceMap::new(),
            cpu_tier: CpuTier::default(),
            events: EventLog::new(config.enable_events),
            counters: Counters::default(),
            stamps: AtomicU64::new(0),
            config,
        })
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Admits sequence `seq` with its prompt, reusing cached full blocks of the same prefix
    /// (and `salt`); returns how many prompt tokens were reused. Their KV is computed; the rest
    /// of the prompt is pending until a plan computes it.
    pub fn allocate(
        &self,
        seq: SeqId,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Result<usize, Error> {
        Ok(self.admit(seq, tokens, salt, None)?.0)
    }

    /// Admits `seq` like [`BlockManager::allocate`] when an external store holds more of the
    /// prompt: the caller claims full blocks `0..loadable_blocks` exist on the GPU or in the
    /// store. Returns the GPU-reused tokens `k * block_size` and the fresh GPU blocks for
    /// logical blocks `k..k + n` to fill from the store (never covering the last token). Their
    /// KV stays pending until [`BlockManager::confirm_loads`].
    pub fn allocate_loading(
        &self,
        seq: SeqId,
        tokens: &[Token],
        loadable_blocks: usize,
        salt: Option<&[u8]>,
    ) -> Result<(usize, Vec<BlockId>), Error> {
        self.admit(seq, tokens, salt, Some(loadable_blocks))
    }

    /// Confirms that the first `loaded` blocks handed out by `allocate_loading` hold their KV:
    /// they become computed (and shareable); the rest stay pending, to be recomputed.
    pub fn confirm_loads(&self, seq: SeqId, loaded: usize) -> Result<(), Error> {
        let mut one = self.seqs.lock_one(seq);
        let s = one.get().ok_or(Error::UnknownSequence(seq))?;
        let Some((first, count)) = s.loading else {
            return Err(invalid(format!(
                "sequence {seq} has no external loads to confirm"
            )));
        };
        if loaded > count {
            return Err(invalid(format!(
                "sequence {seq} was handed {count} blocks to load, not {loaded}"
            )));
        }
        s.loading = None;
        let upto = (first + loaded) * self.bs.get();
        s.planned = s.planned.max(upto);
        self.commit_to(s, upto);
        let hit = (loaded * self.bs.get()) as u64;
        Counters::add(&self.counters.external_hit_tokens, hit);
        Counters::add(&self.counters.prefix_hit_tokens, hit);
        Counters::add(&self.counters.external_failures, (count - loaded) as u64);
        Ok(())
    }

    fn admit(
        &self,
        seq: SeqId,
        tokens: &[Token],
        salt: Option<&[u8]>,
        loadable: Option<usize>,
    ) -> Result<(usize, Vec<BlockId>), Error> {
        if tokens.is_empty() {
            return Err(invalid("allocate needs at least one token"));
        }
        check_room(0, tokens.len())?;
        let mut one = self.seqs.lock_one(seq);
        if one.get().is_some() {
            return Err(Error::DuplicateSequence(seq));
        }
        let bs = self.bs;
        let pages = bs.pages(tokens.len());
        let (found, table) = loop {
            let found = self.lookup(tokens, salt);
            let needed = pages - found.hits.len() + found.cached_hits;
            self.reserve_gpu(needed)?;
            let mut table = Vec::with_capacity(pages);
            let mut used = 0;
            for &(block, seen) in &found.hits {
                match self.gpu.acquire_hit(block, seen, bs.get() as u32) {
                    Some(Hit::Shared) => {}
                    Some(Hit::Revived) => used += 1,
                    None => break,
                }
                table.push(block);
            }
            if table.len() < found.hits.len() {
                // Another thread changed a matched block between lookup and acquire: undo, retry.
                self.release_gpu_blocks(&table, table.len() * bs.get());
                self.gpu.unreserve(needed - used);
                continue;
            }
            while table.len() < pages {
                table.push(self.take_fresh());
                used += 1;
            }
            self.gpu.unreserve(needed - used);
            break (found, table);
        };
        let hit_blocks = found.hits.len();
        let reused = hit_blocks * bs.get();
        let hittable = bs.index(tokens.len() - 1);
        let loads = match loadable {
            Some(until) if self.prefix.is_some() => until.min(hittable).saturating_sub(hit_blocks),
            _ => 0,
        };
        let load_blocks = table[hit_blocks..hit_blocks + loads].to_vec();
        let mut sequence = Sequence::new(
            tokens.to_vec(),
            table,
            found.hashes,
            found.root,
            reused,
            hit_blocks,
        );
        if loads > 0 {
            sequence.loading = Some((hit_blocks, loads));
        }
        if loadable.is_some() {
            Counters::add(
                &self.counters.external_query_tokens,
                ((hittable.saturating_sub(hit_blocks)) * bs.get()) as u64,
            );
        }
        self.gpu.add_stored(tokens.len() - reused);
        Counters::add(&self.counters.computed_tokens, reused as u64);
        Counters::add(
            &self.counters.pending_tokens,
            (tokens.len() - reused) as u64,
        );
        Counters::add(&self.counters.prefix_query_tokens, tokens.len() as u64);
        Counters::add(&self.counters.prefix_hit_tokens, reused as u64);
        one.insert(sequence);
        Ok((reused, load_blocks))
    }

    /// Whether a prompt could be admitted now while keeping the watermark in reserve.
    pub fn can_allocate(&self, tokens: &[Token], salt: Option<&[u8]>) -> bool {
        if tokens.is_empty() || tokens.len() > MAX_TOKENS {
            return false;
        }
        let found = self.lookup(tokens, salt);
        let needed = self.bs.pages(tokens.len()) - found.hits.len() + found.cached_hits;
        self.gpu.available() >= needed + self.watermark_blocks
    }

    /// How many leading full blocks of the prompt the GPU prefix cache holds now (read-only; a
    /// hit never covers the last token).
    pub fn cached_prefix_blocks(&self, tokens: &[Token], salt: Option<&[u8]>) -> usize {
        if tokens.is_empty() || tokens.len() > MAX_TOKENS {
            return 0;
        }
        self.lookup(tokens, salt).hits.len()
    }

    /// The chained hashes of the prompt's full blocks (the values events carry).
    pub fn block_hashes(
        &self,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Result<Vec<BlockHash>, Error> {
        let prefix = self
            .prefix
            .as_ref()
            .ok_or_else(|| invalid("block hashes need prefix caching"))?;
        let mut parent = prefix.root(salt);
        Ok(tokens
            .chunks_exact(self.bs.get())
            .map(|block| {
                parent = prefix.hash_block(&parent, block);
                short(&parent)
            })
            .collect())
    }

    /// A 64-bit fingerprint of the hash key (`None` without prefix caching): managers with the
    /// same fingerprint, block size and salt produce the same block hashes.
    pub fn hash_key_fingerprint(&self) -> Option<u64> {
        self.prefix.as_ref().map(PrefixCache::fingerprint)
    }

    /// The hashes of the computed full blocks `medium` holds: registered in the GPU prefix
    /// cache, or (while events are recorded) copied to the CPU pool by confirmed swap-outs. It
    /// is what an index built from the events describes.
    pub fn stored_hashes(&self, medium: PoolKind) -> Vec<BlockHash> {
        match (medium, &self.prefix) {
            (_, None) => Vec::new(),
            (PoolKind::Gpu, Some(prefix)) => prefix.hashes(),
            (PoolKind::Cpu, Some(_)) => self.cpu_tier.hashes(),
        }
    }

    /// Appends tokens to a running sequence, copying a shared last block on write. The tokens'
    /// KV is pending until a plan computes it; the copy comes back with that plan.
    pub fn append(&self, seq: SeqId, tokens: &[Token]) -> Result<(), Error> {
        if tokens.is_empty() {
            return Err(invalid("append needs at least one token"));
        }
        let mut one = self.seqs.lock_one(seq);
        let s = one.get().ok_or(Error::UnknownSequence(seq))?;
        if s.swapped {
            return Err(Error::SwappedOut(seq));
        }
        not_loading(seq, s)?;
        check_room(s.tokens.len(), tokens.len())?;
        self.settle(self.auto_commit(s));
        let needed = self.blocks_to_append(s, tokens.len());
        self.reserve_gpu(needed)?;
        let used = self.append_reserved(s, tokens);
        self.gpu.unreserve(needed - used);
        self.gpu.add_stored(tokens.len());
        Counters::add(&self.counters.pending_tokens, tokens.len() as u64);
        Ok(())
    }

    /// One decode step: appends `tokens[i]` to `seqs[i]` for the whole batch (all or nothing),
    /// then writes the plan for one query token per sequence into `plan`. On an error `plan`
    /// is left empty.
    pub fn step(&self, seqs: &[SeqId], tokens: &[Token], plan: &mut Plan) -> Result<(), Error> {
        self.fill_step(seqs, tokens, plan)
            .inspect_err(|_| plan.begin(0, 0, 0, self.bs))
    }

    /// Writes the plan for any batch into `plan`: sequence `seqs[i]`'s last `query_lens[i]`
    /// tokens are the queries (prefill, chunked prefill, decode or a mix). On an error `plan` is
    /// left empty.
    pub fn plan(&self, seqs: &[SeqId], query_lens: &[u32], plan: &mut Plan) -> Result<(), Error> {
        self.fill_plan(seqs, query_lens, plan)
            .inspect_err(|_| plan.begin(0, 0, 0, self.bs))
    }

    /// Confirms the engine's forward passes: each sequence's KV is computed up to `upto[i]`
    /// tokens (`None`: up to the end of its latest plan). Copies that plans carried are done,
    /// and newly computed full blocks become shareable. Counts may not exceed what was planned;
    /// counts below what is already computed change nothing.
    pub fn commit(&self, seqs: &[SeqId], upto: Option<&[usize]>) -> Result<(), Error> {
        if let Some(upto) = upto {
            one_each("commit", seqs.len(), upto.len(), "token counts")?;
        }
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        let mut members = Vec::with_capacity(seqs.len());
        for (b, &id) in seqs.iter().enumerate() {
            let member = visit(&mut batch, id, stamp, false)?;
            let s = batch.at(member);
            if let Some(n) = upto.map(|u| u[b]) {
                if n > s.planned {
                    return Err(invalid(format!(
                        "sequence {id}: cannot commit {n} tokens, only {} are planned",
                        s.planned
                    )));
                }
            }
            members.push(member);
        }
        let mut computed = 0;
        for (b, &member) in members.iter().enumerate() {
            let s = batch.at(member);
            let n = upto.map_or(s.planned, |u| u[b]);
            computed += self.commit_unsettled(s, n);
        }
        self.settle(computed);
        Ok(())
    }

    /// Tokens of the sequence whose KV is computed.
    pub fn num_computed(&self, seq: SeqId) -> Result<usize, Error> {
        let mut one = self.seqs.lock_one(seq);
        Ok(one.get().ok_or(Error::UnknownSequence(seq))?.computed)
    }

    fn fill_step(&self, seqs: &[SeqId], tokens: &[Token], plan: &mut Plan) -> Result<(), Error> {
        one_each("step", seqs.len(), tokens.len(), "tokens")?;
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        let mut members = Vec::with_capacity(seqs.len());
        let (mut nnz, mut needed, mut copying) = (0, 0, false);
        for &id in seqs {
            let member = visit(&mut batch, id, stamp, false)?;
            let s = batch.at(member);
            not_loading(id, s)?;
            check_room(s.tokens.len(), 1)?;
            no_gap(id, s, s.tokens.len())?;
            nnz += self.bs.pages(s.tokens.len() + 1);
            needed += self.blocks_to_append(s, 1);
            copying |= !s.copying.is_empty();
            members.push(member);
        }
        // Members with copies in flight are committed first: a completed copy releases its
        // source, which may be another member's tail that then needs no copy-on-write, so
        // `needed` is counted again after them. Any other commit changes no refcount, so it
        // waits for its own member's turn below (one pass over the batch fewer).
        if copying && self.config.auto_commit {
            let mut computed = 0;
            for &member in &members {
                let s = batch.at(member);
                if !s.copying.is_empty() {
                    computed += self.auto_commit(s);
                }
            }
            self.settle(computed);
            needed = members
                .iter()
                .map(|&member| self.blocks_to_append(batch.at(member), 1))
                .sum();
        }
        self.reserve_gpu(needed)?;
        plan.begin(seqs.len(), nnz, seqs.len(), self.bs);
        let (mut used, mut computed) = (0, 0);
        for (&member, &token) in members.iter().zip(tokens) {
            let s = batch.at(member);
            computed += self.auto_commit(s);
            used += self.append_reserved(s, &[token]);
            self.plan_one(s, 1, plan);
        }
        self.settle(computed);
        self.gpu.unreserve(needed - used);
        self.gpu.add_stored(seqs.len());
        Counters::add(&self.counters.pending_tokens, seqs.len() as u64);
        Ok(())
    }

    fn fill_plan(&self, seqs: &[SeqId], query_lens: &[u32], plan: &mut Plan) -> Result<(), Error> {
        one_each("plan", seqs.len(), query_lens.len(), "query lengths")?;
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        let (mut nnz, mut num_query_tokens) = (0, 0);
        let mut members = Vec::with_capacity(seqs.len());
        for (&id, &q) in seqs.iter().zip(query_lens) {
            let member = visit(&mut batch, id, stamp, false)?;
            members.push(member);
            let s = batch.at(member);
            not_loading(id, s)?;
            let len = s.tokens.len();
            if q == 0 || q as usize > len {
                return Err(invalid(format!(
                    "query length {q} of sequence {id} must be in 1..={len}"
                )));
            }
            no_gap(id, s, len - q as usize)?;
            nnz += self.bs.pages(len);
            num_query_tokens += q as usize;
        }
        plan.begin(seqs.len(), nnz, num_query_tokens, self.bs);
        let mut computed = 0;
        for (&member, &q) in members.iter().zip(query_lens) {
            let s = batch.at(member);
            computed += self.auto_commit(s);
            self.plan_one(s, q as usize, plan);
        }
        self.settle(computed);
        Ok(())
    }

    /// Adds a validated sequence's last `q` tokens to the plan, with the copies it must apply
    /// first; the plan's forward pass computes the sequence's KV up to its end.
    fn plan_one(&self, s: &mut Sequence, q: usize, plan: &mut Plan) {
        let len = s.tokens.len();
        plan.push(&s.table, len, q, self.bs);
        if !s.copies.is_empty() {
            for mut copy in s.copies.drain(..) {
                plan.push_copy(copy.src, copy.dst);
                copy.until = len;
                s.copying.push(copy);
            }
        }
        s.planned = len;
    }

    /// With `auto_commit`, a call naming a sequence first commits its latest plan. Returns the
    /// tokens that became computed, for [`BlockManager::settle`].
    fn auto_commit(&self, s: &mut Sequence) -> u64 {
        if self.config.auto_commit {
            self.commit_unsettled(s, s.planned)
        } else {
            0
        }
    }

    /// Commits `s` up to `upto` and settles the token gauges.
    fn commit_to(&self, s: &mut Sequence, upto: usize) {
        let computed = self.commit_unsettled(s, upto);
        self.settle(computed);
    }

    /// Moves `tokens` from the pending gauge to the computed one: once per call, not per
    /// sequence, so a batch pays two atomic additions however large it is.
    fn settle(&self, tokens: u64) {
        if tokens > 0 {
            Counters::add(&self.counters.computed_tokens, tokens);
            Counters::sub(&self.counters.pending_tokens, tokens);
        }
    }

    /// Marks the sequence's KV computed up to `upto` (at most `planned`), completes the copies
    /// of committed plans and registers the newly computed full blocks. Returns the tokens that
    /// became computed; the caller settles them.
    #[inline]
    fn commit_unsettled(&self, s: &mut Sequence, upto: usize) -> u64 {
        debug_assert!(upto <= s.planned);
        let mut computed = 0;
        if upto > s.computed {
            computed = (upto - s.computed) as u64;
            s.computed = upto;
        }
        // The decode step's usual case: no copy to complete and no block newly full.
        let full = self.bs.index(s.computed);
        if s.copying.is_empty() && (full <= s.registered || self.prefix.is_none()) {
            return computed;
        }
        self.complete_and_register(s);
        computed
    }

    /// The rest of a commit: completes the copies of committed plans and registers the newly
    /// computed full blocks.
    fn complete_and_register(&self, s: &mut Sequence) {
        if !s.copying.is_empty() {
            let computed = s.computed;
            s.copying.retain(|copy| {
                let done = copy.until <= computed;
                if done {
                    self.gpu.release_block(copy.src, copy.fill);
                }
                !done
            });
        }
        if !s.swapped && s.swap_source.is_none() && s.loading.is_none() {
            let computed_blocks = self.bs.index(s.computed);
            self.register_full(s, computed_blocks);
        }
    }

    /// Makes `child` a copy of `parent` that shares all its blocks (copy-on-write). The
    /// parent's KV must be computed (after its auto-commit), so shared blocks never hold
    /// pending tokens.
    pub fn fork(&self, parent: SeqId, child: SeqId) -> Result<(), Error> {
        let mut batch = self.seqs.lock(&[parent, child]);
        let p = batch.get(parent).ok_or(Error::UnknownSequence(parent))?;
        if p.swapped {
            return Err(Error::SwappedOut(parent));
        }
        if batch.contains(child) {
            return Err(Error::DuplicateSequence(child));
        }
        let p = batch.get(parent).expect("checked above");
        not_loading(parent, p)?;
        if p.swap_in_pending() {
            return Err(invalid(format!(
                "sequence {parent}: confirm its swap-in before forking it"
            )));
        }
        self.settle(self.auto_commit(p));
        if p.computed != p.tokens.len() {
            return Err(invalid(format!(
                "sequence {parent}: only {} of its {} tokens have computed KV; commit its forward \
                 pass before forking it",
                p.computed,
                p.tokens.len()
            )));
        }
        p.shared_tail = true;
        let mut copy = Sequence::new(
            p.tokens.clone(),
            p.table.clone(),
            p.hashes.clone(),
            p.root,
            p.computed,
            p.registered,
        );
        copy.shared_tail = true;
        for &block in &copy.table {
            self.gpu.share_held(block);
        }
        Counters::add(&self.counters.computed_tokens, copy.computed as u64);
        batch.insert(child, copy);
        Ok(())
    }

    /// Ends a sequence and releases its blocks, last block first, then the sources of its
    /// unconfirmed swap and copies. Its uncommitted KV is never registered.
    pub fn free(&self, seq: SeqId) -> Result<(), Error> {
        // Hold the shard until the blocks are released, so `check` never sees them orphaned.
        let mut one = self.seqs.lock_one(seq);
        let s = one.remove().ok_or(Error::UnknownSequence(seq))?;
        let len = s.tokens.len();
        if s.swapped {
            self.release_cpu_blocks(&s.table);
        } else {
            self.release_gpu_blocks(&s.table, len);
        }
        match &s.swap_source {
            Some(gpu) if s.swapped => self.release_gpu_blocks(gpu, len),
            Some(cpu) => self.release_cpu_blocks(cpu),
            None => {}
        }
        for copy in s.copies.iter().chain(&s.copying) {
            self.gpu.release_block(copy.src, copy.fill);
        }
        if let Some((_, count)) = s.loading {
            Counters::add(&self.counters.external_failures, count as u64);
        }
        Counters::sub(&self.counters.computed_tokens, s.computed as u64);
        Counters::sub(&self.counters.pending_tokens, (len - s.computed) as u64);
        Ok(())
    }

    /// Moves the sequences to the CPU pool; returns the `[gpu, cpu]` block pairs to copy (a
    /// block shared by several of them is copied once). The GPU blocks stay held until
    /// [`BlockManager::confirm_swap_out`] says the copy ran.
    pub fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<[BlockId; 2]>, Error> {
        self.swap(seqs, false)
    }

    /// Brings swapped-out sequences back to the GPU pool; returns the `[cpu, gpu]` pairs. The
    /// CPU blocks stay held, and the GPU blocks unshared, until
    /// [`BlockManager::confirm_swap_in`] says the copy ran.
    pub fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<[BlockId; 2]>, Error> {
        self.swap(seqs, true)
    }

    /// The engine copied the pairs of `swap_out(seqs)`: their GPU blocks are released.
    pub fn confirm_swap_out(&self, seqs: &[SeqId]) -> Result<(), Error> {
        self.confirm_swap(seqs, false)
    }

    /// The engine copied the pairs of `swap_in(seqs)`: their CPU blocks are released and
    /// their computed full blocks become shareable.
    pub fn confirm_swap_in(&self, seqs: &[SeqId]) -> Result<(), Error> {
        self.confirm_swap(seqs, true)
    }

    /// The sequence's GPU block table.
    pub fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>, Error> {
        let mut one = self.seqs.lock_one(seq);
        let s = one.get().ok_or(Error::UnknownSequence(seq))?;
        if s.swapped {
            return Err(Error::SwappedOut(seq));
        }
        Ok(s.table.clone())
    }

    /// Number of tokens in the sequence.
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize, Error> {
        let mut one = self.seqs.lock_one(seq);
        Ok(one.get().ok_or(Error::UnknownSequence(seq))?.tokens.len())
    }

    /// The sequence's tokens.
    pub fn tokens(&self, seq: SeqId) -> Result<Vec<Token>, Error> {
        let mut one = self.seqs.lock_one(seq);
        Ok(one.get().ok_or(Error::UnknownSequence(seq))?.tokens.clone())
    }

    /// Whether `seq` is live (on the GPU or swapped out).
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.lock_one(seq).get().is_some()
    }

    /// Number of live sequences.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether no sequence is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Block counts, token usage and prefix-cache counters.
    pub fn stats(&self) -> Stats {
        let num_blocks = self.gpu.num_blocks();
        let num_free = self.gpu.num_free();
        let num_cached = self.gpu.num_cached();
        let num_held = num_blocks.saturating_sub(num_free + num_cached);
        let stored_tokens = self.gpu.stored_tokens();
        let slots = num_held * self.bs.get();
        Stats {
            num_blocks,
            num_free,
            num_cached,
            num_held,
            usage: num_held as f64 / num_blocks as f64,
            token_usage: if slots == 0 {
                0.0
            } else {
                stored_tokens as f64 / slots as f64
            },
            stored_tokens,
            prefix_query_tokens: Counters::get(&self.counters.prefix_query_tokens),
            prefix_hit_tokens: Counters::get(&self.counters.prefix_hit_tokens),
            evictions: Counters::get(&self.counters.evictions),
            computed_tokens: Counters::get(&self.counters.computed_tokens),
            pending_tokens: Counters::get(&self.counters.pending_tokens),
            external_query_tokens: Counters::get(&self.counters.external_query_tokens),
            external_hit_tokens: Counters::get(&self.counters.external_hit_tokens),
            external_failures: Counters::get(&self.counters.external_failures),
        }
    }

    /// Removes and returns the recorded prefix-cache events (empty unless `enable_events`).
    pub fn take_events(&self) -> Vec<crate::Event> {
        self.events.take()
    }

    /// Drops every prefix-cache registration: CACHED blocks become FREE, held blocks stay
    /// held but are no longer shared with new prompts; the CPU tier is no longer announced.
    pub fn reset_prefix_cache(&self) {
        let Some(prefix) = &self.prefix else {
            self.events.record(|| EventKind::AllBlocksCleared);
            return;
        };
        let mut shards = prefix.lock_all();
        let registered: Vec<BlockId> = shards.iter().flat_map(|s| s.values().copied()).collect();
        self.gpu.clear_hashes(registered.into_iter());
        for shard in &mut shards {
            shard.clear();
        }
        // Under the shard locks and the CPU tier's, so no GPU or CPU event can slip in before
        // this one for a block it clears.
        self.cpu_tier
            .clear(|| self.events.record(|| EventKind::AllBlocksCleared));
    }

    /// Verifies every invariant (block counts, refcount == holders, free list and cache
    /// membership, prefix map <-> hashed blocks, token counts, the KV lifecycle); reports the
    /// first violation.
    pub fn check(&self) -> Result<(), Error> {
        let batch = self.seqs.lock_all();
        let shards = self.prefix.as_ref().map(|p| p.lock_all());
        let gpu = self.gpu.audit();
        let cpu = self.cpu.audit();
        let bs = self.bs;
        let mut gpu_refs = vec![0u32; gpu.states.len()];
        let mut gpu_fill = vec![0u32; gpu.states.len()];
        let mut cpu_refs = vec![0u32; cpu.states.len()];
        let (mut computed_tokens, mut pending_tokens) = (0u64, 0u64);
        for (&id, s) in batch.iter() {
            let len = s.tokens.len();
            let err = |msg: String| Error::InvariantViolated(format!("sequence {id}: {msg}"));
            if s.table.len() != bs.pages(len) {
                return Err(err(format!("{} blocks for {len} tokens", s.table.len())));
            }
            if !(s.computed <= s.planned && s.planned <= len) {
                return Err(err(format!(
                    "computed {} <= planned {} <= {len} tokens fails",
                    s.computed, s.planned
                )));
            }
            if s.registered > bs.index(s.computed) {
                return Err(err(format!(
                    "{} blocks registered but only {} tokens computed",
                    s.registered, s.computed
                )));
            }
            if self.prefix.is_some()
                && !(s.registered <= s.hashes.len() && s.hashes.len() <= bs.index(len))
            {
                return Err(err(format!("{} hashes for {len} tokens", s.hashes.len())));
            }
            if s.swapped
                && (s.planned != s.computed || !s.copies.is_empty() || !s.copying.is_empty())
            {
                return Err(err("swapped out with a plan or a copy in flight".into()));
            }
            if let Some((first, _)) = s.loading {
                if s.computed != first * bs.get() || s.planned != s.computed {
                    return Err(err("planned or computed past its external loads".into()));
                }
            }
            computed_tokens += s.computed as u64;
            pending_tokens += (len - s.computed) as u64;
            let tail = *s.table.last().expect("a sequence has a block");
            let private_tail = s.swapped || s.shared_tail || bs.offset(len) == 0;
            if !private_tail && gpu.states[tail as usize].refcount() != 1 {
                return Err(err(format!(
                    "partial last block {tail} shared but not marked"
                )));
            }
            let mut hold = |refs: &mut Vec<u32>, block: BlockId, fill: Option<u32>| {
                let Some(count) = refs.get_mut(block as usize) else {
                    return Err(err(format!("block {block} out of range")));
                };
                *count += 1;
                if let Some(fill) = fill {
                    let before = std::mem::replace(&mut gpu_fill[block as usize], fill);
                    if before != fill && *count > 1 {
                        return Err(err(format!(
                            "holders of block {block} disagree on its tokens"
                        )));
                    }
                }
                Ok(())
            };
            for (i, &block) in s.table.iter().enumerate() {
                if s.swapped {
                    hold(&mut cpu_refs, block, None)?;
                    continue;
                }
                hold(&mut gpu_refs, block, Some(bs.fill(i, len)))?;
                let state = gpu.states[block as usize];
                if state.hashed() {
                    // A sequence waiting for its swap-in may still hold a registered block:
                    // a sharer swapped in with it confirmed the block's copy.
                    if (i + 1) * bs.get() > s.computed {
                        return Err(err(format!(
                            "block {block} is shared but its KV is not computed"
                        )));
                    }
                    if let Some(prefix) = &self.prefix {
                        if prefix.hash_of(block) != short(&s.hashes[i]) {
                            return Err(err(format!(
                                "block {block} registered under another hash"
                            )));
                        }
                    }
                }
                if ((i + 1) * bs.get()).min(len) > s.computed && state.refcount() != 1 {
                    return Err(err(format!("block {block} holds pending KV but is shared")));
                }
            }
            match &s.swap_source {
                Some(source) if s.swapped => {
                    for (i, &block) in source.iter().enumerate() {
                        hold(&mut gpu_refs, block, Some(bs.fill(i, len)))?;
                    }
                }
                Some(source) => {
                    for &block in source {
                        hold(&mut cpu_refs, block, None)?;
                    }
                }
                None => {}
            }
            for copy in s.copies.iter().chain(&s.copying) {
                hold(&mut gpu_refs, copy.src, Some(copy.fill))?;
            }
        }
        for (pool, audit, refs) in [("GPU", &gpu, &gpu_refs), ("CPU", &cpu, &cpu_refs)] {
            let mut listed = vec![false; audit.states.len()];
            for &block in &audit.free {
                if std::mem::replace(&mut listed[block as usize], true) {
                    return Err(violated(block, format!("twice in the {pool} free list")));
                }
                if !audit.states[block as usize].free() {
                    return Err(violated(block, "in the free list but not FREE"));
                }
            }
            for &block in &audit.cached {
                if std::mem::replace(&mut listed[block as usize], true) {
                    return Err(violated(block, "both free and cached, or cached twice"));
                }
                if !audit.states[block as usize].cached() {
                    return Err(violated(block, "in the eviction list but not CACHED"));
                }
            }
            for (b, (state, &holders)) in audit.states.iter().zip(refs.iter()).enumerate() {
                if state.refcount() != holders {
                    return Err(violated(
                        b as BlockId,
                        format!("{pool} refcount {} but {holders} holders", state.refcount()),
                    ));
                }
                if holders == 0 && !listed[b] {
                    return Err(violated(
                        b as BlockId,
                        "unreferenced but neither free nor cached",
                    ));
                }
            }
            if audit.num_cached != audit.cached.len() {
                return Err(Error::InvariantViolated(format!(
                    "{pool} cached count {} but {} in the eviction list",
                    audit.num_cached,
                    audit.cached.len()
                )));
            }
            if audit.available != audit.free.len() + audit.cached.len() {
                return Err(Error::InvariantViolated(format!(
                    "{pool} available {} but {} free + {} cached",
                    audit.available,
                    audit.free.len(),
                    audit.cached.len()
                )));
            }
        }
        let stored: usize = gpu_fill
            .iter()
            .zip(&gpu_refs)
            .filter(|(_, &refs)| refs > 0)
            .map(|(&f, _)| f as usize)
            .sum();
        if stored != gpu.stored_tokens {
            return Err(Error::InvariantViolated(format!(
                "stored tokens {} but held blocks hold {stored}",
                gpu.stored_tokens
            )));
        }
        for (name, counted, summed) in [
            ("computed", &self.counters.computed_tokens, computed_tokens),
            ("pending", &self.counters.pending_tokens, pending_tokens),
        ] {
            if Counters::get(counted) != summed {
                return Err(Error::InvariantViolated(format!(
                    "{name} tokens {} but the sequences hold {summed}",
                    Counters::get(counted)
                )));
            }
        }
        for (block, _) in self.cpu_tier.blocks() {
            if cpu_refs.get(block as usize).copied().unwrap_or(0) == 0 {
                return Err(violated(block, "announced in the CPU tier but not held"));
            }
        }
        let hashed = gpu.states.iter().filter(|s| s.hashed()).count();
        if let (Some(prefix), Some(shards)) = (&self.prefix, &shards) {
            let mut mapped = 0;
            for (&hash, &block) in shards.iter().flat_map(|s| s.iter()) {
                mapped += 1;
                if !gpu.states[block as usize].hashed() || prefix.hash_of(block) != hash {
                    return Err(violated(
                        block,
                        "mapped in the prefix cache but not registered there",
                    ));
                }
            }
            if mapped != hashed {
                return Err(Error::InvariantViolated(format!(
                    "{hashed} hashed blocks but {mapped} prefix-cache entries"
                )));
            }
        } else if hashed != 0 {
            return Err(Error::InvariantViolated(format!(
                "{hashed} hashed blocks without prefix caching"
            )));
        }
        Ok(())
    }

    fn next_stamp(&self) -> u64 {
        self.stamps.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn reserve_gpu(&self, needed: usize) -> Result<(), Error> {
        self.gpu
            .reserve(needed)
            .map_err(|available| Error::OutOfBlocks {
                pool: PoolKind::Gpu,
                needed,
                available,
            })
    }

    /// Hashes the prompt's full blocks and walks the prefix cache to the first miss, never
    /// covering the last token. Read-only.
    fn lookup(&self, tokens: &[Token], salt: Option<&[u8]>) -> Lookup {
        let Some(prefix) = &self.prefix else {
            return Lookup {
                root: [0; 32],
                hashes: Vec::new(),
                hits: Vec::new(),
                cached_hits: 0,
            };
        };
        let bs = self.bs;
        let root = prefix.root(salt);
        let full = bs.index(tokens.len());
        let hittable = bs.index(tokens.len() - 1);
        let mut hashes = Vec::with_capacity(full);
        let mut hits = Vec::new();
        let mut cached_hits = 0;
        let mut parent = root;
        let mut hitting = true;
        for (i, block_tokens) in tokens.chunks_exact(bs.get()).enumerate() {
            let chain = prefix.hash_block(&parent, block_tokens);
            if hitting && i < hittable {
                match self.find(prefix, short(&chain), short(&parent), block_tokens) {
                    Some((block, state)) => {
                        cached_hits += usize::from(state.refcount() == 0);
                        hits.push((block, state));
                    }
                    None => hitting = false,
                }
            }
            hashes.push(chain);
            parent = chain;
        }
        Lookup {
            root,
            hashes,
            hits,
            cached_hits,
        }
    }

    /// The registered block with exactly this content, with the state it was verified in;
    /// `acquire_hit` with that state is what guards the hit (see `PrefixCache::find`).
    fn find(
        &self,
        prefix: &PrefixCache,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[Token],
    ) -> Option<(BlockId, BlockState)> {
        prefix.find(&self.gpu, hash, parent, tokens)
    }

    /// Takes a block reserved by the caller, unregistering it if it was evicted.
    fn take_fresh(&self) -> BlockId {
        let (block, evicted) = self.gpu.take_reserved();
        if evicted {
            if let Some(prefix) = &self.prefix {
                let hash = prefix.hash_of(block);
                prefix.unregister(block, hash, || {
                    self.events.record(|| EventKind::BlockRemoved {
                        block_hash: hash,
                        block_id: block,
                        medium: PoolKind::Gpu,
                    })
                });
            }
            Counters::add(&self.counters.evictions, 1);
        }
        block
    }

    /// Releases the GPU block table of `len` tokens, last block first.
    fn release_gpu_blocks(&self, table: &[BlockId], len: usize) {
        for (i, &block) in table.iter().enumerate().rev() {
            self.gpu.release_block(block, self.bs.fill(i, len));
        }
    }

    /// Releases a CPU block table, last block first; a freed block leaves the CPU tier.
    fn release_cpu_blocks(&self, table: &[BlockId]) {
        for &block in table.iter().rev() {
            let release = || self.cpu.release_block(block, 0) != Released::Held;
            if !self.events.enabled() {
                release();
                continue;
            }
            self.cpu_tier.release(block, release, |hash| {
                self.events.record(|| EventKind::BlockRemoved {
                    block_hash: hash,
                    block_id: block,
                    medium: PoolKind::Cpu,
                })
            });
        }
    }

    /// Blocks an append of `count` tokens takes: a copy-on-write of a shared partial last
    /// block, plus the new blocks.
    fn blocks_to_append(&self, s: &Sequence, count: usize) -> usize {
        let bs = self.bs;
        usize::from(self.must_copy_tail(s)) + bs.pages(s.tokens.len() + count) - s.table.len()
    }

    /// Whether the last block is partial and shared (by another sequence, or as the source of
    /// a copy not yet done), so writing to it needs a private copy.
    fn must_copy_tail(&self, s: &Sequence) -> bool {
        s.shared_tail
            && self.bs.offset(s.tokens.len()) != 0
            && self
                .gpu
                .state(*s.table.last().expect("a sequence has a block"))
                .refcount()
                > 1
    }

    /// Appends with blocks already reserved; returns how many it took. The caller counts the
    /// appended tokens into the pool's stored tokens (once per batch).
    fn append_reserved(&self, s: &mut Sequence, tokens: &[Token]) -> usize {
        let bs = self.bs;
        let len = s.tokens.len();
        let mut used = 0;
        // A partial block gains holders only through forks and swaps of sequences holding it,
        // so one this sequence held alone in `blocks_to_append` is still private here: a copy
        // is never taken without a reserved block.
        if self.must_copy_tail(s) {
            let last = s.table.last_mut().expect("a sequence has a block");
            let src = *last;
            let dst = self.take_fresh();
            used += 1;
            let fill = bs.offset(len) as u32;
            // The sequence's reference to `src` now belongs to the copy, until it is done.
            s.copies.push(PendingCopy {
                src,
                dst,
                fill,
                until: 0,
            });
            *last = dst;
            self.gpu.add_stored(fill as usize);
        }
        s.shared_tail = false;
        s.tokens.extend_from_slice(tokens);
        let pages = bs.pages(s.tokens.len());
        while s.table.len() < pages {
            s.table.push(self.take_fresh());
            used += 1;
        }
        used
    }

    /// Hashes the sequence's full blocks `0..n` that are not hashed yet.
    fn hash_blocks(&self, prefix: &PrefixCache, s: &mut Sequence, n: usize) {
        let bs = self.bs.get();
        while s.hashes.len() < n {
            let i = s.hashes.len();
            let parent = if i == 0 { s.root } else { s.hashes[i - 1] };
            s.hashes
                .push(prefix.hash_block(&parent, &s.tokens[i * bs..(i + 1) * bs]));
        }
    }

    /// Registers the sequence's full blocks `registered..upto` (all computed) in the prefix
    /// cache, in logical order.
    fn register_full(&self, s: &mut Sequence, upto: usize) {
        let Some(prefix) = &self.prefix else {
            return;
        };
        if s.registered >= upto {
            return;
        }
        self.hash_blocks(prefix, s, upto);
        let bs = self.bs.get();
        for i in s.registered..upto {
            let parent = if i == 0 { s.root } else { s.hashes[i - 1] };
            let tokens = &s.tokens[i * bs..(i + 1) * bs];
            let (hash, parent) = (short(&s.hashes[i]), short(&parent));
            let block = s.table[i];
            prefix.register(block, hash, parent, tokens, || {
                self.gpu.mark_hashed(block);
                self.events.record(|| EventKind::BlockStored {
                    block_hash: hash,
                    parent_hash: (i > 0).then_some(parent),
                    token_ids: tokens.to_vec(),
                    block_id: block,
                    medium: PoolKind::Gpu,
                });
            });
        }
        s.registered = upto;
    }

    /// Announces a swapped-out sequence's computed full blocks in the CPU tier.
    fn announce_cpu(&self, s: &mut Sequence) {
        let Some(prefix) = &self.prefix else {
            return;
        };
        if !self.events.enabled() {
            return;
        }
        let bs = self.bs.get();
        let full = self.bs.index(s.computed);
        self.hash_blocks(prefix, s, full);
        for i in 0..full {
            let (block, hash) = (s.table[i], short(&s.hashes[i]));
            self.cpu_tier.add(block, hash, || {
                self.events.record(|| EventKind::BlockStored {
                    block_hash: hash,
                    parent_hash: (i > 0).then(|| short(&s.hashes[i - 1])),
                    token_ids: s.tokens[i * bs..(i + 1) * bs].to_vec(),
                    block_id: block,
                    medium: PoolKind::Cpu,
                })
            });
        }
    }

    /// `swap_out` (`to_gpu == false`) and `swap_in` (`to_gpu == true`): the sequences move to
    /// fresh blocks of the other pool; their old blocks stay held until the swap is confirmed.
    fn swap(&self, seqs: &[SeqId], to_gpu: bool) -> Result<Vec<[BlockId; 2]>, Error> {
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        // Distinct blocks in order of first appearance: a shared block is copied once.
        let mut order: Vec<BlockId> = Vec::new();
        let mut distinct = HashSet::new();
        for &id in seqs {
            let member = visit(&mut batch, id, stamp, to_gpu)?;
            let s = batch.at(member);
            if s.swap_source.is_some() {
                let pending = if to_gpu { "swap-out" } else { "swap-in" };
                return Err(invalid(format!(
                    "sequence {id}: confirm its {pending} before swapping it again"
                )));
            }
            if !to_gpu {
                not_loading(id, s)?;
                let in_flight =
                    !self.config.auto_commit && (s.planned != s.computed || !s.copying.is_empty());
                if in_flight || !s.copies.is_empty() {
                    return Err(invalid(format!(
                        "sequence {id}: plan and commit its pending work before swapping it out"
                    )));
                }
            }
            order.extend(s.table.iter().filter(|&&block| distinct.insert(block)));
        }
        if !to_gpu {
            for &id in seqs {
                self.settle(self.auto_commit(batch.get(id).expect("validated above")));
            }
        }
        let (to, kind) = if to_gpu {
            (&self.gpu, PoolKind::Gpu)
        } else {
            (&self.cpu, PoolKind::Cpu)
        };
        to.reserve(order.len())
            .map_err(|available| Error::OutOfBlocks {
                pool: kind,
                needed: order.len(),
                available,
            })?;
        let pairs: Vec<[BlockId; 2]> = order
            .iter()
            .map(|&block| {
                let target = if to_gpu {
                    self.take_fresh()
                } else {
                    self.cpu.take_reserved().0
                };
                [block, target]
            })
            .collect();
        let target_of: HashMap<BlockId, BlockId> = pairs.iter().map(|&[b, t]| (b, t)).collect();
        // Each target starts with one holder; every further reference adds one.
        let mut referenced = HashSet::with_capacity(pairs.len());
        for &id in seqs {
            let s = batch.get(id).expect("validated above");
            let len = s.tokens.len();
            let source = s.table.clone();
            for (i, block) in s.table.iter_mut().enumerate() {
                let target = target_of[block];
                if !referenced.insert(target) {
                    to.share_held(target);
                } else if to_gpu {
                    self.gpu.add_stored(self.bs.fill(i, len) as usize);
                }
                *block = target;
            }
            s.swap_source = Some(source);
            s.swapped = !to_gpu;
            // Sequences swapped together keep sharing the blocks they shared.
            s.shared_tail = true;
            if to_gpu {
                // Fresh blocks: registered again once the copy-in is confirmed.
                s.registered = 0;
            }
        }
        Ok(pairs)
    }

    /// `confirm_swap_out` (`to_gpu == false`) and `confirm_swap_in` (`to_gpu == true`).
    fn confirm_swap(&self, seqs: &[SeqId], to_gpu: bool) -> Result<(), Error> {
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        for &id in seqs {
            let member = visit(&mut batch, id, stamp, !to_gpu)?;
            if batch.at(member).swap_source.is_none() {
                let what = if to_gpu { "swap-in" } else { "swap-out" };
                return Err(invalid(format!("sequence {id} has no {what} to confirm")));
            }
        }
        for &id in seqs {
            let s = batch.get(id).expect("validated above");
            let source = s.swap_source.take().expect("validated above");
            if to_gpu {
                self.release_cpu_blocks(&source);
                self.commit_to(s, s.computed);
            } else {
                self.release_gpu_blocks(&source, s.tokens.len());
                self.announce_cpu(s);
            }
        }
        Ok(())
    }
}

/// Fails if a sequence of `len` tokens cannot take `more`.
fn check_room(len: usize, more: usize) -> Result<(), Error> {
    if len + more > MAX_TOKENS {
        return Err(invalid(format!(
            "a sequence holds at most {MAX_TOKENS} tokens ({len} + {more} asked)"
        )));
    }
    Ok(())
}

/// Fails unless a batch call got one of `what` per sequence.
fn one_each(call: &str, seqs: usize, values: usize, what: &str) -> Result<(), Error> {
    if seqs != values {
        return Err(invalid(format!(
            "{call} got {seqs} sequences but {values} {what}"
        )));
    }
    Ok(())
}

/// Fails while the sequence waits for `confirm_loads`.
fn not_loading(id: SeqId, s: &Sequence) -> Result<(), Error> {
    if s.loading.is_some() {
        return Err(invalid(format!(
            "sequence {id}: confirm its external loads first"
        )));
    }
    Ok(())
}

/// Fails if queries starting at `start` would skip tokens no plan has computed.
fn no_gap(id: SeqId, s: &Sequence, start: usize) -> Result<(), Error> {
    if start > s.planned {
        return Err(invalid(format!(
            "sequence {id}: its queries start at position {start}, but tokens {}..{start} were \
             never planned; plan them first",
            s.planned
        )));
    }
    Ok(())
}

/// Checks one member of a batch (live, not repeated, on the expected side), marks it and says
/// where it is.
fn visit(batch: &mut Batch<'_>, id: SeqId, stamp: u64, swapped: bool) -> Result<Member, Error> {
    let member = batch.find(id).ok_or(Error::UnknownSequence(id))?;
    let s = batch.at(member);
    if s.stamp == stamp {
        return Err(invalid(format!("sequence {id} appears twice in the batch")));
    }
    if s.swapped != swapped {
        return Err(if s.swapped {
            Error::SwappedOut(id)
        } else {
            Error::NotSwappedOut(id)
        });
    }
    s.stamp = stamp;
    Ok(member)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn manager_is_send_and_sync() {
        fn shareable<T: Send + Sync>() {}
        shareable::<BlockManager>();
    }

    #[test]
    fn config_is_validated() {
        let bad = |edit: fn(&mut Config)| {
            let mut config = Config::new(8, 4);
            edit(&mut config);
            matches!(BlockManager::new(config), Err(Error::InvalidArgument(_)))
        };
        assert!(bad(|c| c.num_blocks = 0));
        assert!(bad(|c| c.block_size = 0));
        assert!(bad(|c| c.watermark = 1.0));
        assert!(bad(|c| c.watermark = f64::NAN));
        assert!(bad(|c| c.num_blocks = u32::MAX / 2));
        assert!(bad(|c| c.num_cpu_blocks = u32::MAX / 2));
        assert!(BlockManager::new(Config::new(8, 4)).is_ok());
    }

    #[test]
    fn a_failed_plan_leaves_it_empty() {
        let mgr = BlockManager::new(Config::new(8, 4)).unwrap();
        mgr.allocate(1, &[1, 2, 3], None).unwrap();
        let mut plan = Plan::new();
        mgr.plan(&[1], &[3], &mut plan).unwrap();
        assert_eq!(plan.batch_size(), 1);
        assert!(mgr.plan(&[1], &[4], &mut plan).is_err());
        assert_eq!(plan.batch_size(), 0);
        mgr.step(&[1], &[4], &mut plan).unwrap();
        assert_eq!(plan.positions, vec![3]);
        assert_eq!(
            mgr.step(&[2], &[4], &mut plan),
            Err(Error::UnknownSequence(2))
        );
        assert_eq!(plan.batch_size(), 0);
        assert!(plan.block_tables().unwrap().is_empty());
        mgr.check().unwrap();
    }

    fn manager(num_blocks: u32, block_size: u32, edit: impl FnOnce(&mut Config)) -> BlockManager {
        let mut config = Config::new(num_blocks, block_size);
        config.watermark = 0.0;
        edit(&mut config);
        BlockManager::new(config).unwrap()
    }

    /// Plans every uncomputed token of each sequence (a prefill), returning the plan.
    fn prefill(mgr: &BlockManager, seqs: &[SeqId]) -> Plan {
        let lens: Vec<u32> = seqs
            .iter()
            .map(|&s| (mgr.num_tokens(s).unwrap() - mgr.num_computed(s).unwrap()) as u32)
            .collect();
        let mut plan = Plan::new();
        mgr.plan(seqs, &lens, &mut plan).unwrap();
        mgr.check().unwrap();
        plan
    }

    fn is_invalid<T: std::fmt::Debug>(result: Result<T, Error>) -> bool {
        matches!(result, Err(Error::InvalidArgument(_)))
    }

    /// `(medium, block_id, stored)` of each recorded event.
    fn event_blocks(mgr: &BlockManager) -> Vec<(PoolKind, BlockId, bool)> {
        mgr.take_events()
            .into_iter()
            .map(|e| match e.kind {
                EventKind::BlockStored {
                    block_id, medium, ..
                } => (medium, block_id, true),
                EventKind::BlockRemoved {
                    block_id, medium, ..
                } => (medium, block_id, false),
                EventKind::AllBlocksCleared => panic!("nobody reset the cache"),
            })
            .collect()
    }

    #[test]
    fn blocks_are_hittable_only_once_committed() {
        let mgr = manager(16, 4, |c| c.enable_events = true);
        let prompt: Vec<Token> = (1..=9).collect();
        assert_eq!(mgr.allocate(1, &prompt, None).unwrap(), 0);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 0);
        assert!(mgr.take_events().is_empty(), "allocate registers nothing");
        let plan = prefill(&mgr, &[1]);
        assert_eq!(plan.positions, (0..9).collect::<Vec<i32>>());
        // Planned is not computed: a second request still recomputes the prefix.
        assert_eq!(mgr.allocate(2, &prompt, None).unwrap(), 0);
        mgr.free(2).unwrap();
        let st = mgr.stats();
        assert_eq!((st.computed_tokens, st.pending_tokens), (0, 9));
        mgr.commit(&[1], None).unwrap();
        mgr.check().unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 9);
        let st = mgr.stats();
        assert_eq!((st.computed_tokens, st.pending_tokens), (9, 0));
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Gpu, 0, true), (PoolKind::Gpu, 1, true)]
        );
        assert_eq!(mgr.allocate(3, &prompt, None).unwrap(), 8);
        assert_eq!(mgr.block_table(3).unwrap()[..2], [0, 1]);
        mgr.check().unwrap();

        // Auto-commit: the next step's call commits the decode token planned by the last one.
        let mut plan = Plan::new();
        mgr.step(&[1], &[10], &mut plan).unwrap();
        mgr.step(&[1], &[11], &mut plan).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 10);
        assert_eq!(
            mgr.cached_prefix_blocks(&(1..=13).collect::<Vec<_>>(), None),
            2
        );
        mgr.step(&[1], &[12], &mut plan).unwrap();
        mgr.step(&[1], &[13], &mut plan).unwrap();
        assert_eq!(
            mgr.cached_prefix_blocks(&(1..=13).collect::<Vec<_>>(), None),
            3
        );
        mgr.check().unwrap();
    }

    #[test]
    fn without_auto_commit_only_commit_computes() {
        let mgr = manager(16, 4, |c| c.auto_commit = false);
        let prompt: Vec<Token> = (1..=9).collect();
        mgr.allocate(1, &prompt, None).unwrap();
        prefill(&mgr, &[1]);
        let mut plan = Plan::new();
        mgr.step(&[1], &[10], &mut plan).unwrap();
        mgr.append(1, &[11]).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 0);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 0);
        // Beyond what was planned (10 tokens) is refused, and changes nothing.
        assert!(is_invalid(mgr.commit(&[1], Some(&[11]))));
        assert!(is_invalid(mgr.commit(&[1], Some(&[4, 4]))));
        assert!(is_invalid(mgr.commit(&[1, 1], None)));
        assert_eq!(mgr.commit(&[7], None), Err(Error::UnknownSequence(7)));
        assert_eq!(mgr.num_computed(1).unwrap(), 0);
        mgr.commit(&[1], Some(&[5])).unwrap();
        mgr.check().unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 5);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 1);
        // A count below what is computed changes nothing.
        mgr.commit(&[1], Some(&[2])).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 5);
        mgr.commit(&[1], None).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 10);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 2);
        let st = mgr.stats();
        assert_eq!((st.computed_tokens, st.pending_tokens), (10, 1));
        mgr.check().unwrap();
    }

    #[test]
    fn queries_may_not_skip_unplanned_tokens() {
        let mgr = manager(16, 4, |_| {});
        mgr.allocate(1, &(1..=9).collect::<Vec<_>>(), None).unwrap();
        let mut plan = Plan::new();
        assert!(is_invalid(mgr.step(&[1], &[10], &mut plan)));
        assert!(is_invalid(mgr.plan(&[1], &[1], &mut plan)));
        assert!(is_invalid(mgr.plan(&[1], &[5], &mut plan)));
        assert_eq!(mgr.num_tokens(1).unwrap(), 9);
        assert_eq!(plan.batch_size(), 0);
        mgr.check().unwrap();
        // A chunked prefill: the first chunk, then the rest.
        mgr.plan(&[1], &[9], &mut plan).unwrap();
        mgr.append(1, &[10, 11, 12]).unwrap();
        assert!(is_invalid(mgr.plan(&[1], &[1], &mut plan)));
        assert!(is_invalid(mgr.step(&[1], &[13], &mut plan)));
        mgr.plan(&[1], &[3], &mut plan).unwrap();
        assert_eq!(plan.positions, vec![9, 10, 11]);
        mgr.step(&[1], &[13], &mut plan).unwrap();
        assert_eq!(plan.positions, vec![12]);
        // Re-planning already planned tokens is allowed (a recomputation); its auto-commit
        // confirms the step before it.
        mgr.plan(&[1], &[13], &mut plan).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 13);
        mgr.check().unwrap();
    }

    #[test]
    fn a_copy_comes_with_its_plan_and_holds_its_source_until_committed() {
        let mgr = manager(6, 4, |c| {
            c.num_cpu_blocks = 4;
            c.auto_commit = false;
        });
        mgr.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.commit(&[1], None).unwrap();
        mgr.fork(1, 2).unwrap();
        assert_eq!(mgr.block_table(2).unwrap(), vec![0, 1]);
        // The shared partial block 1 is copied to a fresh block 2 on write.
        mgr.append(2, &[7]).unwrap();
        assert_eq!(mgr.block_table(2).unwrap(), vec![0, 2]);
        mgr.check().unwrap();
        assert!(
            is_invalid(mgr.swap_out(&[2])),
            "a copy not yet planned blocks a swap-out"
        );
        mgr.free(1).unwrap();
        mgr.check().unwrap();
        // Block 1 is still held by the copy: filling the pool never hands it out.
        mgr.allocate(3, &(100..112).collect::<Vec<_>>(), None)
            .unwrap();
        assert_eq!(mgr.block_table(3).unwrap(), vec![3, 4, 5]);
        let full = Err(Error::OutOfBlocks {
            pool: PoolKind::Gpu,
            needed: 1,
            available: 0,
        });
        assert_eq!(mgr.allocate(4, &[9], None), full);
        let mut plan = Plan::new();
        mgr.plan(&[2], &[1], &mut plan).unwrap();
        assert_eq!(plan.copies, vec![1, 2]);
        assert_eq!(plan.num_copies(), 1);
        assert_eq!(plan.slot_mapping, vec![2 * 4 + 2]);
        mgr.check().unwrap();
        // Delivered but not committed: the source is still held.
        assert_eq!(mgr.allocate(4, &[9], None), full);
        // A later plan does not deliver it again.
        mgr.plan(&[2], &[1], &mut plan).unwrap();
        assert!(plan.copies.is_empty());
        mgr.commit(&[2], Some(&[6])).unwrap();
        assert_eq!(mgr.allocate(4, &[9], None), full);
        mgr.commit(&[2], None).unwrap();
        mgr.check().unwrap();
        mgr.allocate(4, &[9], None).unwrap();
        assert_eq!(mgr.block_table(4).unwrap(), vec![1]);
        mgr.check().unwrap();
    }

    #[test]
    fn with_auto_commit_the_next_call_completes_a_copy() {
        let mgr = manager(4, 4, |_| {});
        mgr.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        let mut plan = Plan::new();
        mgr.step(&[2], &[7], &mut plan).unwrap();
        assert_eq!(plan.copies, vec![1, 2]);
        mgr.free(1).unwrap();
        assert_eq!(mgr.stats().num_held, 3, "the source is held");
        mgr.step(&[2], &[8], &mut plan).unwrap();
        assert!(plan.copies.is_empty());
        assert_eq!(mgr.stats().num_held, 2, "the step committed the copy");
        mgr.check().unwrap();
    }

    #[test]
    fn freeing_a_copier_releases_its_sources() {
        let mgr = manager(6, 4, |_| {});
        mgr.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        mgr.append(2, &[7]).unwrap();
        let mut plan = Plan::new();
        mgr.plan(&[2], &[1], &mut plan).unwrap();
        assert_eq!(plan.copies, vec![1, 2]);
        mgr.free(1).unwrap();
        mgr.free(2).unwrap();
        mgr.check().unwrap();
        let st = mgr.stats();
        assert_eq!((st.num_held, st.stored_tokens), (0, 0));
        assert_eq!(st.num_cached, 1, "block 0 was computed and registered");
    }

    #[test]
    fn a_step_commits_every_member_before_counting_blocks() {
        let mgr = manager(3, 4, |_| {});
        mgr.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        let mut plan = Plan::new();
        mgr.step(&[2], &[7], &mut plan).unwrap();
        assert_eq!(plan.copies, vec![1, 2]);
        assert_eq!(mgr.stats().num_free, 0);
        // Sequence 2's auto-commit completes its copy, so sequence 1's tail (block 1) is its
        // own again and needs no copy: the full pool is enough, in either batch order.
        mgr.step(&[1, 2], &[7, 8], &mut plan).unwrap();
        assert!(plan.copies.is_empty());
        assert_eq!(mgr.block_table(1).unwrap(), vec![0, 1]);
        mgr.check().unwrap();
    }

    #[test]
    fn swaps_hold_their_sources_until_confirmed() {
        let mgr = manager(4, 4, |c| {
            c.num_cpu_blocks = 4;
            c.enable_events = true;
        });
        let prompt: Vec<Token> = (1..=9).collect();
        mgr.allocate(1, &prompt, None).unwrap();
        prefill(&mgr, &[1]);
        mgr.commit(&[1], None).unwrap();
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Gpu, 0, true), (PoolKind::Gpu, 1, true)]
        );
        assert_eq!(mgr.swap_out(&[1]).unwrap(), vec![[0, 0], [1, 1], [2, 2]]);
        mgr.check().unwrap();
        assert_eq!(mgr.block_table(1), Err(Error::SwappedOut(1)));
        // The GPU blocks are held until the copy is confirmed.
        assert_eq!(mgr.stats().num_held, 3);
        assert_eq!(
            mgr.allocate(2, &(100..108).collect::<Vec<_>>(), None),
            Err(Error::OutOfBlocks {
                pool: PoolKind::Gpu,
                needed: 2,
                available: 1
            })
        );
        assert!(is_invalid(mgr.swap_in(&[1])));
        assert_eq!(mgr.confirm_swap_in(&[1]), Err(Error::SwappedOut(1)));
        assert!(
            mgr.take_events().is_empty(),
            "the CPU tier waits for the copy"
        );
        mgr.confirm_swap_out(&[1]).unwrap();
        mgr.check().unwrap();
        assert!(is_invalid(mgr.confirm_swap_out(&[1])));
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Cpu, 0, true), (PoolKind::Cpu, 1, true)]
        );
        let st = mgr.stats();
        assert_eq!((st.num_held, st.num_cached, st.num_free), (0, 2, 2));

        // Evict the cached copies, so only the swap-in could serve the prefix.
        mgr.allocate(2, &(100..116).collect::<Vec<_>>(), None)
            .unwrap();
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Gpu, 1, false), (PoolKind::Gpu, 0, false)]
        );
        mgr.free(2).unwrap();
        mgr.check().unwrap();

        let pairs = mgr.swap_in(&[1]).unwrap();
        mgr.check().unwrap();
        let table = mgr.block_table(1).unwrap();
        assert_eq!(
            pairs.iter().map(|p| p[0]).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(pairs.iter().map(|p| p[1]).collect::<Vec<_>>(), table);
        // Not hittable, forkable or swappable until the copy-in is confirmed.
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 0);
        assert!(is_invalid(mgr.fork(1, 3)));
        assert!(is_invalid(mgr.swap_out(&[1])));
        assert_eq!(mgr.confirm_swap_out(&[1]), Err(Error::NotSwappedOut(1)));
        assert!(mgr.take_events().is_empty());
        mgr.confirm_swap_in(&[1]).unwrap();
        mgr.check().unwrap();
        assert!(is_invalid(mgr.confirm_swap_in(&[1])));
        // The CPU copies leave (tail first), then the GPU blocks are registered.
        assert_eq!(
            event_blocks(&mgr),
            vec![
                (PoolKind::Cpu, 1, false),
                (PoolKind::Cpu, 0, false),
                (PoolKind::Gpu, table[0], true),
                (PoolKind::Gpu, table[1], true),
            ]
        );
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 2);
        mgr.fork(1, 3).unwrap();
        mgr.check().unwrap();
    }

    #[test]
    fn confirming_one_of_two_swapped_in_sharers_registers_their_blocks() {
        let mgr = manager(8, 2, |c| c.num_cpu_blocks = 4);
        mgr.allocate(1, &[1, 2, 3], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        mgr.swap_out(&[1, 2]).unwrap();
        mgr.confirm_swap_out(&[1, 2]).unwrap();
        mgr.reset_prefix_cache();
        let pairs = mgr.swap_in(&[1, 2]).unwrap();
        assert_eq!(pairs.len(), 2);
        mgr.confirm_swap_in(&[1]).unwrap();
        // Block 0's copy-in is confirmed through sequence 1, though 2 still waits for its own.
        assert_eq!(mgr.cached_prefix_blocks(&[1, 2, 3], None), 1);
        mgr.check().unwrap();
        mgr.free(1).unwrap();
        mgr.check().unwrap();
        mgr.confirm_swap_in(&[2]).unwrap();
        mgr.check().unwrap();
    }

    #[test]
    fn the_cpu_tier_announces_each_hash_once() {
        let mgr = manager(8, 4, |c| {
            c.num_cpu_blocks = 8;
            c.enable_events = true;
        });
        mgr.allocate(1, &(1..=9).collect::<Vec<_>>(), None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        mgr.take_events();
        // Shared blocks are copied once.
        assert_eq!(mgr.swap_out(&[1, 2]).unwrap(), vec![[0, 0], [1, 1], [2, 2]]);
        mgr.confirm_swap_out(&[1, 2]).unwrap();
        mgr.check().unwrap();
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Cpu, 0, true), (PoolKind::Cpu, 1, true)]
        );
        mgr.free(1).unwrap();
        assert!(mgr.take_events().is_empty(), "sequence 2 still holds them");
        mgr.free(2).unwrap();
        mgr.check().unwrap();
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Cpu, 1, false), (PoolKind::Cpu, 0, false)]
        );
    }

    #[test]
    fn without_auto_commit_a_swap_out_waits_for_commit() {
        let mgr = manager(8, 4, |c| {
            c.num_cpu_blocks = 8;
            c.auto_commit = false;
        });
        mgr.allocate(1, &(1..=9).collect::<Vec<_>>(), None).unwrap();
        prefill(&mgr, &[1]);
        assert!(is_invalid(mgr.swap_out(&[1])));
        mgr.commit(&[1], None).unwrap();
        assert_eq!(mgr.swap_out(&[1]).unwrap().len(), 3);
        mgr.check().unwrap();
    }

    #[test]
    fn fork_needs_a_computed_parent() {
        for auto_commit in [true, false] {
            let mgr = manager(8, 4, |c| c.auto_commit = auto_commit);
            mgr.allocate(1, &[1, 2, 3, 4, 5], None).unwrap();
            assert!(is_invalid(mgr.fork(1, 2)));
            prefill(&mgr, &[1]);
            if !auto_commit {
                assert!(is_invalid(mgr.fork(1, 2)));
                mgr.commit(&[1], None).unwrap();
            }
            mgr.fork(1, 2).unwrap();
            assert!(!mgr.contains(3));
            assert_eq!(mgr.block_table(2).unwrap(), mgr.block_table(1).unwrap());
            assert_eq!(mgr.num_computed(2).unwrap(), 5);
            mgr.check().unwrap();
        }
    }

    #[test]
    fn external_loads_become_computed_when_confirmed() {
        let mgr = manager(16, 4, |_| {});
        let prompt: Vec<Token> = (1..=17).collect();
        // Five blocks, four of them hittable (a hit never covers the last token).
        let (reused, loads) = mgr.allocate_loading(1, &prompt, 3, None).unwrap();
        assert_eq!((reused, loads), (0, vec![0, 1, 2]));
        assert_eq!(mgr.stats().external_query_tokens, 16);
        mgr.check().unwrap();
        let mut plan = Plan::new();
        assert!(is_invalid(mgr.step(&[1], &[18], &mut plan)));
        assert!(is_invalid(mgr.plan(&[1], &[17], &mut plan)));
        assert!(is_invalid(mgr.append(1, &[18])));
        assert!(is_invalid(mgr.fork(1, 2)));
        assert!(is_invalid(mgr.confirm_loads(1, 4)));
        assert_eq!(mgr.confirm_loads(9, 1), Err(Error::UnknownSequence(9)));
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 0);
        // Two of the three blocks arrived; the third is recomputed.
        mgr.confirm_loads(1, 2).unwrap();
        mgr.check().unwrap();
        assert!(is_invalid(mgr.confirm_loads(1, 0)));
        assert_eq!(mgr.num_computed(1).unwrap(), 8);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 2);
        let st = mgr.stats();
        assert_eq!(
            (
                st.external_hit_tokens,
                st.prefix_hit_tokens,
                st.external_failures
            ),
            (8, 8, 1)
        );
        mgr.plan(&[1], &[9], &mut plan).unwrap();
        assert_eq!(plan.positions[0], 8);

        // A second admission hits the two computed blocks and loads the next two.
        let (reused, loads) = mgr.allocate_loading(2, &prompt, 9, None).unwrap();
        assert_eq!(reused, 8);
        assert_eq!(loads.len(), 2);
        assert_eq!(mgr.block_table(2).unwrap()[2..4], loads[..]);
        assert_eq!(mgr.stats().external_query_tokens, 16 + 8);
        // Freeing a sequence that still waits counts its loads as failures.
        mgr.free(2).unwrap();
        mgr.check().unwrap();
        assert_eq!(mgr.stats().external_failures, 3);
        // Nothing to load: admitted like `allocate`.
        let (reused, loads) = mgr.allocate_loading(3, &prompt, 2, None).unwrap();
        assert_eq!((reused, loads), (8, vec![]));
        mgr.confirm_loads(3, 0).unwrap_err();
        mgr.check().unwrap();
    }

    #[test]
    fn without_prefix_caching_nothing_is_loaded() {
        let mgr = manager(16, 4, |c| c.enable_prefix_caching = false);
        let (reused, loads) = mgr
            .allocate_loading(1, &(1..=17).collect::<Vec<_>>(), 4, None)
            .unwrap();
        assert_eq!((reused, loads), (0, vec![]));
        assert_eq!(mgr.stats().external_query_tokens, 16);
        prefill(&mgr, &[1]);
        mgr.check().unwrap();
    }
}
