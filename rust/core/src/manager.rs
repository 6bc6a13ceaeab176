//! `BlockManager`: its state, construction, freeing and read-only queries, and the helpers its
//! operations share; the operations live in the submodules, one concept each. Exact semantics:
//! `SEMANTICS.md` beside the crate.

mod admission;
mod audit;
mod fork;
mod hybrid;
mod lifecycle;
mod rollback;
mod step;
mod swap;
#[cfg(all(test, not(loom)))]
mod testing;

pub use hybrid::HybridManager;

use std::sync::Arc;

use crate::block::BlockSize;
use crate::config::{Attention, Config};
use crate::cpu_tier::CpuTier;
use crate::error::invalid;
use crate::events::{EventKind, EventLog};
use crate::feed::{BlockFeed, Registration};
use crate::pool::{BlockPool, Released};
use crate::prefix::PrefixCache;
use crate::sequence::{LockedBatch, Place, Sequence, SequenceMap};
use crate::stats::{Counters, Stats};
use crate::sync::{AtomicU64, Ordering};
use crate::{BlockId, Error, PoolKind, SeqId, Token};

/// The most tokens one sequence may hold: positions and slots are int32.
const MAX_TOKENS: usize = i32::MAX as usize;

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
    gpu: Arc<BlockPool>,
    cpu: Arc<BlockPool>,
    prefix: Option<Arc<PrefixCache>>,
    /// This manager's group in a [`crate::HybridManager`] (0 alone): it keys the group's
    /// blocks apart from other groups' in the shared prefix cache, and only group 0 records
    /// events.
    group: u8,
    seqs: SequenceMap,
    cpu_tier: CpuTier,
    events: Arc<EventLog>,
    feed: Arc<BlockFeed>,
    counters: Counters,
    stamps: AtomicU64,
}

/// What the groups of a [`crate::HybridManager`] share: the pools, the prefix cache, the
/// event log and the block feed.
pub(crate) struct Shared {
    gpu: Arc<BlockPool>,
    cpu: Arc<BlockPool>,
    prefix: Option<Arc<PrefixCache>>,
    events: Arc<EventLog>,
    feed: Arc<BlockFeed>,
}

impl BlockManager {
    /// A manager with every block FREE.
    pub fn new(config: Config) -> Result<BlockManager, Error> {
        let shared = BlockManager::shared(&config, config.attention)?;
        Ok(BlockManager::in_group(config, &shared, 0))
    }

    /// Group `group` of a hybrid manager over `shared` (`config` validated by
    /// [`BlockManager::shared`], but for its attention).
    pub(crate) fn in_group(config: Config, shared: &Shared, group: u8) -> BlockManager {
        BlockManager {
            bs: BlockSize::new(config.block_size as usize),
            watermark_blocks: (config.watermark * f64::from(config.num_blocks)) as usize,
            gpu: Arc::clone(&shared.gpu),
            cpu: Arc::clone(&shared.cpu),
            prefix: shared.prefix.clone(),
            group,
            seqs: SequenceMap::new(),
            cpu_tier: CpuTier::default(),
            events: Arc::clone(&shared.events),
            feed: Arc::clone(&shared.feed),
            counters: Counters::default(),
            stamps: AtomicU64::new(0),
            config,
        }
    }

