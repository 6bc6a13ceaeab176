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
//! A prompt is hashed before its admission takes any lock ([`PromptHashes`]), and a retry after
//! a lost race reuses its map keys.

use xxhash_rust::xxh3::{xxh3_128_with_secret, Xxh3};

use crate::block::BlockState;
use crate::bookkeeping::{try_boxed, TooLarge};
use crate::pool::BlockPool;
use crate::prefix_map::{PrefixMap, Region};
use crate::sequence::room_for;
use crate::sync::{prefetch_write, AtomicU64, Ordering};
use crate::{BlockId, Token};

/// A 128-bit block hash: the first half of the block's BLAKE3 chaining value.
pub type BlockHash = u128;

/// The full 256-bit BLAKE3 chaining value of a prefix (keys the next block's hash).
pub(crate) type Chain = [u8; 32];

/// A block's key in the prefix map (never leaves the process).
pub(crate) type MapKey = u128;

/// The block hash of a chaining value.
pub(crate) fn block_hash_of(chain: &Chain) -> BlockHash {
    let bytes: [u8; 16] = chain[..16].try_into().expect("16 bytes");
    u128::from_le_bytes(bytes)
}

/// XXH3's default secret size (at least 136 bytes).
const SECRET: usize = 192;

/// Tokens a map key hashes from a stack buffer; longer blocks stream. Blocks of up to
/// `SHORT_TOKENS` (the usual sizes) use a smaller buffer.
const INLINE_TOKENS: usize = 64;
const SHORT_TOKENS: usize = 16;

/// Words of a block's registration: what a lookup verifies (`[key_lo, key_hi, parent_key_lo,
/// parent_key_hi]`), then the BLAKE3 chaining value a hit reads next (one cache line), then the
/// block's tokens, two to a word (the first in the low half), in whole lines.
const KEY: usize = 0;
const PARENT: usize = 2;
const CHAIN: usize = 4;
const TOKENS: usize = 8;

/// Words in a cache line, and in the two-line unit a core's adjacent-line prefetcher fetches.
const LINE_WORDS: usize = 8;
const PAIR_WORDS: usize = 16;

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
    /// Per block, `stride` words from `first + block * stride`: its registration. Block 0
    /// starts a 128-byte unit, so a 16-token block's registration (key, chain and tokens) is
    /// one unit, whose two lines a registration writes and a hit reads together.
    words: Box<[AtomicU64]>,
    stride: usize,
    first: usize,
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

