//! `BlockManager`: sequences, prefix reuse, copy-on-write, swapping and plans on top of the
//! block pool. Exact semantics: `SEMANTICS.md` beside the crate.

use std::collections::{HashMap, HashSet};

use crate::block::{BlockSize, BlockState};
use crate::error::{invalid, violated};
use crate::events::{EventKind, EventLog};
use crate::plan::Plan;
use crate::pool::{BlockPool, Hit, Released};
use crate::prefix::{short, BlockHash, Chain, PrefixCache};
use crate::sequence::{Batch, Sequence, SequenceMap};
use crate::stats::{Counters, Stats};
use crate::sync::{lock, AtomicU64, Mutex, Ordering};
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
}

impl Config {
    /// `num_blocks` blocks of `block_size` tokens with the defaults: no CPU pool, prefix
    /// caching on, watermark 0.01, random hash key, no events.
    pub fn new(num_blocks: u32, block_size: u32) -> Config {
        Config {
            num_blocks,
            block_size,
            num_cpu_blocks: 0,
            enable_prefix_caching: true,
            watermark: 0.01,
            hash_key: None,
            enable_events: false,
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
pub struct BlockManager {
    config: Config,
    bs: BlockSize,
    watermark_blocks: usize,
    gpu: BlockPool,
    cpu: BlockPool,
    prefix: Option<PrefixCache>,
    seqs: SequenceMap,
    copies: Mutex<Vec<[BlockId; 2]>>,
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
            Some(PrefixCache::new(key, config.num_blocks, config.block_size))
        } else {
            None
        };
        Ok(BlockManager {
            bs: BlockSize::new(config.block_size as usize),
            watermark_blocks: (config.watermark * f64::from(config.num_blocks)) as usize,
            gpu: BlockPool::new(config.num_blocks),
            cpu: BlockPool::new(config.num_cpu_blocks),
            prefix,
            seqs: SequenceMap::new(),
            copies: Mutex::new(Vec::new()),
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
    /// (and `salt`); returns how many prompt tokens were reused.
    pub fn allocate(
        &self,
        seq: SeqId,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Result<usize, Error> {
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
        let mut sequence = Sequence {
            tokens: tokens.to_vec(),
            table,
            hashes: found.hashes,
            root: found.root,
            swapped: false,
            shared_tail: false,
            stamp: 0,
        };
        let reused = hit_blocks * bs.get();
        self.gpu.add_stored(tokens.len() - reused);
        self.register_full(&mut sequence, hit_blocks..bs.index(tokens.len()));
        Counters::add(&self.counters.prefix_query_tokens, tokens.len() as u64);
        Counters::add(&self.counters.prefix_hit_tokens, reused as u64);
        one.insert(sequence);
        Ok(reused)
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

    /// Appends tokens to a running sequence, copying a shared last block on write.
    pub fn append(&self, seq: SeqId, tokens: &[Token]) -> Result<(), Error> {
        if tokens.is_empty() {
            return Err(invalid("append needs at least one token"));
        }
        let mut one = self.seqs.lock_one(seq);
        let s = one.get().ok_or(Error::UnknownSequence(seq))?;
        if s.swapped {
            return Err(Error::SwappedOut(seq));
        }
        check_room(s.tokens.len(), tokens.len())?;
        let needed = self.blocks_to_append(s, tokens.len());
        self.reserve_gpu(needed)?;
        let used = self.append_reserved(s, tokens);
        self.gpu.unreserve(needed - used);
        self.gpu.add_stored(tokens.len());
        Ok(())
    }

    /// One decode step: appends `tokens[i]` to `seqs[i]` for the whole batch (all or nothing),
    /// then writes the plan for one query token per sequence into `plan`. On an error `plan`
    /// is left empty.
    pub fn step(&self, seqs: &[SeqId], tokens: &[Token], plan: &mut Plan) -> Result<(), Error> {
        self.fill_step(seqs, tokens, plan)
            .inspect_err(|_| plan.begin(0, 0, 0))
    }

    /// Writes the plan for any batch into `plan`: sequence `seqs[i]`'s last `query_lens[i]`
    /// tokens are the queries (prefill, chunked prefill, decode or a mix). On an error `plan` is
    /// left empty.
    pub fn plan(&self, seqs: &[SeqId], query_lens: &[u32], plan: &mut Plan) -> Result<(), Error> {
        self.fill_plan(seqs, query_lens, plan)
            .inspect_err(|_| plan.begin(0, 0, 0))
    }

    fn fill_step(&self, seqs: &[SeqId], tokens: &[Token], plan: &mut Plan) -> Result<(), Error> {
        if seqs.len() != tokens.len() {
            return Err(invalid(format!(
                "step got {} sequences but {} tokens",
                seqs.len(),
                tokens.len()
            )));
        }
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        let mut needed = 0;
        let mut max_blocks = 0;
        for &id in seqs {
            let s = visit(&mut batch, id, stamp, false)?;
            check_room(s.tokens.len(), 1)?;
            needed += self.blocks_to_append(s, 1);
            max_blocks = max_blocks.max(self.bs.pages(s.tokens.len() + 1));
        }
        self.reserve_gpu(needed)?;
        plan.begin(seqs.len(), seqs.len() * max_blocks, seqs.len());
        let mut used = 0;
        for (&id, &token) in seqs.iter().zip(tokens) {
            let s = batch.get(id).expect("validated above");
            used += self.append_reserved(s, &[token]);
            plan.push(&s.table, s.tokens.len(), 1, self.bs);
        }
        plan.finish();
        self.gpu.unreserve(needed - used);
        self.gpu.add_stored(seqs.len());
        Ok(())
    }

    fn fill_plan(&self, seqs: &[SeqId], query_lens: &[u32], plan: &mut Plan) -> Result<(), Error> {
        if seqs.len() != query_lens.len() {
            return Err(invalid(format!(
                "plan got {} sequences but {} query lengths",
                seqs.len(),
                query_lens.len()
            )));
        }
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        // Sizes are unknown until the loop; a reused plan already has the room.
        plan.begin(seqs.len(), 0, 0);
        for (&id, &q) in seqs.iter().zip(query_lens) {
            let s = visit(&mut batch, id, stamp, false)?;
            if q == 0 || q as usize > s.tokens.len() {
                return Err(invalid(format!(
                    "query length {q} of sequence {id} must be in 1..={}",
                    s.tokens.len()
                )));
            }
            plan.push(&s.table, s.tokens.len(), q as usize, self.bs);
        }
        plan.finish();
        Ok(())
    }

    /// Makes `child` a copy of `parent` that shares all its blocks (copy-on-write).
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
        p.shared_tail = true;
        let mut copy = p.clone();
        copy.stamp = 0;
        for &block in &copy.table {
            self.gpu.share_held(block);
        }
        batch.insert(child, copy);
        Ok(())
    }

    /// Ends a sequence and releases its blocks, last block first.
    pub fn free(&self, seq: SeqId) -> Result<(), Error> {
        // Hold the shard until the blocks are released, so `check` never sees them orphaned.
        let mut one = self.seqs.lock_one(seq);
        let s = one.remove().ok_or(Error::UnknownSequence(seq))?;
        if s.swapped {
            for &block in s.table.iter().rev() {
                self.cpu.release_block(block, 0);
            }
        } else {
            self.release_gpu_blocks(&s.table, s.tokens.len());
        }
        Ok(())
    }

    /// Removes and returns the pending copy-on-write pairs `[src, dst]`, oldest first. Apply them
    /// to the KV tensors before writing the step's new KV.
    pub fn take_copies(&self) -> Vec<[BlockId; 2]> {
        std::mem::take(&mut *lock(&self.copies))
    }

    /// Moves the sequences to the CPU pool; returns the `[gpu, cpu]` block pairs to copy (a
    /// block shared by several of them is copied once).
    pub fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<[BlockId; 2]>, Error> {
        self.swap(seqs, false)
    }

    /// Brings swapped-out sequences back to the GPU pool; returns the `[cpu, gpu]` pairs.
    pub fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<[BlockId; 2]>, Error> {
        self.swap(seqs, true)
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
        }
    }

    /// Removes and returns the recorded prefix-cache events (empty unless `enable_events`).
    pub fn take_events(&self) -> Vec<crate::Event> {
        self.events.take()
    }

    /// Drops every prefix-cache registration: CACHED blocks become FREE, held blocks stay
    /// held but are no longer shared with new prompts.
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
        // Under the shard locks, so no registration's event can slip in before this one.
        self.events.record(|| EventKind::AllBlocksCleared);
    }

    /// Verifies every invariant (block counts, refcount == holders, free list and cache
    /// membership, prefix map <-> hashed blocks, token counts); reports the first violation.
    pub fn check(&self) -> Result<(), Error> {
        let batch = self.seqs.lock_all();
        let shards = self.prefix.as_ref().map(|p| p.lock_all());
        let gpu = self.gpu.audit();
        let cpu = self.cpu.audit();
        let bs = self.bs;
        let mut gpu_refs = vec![0u32; gpu.states.len()];
        let mut gpu_fill = vec![0u32; gpu.states.len()];
        let mut cpu_refs = vec![0u32; cpu.states.len()];
        for (&id, s) in batch.iter() {
            let len = s.tokens.len();
            let err = |msg: String| Error::InvariantViolated(format!("sequence {id}: {msg}"));
            if s.table.len() != bs.pages(len) {
                return Err(err(format!("{} blocks for {len} tokens", s.table.len())));
            }
            if self.prefix.is_some() && s.hashes.len() != bs.index(len) {
                return Err(err(format!("{} hashes for {len} tokens", s.hashes.len())));
            }
            let tail = *s.table.last().expect("a sequence has a block");
            let private_tail = s.swapped || s.shared_tail || bs.offset(len) == 0;
            if !private_tail && gpu.states[tail as usize].refcount() != 1 {
                return Err(err(format!(
                    "partial last block {tail} shared but not marked"
                )));
            }
            for (i, &block) in s.table.iter().enumerate() {
                let refs = if s.swapped {
                    &mut cpu_refs
                } else {
                    &mut gpu_refs
                };
                let Some(count) = refs.get_mut(block as usize) else {
                    return Err(err(format!("block {block} out of range")));
                };
                *count += 1;
                if s.swapped {
                    continue;
                }
                let fill = bs.fill(i, len);
                if std::mem::replace(&mut gpu_fill[block as usize], fill) != fill && *count > 1 {
                    return Err(err(format!(
                        "holders of block {block} disagree on its tokens"
                    )));
                }
                if let Some(prefix) = &self.prefix {
                    if gpu.states[block as usize].hashed()
                        && prefix.hash_of(block) != short(&s.hashes[i])
                    {
                        return Err(err(format!("block {block} registered under another hash")));
                    }
                }
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
        let stored: usize = gpu_fill.iter().map(|&f| f as usize).sum();
        if stored != gpu.stored_tokens {
            return Err(Error::InvariantViolated(format!(
                "stored tokens {} but held blocks hold {stored}",
                gpu.stored_tokens
            )));
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

    /// The registered block with exactly this content, with the state it was verified in.
    fn find(
        &self,
        prefix: &PrefixCache,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[Token],
    ) -> Option<(BlockId, BlockState)> {
        let block = prefix.get(hash)?;
        let state = self.gpu.state(block);
        if !state.hashed() || !prefix.matches(block, hash, parent, tokens) {
            return None;
        }
        // The contents read above belong to `state`'s incarnation only if it did not change.
        (self.gpu.state(block).generation() == state.generation()).then_some((block, state))
    }

    /// Takes a block reserved by the caller, unregistering it if it was evicted.
    fn take_fresh(&self) -> BlockId {
        let (block, evicted) = self.gpu.take_reserved();
        if evicted {
            if let Some(prefix) = &self.prefix {
                let hash = prefix.hash_of(block);
                prefix.unregister(block, hash, || {
                    self.events
                        .record(|| EventKind::BlockRemoved { block_hash: hash })
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

    /// Blocks an append of `count` tokens takes: a copy-on-write of a shared partial last
    /// block, plus the new blocks.
    fn blocks_to_append(&self, s: &Sequence, count: usize) -> usize {
        let bs = self.bs;
        usize::from(self.must_copy_tail(s)) + bs.pages(s.tokens.len() + count) - s.table.len()
    }

    /// Whether the last block is partial and shared, so writing to it needs a private copy.
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
            lock(&self.copies).push([src, dst]);
            *last = dst;
            let released = self.gpu.release_block(src, bs.offset(len) as u32);
            debug_assert_eq!(released, Released::Held);
            self.gpu.add_stored(bs.offset(len));
        }
        s.shared_tail = false;
        s.tokens.extend_from_slice(tokens);
        let new_len = s.tokens.len();
        let pages = bs.pages(new_len);
        while s.table.len() < pages {
            s.table.push(self.take_fresh());
            used += 1;
        }
        self.register_full(s, bs.index(len)..bs.index(new_len));
        used
    }

    /// Registers the sequence's full blocks `range` in the prefix cache (hashing new ones).
    fn register_full(&self, s: &mut Sequence, range: std::ops::Range<usize>) {
        let Some(prefix) = &self.prefix else {
            return;
        };
        let bs = self.bs.get();
        for i in range {
            let parent = if i == 0 { s.root } else { s.hashes[i - 1] };
            let tokens = &s.tokens[i * bs..(i + 1) * bs];
            if i == s.hashes.len() {
                s.hashes.push(prefix.hash_block(&parent, tokens));
            }
            let (hash, parent) = (short(&s.hashes[i]), short(&parent));
            let block = s.table[i];
            prefix.register(block, hash, parent, tokens, || {
                self.gpu.mark_hashed(block);
                self.events.record(|| EventKind::BlockStored {
                    block_hash: hash,
                    parent_hash: (i > 0).then_some(parent),
                    token_ids: tokens.to_vec(),
                });
            });
        }
    }

    /// `swap_out` (`to_gpu == false`) and `swap_in` (`to_gpu == true`).
    fn swap(&self, seqs: &[SeqId], to_gpu: bool) -> Result<Vec<[BlockId; 2]>, Error> {
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        // Distinct blocks in order of first appearance: a shared block is copied once.
        let mut order: Vec<BlockId> = Vec::new();
        let mut distinct = HashSet::new();
        for &id in seqs {
            let s = visit(&mut batch, id, stamp, to_gpu)?;
            order.extend(s.table.iter().filter(|&&block| distinct.insert(block)));
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
            if to_gpu {
                for &block in s.table.iter().rev() {
                    self.cpu.release_block(block, 0);
                }
            } else {
                self.release_gpu_blocks(&s.table, len);
            }
            for (i, block) in s.table.iter_mut().enumerate() {
                let target = target_of[block];
                if !referenced.insert(target) {
                    to.share_held(target);
                } else if to_gpu {
                    self.gpu.add_stored(self.bs.fill(i, len) as usize);
                }
                *block = target;
            }
            s.swapped = !to_gpu;
            // Sequences swapped together keep sharing the blocks they shared.
            s.shared_tail = true;
        }
        if to_gpu {
            for &id in seqs {
                let s = batch.get(id).expect("validated above");
                let full = self.bs.index(s.tokens.len());
                self.register_full(s, 0..full);
            }
        }
        Ok(pairs)
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

/// Checks one member of a batch (live, not repeated, on the expected side) and marks it.
fn visit<'b>(
    batch: &'b mut Batch<'_>,
    id: SeqId,
    stamp: u64,
    swapped: bool,
) -> Result<&'b mut Sequence, Error> {
    let s = batch.get(id).ok_or(Error::UnknownSequence(id))?;
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
    Ok(s)
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
        assert!(plan.block_tables.is_empty());
        mgr.check().unwrap();
    }
}
