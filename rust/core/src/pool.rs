//! The physical block pool: one atomic state word per block, a lock-free free list, the
//! eviction order of CACHED blocks, and the count of available blocks that makes multi-block
//! operations all-or-nothing.
//!
//! Concurrency protocol:
//! - FREE blocks live in the lock-free [`FreeList`]; popping one is the only way to own it.
//! - HELD blocks change refcount by CAS on their state word, lock-free.
//! - Transitions into and out of CACHED (release to zero of a hashed block, revival by a prefix
//!   hit, eviction, reset) happen under the `lru` lock, so the list always matches the states.
//!   That lock is never taken on the decode path unless the pool must evict.
//! - `available` counts FREE + CACHED blocks not yet promised to anyone. An operation first
//!   reserves every block it needs with one CAS, so it either gets all of them or none.
//! - A block's registration (hash, parent, tokens in the prefix cache) is written before
//!   `mark_hashed`'s release; every later change of the state word is a read-modify-write or
//!   happens under the `lru` lock, so a lookup's acquire load of a hashed state sees the
//!   registration of that incarnation. `acquire_hits` then takes the block only if the
//!   incarnation is unchanged: that, not the lookup, is what guarantees a hit's contents.
//! - These atomics order host metadata only. The GPU's KV writes into a block are ordered by the
//!   engine's CUDA streams and events, never by anything here.

use crate::block::BlockState;
use crate::bookkeeping::{try_boxed, TooLarge};
use crate::free_list::FreeList;
use crate::lru::Lru;
use crate::sync::{lock, AtomicU64, AtomicUsize, Backoff, Mutex, MutexGuard, Ordering};
use crate::BlockId;

/// A pool of `num_blocks` blocks with lock-free allocation and reference counting. Internal:
/// its callers keep the invariant that a block is released only by a holder (a release of an
/// unheld block would put it on the free list twice).
pub(crate) struct BlockPool {
    states: Box<[AtomicU64]>,
    free: FreeList,
    lru: Mutex<Lru>,
    /// The LRU's length, stored under its lock (a plain store, not a locked read-modify-write)
    /// for lock-free readers.
    num_cached: AtomicUsize,
    available: AtomicUsize,
    stored_tokens: AtomicUsize,
}

/// Blocks a run of releases or revivals handles per hold of the LRU lock: bounds how long it
/// keeps other threads' takes waiting.
const RUN_CHUNK: usize = 16;

/// What a prefix hit did to the block it matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hit {
    /// The block was HELD by someone else; now shared.
    Shared,
    /// The block was CACHED; now held again (it used one reserved block).
    Revived,
}

/// What a release did to the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Released {
    /// Other holders remain.
    Held,
    /// Last holder gone; the hashed block is now CACHED.
    Cached,
    /// Last holder gone; the block is FREE.
    Freed,
}

/// A consistent picture of the pool, taken while nothing else runs (see `check`).
pub(crate) struct PoolAudit {
    pub(crate) states: Vec<BlockState>,
    pub(crate) free: Vec<BlockId>,
    pub(crate) cached: Vec<BlockId>,
    pub(crate) num_cached: usize,
    pub(crate) available: usize,
    pub(crate) stored_tokens: usize,
}

impl BlockPool {
    /// A pool whose blocks are all FREE, or the allocation that failed.
    pub(crate) fn new(num_blocks: u32) -> Result<BlockPool, TooLarge> {
        let n = num_blocks as usize;
        Ok(BlockPool {
            states: try_boxed(n, |_| AtomicU64::new(BlockState::FREE.0))?,
            free: FreeList::full(num_blocks)?,
            lru: Mutex::new(Lru::new(num_blocks)?),
            num_cached: AtomicUsize::new(0),
            available: AtomicUsize::new(n),
            stored_tokens: AtomicUsize::new(0),
        })
    }

    /// Takes one block (FREE first, else evicts the least recently released CACHED one), or
    /// `None` when every block is held.
    pub(crate) fn allocate(&self) -> Option<BlockId> {
        self.reserve(1).ok()?;
        Some(self.take_reserved().0)
    }

    /// Number of blocks nobody holds and that are not in the prefix cache.
    pub(crate) fn num_free(&self) -> usize {
        let unheld = self.available.load(Ordering::Relaxed);
        unheld.saturating_sub(self.num_cached())
    }

    /// Number of unreferenced blocks kept for prefix reuse.
    pub(crate) fn num_cached(&self) -> usize {
        self.num_cached.load(Ordering::Relaxed)
    }

    /// Number of blocks in the pool.
    pub(crate) fn num_blocks(&self) -> usize {
        self.states.len()
    }

