//! The prefix map: map key -> registered block, as one open-addressing table of block ids.
//!
//! The high bits of a key pick a region of the table, its low bits the home slot inside it;
//! entries probe linearly from home (wrapping inside the region) and a removal shifts the
//! entries after it back, so there are no tombstones and probes stay short. A slot holds a
//! block id and the key's low 32 bits (its home and a fingerprint); the full key stays in the
//! block's registration (`key_of`), read only when the fingerprint matches. So a slot is eight
//! bytes, a key's slot is known before any lookup, a probe or a removal
//! reads no other block's registration, and the table has two slots per block (load at most
//! one half).
//!
//! Writers hold their region's lock. Readers may probe without it ([`PrefixMap::probe`]): what
//! they find is only a candidate, verified by the caller against the block's registration and
//! state, and a lock-free miss is not final (a concurrent removal can shift an entry past the
//! reader), so callers confirm it under the lock ([`Region::get`]).

use crate::bookkeeping::{try_boxed, TooLarge};
use crate::prefix::MapKey;
use crate::sync::{lock, AtomicU64, Mutex, MutexGuard, Ordering};
use crate::BlockId;

/// An empty slot (no block has id `BlockId::MAX`).
const EMPTY: u64 = u64::MAX;

/// A slot's entry: the key's low half-word above the block id.
fn entry(key: MapKey, block: BlockId) -> u64 {
    (u64::from(key as u32) << 32) | u64::from(block)
}

/// The block of an entry.
fn block_of(entry: u64) -> BlockId {
    entry as BlockId
}

/// Whether an entry's fingerprint is the key's.
fn fingerprint_matches(entry: u64, key: MapKey) -> bool {
    (entry >> 32) as u32 == key as u32
}

/// Slots per region at least, before the table is cut into more regions (at most
/// `MAX_REGIONS`): a pool of up to 1024 blocks is one region, which cannot fill up.
const MIN_REGION: usize = 2048;
const MAX_REGIONS: usize = 64;

/// The table and its region locks.
pub(crate) struct PrefixMap {
    slots: Box<[AtomicU64]>,
    regions: Box<[Mutex<()>]>,
    /// Slots per region, a power of two.
    region_len: usize,
}

impl PrefixMap {
    /// An empty map for a pool of `num_blocks` blocks, or the allocation that failed.
    pub(crate) fn new(num_blocks: u32) -> Result<PrefixMap, TooLarge> {
        let len = (2 * num_blocks as usize).next_power_of_two();
        let regions = (len / MIN_REGION).clamp(1, MAX_REGIONS);
        Ok(PrefixMap {
            slots: try_boxed(len, |_| AtomicU64::new(EMPTY))?,
            regions: (0..regions).map(|_| Mutex::new(())).collect(),
            region_len: len / regions,
        })
    }

    fn region_of(&self, key: MapKey) -> usize {
        (key >> 64) as usize & (self.regions.len() - 1)
    }

    /// The slot a key's probe starts at.
    fn home(&self, key: MapKey) -> usize {
        self.region_of(key) * self.region_len + self.offset(key as u32)
    }

    /// The home of a key with these low bits, inside its region (regions have at most 2^27
    /// slots, so the low 32 bits decide it).
    fn offset(&self, low: u32) -> usize {
        low as usize & (self.region_len - 1)
    }

    /// The slot after `slot`, wrapping inside its region.
    fn next(&self, slot: usize) -> usize {
        let mask = self.region_len - 1;
        (slot & !mask) | ((slot + 1) & mask)
    }

    fn load(&self, slot: usize) -> u64 {
        self.slots[slot].load(Ordering::Relaxed)
    }

    /// The first block on `key`'s probe with `key`'s fingerprint, without a lock: only a
    /// candidate, which the caller verifies against its registration (see the module doc).
    /// The registration is not read here, so the caller's verification is the only miss on it.
    pub(crate) fn probe(&self, key: MapKey) -> Option<BlockId> {
        let mut slot = self.home(key);
        for _ in 0..self.region_len {
            match self.load(slot) {
                EMPTY => return None,
                e if fingerprint_matches(e, key) => return Some(block_of(e)),
                _ => slot = self.next(slot),
            }
        }
        None
    }

