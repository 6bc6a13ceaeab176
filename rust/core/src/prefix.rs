//! The prefix cache: the map from a full block's contents (with its whole prefix) to the
//! physical block holding them, with each registered block's parent and tokens kept so a hit
//! can be verified (a forged or accidental key collision is a miss, never another sequence's KV).
//!
//! Two chains of keyed hashes run over a sequence's full blocks:
//! - the **map key**, in-process only: `k_i = XXH3-128_secret(k_{i-1} || tokens_i)`, with the
//!   secret drawn from the manager's key. A hit is verified by the stored parent key and tokens,
//!   so this hash only has to be keyed and well spread; a 16-token block costs a few ns.
//! - the **published hash** (events, `block_hashes`, `stored_hashes`, the external tier): the
//!   BLAKE3 chaining value `c_i = BLAKE3_keyed(c_{i-1}, tokens_i)` from
//!   `c_root = BLAKE3_keyed(key, "pagedkv/root" || salt)`. Each link is keyed by the previous
//!   256-bit value, so the whole prefix and the salt are bound in, and a 16-token block is one
//!   BLAKE3 compression. A block's hash is the first 128 bits of its chaining value. It must be
//!   stable across processes and hard to forge, so it stays BLAKE3; a registered block keeps
//!   its chaining value, and a hit reads it instead of hashing the prompt again.
//!
//! A block with extra keys ([`crate::keys`]) binds their digest into both: its BLAKE3 input
//! starts with it, and its map key hashes a *link* (a keyed BLAKE3 of the parent key and the
//! digest) in place of the parent key; the registration stores the link, so a hit verifies it.
//!
//! A prompt is hashed before its admission takes any lock ([`PromptHashes`]), and a retry after
//! a lost race reuses its map keys.

use xxhash_rust::xxh3::xxh3_128_with_secret;

use crate::block::BlockState;
use crate::bookkeeping::{try_boxed, TooLarge};
use crate::keys::{digest_of, Digest, HashKeys};
use crate::pool::BlockPool;
use crate::prefix_map::{PrefixMap, Region};
use crate::sync::{AtomicU64, Ordering};
use crate::{BlockId, Token};

/// A 128-bit block hash: the first half of the block's BLAKE3 chaining value.
pub type BlockHash = u128;

/// The full 256-bit BLAKE3 chaining value of a prefix (keys the next block's hash).
pub(crate) type Chain = [u8; 32];

/// The chaining value of a block of a hybrid manager's group past 0 without the block feed,
/// which publishes no hashes (its blocks are keyed in the map only).
pub(crate) const UNPUBLISHED: Chain = [0; 32];

/// A block's key in the prefix map (never leaves the process).
pub(crate) type MapKey = u128;

/// The block hash of a chaining value.
pub(crate) fn block_hash_of(chain: &Chain) -> BlockHash {
    let bytes: [u8; 16] = chain[..16].try_into().expect("16 bytes");
    u128::from_le_bytes(bytes)
}

/// XXH3's default secret size (at least 136 bytes).
const SECRET: usize = 192;

/// Bytes of the block a hash reads from the stack; longer blocks are packed on the heap.
const STACK_BYTES: usize = 16 + 4 * 32;

/// Words of a block's registration: what a lookup verifies (`[key_lo, key_hi, parent_key_lo,
/// parent_key_hi]`), then the BLAKE3 chaining value a hit reads next, the group that registered
/// it, then the block's tokens, two to a word (the first in the low half).
const KEY: usize = 0;
const PARENT: usize = 2;
const CHAIN: usize = 4;
const GROUP: usize = 8;
const TOKENS: usize = 9;

/// Hashes, map and registered contents of one GPU pool.
pub(crate) struct PrefixCache {
    key: [u8; 32],
    /// The map key's XXH3 secret, drawn from `key`.
    secret: [u8; SECRET],
    /// The BLAKE3 chaining value before block 0 without a salt (the usual case).
    unsalted_root: Chain,
    block_size: usize,
    /// Map key -> registered block.
    map: PrefixMap,
    /// Per block, `stride` words from `block * stride`: its registration.
    words: Box<[AtomicU64]>,
    stride: usize,
}

