//! The prefix cache: chained keyed hashes of full blocks and the map from hash to the physical
//! block holding that content, with each registered block's parent hash and tokens kept so a
//! hit can be verified (a forged hash collision is a miss, never another sequence's KV).
//!
//! The chain: `c_root = BLAKE3_keyed(key, "pagedkv/root" || salt)`, then block `i`'s chaining
//! value `c_i = BLAKE3_keyed(c_{i-1}, tokens_i)`: each link is keyed by the previous 256-bit
//! value, so the whole prefix and the salt are bound in, and a 16-token block is one BLAKE3
//! compression (parent and tokens in one message would take two). A block's hash is the first
//! 128 bits of its chaining value.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::block::BlockState;
use crate::bookkeeping::{try_boxed, TooLarge};
use crate::pool::BlockPool;
use crate::sync::{lock, AtomicU32, AtomicU64, Mutex, MutexGuard, Ordering};
use crate::{BlockId, Token};

/// A 128-bit block hash: the first half of the block's chaining value.
pub type BlockHash = u128;

/// The full 256-bit chaining value of a prefix (keys the next block's hash).
pub(crate) type Chain = [u8; 32];

/// The block hash of a chaining value.
pub(crate) fn block_hash_of(chain: &Chain) -> BlockHash {
    let bytes: [u8; 16] = chain[..16].try_into().expect("16 bytes");
    u128::from_le_bytes(bytes)
}

const SHARDS: usize = 64;

/// The keys are already uniformly random (keyed BLAKE3), so the map uses their low bits as is.
#[derive(Default)]
pub(crate) struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Shard = HashMap<BlockHash, BlockId, BuildHasherDefault<PassThrough>>;

/// Hashes, map and registered contents of one GPU pool.
pub(crate) struct PrefixCache {
    key: [u8; 32],
    block_size: usize,
    shards: Box<[Mutex<Shard>]>,
    /// Per block: `[hash_lo, hash_hi, parent_lo, parent_hi]` of its registration.
    meta: Box<[AtomicU64]>,
    /// Per block: its `block_size` tokens at registration.
    tokens: Box<[AtomicU32]>,
}

fn split(h: BlockHash) -> (u64, u64) {
    (h as u64, (h >> 64) as u64)
}

fn join(lo: u64, hi: u64) -> BlockHash {
    u128::from(lo) | (u128::from(hi) << 64)
}

impl PrefixCache {
    /// An empty cache for `num_blocks` blocks of `block_size` tokens, or the allocation that
    /// failed.
    pub(crate) fn new(
        key: [u8; 32],
        num_blocks: u32,
        block_size: u32,
    ) -> Result<PrefixCache, TooLarge> {
        let n = num_blocks as usize;
        Ok(PrefixCache {
            key,
            block_size: block_size as usize,
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            meta: try_boxed(4 * n, |_| AtomicU64::new(0))?,
            tokens: try_boxed(n * block_size as usize, |_| AtomicU32::new(0))?,
        })
    }

    /// The chaining value before a sequence's first block: binds the key and the tenant salt.
    pub(crate) fn root(&self, salt: Option<&[u8]>) -> Chain {
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        hasher.update(b"pagedkv/root");
        match salt {
            None => hasher.update(&[0]),
            Some(salt) => hasher
                .update(&[1])
                .update(&(salt.len() as u64).to_le_bytes())
                .update(salt),
        };
        *hasher.finalize().as_bytes()
    }

    /// A public 64-bit fingerprint of the key: equal for managers that hash alike, and reveals
    /// nothing about the key itself (it is a keyed hash of a constant).
    pub(crate) fn fingerprint(&self) -> u64 {
        let digest = blake3::keyed_hash(&self.key, b"pagedkv/fingerprint");
        u64::from_le_bytes(digest.as_bytes()[..8].try_into().expect("8 bytes"))
    }