    /// FREE + CACHED blocks nobody has reserved.
    pub(crate) fn available(&self) -> usize {
        self.available.load(Ordering::Relaxed)
    }

    /// Tokens stored in held blocks (each physical block counted once).
    pub(crate) fn stored_tokens(&self) -> usize {
        self.stored_tokens.load(Ordering::Relaxed)
    }

    /// Promises `n` blocks to the caller, all or none; on failure returns what was available.
    pub(crate) fn reserve(&self, n: usize) -> Result<(), usize> {
        if n == 0 {
            return Ok(());
        }
        // Acquire: pairs with the releases' Release increments, so the blocks counted in are
        // already on the free list or in the LRU when `take_reserved` looks for them.
        self.available
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |a| a.checked_sub(n))
            .map(|_| ())
    }

    /// Returns `n` reserved blocks that were not used.
    pub(crate) fn unreserve(&self, n: usize) {
        if n > 0 {
            self.available.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Takes a block the caller reserved: FREE first, else the LRU head. Returns the block and
    /// whether it was evicted from the prefix cache (the caller then unregisters its hash).
    pub(crate) fn take_reserved(&self) -> (BlockId, bool) {
        let mut backoff = Backoff::default();
        loop {
            if let Some(block) = self.free.pop() {
                // Nobody else writes a FREE block's state: lookups only CAS hashed snapshots.
                let state = &self.states[block as usize];
                let old = BlockState(state.load(Ordering::Relaxed));
                state.store(old.fresh().0, Ordering::Relaxed);
                return (block, false);
            }
            let mut lru = lock(&self.lru);
            if let Some(block) = lru.pop_front() {
                self.num_cached.store(lru.len(), Ordering::Relaxed);
                // CACHED states change only under this lock, so a plain store is exact.
                let state = &self.states[block as usize];
                let old = BlockState(state.load(Ordering::Relaxed));
                debug_assert!(old.cached());
                state.store(old.fresh().0, Ordering::Release);
                return (block, true);
            }
            drop(lru);
            // Another reserver popped a block our count came from and left us one that is
            // being pushed right now (counts are fungible, blocks are not).
            backoff.snooze();
        }
    }

    /// The current state word of `block`.
    pub(crate) fn state(&self, block: BlockId) -> BlockState {
        // Acquire: a hashed state makes its registration (hash, parent, tokens) visible.
        BlockState(self.states[block as usize].load(Ordering::Acquire))
    }

    /// Adds a holder to a block the caller already holds through another reference.
    pub(crate) fn share_held(&self, block: BlockId) {
        let old = self.states[block as usize].fetch_add(1, Ordering::Relaxed);
        debug_assert!(BlockState(old).refcount() >= 1);
    }

    /// One prefix hit's [`BlockPool::acquire_hits`], for the tests of the protocol.
    #[cfg(test)]
    pub(crate) fn acquire_hit(&self, block: BlockId, seen: BlockState, fill: u32) -> Option<Hit> {
        match self.acquire_hits(&[(block, seen)], fill) {
            (0, _) => None,
            (_, 0) => Some(Hit::Shared),
            _ => Some(Hit::Revived),
        }
    }

    /// Takes a reference to each block a prefix lookup matched, in order, stopping at the first
    /// that is no longer the incarnation it was seen in (same generation, still hashed) or no
    /// longer in the same class (held or cached). Reviving a CACHED block consumes one block
    /// the caller reserved and counts its `fill` tokens as stored again. The LRU lock is taken
    /// at most once per chunk of blocks (and held for no more than a chunk), not per revival.
    /// Returns how many blocks were acquired, and how many of them were revived.
    pub(crate) fn acquire_hits(&self, hits: &[(BlockId, BlockState)], fill: u32) -> (usize, usize) {
        let (mut lru, mut revived, mut uncounted) = (None, 0, 0);
        for (acquired, &(block, seen)) in hits.iter().enumerate() {
            match self.acquire_under(block, seen, &mut lru) {
                None => {
                    self.finish_revivals(lru, uncounted * fill as usize);
                    return (acquired, revived);
                }
                Some(Hit::Shared) => {}
                Some(Hit::Revived) => {
                    revived += 1;
                    uncounted += 1;
                }
            }
            if (acquired + 1) % RUN_CHUNK == 0 {
                self.finish_revivals(lru.take(), uncounted * fill as usize);
                uncounted = 0;
            }
        }
        self.finish_revivals(lru, uncounted * fill as usize);
        (hits.len(), revived)
    }

    /// One acquisition of [`BlockPool::acquire_hits`], taking the LRU lock into `lru` (if not
    /// held yet) when the block is CACHED; the caller updates the counters.
    fn acquire_under<'p>(
        &'p self,
        block: BlockId,
        seen: BlockState,
        lru: &mut Option<MutexGuard<'p, Lru>>,
    ) -> Option<Hit> {
        let state = &self.states[block as usize];
        if seen.refcount() > 0 {
            let mut current = BlockState(state.load(Ordering::Relaxed));
            loop {
                let same = current.generation() == seen.generation() && current.hashed();
                if !same || current.refcount() == 0 {
                    return None;
                }
                // Acquire: the holders' host-side writes about the block (its registration)
                // happen before ours.
                match state.compare_exchange_weak(
                    current.0,
                    current.with_refcount(current.refcount() + 1).0,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => return Some(Hit::Shared),
                    Err(now) => current = BlockState(now),
                }
            }
        }
        let lru = lru.get_or_insert_with(|| lock(&self.lru));
        let current = BlockState(state.load(Ordering::Relaxed));
        if current != seen {
            return None;
        }
        lru.remove(block);
        // A read-modify-write, not a store: it continues the release sequence headed by
        // `mark_hashed`, on which lookups that read the revived state rely. Refcount 0 -> 1.
        state.fetch_add(1, Ordering::Relaxed);
        Some(Hit::Revived)
    }

    /// Publishes what revivals under `lru` did: the LRU's length (then the lock is let go),
    /// and `fill` tokens stored again.
    fn finish_revivals(&self, lru: Option<MutexGuard<'_, Lru>>, fill: usize) {
        if let Some(lru) = lru {
            self.num_cached.store(lru.len(), Ordering::Relaxed);
        }
        if fill > 0 {
            self.stored_tokens.fetch_add(fill, Ordering::Relaxed);
        }
    }

    /// Marks a held block, not hashed yet, as registered in the prefix cache.
    pub(crate) fn mark_hashed(&self, block: BlockId) {
        // Release: the registration written before (hash, parent, tokens) is visible to lookups
        // that see the flag. Host metadata only: the KV itself is ordered by the GPU streams.
        let hashed = BlockState(0).with_hashed(true).0;
        let old = BlockState(self.states[block as usize].fetch_or(hashed, Ordering::Release));
        debug_assert!(old.refcount() >= 1 && !old.hashed());
    }

    /// Counts `tokens` newly written into held blocks.
    pub(crate) fn add_stored(&self, tokens: usize) {
        self.stored_tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    /// Counts `tokens` no longer written in held blocks (dropped from a block that stays held).
    pub(crate) fn remove_stored(&self, tokens: usize) {
        self.stored_tokens.fetch_sub(tokens, Ordering::Relaxed);
    }

    /// Drops one reference to a block holding `fill` tokens (all its holders agree on that);
    /// at zero they no longer count as stored. See [`Released`].
    pub(crate) fn release_block(&self, block: BlockId, fill: u32) -> Released {
        let mut lru = None;
        let released = self.release_under(block, &mut lru, false);
        let last = usize::from(released != Released::Held);
        self.finish_releases(lru, last, last * fill as usize);
        released
    }

    /// [`BlockPool::release_block`] for each of `blocks` (block, fill) in order, with the LRU
    /// lock taken once per chunk of blocks rather than per block that becomes CACHED, and the
    /// counters updated once per chunk.
    pub(crate) fn release_blocks(&self, blocks: impl IntoIterator<Item = (BlockId, u32)>) {
        self.release_blocks_as(blocks.into_iter().map(|(block, fill)| (block, fill, false)));
    }

    /// [`BlockPool::release_blocks`] where each block says whether, once CACHED, it is evicted
    /// before every block cached so far (`true`) or after them (`false`).
    pub(crate) fn release_blocks_as(&self, blocks: impl IntoIterator<Item = (BlockId, u32, bool)>) {
        let (mut lru, mut last, mut fill, mut handled) = (None, 0, 0, 0);
        for (block, block_fill, first) in blocks {
            if self.release_under(block, &mut lru, first) != Released::Held {
                last += 1;
                fill += block_fill as usize;
            }
            handled += 1;
            if handled == RUN_CHUNK {
                self.finish_releases(lru.take(), last, fill);
                (last, fill, handled) = (0, 0, 0);
            }
        }
        self.finish_releases(lru, last, fill);
    }

    /// One release of [`BlockPool::release_block`], taking the LRU lock into `lru` (if not held
    /// yet) when the block becomes CACHED, at the LRU's head if `first`; the caller updates the
    /// counters.
    fn release_under<'p>(
        &'p self,
        block: BlockId,
        lru: &mut Option<MutexGuard<'p, Lru>>,
        first: bool,
    ) -> Released {
        let state = &self.states[block as usize];
        let mut current = BlockState(state.load(Ordering::Relaxed));
        loop {
            debug_assert!(current.refcount() >= 1, "release of unheld block {block}");
            if current.refcount() > 1 {
                // Release: this holder's host-side accesses to the block happen before the last
                // holder's release, so whoever reuses the block comes after all of them.
                match state.compare_exchange_weak(
                    current.0,
                    current.with_refcount(current.refcount() - 1).0,
                    Ordering::Release,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => return Released::Held,
                    Err(now) => {
                        current = BlockState(now);
                        continue;
                    }
                }
            }
            if current.hashed() {
                let lru = lru.get_or_insert_with(|| lock(&self.lru));
                if let Err(now) = state.compare_exchange(
                    current.0,
                    current.with_refcount(0).0,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                ) {
                    current = BlockState(now);
                    continue;
                }
                if first {
                    lru.push_front(block);
                } else {
                    lru.push_back(block);
                }
                return Released::Cached;
            }
            // The last holder of an unhashed block is alone with it: lookups only CAS hashed
            // snapshots, and nobody else can register or share it. A store suffices.
            state.store(current.with_refcount(0).0, Ordering::Release);
            self.free.push(block);
            return Released::Freed;
        }
    }

    /// Publishes what releases under `lru` did: the LRU's length (then the lock is let go),
    /// `fill` tokens no longer stored, and `last` blocks available again.
    fn finish_releases(&self, lru: Option<MutexGuard<'_, Lru>>, last: usize, fill: usize) {
        if let Some(lru) = lru {
            self.num_cached.store(lru.len(), Ordering::Relaxed);
        }
        if last > 0 {
            self.stored_tokens.fetch_sub(fill, Ordering::Relaxed);
            // Release, after the pushes: a reserver whose count includes these blocks finds
            // them on the free list or in the LRU (pairs with `reserve`'s Acquire).
            self.available.fetch_add(last, Ordering::Release);
        }
    }

    /// Forgets every registration: `registered` (all hashed blocks) lose their flag, and every
    /// CACHED block becomes FREE, pushed from the LRU head to its tail.
    pub(crate) fn clear_hashes(&self, registered: impl Iterator<Item = BlockId>) {
        let mut lru = lock(&self.lru);
        for block in registered {
            let not_hashed = !BlockState(0).with_hashed(true).0;
            self.states[block as usize].fetch_and(not_hashed, Ordering::Relaxed);
        }
        while let Some(block) = lru.pop_front() {
            self.num_cached.store(lru.len(), Ordering::Relaxed);
            self.free.push(block);
        }
    }

    /// The pool's whole state; exact only while no other thread uses the pool.
    pub(crate) fn audit(&self) -> PoolAudit {
        let lru = lock(&self.lru);
        PoolAudit {
            states: self
                .states
                .iter()
                .map(|s| BlockState(s.load(Ordering::Acquire)))
                .collect(),
            free: self.free.snapshot(),
            cached: lru.iter().collect(),
            num_cached: self.num_cached.load(Ordering::Relaxed),
            available: self.available.load(Ordering::Acquire),
            stored_tokens: self.stored_tokens.load(Ordering::Relaxed),
        }
    }
}