fn split(h: u128) -> [u64; 2] {
    [h as u64, (h >> 64) as u64]
}

fn join(lo: u64, hi: u64) -> u128 {
    u128::from(lo) | (u128::from(hi) << 64)
}

/// Two tokens as a registration stores them in one word, the first in the low half (an odd
/// block's last token has a word of its own).
fn token_pair(pair: &[Token]) -> u64 {
    u64::from(pair[0]) | u64::from(pair[1]) << 32
}

/// Writes a block's `tokens` into its registration's `stored` words ([`token_pair`]).
fn store_tokens(stored: &[AtomicU64], tokens: &[Token]) {
    let pairs = tokens.chunks_exact(2);
    for (slot, pair) in stored.iter().zip(pairs.clone()) {
        slot.store(token_pair(pair), Ordering::Relaxed);
    }
    if let [last] = pairs.remainder() {
        stored[tokens.len() / 2].store(u64::from(*last), Ordering::Relaxed);
    }
}

/// Runs `hash` on `head` followed by `tokens` as little-endian bytes: the one packing of a
/// block's tokens for both of its hashes.
fn with_bytes<R>(head: &[u8], tokens: &[Token], hash: impl FnOnce(&[u8]) -> R) -> R {
    let len = head.len() + 4 * tokens.len();
    let mut stack = [0u8; STACK_BYTES];
    let mut heap = Vec::new();
    let bytes = if len <= STACK_BYTES {
        &mut stack[..len]
    } else {
        heap.resize(len, 0);
        &mut heap[..]
    };
    let (start, rest) = bytes.split_at_mut(head.len());
    start.copy_from_slice(head);
    for (dst, t) in rest.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    hash(bytes)
}

/// The map key before block 0: the second half of the BLAKE3 root, so it binds the key and the
/// salt and is never a published hash.
pub(crate) fn root_key(root: &Chain) -> MapKey {
    u128::from_le_bytes(root[16..].try_into().expect("16 bytes"))
}

/// A prompt hashed for admission: the map keys of its full blocks, the hits they verify, and
/// the BLAKE3 chaining values the sequence will publish. Built before any lock is taken; a
/// retry after a lost race reuses it (see [`PromptHashes::find_hits`]).
pub(crate) struct PromptHashes {
    pub(crate) root: Chain,
    /// Map key of every full block.
    pub(crate) keys: Vec<MapKey>,
    /// Chaining value of every full block: read from the hit blocks (valid once they are
    /// acquired in the state they were verified in), then computed for the rest.
    pub(crate) chains: Vec<Chain>,
    /// Verified hits, with the state each was verified in (for `acquire_hits`).
    pub(crate) hits: Vec<(BlockId, BlockState)>,
    /// The extra keys' digest of every full block (empty when the prompt has none).
    digests: Vec<Option<Digest>>,
    /// Hits with refcount 0 (CACHED): taking them uses up an available block.
    pub(crate) cached_hits: usize,
    /// The logical block the hits start at (0 but for windowed attention).
    pub(crate) first: usize,
    /// Whether the chaining values are computed (group 0, or any with the block feed) or left
    /// [`UNPUBLISHED`].
    publishes: bool,
    /// `chains[computed_from..]` were computed, starting from `chains[computed_from - 1]` as
    /// it was then (the root when 0).
    computed_from: usize,
    base: Chain,
}

impl PromptHashes {
    /// Walks the prefix map to the first miss among the first `hittable` blocks, reading each
    /// hit's chaining value, then computes the chaining values after the hits unless a
    /// previous walk already did from the same starting point. Read-only on the cache.
    pub(crate) fn find_hits(
        &mut self,
        prefix: &PrefixCache,
        pool: &BlockPool,
        tokens: &[Token],
        hittable: usize,
    ) {
        self.hits.clear();
        self.cached_hits = 0;
        self.first = 0;
        let bs = prefix.block_size;
        let mut parent = root_key(&self.root);
        for (i, &key) in self.keys.iter().enumerate().take(hittable) {
            let block_tokens = &tokens[i * bs..(i + 1) * bs];
            let link = prefix.link(parent, self.digest(i));
            let Some((block, state)) = prefix.find(pool, key, link, block_tokens) else {
                break;
            };
            self.cached_hits += usize::from(state.refcount() == 0);
            self.hits.push((block, state));
            // Read after `find`'s acquire load of the state, like the verified tokens: if
            // `acquire_hits` later succeeds with that state, this is the hit's own chain.
            self.chains[i] = prefix.chain_of(block);
            parent = key;
        }
        self.chain_from(prefix, tokens, self.hits.len());
    }