    /// Locks the region of `key`.
    pub(crate) fn lock(&self, key: MapKey) -> Region<'_> {
        let region = self.region_of(key);
        Region {
            map: self,
            region,
            _guard: lock(&self.regions[region]),
        }
    }

    /// Locks each region in turn, in order, as the iterator reaches it.
    pub(crate) fn regions(&self) -> impl Iterator<Item = Region<'_>> {
        (0..self.regions.len()).map(|region| Region {
            map: self,
            region,
            _guard: lock(&self.regions[region]),
        })
    }

    /// Locks every region, in order: the whole map, for a reset or an audit.
    pub(crate) fn lock_all(&self) -> Vec<Region<'_>> {
        self.regions().collect()
    }
}

/// A locked region: its entries are exact while the lock is held.
pub(crate) struct Region<'a> {
    map: &'a PrefixMap,
    region: usize,
    _guard: MutexGuard<'a, ()>,
}

impl Region<'_> {
    /// The slot of `key` (`Ok`), or the empty slot where it would go (`Err`; `None` if the
    /// region is full, or `key` is not of this region).
    fn find(
        &self,
        key: MapKey,
        key_of: &impl Fn(BlockId) -> MapKey,
    ) -> Result<usize, Option<usize>> {
        let map = self.map;
        if map.region_of(key) != self.region {
            return Err(None);
        }
        let mut slot = map.home(key);
        for _ in 0..map.region_len {
            match map.load(slot) {
                EMPTY => return Err(Some(slot)),
                e if fingerprint_matches(e, key) && key_of(block_of(e)) == key => return Ok(slot),
                _ => slot = map.next(slot),
            }
        }
        Err(None)
    }

    /// The block mapped to `key`, exactly.
    pub(crate) fn get(&self, key: MapKey, key_of: impl Fn(BlockId) -> MapKey) -> Option<BlockId> {
        self.find(key, &key_of)
            .ok()
            .map(|slot| block_of(self.map.load(slot)))
    }

    /// The empty slot `key` would take, if `key` is not mapped and the region has room.
    pub(crate) fn vacancy(
        &self,
        key: MapKey,
        key_of: impl Fn(BlockId) -> MapKey,
    ) -> Option<Vacancy> {
        let slot = self.find(key, &key_of).err().flatten()?;
        Some(Vacancy { slot, key })
    }

    /// Maps the key of `vacancy` to `block`, whose registration must already say that key.
    pub(crate) fn fill(&mut self, vacancy: Vacancy, block: BlockId) {
        self.map.slots[vacancy.slot].store(entry(vacancy.key, block), Ordering::Relaxed);
    }

    /// Unmaps `key` if it maps to `block`; says whether it did. The entries after it move back
    /// to where a probe still finds them.
    pub(crate) fn remove(&mut self, key: MapKey, block: BlockId) -> bool {
        let map = self.map;
        if map.region_of(key) != self.region {
            return false;
        }
        let mut slot = map.home(key);
        for _ in 0..map.region_len {
            match map.load(slot) {
                EMPTY => return false,
                e if e == entry(key, block) => {
                    self.shift_back(slot);
                    return true;
                }
                _ => slot = map.next(slot),
            }
        }
        false
    }

    /// Empties `hole` and moves back every later entry of its cluster whose home is not
    /// between the hole and where the entry sits (cyclically).
    fn shift_back(&mut self, mut hole: usize) {
        let map = self.map;
        let mask = map.region_len - 1;
        let mut slot = map.next(hole);
        // Once around the region at most: a full region has no empty slot to stop at.
        for _ in 1..map.region_len {
            let e = map.load(slot);
            if e == EMPTY {
                break;
            }
            // Distances from the entry's home, inside the region.
            let home = map.offset((e >> 32) as u32);
            let to_hole = hole.wrapping_sub(home) & mask;
            let to_slot = slot.wrapping_sub(home) & mask;
            if to_hole < to_slot {
                map.slots[hole].store(e, Ordering::Relaxed);
                hole = slot;
            }
            slot = map.next(slot);
        }
        map.slots[hole].store(EMPTY, Ordering::Relaxed);
    }

    /// The blocks this region maps.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        let start = self.region * self.map.region_len;
        (start..start + self.map.region_len)
            .map(|slot| self.map.load(slot))
            .filter(|&e| e != EMPTY)
            .map(block_of)
    }

    /// Unmaps everything in this region.
    pub(crate) fn clear(&mut self) {
        let start = self.region * self.map.region_len;
        for slot in &self.map.slots[start..start + self.map.region_len] {
            slot.store(EMPTY, Ordering::Relaxed);
        }
    }
}