    /// The pools, prefix cache and event log a manager (or the groups of one) is built on;
    /// events are recorded only if group 0 (attending as `first`) announces its blocks.
    pub(crate) fn shared(config: &Config, first: Attention) -> Result<Shared, Error> {
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
            let prefix = prefix.map_err(|e| e.naming(format!("num_blocks * block_size = {slots}")));
            Some(Arc::new(prefix?))
        } else {
            None
        };
        Ok(Shared {
            gpu: Arc::new(gpu),
            cpu: Arc::new(cpu),
            prefix,
            events: Arc::new(EventLog::new(
                config.enable_events && first == Attention::Full,
            )),
            feed: Arc::new(BlockFeed::new(config.enable_block_feed)),
        })
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &Config {
        &self.config
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
            self.release_gpu_blocks(&s.table, s.first, s.first, len);
        }
        match &s.swap_source {
            Some(gpu) if s.swapped => self.release_gpu_blocks(gpu, s.first, s.first, len),
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

    /// The sequence's GPU block table: from logical block [`BlockManager::first_block`] on (0
    /// but for windowed attention).
    pub fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>, Error> {
        let one = self.seqs.lock_one(seq);
        let s = one.get_ref().ok_or(Error::UnknownSequence(seq))?;
        if s.swapped {
            return Err(Error::SwappedOut(seq));
        }
        Ok(s.table.clone())
    }

    /// The logical block the sequence's table starts at: blocks before it left the attention
    /// window and were released (always 0 with full attention).
    pub fn first_block(&self, seq: SeqId) -> Result<usize, Error> {
        let one = self.seqs.lock_one(seq);
        Ok(one.get_ref().ok_or(Error::UnknownSequence(seq))?.first)
    }

    /// Number of tokens in the sequence.
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize, Error> {
        let one = self.seqs.lock_one(seq);
        Ok(one
            .get_ref()
            .ok_or(Error::UnknownSequence(seq))?
            .tokens
            .len())
    }

    /// The sequence's tokens.
    pub fn tokens(&self, seq: SeqId) -> Result<Vec<Token>, Error> {
        let one = self.seqs.lock_one(seq);
        Ok(one
            .get_ref()
            .ok_or(Error::UnknownSequence(seq))?
            .tokens
            .clone())
    }

    /// Whether `seq` is live (on the GPU or swapped out).
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.lock_one(seq).get_ref().is_some()
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
            prefix_allowed_tokens: Counters::get(&self.counters.prefix_allowed_tokens),
        }
    }

    /// Removes and returns the recorded prefix-cache events (empty unless `enable_events`).
    pub fn take_events(&self) -> Vec<crate::Event> {
        self.events.take()
    }

    /// Takes the recorded events and appends them to `out` as one msgpack `EventBatch`
    /// ([`crate::encode_batch`]); returns how many events it took.
    pub fn take_event_batch(&self, header: &crate::BatchHeader, out: &mut Vec<u8>) -> usize {
        let events = self.events.take();
        crate::encode_batch(header, &events, out);
        events.len()
    }

    /// Removes and returns the recorded registrations (empty unless `enable_block_feed`).
    pub fn take_registrations(&self) -> Vec<Registration> {
        self.feed.take()
    }

    /// Whether this manager computes its blocks' published hashes: group 0's are what events
    /// carry, and with the block feed every group's are what the feed carries.
    fn publishes_hashes(&self) -> bool {
        self.group == 0 || self.feed.enabled()
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

    /// Releases logical blocks `from..` of a GPU block table of `len` tokens that starts at
    /// logical block `first`, last block first.
    fn release_gpu_blocks(&self, table: &[BlockId], first: usize, from: usize, len: usize) {
        let blocks = table.iter().enumerate().skip(from - first).rev();
        self.gpu
            .release_blocks(blocks.map(|(j, &block)| (block, self.bs.fill(first + j, len))));
    }

    /// With windowed attention, releases the blocks no query from `position` on reads. They
    /// are evicted before every other cached block, but for those a request resuming where the
    /// sequence's prompt ends needs (the next turn of a chat), which keep their place.
    #[inline(always)]
    fn release_behind(&self, s: &mut Sequence, position: usize) {
        let attention = self.config.attention;
        if attention == Attention::Full {
            return;
        }
        let keep = self.bs.index(attention.first_key(position));
        if keep <= s.first {
            return;
        }
        let resume = self.bs.index(s.prompt_len.saturating_sub(1));
        let kept = self.bs.index(attention.first_key(resume * self.bs.get()))..resume;
        let (len, first, n) = (s.tokens.len(), s.first, keep - s.first);
        let blocks = s.table[..n].iter().enumerate().map(|(j, &block)| {
            let i = first + j;
            (block, self.bs.fill(i, len), !kept.contains(&i))
        });
        self.gpu.release_blocks_as(blocks);
        s.table.drain(..n);
        s.first = keep;
        s.table_changed();
    }

    /// Whether this manager's blocks are announced by events: group 0's, with full attention
    /// (a windowed group releases blocks whose children it still holds, which a router's tree
    /// cannot follow, so a manager whose group 0 is windowed records no events at all).
    fn announces(&self) -> bool {
        self.group == 0 && self.config.attention == Attention::Full
    }

    /// Whether this manager records events.
    fn publishes(&self) -> bool {
        self.announces() && self.events.enabled()
    }

    /// Releases a CPU block table, last block first; a freed block leaves the CPU tier.
    fn release_cpu_blocks(&self, table: &[BlockId]) {
        for &block in table.iter().rev() {
            let release = || self.cpu.release_block(block, 0) != Released::Held;
            if !self.publishes() {
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
}

/// Fails if a sequence of `len` tokens cannot take `more`.
#[inline(always)]
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
#[inline(always)]
fn not_loading(id: SeqId, s: &Sequence) -> Result<(), Error> {
    if s.loading.is_some() {
        return Err(invalid(format!(
            "sequence {id}: confirm its external loads first"
        )));
    }
    Ok(())
}

/// Fails if queries starting at `start` would skip tokens no plan has computed.
#[inline(always)]
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

/// Checks one sequence of a batch (live, not repeated, on the expected side), marks it with
/// the call's `stamp` and says where it is.
fn visit(
    batch: &mut LockedBatch<'_>,
    id: SeqId,
    stamp: u64,
    swapped: bool,
) -> Result<Place, Error> {
    visit_hinted(batch, id, None, stamp, swapped)
}

/// [`visit`], looking where `hint` says first (a persistent batch remembers where its rows'
/// sequences were).
#[inline(always)]
fn visit_hinted(
    batch: &mut LockedBatch<'_>,
    id: SeqId,
    hint: Option<Place>,
    stamp: u64,
    swapped: bool,
) -> Result<Place, Error> {
    let place = batch.find(id, hint).ok_or(Error::UnknownSequence(id))?;
    let s = batch.at(place);
    if s.stamp == stamp {
        return Err(invalid(format!("sequence {id} appears twice in the batch")));
    }
    s.stamp = stamp;
    if s.swapped != swapped {
        return Err(if s.swapped {
            Error::SwappedOut(id)
        } else {
            Error::NotSwappedOut(id)
        });
    }
    Ok(place)
}

/// The blocks one operation took, and how many of them it evicted from the prefix cache.
#[derive(Default)]
struct Taken {
    blocks: usize,
    evictions: u64,
}

impl BlockManager {
    /// Hands out the next block the caller reserved (FREE first, else the least recently
    /// released CACHED block, which leaves the prefix cache now).
    fn take(&self, taken: &mut Taken) -> BlockId {
        let (block, evicted) = self.gpu.take_reserved();
        taken.blocks += 1;
        if evicted {
            if let Some(prefix) = &self.prefix {
                prefix.unregister(block, || {
                    let group = prefix.group_of(block);
                    self.feed.record(|| Registration::Removed { group, block });
                    if group != 0 {
                        return;
                    }
                    self.events.record(|| EventKind::BlockRemoved {
                        block_hash: prefix.hash_of(block),
                        block_id: block,
                        medium: PoolKind::Gpu,
                    })
                });
            }
            taken.evictions += 1;
        }
        block
    }

    /// Ends an operation that reserved `reserved` blocks and took `taken`: counts its
    /// evictions and gives back the reserved blocks it did not take.
    fn finish_taking(&self, reserved: usize, taken: Taken) {
        if taken.evictions > 0 {
            Counters::add(&self.counters.evictions, taken.evictions);
        }
        self.gpu.unreserve(reserved - taken.blocks);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn manager_is_send_and_sync() {
        fn shareable<T: Send + Sync>() {}
        shareable::<BlockManager>();
    }
}