    /// For windowed attention: the longest hit of at most `upto` blocks whose blocks
    /// `first(k)..k`, those a query at the hit point reads, are all cached. Hits go from block
    /// `self.first`, and every chaining value is computed (the blocks before the hit need
    /// not be cached). Returns the hit's length in blocks. Read-only on the cache.
    pub(crate) fn find_window_hits(
        &mut self,
        prefix: &PrefixCache,
        pool: &BlockPool,
        tokens: &[Token],
        upto: usize,
        first: impl Fn(usize) -> usize,
    ) -> usize {
        let bs = prefix.block_size;
        let mut found: Vec<Option<Option<(BlockId, BlockState)>>> = vec![None; upto];
        let (root, keys, digests) = (root_key(&self.root), &self.keys, &self.digests);
        let mut probe = |i: usize| {
            *found[i].get_or_insert_with(|| {
                let parent = if i == 0 { root } else { keys[i - 1] };
                let digest = digests.get(i).and_then(Option::as_ref);
                let link = prefix.link(parent, digest);
                prefix.find(pool, keys[i], link, &tokens[i * bs..(i + 1) * bs])
            })
        };
        let mut k = upto;
        while let Some(miss) = (first(k)..k).rev().find(|&i| probe(i).is_none()) {
            k = miss;
        }
        let start = if k == 0 { 0 } else { first(k) };
        let hits: Vec<_> = (start..k)
            .map(|i| probe(i).expect("verified above"))
            .collect();
        self.first = start;
        self.hits = hits;
        self.cached_hits = (self.hits.iter())
            .filter(|(_, state)| state.refcount() == 0)
            .count();
        self.chain_from(prefix, tokens, 0);
        k
    }

    /// Computes the chaining values of blocks `from..`, unless a previous walk already did from
    /// the same starting point.
    fn chain_from(&mut self, prefix: &PrefixCache, tokens: &[Token], from: usize) {
        if !self.publishes {
            self.chains[from..].fill(UNPUBLISHED);
            return;
        }
        let base = if from == 0 {
            self.root
        } else {
            self.chains[from - 1]
        };
        if from == self.computed_from && base == self.base {
            return;
        }
        let mut chain = base;
        for (i, block_tokens) in tokens
            .chunks_exact(prefix.block_size)
            .enumerate()
            .skip(from)
        {
            chain = prefix.hash_block(&chain, block_tokens, self.digest(i));
            self.chains[i] = chain;
        }
        self.computed_from = from;
        self.base = base;
    }

    fn digest(&self, i: usize) -> Option<&Digest> {
        self.digests.get(i).and_then(Option::as_ref)
    }
}

impl PrefixCache {
    /// An empty cache for `num_blocks` blocks of `block_size` tokens, or the allocation that
    /// failed.
    pub(crate) fn new(
        key: [u8; 32],
        num_blocks: u32,
        block_size: u32,
    ) -> Result<PrefixCache, TooLarge> {
        let stride = TOKENS + (block_size as usize).div_ceil(2);
        let words = try_boxed(num_blocks as usize * stride, |_| AtomicU64::new(0))?;
        let mut secret = [0u8; SECRET];
        blake3::Hasher::new_keyed(&key)
            .update(b"pagedkv/map-secret")
            .finalize_xof()
            .fill(&mut secret);
        Ok(PrefixCache {
            key,
            secret,
            unsalted_root: root_of(&key, None, None),
            block_size: block_size as usize,
            map: PrefixMap::new(num_blocks)?,
            words,
            stride,
        })
    }