/// The pool behind handles that release their block when dropped, so no caller can release a
/// block it does not hold. For `benches/pool.rs`; not part of the API.
pub mod bench {
    use super::BlockPool;
    use crate::BlockId;

    /// A pool of FREE blocks.
    pub struct Pool(BlockPool);

    /// One held block; dropping it releases it.
    pub struct Held<'p> {
        pool: &'p BlockPool,
        block: BlockId,
    }

    impl Pool {
        /// A pool of `num_blocks` FREE blocks; panics if its bookkeeping cannot be allocated.
        pub fn new(num_blocks: u32) -> Pool {
            Pool(BlockPool::new(num_blocks).expect("a pool that fits in memory"))
        }

        /// Takes one block, or `None` when every block is held.
        pub fn allocate(&self) -> Option<Held<'_>> {
            let block = self.0.allocate()?;
            Some(Held {
                pool: &self.0,
                block,
            })
        }

        /// Blocks nobody holds.
        pub fn num_free(&self) -> usize {
            self.0.num_free()
        }
    }

    impl Held<'_> {
        /// The block's id.
        pub fn id(&self) -> BlockId {
            self.block
        }
    }

    impl Drop for Held<'_> {
        fn drop(&mut self) {
            self.pool.release_block(self.block, 0);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, loom))]
mod loom_tests;