    /// The chaining value of one full block after `parent`.
    pub(crate) fn hash_block(&self, parent: &Chain, tokens: &[Token]) -> Chain {
        const CHUNK: usize = 64;
        let mut buf = [0u8; 4 * CHUNK];
        if tokens.len() <= CHUNK {
            let len = 4 * tokens.len();
            for (dst, t) in buf[..len].chunks_exact_mut(4).zip(tokens) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            return *blake3::keyed_hash(parent, &buf[..len]).as_bytes();
        }
        let mut hasher = blake3::Hasher::new_keyed(parent);
        for chunk in tokens.chunks(CHUNK) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            hasher.update(&buf[..4 * chunk.len()]);
        }
        *hasher.finalize().as_bytes()
    }

    fn shard(&self, hash: BlockHash) -> &Mutex<Shard> {
        &self.shards[(hash >> 64) as usize % SHARDS]
    }

    /// The block registered under `hash`, if any (unverified: see [`PrefixCache::matches`]).
    pub(crate) fn get(&self, hash: BlockHash) -> Option<BlockId> {
        lock(self.shard(hash)).get(&hash).copied()
    }

    /// The block of `pool` registered with exactly this content, with the state it was verified
    /// in. Read-only and unguarded: the block may be evicted and reused the moment after, so a
    /// caller must take it with `pool.acquire_hit(block, state, ..)`, which succeeds only while
    /// the block is still that incarnation. (The state's acquire load makes that incarnation's
    /// registration visible; contents read from a later one imply a generation `acquire_hit`
    /// rejects. Model-checked below.)
    pub(crate) fn find(
        &self,
        pool: &BlockPool,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[Token],
    ) -> Option<(BlockId, BlockState)> {
        let block = self.get(hash)?;
        let state = pool.state(block);
        (state.hashed() && self.matches(block, hash, parent, tokens)).then_some((block, state))
    }

    /// Whether `block`'s registered contents are exactly `(hash, parent, tokens)`.
    pub(crate) fn matches(
        &self,
        block: BlockId,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[Token],
    ) -> bool {
        let b = block as usize;
        let m = &self.meta[4 * b..4 * b + 4];
        let load = |i: usize| m[i].load(Ordering::Relaxed);
        if join(load(0), load(1)) != hash || join(load(2), load(3)) != parent {
            return false;
        }
        let stored = &self.tokens[b * self.block_size..(b + 1) * self.block_size];
        stored
            .iter()
            .zip(tokens)
            .all(|(s, &t)| s.load(Ordering::Relaxed) == t)
    }

    /// The hash `block` was registered under.
    pub(crate) fn hash_of(&self, block: BlockId) -> BlockHash {
        let b = block as usize;
        join(
            self.meta[4 * b].load(Ordering::Relaxed),
            self.meta[4 * b + 1].load(Ordering::Relaxed),
        )
    }

    /// Registers `block` (held by the caller, full) under `hash` unless the hash is already
    /// mapped; then `publish` (flag the block, record the event) runs under the shard lock once the
    /// contents are written, so a reset or an eviction of the same hash is ordered with it.
    pub(crate) fn register(
        &self,
        block: BlockId,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[Token],
        publish: impl FnOnce(),
    ) {
        let mut shard = lock(self.shard(hash));
        if shard.contains_key(&hash) {
            return;
        }
        let b = block as usize;
        let (hash_lo, hash_hi) = split(hash);
        let (parent_lo, parent_hi) = split(parent);
        for (slot, value) in self.meta[4 * b..4 * b + 4]
            .iter()
            .zip([hash_lo, hash_hi, parent_lo, parent_hi])
        {
            slot.store(value, Ordering::Relaxed);
        }
        for (slot, &t) in self.tokens[b * self.block_size..].iter().zip(tokens) {
            slot.store(t, Ordering::Relaxed);
        }
        publish();
        shard.insert(hash, block);
    }

    /// Removes `hash` if it still maps to `block` (an evicted block's registration), running
    /// `removed` under the shard lock if it did.
    pub(crate) fn unregister(&self, block: BlockId, hash: BlockHash, removed: impl FnOnce()) {
        let mut shard = lock(self.shard(hash));
        if shard.get(&hash) == Some(&block) {
            shard.remove(&hash);
            removed();
        }
    }

    /// Every registered hash (each shard read under its lock, one after another).
    pub(crate) fn hashes(&self) -> Vec<BlockHash> {
        self.shards
            .iter()
            .flat_map(|shard| lock(shard).keys().copied().collect::<Vec<_>>())
            .collect()
    }

    /// Locks every shard (in order), for a reset or an audit.
    pub(crate) fn lock_all(&self) -> Vec<MutexGuard<'_, Shard>> {
        self.shards.iter().map(lock).collect()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_and_depend_on_key_and_salt() {
        let a = PrefixCache::new([1; 32], 4, 4).unwrap();
        let b = PrefixCache::new([2; 32], 4, 4).unwrap();
        let root = a.root(None);
        assert_ne!(root, a.root(Some(b"tenant")));
        assert_ne!(a.root(Some(b"")), root);
        let h = a.hash_block(&root, &[1, 2, 3, 4]);
        assert_eq!(h, a.hash_block(&root, &[1, 2, 3, 4]));
        assert_ne!(h, a.hash_block(&root, &[1, 2, 3, 5]));
        assert_ne!(h, a.hash_block(&h, &[1, 2, 3, 4]));
        assert_ne!(h, b.hash_block(&b.root(None), &[1, 2, 3, 4]));
    }

    #[test]
    fn long_blocks_hash_all_tokens() {
        let c = PrefixCache::new([0; 32], 1, 200).unwrap();
        let tokens: Vec<u32> = (0..200).collect();
        let mut other = tokens.clone();
        other[199] = 7;
        let root = c.root(None);
        assert_ne!(c.hash_block(&root, &tokens), c.hash_block(&root, &other));
    }

    #[test]
    fn register_verify_unregister() {
        let c = PrefixCache::new([0; 32], 2, 2).unwrap();
        let h = block_hash_of(&c.hash_block(&c.root(None), &[1, 2]));
        c.register(1, h, 5, &[1, 2], || {});
        c.register(0, h, 5, &[1, 2], || panic!("already mapped"));
        assert_eq!(c.get(h), Some(1));
        assert!(c.matches(1, h, 5, &[1, 2]));
        assert!(!c.matches(1, h, 6, &[1, 2]));
        assert!(!c.matches(1, h, 5, &[1, 3]));
        c.unregister(0, h, || panic!("not mapped to 0"));
        assert_eq!(c.get(h), Some(1));
        let mut removed = false;
        c.unregister(1, h, || removed = true);
        assert!(removed);
        assert_eq!(c.get(h), None);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::pool::Hit;
    use loom::sync::Arc;

    /// Two hashes in different shards, so only the block's state word orders the threads.
    const OLD: BlockHash = 1 << 64;
    const NEW: BlockHash = 2 << 64;
    const OLD_TOKENS: [Token; 2] = [1, 1];
    const NEW_TOKENS: [Token; 2] = [2, 2];

    /// A one-block pool whose block is CACHED, registered as `OLD`.
    fn one_cached_block() -> (BlockPool, PrefixCache) {
        let pool = BlockPool::new(1).unwrap();
        let prefix = PrefixCache::new([0; 32], 1, 2).unwrap();
        let block = pool.allocate().unwrap();
        prefix.register(block, OLD, 0, &OLD_TOKENS, || pool.mark_hashed(block));
        pool.release_block(block, 0);
        (pool, prefix)
    }

    /// `allocate`'s path for one block: lookup, reserve if the hit is CACHED, acquire.
    fn lookup_and_acquire(
        pool: &BlockPool,
        prefix: &PrefixCache,
        hash: BlockHash,
        tokens: &[Token],
    ) -> Option<(BlockId, Hit)> {
        let (block, seen) = prefix.find(pool, hash, 0, tokens)?;
        let needed = usize::from(seen.refcount() == 0);
        pool.reserve(needed).ok()?;
        match pool.acquire_hit(block, seen, 0) {
            Some(hit) => Some((block, hit)),
            None => {
                pool.unreserve(needed);
                None
            }
        }
    }

    /// A lookup of `OLD` races a thread that evicts the block, registers `NEW` contents in it,
    /// lets it go (CACHED) and revives it by a `NEW` hit. Whatever the interleaving, a hit on
    /// `OLD` holds `OLD`'s contents while it holds the block.
    #[test]
    fn lookup_races_evict_reregister_and_revive() {
        // Reaching a stale read takes three preemptions; the suite's default bound is two.
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(4);
        model.check(|| {
            let shared = Arc::new(one_cached_block());
            let other = shared.clone();
            let reuser = loom::thread::spawn(move || {
                let (pool, prefix) = &*other;
                if pool.reserve(1).is_err() {
                    return None; // the lookup revived the block first
                }
                let (block, evicted) = pool.take_reserved();
                assert!(evicted);
                prefix.unregister(block, prefix.hash_of(block), || {});
                prefix.register(block, NEW, 0, &NEW_TOKENS, || pool.mark_hashed(block));
                pool.release_block(block, 0);
                lookup_and_acquire(pool, prefix, NEW, &NEW_TOKENS)
            });
            let (pool, prefix) = &*shared;
            let old_hit = lookup_and_acquire(pool, prefix, OLD, &OLD_TOKENS);
            if let Some((block, _)) = old_hit {
                assert!(
                    prefix.matches(block, OLD, 0, &OLD_TOKENS),
                    "a hit on OLD holds other contents"
                );
            }
            let new_hit = reuser.join().unwrap();
            if let Some((block, _)) = old_hit {
                assert!(prefix.matches(block, OLD, 0, &OLD_TOKENS));
                assert!(new_hit.is_none(), "the block was never evicted");
            }
            let holders = usize::from(old_hit.is_some()) + usize::from(new_hit.is_some());
            assert_eq!(pool.state(0).refcount() as usize, holders);
            assert_eq!(pool.available() + holders, 1);
        });
    }
}