    /// The chaining value before a sequence's first block in `group`: binds the key, the tenant
    /// salt, the LoRA adapter and, past group 0, the group (whose blocks hold other layers' KV).
    pub(crate) fn root(&self, keys: &HashKeys<'_>, group: u8) -> Chain {
        let root = match (keys.salt, keys.lora_name) {
            (None, None) => self.unsalted_root,
            (salt, lora) => root_of(&self.key, salt, lora),
        };
        match group {
            0 => root,
            _ => *blake3::keyed_hash(&root, &[b'g', group]).as_bytes(),
        }
    }

    /// What a block's map key and registration name as its parent: the parent's key, or with
    /// extra keys a keyed hash of it and their digest.
    pub(crate) fn link(&self, parent: MapKey, digest: Option<&Digest>) -> MapKey {
        let Some(digest) = digest else {
            return parent;
        };
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        hasher.update(b"pagedkv/link");
        hasher.update(&parent.to_le_bytes()).update(digest);
        let out = hasher.finalize();
        u128::from_le_bytes(out.as_bytes()[..16].try_into().expect("16 bytes"))
    }

    /// A public 64-bit fingerprint of the key: equal for managers that hash alike, and reveals
    /// nothing about the key itself (it is a keyed hash of a constant).
    pub(crate) fn fingerprint(&self) -> u64 {
        let digest = blake3::keyed_hash(&self.key, b"pagedkv/fingerprint");
        u64::from_le_bytes(digest.as_bytes()[..8].try_into().expect("8 bytes"))
    }

    /// The BLAKE3 chaining value of one full block after `parent`, with its extra keys' digest.
    pub(crate) fn hash_block(
        &self,
        parent: &Chain,
        tokens: &[Token],
        digest: Option<&Digest>,
    ) -> Chain {
        with_bytes(digest.map_or(&[][..], |d| &d[..]), tokens, |bytes| {
            *blake3::keyed_hash(parent, bytes).as_bytes()
        })
    }

    /// The map key of one full block after the block keyed `parent`.
    pub(crate) fn key_block(&self, parent: MapKey, tokens: &[Token]) -> MapKey {
        with_bytes(&parent.to_le_bytes(), tokens, |bytes| {
            xxh3_128_with_secret(bytes, &self.secret)
        })
    }

    /// Hashes a prompt for admission: the root and every full block's map key, no lookup yet
    /// (see [`PromptHashes::find_hits`]); the walk computes the chaining values if
    /// `publishes`. Takes no lock; the vectors become the admitted sequence's.
    pub(crate) fn hash_prompt(
        &self,
        tokens: &[Token],
        with: &HashKeys<'_>,
        group: u8,
        publishes: bool,
    ) -> PromptHashes {
        let root = self.root(with, group);
        let full = tokens.len() / self.block_size;
        let digests: Vec<Option<Digest>> = match with.extra_keys {
            [] => Vec::new(),
            spans => (0..full)
                .map(|i| digest_of(spans, i, self.block_size))
                .collect(),
        };
        let mut keys = Vec::with_capacity(full);
        let mut key = root_key(&root);
        for (i, block_tokens) in tokens.chunks_exact(self.block_size).enumerate() {
            let digest = digests.get(i).and_then(Option::as_ref);
            key = self.key_block(self.link(key, digest), block_tokens);
            keys.push(key);
        }
        let mut chains = Vec::with_capacity(full);
        chains.resize(full, UNPUBLISHED);
        PromptHashes {
            root,
            keys,
            chains,
            hits: Vec::new(),
            digests,
            cached_hits: 0,
            first: 0,
            publishes,
            computed_from: usize::MAX,
            base: [0; 32],
        }
    }

    /// The verified hits among the first `hittable` full blocks of a prompt, up to the first
    /// miss, and how many of them are CACHED; hashes only the blocks it walks. Read-only.
    pub(crate) fn count_hits(
        &self,
        pool: &BlockPool,
        tokens: &[Token],
        with: &HashKeys<'_>,
        group: u8,
        hittable: usize,
    ) -> (usize, usize) {
        let (mut hits, mut cached) = (0, 0);
        let mut parent = root_key(&self.root(with, group));
        for (i, block_tokens) in tokens.chunks_exact(self.block_size).enumerate() {
            if i == hittable {
                break;
            }
            let link = self.link(
                parent,
                digest_of(with.extra_keys, i, self.block_size).as_ref(),
            );
            let key = self.key_block(link, block_tokens);
            let Some((_, state)) = self.find(pool, key, link, block_tokens) else {
                break;
            };
            hits += 1;
            cached += usize::from(state.refcount() == 0);
            parent = key;
        }
        (hits, cached)
    }