/// An empty slot found under a region's lock, for the key it was looked up with.
pub(crate) struct Vacancy {
    slot: usize,
    key: MapKey,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random-ish inserts and removals of `blocks` blocks in a map for `num_blocks` (one
    /// region), with many keys sharing homes, against a `HashMap`: every key stays findable,
    /// locked and lock-free, and only a full region refuses a new key.
    fn churn(num_blocks: u32, blocks: u64) {
        let map = PrefixMap::new(num_blocks).unwrap();
        assert_eq!(map.regions.len(), 1);
        let mut keys: HashMap<BlockId, MapKey> = HashMap::new();
        let mut model: HashMap<MapKey, BlockId> = HashMap::new();
        let mut x: u64 = 7;
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Few distinct homes, so clusters form and wrap around the region's end.
            let key = MapKey::from((x >> 33) % 40) | ((x >> 60) as MapKey) << 64;
            let block = ((x >> 40) % blocks) as BlockId;
            let key_of = |keys: &HashMap<BlockId, MapKey>, b| keys.get(&b).copied();
            if let Some(&old) = keys.get(&block) {
                let removed = map.lock(old).remove(old, block);
                assert!(removed);
                model.remove(&old);
                keys.remove(&block);
            } else {
                let mut region = map.lock(key);
                match region.vacancy(key, |b| key_of(&keys, b).unwrap()) {
                    Some(vacancy) => {
                        assert!(!model.contains_key(&key));
                        keys.insert(block, key);
                        model.insert(key, block);
                        region.fill(vacancy, block);
                    }
                    None => {
                        assert!(model.contains_key(&key) || model.len() == map.region_len)
                    }
                }
            }
            for (&k, &b) in &model {
                assert_eq!(map.lock(k).get(k, |b| key_of(&keys, b).unwrap()), Some(b));
                let probed = map.probe(k).expect("a mapped key probes to a candidate");
                assert_eq!(k as u32, keys[&probed] as u32);
            }
            let mut mapped: Vec<_> = map.lock_all()[0].blocks().collect();
            mapped.sort_unstable();
            let mut expected: Vec<_> = model.values().copied().collect();
            expected.sort_unstable();
            assert_eq!(mapped, expected);
        }
    }

    #[test]
    fn matches_a_hash_map_under_churn() {
        churn(16, 16);
    }

    #[test]
    fn matches_a_hash_map_in_a_full_region() {
        churn(2, 4);
    }

    #[test]
    fn a_full_region_takes_no_more() {
        let map = PrefixMap::new(1).unwrap();
        assert_eq!(map.region_len, 2);
        let key_of = |b: BlockId| MapKey::from(b) * 4;
        for block in 0..2 {
            let key = key_of(block);
            let mut region = map.lock(key);
            let vacancy = region.vacancy(key, key_of).unwrap();
            region.fill(vacancy, block);
        }
        assert!(map.lock(8).vacancy(8, key_of).is_none());
        assert_eq!(map.lock(4).get(4, key_of), Some(1));
        assert!(!map.lock(4).remove(4, 0));
        assert!(map.lock(4).remove(4, 1));
        assert!(map.lock(8).vacancy(8, key_of).is_some());
    }

    #[test]
    fn large_pools_split_into_regions() {
        let map = PrefixMap::new(25_088).unwrap();
        assert_eq!((map.regions.len(), map.region_len), (32, 2048));
        let map = PrefixMap::new(1 << 20).unwrap();
        assert_eq!(map.regions.len(), MAX_REGIONS);
    }
}
