//! Admission and the prefix cache: `allocate` (and `allocate_loading`) reuse the cached full
//! blocks of a prompt's prefix; read-only lookups, block hashes and the cache's reset.

use std::sync::Arc;

use crate::block::BlockSize;
use crate::config::Attention;
use crate::error::invalid;
use crate::events::EventKind;
use crate::feed::Registration;
use crate::keys::{check_spans, digest_of, HashKeys};
use crate::manager::{check_room, BlockManager, Taken, MAX_TOKENS};
use crate::prefix::{block_hash_of, root_key, BlockHash, MapKey, PrefixCache, PromptHashes};
use crate::sequence::{LockedSeq, Sequence};
use crate::stats::Counters;
use crate::{BlockId, Error, PoolKind, SeqId, Token};

/// A prompt being admitted: its hashes and found hits (`None` without prefix caching).
pub(super) struct Admission(Option<PromptHashes>);

impl Admission {
    /// The prompt's full blocks' map keys and its root key (none without prefix caching).
    pub(super) fn keys(&self) -> Option<(&[MapKey], MapKey)> {
        let p = self.0.as_ref()?;
        Some((&p.keys, root_key(&p.root)))
    }
}

/// Fails unless a prompt can be admitted; returns how many of its full blocks a hit may cover
/// (never the last token).
pub(super) fn check_prompt(
    tokens: &[Token],
    bs: BlockSize,
    with: &HashKeys<'_>,
) -> Result<usize, Error> {
    if tokens.is_empty() {
        return Err(invalid("allocate needs at least one token"));
    }
    check_room(0, tokens.len())?;
    check_spans(with.extra_keys, 0, tokens.len())?;
    Ok(bs.index(tokens.len() - 1))
}