    /// The block registered under `key`, if any (unverified: see [`PrefixCache::matches`]).
    pub(crate) fn get(&self, key: MapKey) -> Option<BlockId> {
        self.map.lock(key).get(key, |block| self.key_of(block))
    }

    /// The block of `pool` registered with exactly this content, with the state it was verified
    /// in. Read-only and unguarded: the block may be evicted and reused the moment after, so a
    /// caller must take it with `pool.acquire_hits`, which succeeds only while the block is
    /// still that incarnation. (The state's acquire load makes that incarnation's registration
    /// visible; contents read from a later one imply a generation `acquire_hits` rejects.
    /// Model-checked below.)
    pub(crate) fn find(
        &self,
        pool: &BlockPool,
        key: MapKey,
        parent: MapKey,
        tokens: &[Token],
    ) -> Option<(BlockId, BlockState)> {
        // A hashed block registered under `key` is the one the map holds for it (a block is
        // hashed exactly while mapped), so a verified lock-free probe is the map's answer; a
        // lock-free miss is confirmed under the lock.
        let probed = self.map.probe(key);
        if let Some(hit) = probed.and_then(|block| self.verify(pool, block, key, parent, tokens)) {
            return Some(hit);
        }
        self.find_locked(pool, key, parent, tokens)
    }

    /// [`PrefixCache::find`] under the lock of `key`'s region, after a lock-free miss.
    fn find_locked(
        &self,
        pool: &BlockPool,
        key: MapKey,
        parent: MapKey,
        tokens: &[Token],
    ) -> Option<(BlockId, BlockState)> {
        self.verify(pool, self.get(key)?, key, parent, tokens)
    }

    /// `block` with the state it was verified in, if it is hashed with exactly this content.
    fn verify(
        &self,
        pool: &BlockPool,
        block: BlockId,
        key: MapKey,
        parent: MapKey,
        tokens: &[Token],
    ) -> Option<(BlockId, BlockState)> {
        let state = pool.state(block);
        (state.hashed() && self.matches(block, key, parent, tokens)).then_some((block, state))
    }

    /// `block`'s registration: its key, parent key and chain (the first line), and its tokens.
    fn registration(&self, block: BlockId) -> (&[AtomicU64; TOKENS], &[AtomicU64]) {
        let start = block as usize * self.stride;
        let (head, tokens) = self.words[start..start + self.stride].split_at(TOKENS);
        (head.try_into().expect("a line"), tokens)
    }

    /// Whether `block`'s registered contents are exactly `(key, parent, tokens)`.
    pub(crate) fn matches(
        &self,
        block: BlockId,
        key: MapKey,
        parent: MapKey,
        tokens: &[Token],
    ) -> bool {
        let (head, stored) = self.registration(block);
        let load = |i: usize| head[i].load(Ordering::Relaxed);
        if join(load(KEY), load(KEY + 1)) != key || join(load(PARENT), load(PARENT + 1)) != parent {
            return false;
        }
        let pairs = tokens.chunks_exact(2);
        let mut differ = 0;
        for (s, pair) in stored.iter().zip(pairs.clone()) {
            differ |= s.load(Ordering::Relaxed) ^ token_pair(pair);
        }
        if let [last] = pairs.remainder() {
            differ |= stored[tokens.len() / 2].load(Ordering::Relaxed) ^ u64::from(*last);
        }
        differ == 0
    }

    /// The map key `block` was registered under.
    pub(crate) fn key_of(&self, block: BlockId) -> MapKey {
        let (head, _) = self.registration(block);
        join(
            head[KEY].load(Ordering::Relaxed),
            head[KEY + 1].load(Ordering::Relaxed),
        )
    }