/// Writes a block's `tokens` into its registration's `stored` words ([`token_pair`]); a block
/// of the usual 16 tokens in eight stores, without a loop.
#[inline(always)]
fn store_tokens(stored: &[AtomicU64], tokens: &[Token]) {
    let store = |stored: &[AtomicU64], tokens: &[Token]| {
        let pairs = tokens.chunks_exact(2);
        for (slot, pair) in stored.iter().zip(pairs.clone()) {
            slot.store(token_pair(pair), Ordering::Relaxed);
        }
        if let [last] = pairs.remainder() {
            stored[tokens.len() / 2].store(u64::from(*last), Ordering::Relaxed);
        }
    };
    match (stored.first_chunk::<8>(), tokens.first_chunk::<16>()) {
        (Some(words), Some(sixteen)) if tokens.len() == 16 => store(words, sixteen),
        _ => store(stored, tokens),
    }
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
    /// Hits with refcount 0 (CACHED): taking them uses up an available block.
    pub(crate) cached_hits: usize,
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
        let bs = prefix.block_size;
        let mut parent = root_key(&self.root);
        for (i, &key) in self.keys.iter().enumerate().take(hittable) {
            let block_tokens = &tokens[i * bs..(i + 1) * bs];
            let Some((block, state)) = prefix.find(pool, key, parent, block_tokens) else {
                break;
            };
            self.cached_hits += usize::from(state.refcount() == 0);
            self.hits.push((block, state));
            // Read after `find`'s acquire load of the state, like the verified tokens: if
            // `acquire_hits` later succeeds with that state, this is the hit's own chain.
            self.chains[i] = prefix.chain_of(block);
            parent = key;
        }
        let from = self.hits.len();
        let base = if from == 0 {
            self.root
        } else {
            self.chains[from - 1]
        };
        if from == self.computed_from && base == self.base {
            return;
        }
        let mut chain = base;
        for (i, block_tokens) in tokens.chunks_exact(bs).enumerate().skip(from) {
            chain = prefix.hash_block(&chain, block_tokens);
            self.chains[i] = chain;
        }
        self.computed_from = from;
        self.base = base;
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
        let n = num_blocks as usize;
        let token_words = (block_size as usize).div_ceil(2);
        let stride = TOKENS + token_words.next_multiple_of(LINE_WORDS);
        let words = try_boxed(n * stride + PAIR_WORDS - 1, |_| AtomicU64::new(0))?;
        let word = std::mem::size_of::<AtomicU64>();
        let unit = PAIR_WORDS * word;
        let first = (unit - words.as_ptr() as usize % unit) % unit / word;
        let mut secret = [0u8; SECRET];
        blake3::Hasher::new_keyed(&key)
            .update(b"pagedkv/map-secret")
            .finalize_xof()
            .fill(&mut secret);
        Ok(PrefixCache {
            key,
            secret,
            unsalted_root: root_of(&key, None),
            block_size: block_size as usize,
            map: PrefixMap::new(num_blocks)?,
            words,
            stride,
            first,
        })
    }

    /// The chaining value before a sequence's first block: binds the key and the tenant salt.
    pub(crate) fn root(&self, salt: Option<&[u8]>) -> Chain {
        match salt {
            None => self.unsalted_root,
            Some(_) => root_of(&self.key, salt),
        }
    }

    /// A public 64-bit fingerprint of the key: equal for managers that hash alike, and reveals
    /// nothing about the key itself (it is a keyed hash of a constant).
    pub(crate) fn fingerprint(&self) -> u64 {
        let digest = blake3::keyed_hash(&self.key, b"pagedkv/fingerprint");
        u64::from_le_bytes(digest.as_bytes()[..8].try_into().expect("8 bytes"))
    }

    /// The BLAKE3 chaining value of one full block after `parent`.
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

    /// The map key of one full block after the block keyed `parent`.
    pub(crate) fn key_block(&self, parent: MapKey, tokens: &[Token]) -> MapKey {
        const SHORT: usize = 16 + 4 * SHORT_TOKENS;
        const INLINE: usize = 16 + 4 * INLINE_TOKENS;
        match tokens.len() {
            // The usual size, its length known to the copy and the hash: no loop, no dispatch.
            SHORT_TOKENS => self.key_inline::<SHORT>(parent, tokens),
            len if len < SHORT_TOKENS => self.key_inline::<SHORT>(parent, tokens),
            len if len <= INLINE_TOKENS => self.key_inline::<INLINE>(parent, tokens),
            _ => self.key_streamed(parent, tokens),
        }
    }

    /// [`PrefixCache::key_block`] of a long block, streamed.
    #[inline(never)]
    fn key_streamed(&self, parent: MapKey, tokens: &[Token]) -> MapKey {
        let mut buf = [0u8; 4 * INLINE_TOKENS];
        let mut hasher = Xxh3::with_secret(self.secret);
        hasher.update(&parent.to_le_bytes());
        for chunk in tokens.chunks(INLINE_TOKENS) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            hasher.update(&buf[..4 * chunk.len()]);
        }
        hasher.digest128()
    }

    /// [`PrefixCache::key_block`] hashed from a stack buffer of `N` bytes (which holds the
    /// parent key and the tokens): sized for the block, so it costs no more to clear than it
    /// holds.
    #[inline(always)]
    fn key_inline<const N: usize>(&self, parent: MapKey, tokens: &[Token]) -> MapKey {
        let mut buf = [0u8; N];
        buf[..16].copy_from_slice(&parent.to_le_bytes());
        let len = 16 + 4 * tokens.len();
        for (dst, t) in buf[16..len].chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_128_with_secret(&buf[..len], &self.secret)
    }

    /// Hashes a prompt for admission: the root and every full block's map key, no lookup yet
    /// (see [`PromptHashes::find_hits`]). Takes no lock. The vectors become the admitted
    /// sequence's, so they have room for the blocks it decodes ([`room_for`]).
    pub(crate) fn hash_prompt(&self, tokens: &[Token], salt: Option<&[u8]>) -> PromptHashes {
        let root = self.root(salt);
        let full = tokens.len() / self.block_size;
        let mut keys = Vec::with_capacity(room_for(full));
        let mut key = root_key(&root);
        for block_tokens in tokens.chunks_exact(self.block_size) {
            key = self.key_block(key, block_tokens);
            keys.push(key);
        }
        let mut chains = Vec::with_capacity(room_for(full));
        chains.resize(full, [0; 32]);
        PromptHashes {
            root,
            keys,
            chains,
            hits: Vec::new(),
            cached_hits: 0,
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
        salt: Option<&[u8]>,
        hittable: usize,
    ) -> (usize, usize) {
        let (mut hits, mut cached) = (0, 0);
        let mut parent = root_key(&self.root(salt));
        for block_tokens in tokens.chunks_exact(self.block_size).take(hittable) {
            let key = self.key_block(parent, block_tokens);
            let Some((_, state)) = self.find(pool, key, parent, block_tokens) else {
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
    #[inline]
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
    #[cold]
    #[inline(never)]
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
    #[inline(always)]
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
        let start = self.registration_start(block);
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

    /// Starts fetching the lines a registration of `block` under `key` writes.
    #[inline]
    pub(crate) fn prefetch_registration(&self, block: BlockId, key: MapKey) {
        self.map.prefetch(key);
        prefetch_write(self.registration_at(block));
        self.prefetch_stored_tokens(block);
    }

    /// Starts fetching the lines of `block`'s registration that hold its tokens.
    #[inline]
    pub(crate) fn prefetch_stored_tokens(&self, block: BlockId) {
        let start = self.registration_at(block);
        for line in TOKENS / LINE_WORDS..self.stride / LINE_WORDS {
            prefetch_write(start.wrapping_add(line * LINE_WORDS));
        }
    }

    /// Starts fetching the registration an eviction of `block` reads.
    pub(crate) fn prefetch_key(&self, block: BlockId) {
        prefetch_write(self.registration_at(block));
    }

    /// Where `block`'s registration starts, for a prefetch: computed, not bounds checked (the
    /// hint reads nothing).
    fn registration_at(&self, block: BlockId) -> *const AtomicU64 {
        self.words
            .as_ptr()
            .wrapping_add(self.registration_start(block))
    }

    /// The index in `words` of `block`'s registration's first word.
    fn registration_start(&self, block: BlockId) -> usize {
        self.first + block as usize * self.stride
    }

    /// Starts fetching the map slot an eviction of `block` probes first (reads its key).
    pub(crate) fn prefetch_slot(&self, block: BlockId) {
        self.map.prefetch(self.key_of(block));
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

    /// The (published) hash `block` was registered with.
    pub(crate) fn hash_of(&self, block: BlockId) -> BlockHash {
        block_hash_of(&self.chain_of(block))
    }

    /// Registers `block` (held by the caller, full) under `key` unless the key is already
    /// mapped (or, against all odds for keyed hashes, its region of the map is full); then
    /// `publish` (flag the block, record the event) runs under the region's lock once the
    /// contents are written, so a reset or an eviction of the same key is ordered with it.
    #[inline]
    pub(crate) fn register(
        &self,
        block: BlockId,
        key: MapKey,
        parent: MapKey,
        chain: &Chain,
        tokens: &[Token],
        publish: impl FnOnce(),
    ) {
        let mut region = self.map.lock(key);
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
            .chain(chain);
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

    /// The published hash of every registered block (each region read under its lock, one after
    /// another: a block mapped there cannot be unregistered, so its registration is stable).
    pub(crate) fn hashes(&self) -> Vec<BlockHash> {
        self.map
            .regions()
            .flat_map(|region| {
                let hashes: Vec<_> = region.blocks().map(|b| self.hash_of(b)).collect();
                hashes
            })
            .collect()
    }

    /// Locks the whole map (region by region, in order), for a reset or an audit.
    pub(crate) fn lock_all(&self) -> Vec<Region<'_>> {
        self.map.lock_all()
    }
}

/// `BLAKE3_keyed(key, "pagedkv/root" || salt)`, with the salt's presence and length bound in.
fn root_of(key: &[u8; 32], salt: Option<&[u8]>) -> Chain {
    let mut hasher = blake3::Hasher::new_keyed(key);
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
    fn map_keys_chain_and_depend_on_key_and_salt() {
        let a = PrefixCache::new([1; 32], 4, 4).unwrap();
        let b = PrefixCache::new([2; 32], 4, 4).unwrap();
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        let keys = |c: &PrefixCache, salt: Option<&[u8]>| c.hash_prompt(&tokens, salt).keys;
        let k = keys(&a, None);
        assert_eq!(k.len(), 2);
        assert_eq!(k, keys(&a, None));
        assert_eq!(k[0], a.key_block(root_key(&a.root(None)), &tokens[..4]));
        assert_eq!(k[1], a.key_block(k[0], &tokens[4..]));
        assert_ne!(k[0], a.key_block(root_key(&a.root(None)), &tokens[4..]));
        assert_ne!(k, keys(&a, Some(b"tenant")));
        assert_ne!(k, keys(&b, None));
    }

    #[test]
    fn long_blocks_hash_all_tokens() {
        let c = PrefixCache::new([0; 32], 1, 200).unwrap();
        let tokens: Vec<u32> = (0..200).collect();
        let mut other = tokens.clone();
        other[199] = 7;
        let root = c.root(None);
        assert_ne!(c.hash_block(&root, &tokens), c.hash_block(&root, &other));
        assert_ne!(c.key_block(0, &tokens), c.key_block(0, &other));
    }

    /// Every path of `key_block` (short, the usual 16 tokens, a buffer, streamed) is XXH3 of
    /// the parent key and the tokens, so the key is one function of them.
    #[test]
    fn map_keys_are_one_function_of_parent_and_tokens() {
        let c = PrefixCache::new([0; 32], 1, 200).unwrap();
        let parent: MapKey = 0x0123_4567_89ab_cdef << 60 | 42;
        for len in [1, 15, 16, 17, 64, 65, 200] {
            let tokens: Vec<Token> = (0..len).map(|t| t * 31 + 5).collect();
            let mut bytes = parent.to_le_bytes().to_vec();
            bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
            let expected = xxh3_128_with_secret(&bytes, &c.secret);
            assert_eq!(c.key_block(parent, &tokens), expected, "{len} tokens");
        }
    }

    /// A registration stores every token of its block (the usual 16 without a loop, any other
    /// size pairwise): each one verifies, and changing any one fails.
    #[test]
    fn registrations_store_every_token() {
        for bs in [1, 3, 15, 16, 17, 32] {
            let c = PrefixCache::new([0; 32], 2, bs).unwrap();
            let tokens: Vec<Token> = (0..bs as Token).map(|t| t * 7 + 1).collect();
            let chain = c.hash_block(&c.root(None), &tokens);
            let k = c.key_block(root_key(&c.root(None)), &tokens);
            c.register(1, k, 5, &chain, &tokens, || {});
            assert!(c.matches(1, k, 5, &tokens), "{bs} tokens");
            for i in 0..tokens.len() {
                let mut other = tokens.clone();
                other[i] += 1;
                assert!(
                    !c.matches(1, k, 5, &other),
                    "{bs} tokens, token {i} changed"
                );
            }
        }
    }

    #[test]
    fn register_verify_unregister() {
        let c = PrefixCache::new([0; 32], 2, 2).unwrap();
        let chain = c.hash_block(&c.root(None), &[1, 2]);
        let k = c.key_block(root_key(&c.root(None)), &[1, 2]);
        c.register(1, k, 5, &chain, &[1, 2], || {});
        c.register(0, k, 5, &chain, &[1, 2], || panic!("already mapped"));
        assert_eq!(c.get(k), Some(1));
        assert_eq!((c.key_of(1), c.chain_of(1)), (k, chain));
        assert_eq!(c.hash_of(1), block_hash_of(&chain));
        assert_eq!(c.hashes(), vec![block_hash_of(&chain)]);
        assert!(c.matches(1, k, 5, &[1, 2]));
        assert!(!c.matches(1, k, 6, &[1, 2]));
        assert!(!c.matches(1, k, 5, &[1, 3]));
        c.unregister(0, || panic!("not mapped to 0"));
        assert_eq!(c.get(k), Some(1));
        let mut removed = false;
        c.unregister(1, || removed = true);
        assert!(removed);
        assert_eq!(c.get(k), None);
    }

    /// Tokens are stored two to a word: an odd block's last token has a word of its own, and
    /// every token is verified, in blocks spanning several lines.
    #[test]
    fn every_token_of_odd_and_long_blocks_is_verified() {
        for bs in [1, 3, 17, 33] {
            let c = PrefixCache::new([0; 32], 3, bs).unwrap();
            let tokens: Vec<Token> = (0..bs).map(|t| t * 7 + 1).collect();
            let k = c.key_block(0, &tokens);
            c.register(2, k, 0, &[0; 32], &tokens, || {});
            assert!(c.matches(2, k, 0, &tokens));
            for i in 0..tokens.len() {
                let mut other = tokens.clone();
                other[i] += 1;
                assert!(!c.matches(2, k, 0, &other), "block size {bs}, token {i}");
            }
            assert_eq!(c.key_of(1), 0, "a neighbour's registration is untouched");
        }
    }

    /// A prompt whose first block is registered: the walk reads the hit's chain, computes the
    /// rest once, and a second walk that finds the same hits recomputes nothing.
    #[test]
    fn prompt_hashes_read_hits_and_compute_the_rest_once() {
        let pool = BlockPool::new(2).unwrap();
        let c = PrefixCache::new([3; 32], 2, 2).unwrap();
        let tokens = [1, 2, 3, 4, 5];
        let root = c.root(None);
        let chains = [
            c.hash_block(&root, &tokens[..2]),
            c.hash_block(&c.hash_block(&root, &tokens[..2]), &tokens[2..4]),
        ];
        let mut prompt = c.hash_prompt(&tokens, None);
        prompt.find_hits(&c, &pool, &tokens, 2);
        assert!(prompt.hits.is_empty());
        assert_eq!(prompt.chains, chains);
        assert_eq!(prompt.computed_from, 0);

        let block = pool.allocate().unwrap();
        let parent = root_key(&root);
        c.register(
            block,
            prompt.keys[0],
            parent,
            &chains[0],
            &tokens[..2],
            || pool.mark_hashed(block),
        );
        prompt.find_hits(&c, &pool, &tokens, 2);
        assert_eq!(prompt.hits.len(), 1);
        assert_eq!((prompt.hits[0].0, prompt.cached_hits), (block, 0));
        assert_eq!(prompt.chains, chains);
        assert_eq!(prompt.computed_from, 1);
        prompt.chains[1] = [9; 32]; // would be recomputed if the walk started elsewhere
        prompt.find_hits(&c, &pool, &tokens, 2);
        assert_eq!(prompt.chains[1], [9; 32]);
        assert_eq!(c.count_hits(&pool, &tokens, None, 2), (1, 0));
        assert_eq!(c.count_hits(&pool, &tokens, None, 0), (0, 0));
        assert_eq!(c.count_hits(&pool, &tokens, Some(b"s"), 2), (0, 0));
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::pool::Hit;
    use loom::sync::Arc;

    /// Two keys of one region; a lookup's lock-free probe takes no lock, so only the block's
    /// state word orders the threads.
    const OLD: MapKey = 1 << 64;
    const NEW: MapKey = 2 << 64;
    const OLD_TOKENS: [Token; 2] = [1, 1];
    const NEW_TOKENS: [Token; 2] = [2, 2];
    const OLD_CHAIN: Chain = [1; 32];
    const NEW_CHAIN: Chain = [2; 32];

    /// A one-block pool whose block is CACHED, registered as `OLD`.
    fn one_cached_block() -> (BlockPool, PrefixCache) {
        let pool = BlockPool::new(1).unwrap();
        let prefix = PrefixCache::new([0; 32], 1, 2).unwrap();
        let block = pool.allocate().unwrap();
        prefix.register(block, OLD, 0, &OLD_CHAIN, &OLD_TOKENS, || {
            pool.mark_hashed(block)
        });
        pool.release_block(block, 0);
        (pool, prefix)
    }

    /// `allocate`'s path for one block: lookup (reading the hit's chain), reserve if the hit
    /// is CACHED, acquire.
    fn lookup_and_acquire(
        pool: &BlockPool,
        prefix: &PrefixCache,
        key: MapKey,
        tokens: &[Token],
    ) -> Option<(BlockId, Hit, Chain)> {
        let (block, seen) = prefix.find(pool, key, 0, tokens)?;
        let chain = prefix.chain_of(block);
        let needed = usize::from(seen.refcount() == 0);
        pool.reserve(needed).ok()?;
        match pool.acquire_hit(block, seen, 0) {
            Some(hit) => Some((block, hit, chain)),
            None => {
                pool.unreserve(needed);
                None
            }
        }
    }

    /// A lookup of `OLD` races a thread that evicts the block, registers `NEW` contents in it,
    /// lets it go (CACHED) and revives it by a `NEW` hit. Whatever the interleaving, a hit on
    /// `OLD` holds `OLD`'s contents while it holds the block, and read `OLD`'s chain.
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
                prefix.unregister(block, || {});
                prefix.register(block, NEW, 0, &NEW_CHAIN, &NEW_TOKENS, || {
                    pool.mark_hashed(block)
                });
                pool.release_block(block, 0);
                lookup_and_acquire(pool, prefix, NEW, &NEW_TOKENS)
            });
            let (pool, prefix) = &*shared;
            let old_hit = lookup_and_acquire(pool, prefix, OLD, &OLD_TOKENS);
            if let Some((block, _, chain)) = old_hit {
                assert_eq!(chain, OLD_CHAIN, "a hit on OLD read another chain");
                assert!(
                    prefix.matches(block, OLD, 0, &OLD_TOKENS),
                    "a hit on OLD holds other contents"
                );
            }
            let new_hit = reuser.join().unwrap();
            if let Some((block, _, _)) = old_hit {
                assert!(prefix.matches(block, OLD, 0, &OLD_TOKENS));
                assert!(new_hit.is_none(), "the block was never evicted");
            }
            if let Some((_, _, chain)) = new_hit {
                assert_eq!(chain, NEW_CHAIN);
            }
            let holders = usize::from(old_hit.is_some()) + usize::from(new_hit.is_some());
            assert_eq!(pool.state(0).refcount() as usize, holders);
            assert_eq!(pool.available() + holders, 1);
        });
    }

    /// Two keys with one home (and different fingerprints): `SECOND` sits behind `FIRST` until
    /// `FIRST`'s block is evicted and `SECOND` shifts back over it. A lookup of `SECOND` racing
    /// that shift may miss on its lock-free probe, but never misses in the end: `SECOND` stays
    /// mapped throughout.
    #[test]
    fn lookup_finds_an_entry_that_shifts_back() {
        const FIRST: MapKey = 1 << 64 | 4;
        const SECOND: MapKey = 3 << 64 | 8;
        loom::model(|| {
            let pool = Arc::new(BlockPool::new(2).unwrap());
            let prefix = Arc::new(PrefixCache::new([0; 32], 2, 2).unwrap());
            for (key, tokens) in [(FIRST, [1, 1]), (SECOND, [2, 2])] {
                let block = pool.allocate().unwrap();
                prefix.register(block, key, 0, &[0; 32], &tokens, || pool.mark_hashed(block));
            }
            pool.release_block(0, 0);
            let reader = {
                let (pool, prefix) = (pool.clone(), prefix.clone());
                loom::thread::spawn(move || {
                    let found = prefix.find(&pool, SECOND, 0, &[2, 2]);
                    found.map(|(block, _)| block)
                })
            };
            pool.reserve(1).unwrap();
            let (block, evicted) = pool.take_reserved();
            assert!(evicted);
            prefix.unregister(block, || {});
            let found = reader.join().unwrap();
            assert_eq!(found, Some(1));
            assert_eq!(prefix.get(FIRST), None);
            assert_eq!(prefix.get(SECOND), Some(1));
        });
    }
}