impl BlockManager {
    /// Admits sequence `seq` with its prompt, reusing cached full blocks of the same prefix
    /// (and `salt`); returns how many prompt tokens were reused. Their KV is computed; the rest
    /// of the prompt is pending until a plan computes it.
    pub fn allocate(
        &self,
        seq: SeqId,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Result<usize, Error> {
        self.allocate_keyed(seq, tokens, &HashKeys::salt(salt))
    }

    /// [`BlockManager::allocate`] with a LoRA adapter and extra keys as well as a salt.
    pub fn allocate_keyed(
        &self,
        seq: SeqId,
        tokens: &[Token],
        keys: &HashKeys<'_>,
    ) -> Result<usize, Error> {
        Ok(self.admit(seq, tokens, keys, None)?.0)
    }

    /// Admits `seq` like [`BlockManager::allocate`] when an external store holds more of the
    /// prompt: the caller claims full blocks `0..loadable_blocks` exist on the GPU or in the
    /// store. Returns the GPU-reused tokens `k * block_size` and the fresh GPU blocks to fill
    /// from the store: logical blocks `k..k + n` (never covering the last token), or with
    /// windowed attention those of them the query at `(k + n) * block_size` reads. Their KV
    /// stays pending until [`BlockManager::confirm_loads`].
    pub fn allocate_loading(
        &self,
        seq: SeqId,
        tokens: &[Token],
        loadable_blocks: usize,
        salt: Option<&[u8]>,
    ) -> Result<(usize, Vec<BlockId>), Error> {
        self.allocate_loading_keyed(seq, tokens, loadable_blocks, &HashKeys::salt(salt))
    }

    /// [`BlockManager::allocate_loading`] with a LoRA adapter and extra keys as well as a salt.
    pub fn allocate_loading_keyed(
        &self,
        seq: SeqId,
        tokens: &[Token],
        loadable_blocks: usize,
        keys: &HashKeys<'_>,
    ) -> Result<(usize, Vec<BlockId>), Error> {
        self.admit(seq, tokens, keys, Some(loadable_blocks))
    }

    fn admit(
        &self,
        seq: SeqId,
        tokens: &[Token],
        with: &HashKeys<'_>,
        loadable: Option<usize>,
    ) -> Result<(usize, Vec<BlockId>), Error> {
        let hittable = check_prompt(tokens, self.bs, with)?;
        // The prompt is hashed before any lock is taken, so a long prompt never stalls the
        // sequences that share its shard, and a retry after a lost race hashes nothing again.
        let mut prompt = self.hash_prompt(tokens, with);
        loop {
            let hit = self.find_hits(&mut prompt, tokens, hittable);
            let mut one = self.seqs.lock_one(seq);
            if one.get().is_some() {
                return Err(Error::DuplicateSequence(seq));
            }
            let needed = self.admission_needs(tokens, &prompt);
            self.reserve_gpu(needed)?;
            let (table, used) = match self.acquire_hits(&prompt) {
                Ok(acquired) => acquired,
                Err(used) => {
                    self.gpu.unreserve(needed - used);
                    continue;
                }
            };
            let needed = needed - used;
            let admitted = (tokens, with, prompt, hit, hit);
            return Ok(self.admit_locked(&mut one, admitted, table, needed, loadable));
        }
    }

    /// The prompt's hashes for admission (none without prefix caching).
    pub(super) fn hash_prompt(&self, tokens: &[Token], with: &HashKeys<'_>) -> Admission {
        let publishes = self.publishes_hashes();
        let hash = |p: &Arc<PrefixCache>| p.hash_prompt(tokens, with, self.group, publishes);
        Admission(self.prefix.as_ref().map(hash))
    }

    /// Finds the prompt's longest hit of at most `upto` full blocks that this manager can
    /// serve (with windowed attention, the blocks its next query reads); returns its length in
    /// blocks. Read-only on the cache.
    pub(super) fn find_hits(&self, prompt: &mut Admission, tokens: &[Token], upto: usize) -> usize {
        let (Some(prefix), Some(prompt)) = (&self.prefix, &mut prompt.0) else {
            return 0;
        };
        match self.config.attention {
            Attention::Full => {
                prompt.find_hits(prefix, &self.gpu, tokens, upto);
                prompt.hits.len()
            }
            attention => {
                let bs = self.bs;
                let first = |k: usize| bs.index(attention.first_key(k * bs.get()));
                prompt.find_window_hits(prefix, &self.gpu, tokens, upto, first)
            }
        }
    }

    /// Blocks admitting the prompt with its found hits takes.
    pub(super) fn admission_needs(&self, tokens: &[Token], prompt: &Admission) -> usize {
        let pages = self.bs.pages(tokens.len());
        match &prompt.0 {
            Some(p) => pages - p.first - p.hits.len() + p.cached_hits,
            None => pages,
        }
    }

    /// Takes the prompt's hits (reserved): the table of the hit blocks and how many reserved
    /// blocks that used. If another thread changed a hit since, nothing is taken and the error
    /// says how many reserved blocks went back to the pool with the hits released again.
    pub(super) fn acquire_hits(&self, prompt: &Admission) -> Result<(Vec<BlockId>, usize), usize> {
        let Some(p) = &prompt.0 else {
            return Ok((Vec::new(), 0));
        };
        let (acquired, used) = self.gpu.acquire_hits(&p.hits, self.bs.get() as u32);
        let table: Vec<BlockId> = p.hits[..acquired].iter().map(|&(block, _)| block).collect();
        if acquired < p.hits.len() {
            // Releasing the revived hits makes the `used` blocks available again.
            self.release_gpu_blocks(&table, 0, 0, table.len() * self.bs.get());
            return Err(used);
        }
        Ok((table, used))
    }

    /// Admits the sequence once `admitted`'s hits (`(tokens, keys, prompt, hit, allowed)`:
    /// `hit` blocks of the `allowed` this manager alone could serve) are in `table` and `needed`
    /// blocks are reserved for the rest: returns the reused tokens and the blocks to load.
    pub(super) fn admit_locked(
        &self,
        one: &mut LockedSeq<'_>,
        admitted: (&[Token], &HashKeys<'_>, Admission, usize, usize),
        mut table: Vec<BlockId>,
        needed: usize,
        loadable: Option<usize>,
    ) -> (usize, Vec<BlockId>) {
        let (tokens, with, prompt, hit, allowed) = admitted;
        let bs = self.bs;
        let (pages, hittable) = (bs.pages(tokens.len()), bs.index(tokens.len() - 1));
        let first = prompt.0.as_ref().map_or(0, |p| p.first);
        let mut taken = Taken::default();
        while first + table.len() < pages {
            table.push(self.take(&mut taken));
        }
        self.finish_taking(needed, taken);
        let reused = hit * bs.get();
        let loads = match loadable {
            Some(until) if self.prefix.is_some() => until.min(hittable).saturating_sub(hit),
            _ => 0,
        };
        let start = self.load_start(hit, loads);
        let load_blocks = table[start - first..hit + loads - first].to_vec();
        let (keys, hashes, root) = match prompt.0 {
            Some(p) => (p.keys, p.chains, p.root),
            None => (Vec::new(), Vec::new(), [0; 32]),
        };
        let mut sequence = Sequence::new(tokens.to_vec(), table, keys, hashes, root, reused, hit);
        sequence.first = first;
        if loads > 0 {
            sequence.loading = Some((hit, loads));
        }
        sequence.extra.spans = with.extra_keys.to_vec();
        if self.events.enabled() {
            sequence.extra.salt = with.salt.map(Arc::from);
            sequence.extra.lora_name = with.lora_name.map(Arc::from);
        }
        if loadable.is_some() {
            Counters::add(
                &self.counters.external_query_tokens,
                ((hittable.saturating_sub(hit)) * bs.get()) as u64,
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
        Counters::add(
            &self.counters.prefix_allowed_tokens,
            (allowed * bs.get()) as u64,
        );
        one.insert(sequence);
        (reused, load_blocks)
    }

    /// Whether a prompt could be admitted now while keeping the watermark in reserve.
    pub fn can_allocate(&self, tokens: &[Token], salt: Option<&[u8]>) -> bool {
        self.fits(tokens, &HashKeys::salt(salt))
    }

    /// [`BlockManager::can_allocate`] with a LoRA adapter and extra keys as well as a salt;
    /// fails on extra keys outside the tokens.
    pub fn can_allocate_keyed(&self, tokens: &[Token], keys: &HashKeys<'_>) -> Result<bool, Error> {
        check_spans(keys.extra_keys, 0, tokens.len())?;
        Ok(self.fits(tokens, keys))
    }

    fn fits(&self, tokens: &[Token], keys: &HashKeys<'_>) -> bool {
        if tokens.is_empty() || tokens.len() > MAX_TOKENS {
            return false;
        }
        let needed = self.count_hits(tokens, keys).1;
        self.gpu.available() >= needed + self.watermark_blocks
    }

    /// How many leading full blocks of the prompt the GPU prefix cache can serve now
    /// (read-only; a hit never covers the last token). With windowed attention, a prefix is
    /// served when the blocks its next query reads are cached.
    pub fn cached_prefix_blocks(&self, tokens: &[Token], salt: Option<&[u8]>) -> usize {
        self.cached_blocks(tokens, &HashKeys::salt(salt))
    }

    /// [`BlockManager::cached_prefix_blocks`] with a LoRA adapter and extra keys as well; fails
    /// on extra keys outside the tokens.
    pub fn cached_prefix_blocks_keyed(
        &self,
        tokens: &[Token],
        keys: &HashKeys<'_>,
    ) -> Result<usize, Error> {
        check_spans(keys.extra_keys, 0, tokens.len())?;
        Ok(self.cached_blocks(tokens, keys))
    }

    fn cached_blocks(&self, tokens: &[Token], keys: &HashKeys<'_>) -> usize {
        if tokens.is_empty() || tokens.len() > MAX_TOKENS {
            return 0;
        }
        self.count_hits(tokens, keys).0
    }

    /// The chained hashes of the prompt's full blocks (the values events carry).
    pub fn block_hashes(
        &self,
        tokens: &[Token],
        salt: Option<&[u8]>,
    ) -> Result<Vec<BlockHash>, Error> {
        self.block_hashes_keyed(tokens, &HashKeys::salt(salt))
    }

    /// [`BlockManager::block_hashes`] with a LoRA adapter and extra keys as well as a salt.
    pub fn block_hashes_keyed(
        &self,
        tokens: &[Token],
        keys: &HashKeys<'_>,
    ) -> Result<Vec<BlockHash>, Error> {
        let prefix = self
            .prefix
            .as_ref()
            .ok_or_else(|| invalid("block hashes need prefix caching"))?;
        check_spans(keys.extra_keys, 0, tokens.len())?;
        let bs = self.bs.get();
        let mut parent = prefix.root(keys, self.group);
        Ok(tokens
            .chunks_exact(bs)
            .enumerate()
            .map(|(i, block)| {
                let digest = digest_of(keys.extra_keys, i, bs);
                parent = prefix.hash_block(&parent, block, digest.as_ref());
                block_hash_of(&parent)
            })
            .collect())
    }

    /// A 64-bit fingerprint of the hash key (`None` without prefix caching): managers with the
    /// same fingerprint, block size and salt produce the same block hashes.
    pub fn hash_key_fingerprint(&self) -> Option<u64> {
        self.prefix.as_deref().map(PrefixCache::fingerprint)
    }

    /// The hashes of the computed full blocks `medium` holds: registered in the GPU prefix
    /// cache, or (while events are recorded) copied to the CPU pool by confirmed swap-outs. It
    /// is what an index built from the events describes.
    pub fn stored_hashes(&self, medium: PoolKind) -> Vec<BlockHash> {
        match (medium, &self.prefix) {
            (_, None) => Vec::new(),
            (PoolKind::Gpu, Some(prefix)) => prefix.hashes(self.group),
            (PoolKind::Cpu, Some(_)) => self.cpu_tier.hashes(),
        }
    }

    /// Drops every prefix-cache registration: CACHED blocks become FREE, held blocks stay
    /// held but are no longer shared with new prompts; the CPU tier is no longer announced.
    pub fn reset_prefix_cache(&self) {
        self.feed.record(|| Registration::Cleared);
        let Some(prefix) = &self.prefix else {
            self.events.record(|| EventKind::AllBlocksCleared);
            return;
        };
        let mut regions = prefix.lock_all();
        let registered: Vec<BlockId> = regions.iter().flat_map(|r| r.blocks()).collect();
        self.gpu.clear_hashes(registered.into_iter());
        for region in &mut regions {
            region.clear();
        }
        // Under the map's locks and the CPU tier's, so no GPU or CPU event can slip in before
        // this one for a block it clears.
        self.cpu_tier
            .clear(|| self.events.record(|| EventKind::AllBlocksCleared));
    }

    /// The prompt's hit in blocks and the blocks admitting it would take. Read-only.
    fn count_hits(&self, tokens: &[Token], keys: &HashKeys<'_>) -> (usize, usize) {
        let pages = self.bs.pages(tokens.len());
        let hittable = self.bs.index(tokens.len() - 1);
        match (&self.prefix, self.config.attention) {
            (None, _) => (0, pages),
            (Some(prefix), Attention::Full) => {
                let (hits, cached) =
                    prefix.count_hits(&self.gpu, tokens, keys, self.group, hittable);
                (hits, pages - hits + cached)
            }
            (Some(_), _) => {
                let mut prompt = self.hash_prompt(tokens, keys);
                let hit = self.find_hits(&mut prompt, tokens, hittable);
                (hit, self.admission_needs(tokens, &prompt))
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::events::EventKind;
    use crate::manager::testing::*;
    use crate::{BlockHash, Error, Plan, PoolKind, Token};

    /// The published chain exactly as SEMANTICS.md defines it, computed with BLAKE3 directly.
    fn blake3_hashes(
        key: &[u8; 32],
        salt: Option<&[u8]>,
        tokens: &[Token],
        bs: usize,
    ) -> Vec<BlockHash> {
        let mut root = blake3::Hasher::new_keyed(key);
        root.update(b"pagedkv/root");
        match salt {
            None => root.update(&[0]),
            Some(salt) => root
                .update(&[1])
                .update(&(salt.len() as u64).to_le_bytes())
                .update(salt),
        };
        let mut chain = *root.finalize().as_bytes();
        tokens
            .chunks_exact(bs)
            .map(|block| {
                let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
                chain = *blake3::keyed_hash(&chain, &bytes).as_bytes();
                u128::from_le_bytes(chain[..16].try_into().unwrap())
            })
            .collect()
    }

    /// `(hash, parent)` of each `BlockStored` event.
    fn stored(mgr: &crate::BlockManager) -> Vec<(BlockHash, Option<BlockHash>)> {
        mgr.take_events()
            .into_iter()
            .filter_map(|e| match e.kind {
                EventKind::BlockStored {
                    block_hash,
                    parent_hash,
                    ..
                } => Some((block_hash, parent_hash)),
                _ => None,
            })
            .collect()
    }

    /// Whatever keys the prefix map, every hash that leaves the process is the BLAKE3 chain:
    /// `block_hashes`, the fingerprint, events and `stored_hashes`, including the blocks a
    /// sequence registers after a hit (whose chain continues from the hit's stored value).
    #[test]
    fn published_hashes_are_the_blake3_chain() {
        let key = [7u8; 32];
        let mgr = manager(32, 4, |c| {
            c.hash_key = Some(key);
            c.enable_events = true;
        });
        let prompt: Vec<Token> = (100..117).collect(); // 4 full blocks and one token
        let expected = blake3_hashes(&key, None, &prompt, 4);
        assert_eq!(mgr.block_hashes(&prompt, None).unwrap(), expected);
        let salted = blake3_hashes(&key, Some(b"tenant"), &prompt, 4);
        assert_eq!(mgr.block_hashes(&prompt, Some(b"tenant")).unwrap(), salted);
        assert_ne!(salted, expected);
        let fingerprint = blake3::keyed_hash(&key, b"pagedkv/fingerprint");
        assert_eq!(
            mgr.hash_key_fingerprint(),
            Some(u64::from_le_bytes(
                fingerprint.as_bytes()[..8].try_into().unwrap()
            ))
        );

        mgr.allocate(1, &prompt[..9], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.commit(&[1], None).unwrap();
        assert_eq!(
            stored(&mgr),
            vec![(expected[0], None), (expected[1], Some(expected[0]))]
        );
        // A hit on both blocks, then two more blocks computed after them.
        assert_eq!(mgr.allocate(2, &prompt, None).unwrap(), 8);
        prefill(&mgr, &[2]);
        mgr.commit(&[2], None).unwrap();
        assert_eq!(
            stored(&mgr),
            vec![
                (expected[2], Some(expected[1])),
                (expected[3], Some(expected[2]))
            ]
        );
        let mut gpu = mgr.stored_hashes(PoolKind::Gpu);
        gpu.sort_unstable();
        let mut all = expected.clone();
        all.sort_unstable();
        assert_eq!(gpu, all);
        mgr.check().unwrap();
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

    /// An admission whose hit was evicted after its lookup (by another thread) gives back
    /// exactly what it reserved, and retries.
    #[test]
    fn a_lost_race_for_a_hit_gives_back_its_reservation() {
        let mgr = manager(8, 4, |_| {});
        let prompt: Vec<Token> = (1..=9).collect();
        mgr.allocate(1, &prompt, None).unwrap();
        prefill(&mgr, &[1]);
        mgr.commit(&[1], None).unwrap();
        mgr.free(1).unwrap();
        // Blocks 1 and 0 are cached (1 at the head), the other six free.
        let mut admission = mgr.hash_prompt(&prompt, &crate::HashKeys::default());
        assert_eq!(mgr.find_hits(&mut admission, &prompt, 2), 2);
        // Another sequence takes the free blocks and evicts block 1, then leaves.
        mgr.allocate(2, &(100..128).collect::<Vec<_>>(), None)
            .unwrap();
        assert_eq!(mgr.stats().evictions, 1);
        mgr.free(2).unwrap();
        let needed = mgr.admission_needs(&prompt, &admission);
        mgr.reserve_gpu(needed).unwrap();
        // Block 0 is revived, block 1 is not the block it was: nothing is taken, and what
        // the revival used went back to the pool with the hit released again.
        let used = mgr.acquire_hits(&admission).unwrap_err();
        mgr.gpu.unreserve(needed - used);
        mgr.check().unwrap();
        let st = mgr.stats();
        assert_eq!((st.num_free, st.num_cached, st.num_held), (7, 1, 0));
        assert_eq!(mgr.allocate(3, &prompt, None).unwrap(), 4);
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