    /// The BLAKE3 chaining value `block` was registered with.
    pub(crate) fn chain_of(&self, block: BlockId) -> Chain {
        let mut chain = [0u8; 32];
        let (head, _) = self.registration(block);
        for (dst, word) in chain.chunks_exact_mut(8).zip(&head[CHAIN..]) {
            dst.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        chain
    }

    /// The group that registered `block`.
    pub(crate) fn group_of(&self, block: BlockId) -> u8 {
        let (head, _) = self.registration(block);
        head[GROUP].load(Ordering::Relaxed) as u8
    }

    /// The (published) hash `block` was registered with.
    pub(crate) fn hash_of(&self, block: BlockId) -> BlockHash {
        block_hash_of(&self.chain_of(block))
    }

    /// Registers `block` (held by the caller, full) under `key` if `linked` (its parent is
    /// registered, checked under the region's lock so a reset is ordered with it) and the key
    /// is not mapped yet (nor, against all odds for keyed hashes, its region of the map full);
    /// then `publish` (flag the block, record the event) runs under the lock once the contents
    /// are written, so a reset or an eviction of the same key is ordered with it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn register(
        &self,
        block: BlockId,
        key: MapKey,
        parent: MapKey,
        chain: &Chain,
        tokens: &[Token],
        group: u8,
        linked: impl FnOnce() -> bool,
        publish: impl FnOnce(),
    ) {
        let mut region = self.map.lock(key);
        if !linked() {
            return;
        }
        let Some(vacancy) = region.vacancy(key, |block| self.key_of(block)) else {
            return;
        };
        let (head, stored) = self.registration(block);
        let [key_lo, key_hi] = split(key);
        let [parent_lo, parent_hi] = split(parent);
        let chain = chain
            .chunks_exact(8)
            .map(|word| u64::from_le_bytes(word.try_into().expect("8 bytes")));
        let values = [key_lo, key_hi, parent_lo, parent_hi]
            .into_iter()
            .chain(chain)
            .chain([u64::from(group)]);
        for (slot, value) in head.iter().zip(values) {
            slot.store(value, Ordering::Relaxed);
        }
        store_tokens(stored, tokens);
        publish();
        region.fill(vacancy, block);
    }

    /// Removes `block`'s registration if its key still maps to it (an evicted block), running
    /// `removed` under the region's lock if it did.
    pub(crate) fn unregister(&self, block: BlockId, removed: impl FnOnce()) {
        let key = self.key_of(block);
        let mut region = self.map.lock(key);
        if region.remove(key, block) {
            removed();
        }
    }

    /// The published hash of every block `group` registered (each region read under its lock,
    /// one after another: a block mapped there cannot be unregistered, so its registration is
    /// stable).
    pub(crate) fn hashes(&self, group: u8) -> Vec<BlockHash> {
        self.map
            .regions()
            .flat_map(|region| {
                let hashes: Vec<_> = (region.blocks())
                    .filter(|&b| self.group_of(b) == group)
                    .map(|b| self.hash_of(b))
                    .collect();
                hashes
            })
            .collect()
    }

    /// Locks the whole map (region by region, in order), for a reset or an audit.
    pub(crate) fn lock_all(&self) -> Vec<Region<'_>> {
        self.map.lock_all()
    }
}

/// `BLAKE3_keyed(key, "pagedkv/root" || salt || lora)`, with the salt's presence and length
/// bound in, then (only if there is one) the LoRA adapter's length and name.
fn root_of(key: &[u8; 32], salt: Option<&[u8]>, lora: Option<&str>) -> Chain {
    let mut hasher = blake3::Hasher::new_keyed(key);
    hasher.update(b"pagedkv/root");
    match salt {
        None => hasher.update(&[0]),
        Some(salt) => hasher
            .update(&[1])
            .update(&(salt.len() as u64).to_le_bytes())
            .update(salt),
    };
    if let Some(lora) = lora {
        hasher
            .update(&(lora.len() as u64).to_le_bytes())
            .update(lora.as_bytes());
    }
    *hasher.finalize().as_bytes()
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, loom))]
mod loom_tests;
