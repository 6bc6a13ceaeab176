//! Per-sequence state (tokens, block table, block hashes, lifecycle) in a sharded map. An
//! operation locks the shards of the sequences it touches, in shard order, so different
//! sequences can be driven from different threads at once and batches never deadlock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::keys::SequenceKeys;
use crate::prefix::{block_hash_of, root_key, BlockHash, Chain, MapKey};
use crate::sync::{lock, AtomicUsize, Mutex, MutexGuard, Ordering};
use crate::{BlockId, SeqId, Token};

/// Shards of the sequence map; a batch's shards are a bit mask in a `u32`.
const SHARDS: usize = 32;
const _: () = assert!(SHARDS.is_power_of_two() && SHARDS <= u32::BITS as usize);

/// One sequence: its tokens, its block table, the hashes of its full blocks and where its KV
/// stands in the lifecycle (pending -> computed). The fields every decode step reads come
/// first, so they share the struct's first cache lines.
#[derive(Clone, Debug)]
#[repr(C)]
pub(crate) struct Sequence {
    pub(crate) tokens: Vec<Token>,
    /// GPU block ids, or CPU block ids while `swapped`, of logical blocks `first..`.
    pub(crate) table: Vec<BlockId>,
    /// Logical blocks `0..first` left the attention window (windowed managers only): no query
    /// reads them again, so they were released.
    pub(crate) first: usize,
    /// Tokens `0..computed` have KV the engine confirmed.
    pub(crate) computed: usize,
    /// Tokens `0..planned` are computed or being computed by a handed-out plan
    /// (`computed <= planned <= len`).
    pub(crate) planned: usize,
    /// Full blocks `0..registered` were offered to the prefix cache (all computed).
    pub(crate) registered: usize,
    /// The last call that visited this sequence ([`crate::BlockManager`]'s call stamps).
    pub(crate) stamp: u64,
    /// The version of `table` (see the crate docs' "Versions and stamps").
    pub(crate) version: u64,
    pub(crate) swapped: bool,
    /// The partial last block may be shared (after a fork or a swap), so an append must check
    /// its refcount and copy on write. False means it is held by this sequence alone.
    pub(crate) shared_tail: bool,
    /// Copies handed to a plan whose forward pass is not committed yet.
    pub(crate) copying: Vec<PendingCopy>,
    /// External loads handed out by `allocate_loading`: logical blocks `first..first + count`.
    pub(crate) loading: Option<(usize, usize)>,
    /// Copy-on-write copies recorded by appends, not yet handed to a plan. This sequence holds
    /// each source until the plan that applies the copy is committed.
    pub(crate) copies: Vec<PendingCopy>,
    /// The other pool's table of a swap whose copy is not confirmed yet (still held): the GPU
    /// blocks of a swap-out (while `swapped`) or the CPU blocks of a swap-in.
    pub(crate) swap_source: Option<Vec<BlockId>>,
    /// `hashes[i]` is the chaining value of full block `i`, computed lazily (empty without
    /// prefix caching).
    pub(crate) hashes: Vec<Chain>,
    /// `keys[i]` is the prefix-map key of full block `i` (as many as `hashes`).
    pub(crate) keys: Vec<MapKey>,
    /// Chaining value before block 0 (binds the key and the salt).
    pub(crate) root: Chain,
    /// Tokens of its prompt (what `allocate` and the `append`s before its first decode step
    /// added): a windowed manager keeps the blocks a later request needs to resume there ahead
    /// of other released blocks.
    pub(crate) prompt_len: usize,
    /// What its hashes bind besides the tokens (the root binds the salt and LoRA adapter).
    pub(crate) extra: SequenceKeys,
}

/// One copy-on-write copy a sequence still depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PendingCopy {
    pub(crate) src: BlockId,
    pub(crate) dst: BlockId,
    /// Tokens of `src` the copy carries (its fill when copied).
    pub(crate) fill: u32,
    /// The copy is done once the sequence's KV is computed up to here (the end of the plan
    /// that carried it).
    pub(crate) until: usize,
}

impl Sequence {
    /// A new sequence whose first `computed` tokens (whole blocks) already have KV.
    pub(crate) fn new(
        tokens: Vec<Token>,
        table: Vec<BlockId>,
        keys: Vec<MapKey>,
        hashes: Vec<Chain>,
        root: Chain,
        computed: usize,
        registered: usize,
    ) -> Sequence {
        Sequence {
            prompt_len: tokens.len(),
            tokens,
            table,
            first: 0,
            keys,
            hashes,
            root,
            extra: SequenceKeys::default(),
            swapped: false,
            shared_tail: false,
            stamp: 0,
            computed,
            planned: computed,
            registered,
            copies: Vec::new(),
            copying: Vec::new(),
            swap_source: None,
            loading: None,
            version: next_version(),
        }
    }

    /// The block holding logical block `i` (at least `first`).
    #[inline(always)]
    pub(crate) fn block(&self, i: usize) -> BlockId {
        self.table[i - self.first]
    }

    /// Marks the table as changed in place (an entry replaced).
    pub(crate) fn table_changed(&mut self) {
        self.version = next_version();
    }

    /// The prefix-map key before full block `i` (hashed up to `i - 1`).
    pub(crate) fn parent_key(&self, i: usize) -> MapKey {
        match i {
            0 => root_key(&self.root),
            _ => self.keys[i - 1],
        }
    }

    /// The chaining value full block `i` is hashed under (hashed up to `i - 1`).
    pub(crate) fn parent_chain(&self, i: usize) -> Chain {
        match i {
            0 => self.root,
            _ => self.hashes[i - 1],
        }
    }

    /// The published hash of full block `i`'s parent, as its events carry it (none for block 0).
    pub(crate) fn parent_hash(&self, i: usize) -> Option<BlockHash> {
        i.checked_sub(1)
            .map(|parent| block_hash_of(&self.hashes[parent]))
    }

    /// Whether a swap-in's copy is not confirmed yet: until it is, the sequence's blocks are
    /// not registered through it.
    pub(crate) fn swap_in_pending(&self) -> bool {
        !self.swapped && self.swap_source.is_some()
    }
}

/// A table version no sequence has had (never 0). Process-wide, so a sequence re-admitted
/// under the id of a freed one, or in another manager, never repeats a version.
fn next_version() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static VERSIONS: AtomicU64 = AtomicU64::new(1);
    VERSIONS.fetch_add(1, Ordering::Relaxed)
}

/// Multiplicative hashing of sequence ids (callers often use consecutive ids).
#[derive(Default)]
pub(crate) struct SeqIdHasher(u64);

impl Hasher for SeqIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    }
}

/// One shard: its sequences in a dense array, and each id's index in it.
#[derive(Default)]
pub(crate) struct Shard {
    seqs: Vec<(SeqId, Sequence)>,
    index: HashMap<SeqId, usize, BuildHasherDefault<SeqIdHasher>>,
}

impl Shard {
    fn get(&mut self, id: SeqId) -> Option<&mut Sequence> {
        let i = *self.index.get(&id)?;
        Some(&mut self.seqs[i].1)
    }

    fn get_ref(&self, id: SeqId) -> Option<&Sequence> {
        Some(&self.seqs[*self.index.get(&id)?].1)
    }

    /// Adds `id`, which is not live.
    fn insert(&mut self, id: SeqId, seq: Sequence) {
        self.index.insert(id, self.seqs.len());
        self.seqs.push((id, seq));
    }

    /// Removes `id`; the last sequence moves into its place.
    fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let i = self.index.remove(&id)?;
        let (_, seq) = self.seqs.swap_remove(i);
        if let Some((moved, _)) = self.seqs.get(i) {
            self.index.insert(*moved, i);
        }
        Some(seq)
    }
}

fn shard_of(id: SeqId) -> usize {
    (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (u64::BITS - SHARDS.trailing_zeros())) as usize
}

/// All live sequences.
pub(crate) struct SequenceMap {
    shards: Box<[Mutex<Shard>]>,
    len: AtomicUsize,
}

impl SequenceMap {
    /// No sequences.
    pub(crate) fn new() -> SequenceMap {
        SequenceMap {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            len: AtomicUsize::new(0),
        }
    }

    /// Number of live sequences.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Locks the shards holding `ids`, in shard order, for the duration of one operation.
    pub(crate) fn lock(&self, ids: &[SeqId]) -> LockedBatch<'_> {
        let mut mask: u32 = ids.iter().fold(0, |mask, &id| mask | 1 << shard_of(id));
        let mut guards: [Option<MutexGuard<'_, Shard>>; SHARDS] = std::array::from_fn(|_| None);
        while mask != 0 {
            let shard = mask.trailing_zeros() as usize;
            guards[shard] = Some(lock(&self.shards[shard]));
            mask &= mask - 1;
        }
        LockedBatch {
            guards,
            len: &self.len,
        }
    }

    /// Locks the one shard holding `id`.
    pub(crate) fn lock_one(&self, id: SeqId) -> LockedSeq<'_> {
        LockedSeq {
            shard: lock(&self.shards[shard_of(id)]),
            id,
            len: &self.len,
        }
    }

    /// Locks every shard, in order, to read them (an audit).
    pub(crate) fn read_all(&self) -> ReadAll<'_> {
        ReadAll {
            shards: self.shards.iter().map(lock).collect(),
        }
    }
}

/// Where a live sequence of a [`LockedBatch`] is: found once, then reached without a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    shard: u8,
    index: u32,
}

/// The locked shards of one batch operation.
pub(crate) struct LockedBatch<'a> {
    guards: [Option<MutexGuard<'a, Shard>>; SHARDS],
    len: &'a AtomicUsize,
}

impl LockedBatch<'_> {
    #[inline(always)]
    fn shard(&mut self, shard: usize) -> &mut Shard {
        self.guards[shard]
            .as_mut()
            .expect("the batch locked this sequence's shard")
    }

    /// Where the sequence is, if live, trying `hint` (where it was found before) first. Valid
    /// until a sequence is added or removed.
    #[inline(always)]
    pub(crate) fn find(&mut self, id: SeqId, hint: Option<Place>) -> Option<Place> {
        let shard = shard_of(id);
        if let Some(hint) = hint.filter(|hint| hint.shard as usize == shard) {
            let seqs = &self.shard(shard).seqs;
            if seqs
                .get(hint.index as usize)
                .is_some_and(|(at, _)| *at == id)
            {
                return Some(hint);
            }
        }
        let index = *self.shard(shard).index.get(&id)?;
        Some(Place {
            shard: shard as u8,
            index: index as u32,
        })
    }

    /// The sequence at `place` (from [`LockedBatch::find`]).
    #[inline(always)]
    pub(crate) fn at(&mut self, place: Place) -> &mut Sequence {
        &mut self.shard(place.shard as usize).seqs[place.index as usize].1
    }

    /// The sequence, if live.
    pub(crate) fn get(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.shard(shard_of(id)).get(id)
    }

    /// Whether `id` is live.
    pub(crate) fn contains(&mut self, id: SeqId) -> bool {
        self.shard(shard_of(id)).index.contains_key(&id)
    }

    /// Adds a new sequence.
    pub(crate) fn insert(&mut self, id: SeqId, seq: Sequence) {
        self.shard(shard_of(id)).insert(id, seq);
        self.len.fetch_add(1, Ordering::Relaxed);
    }
}

/// Every shard, locked to read them.
pub(crate) struct ReadAll<'a> {
    shards: Vec<MutexGuard<'a, Shard>>,
}

impl ReadAll<'_> {
    /// Every live sequence.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&SeqId, &Sequence)> {
        (self.shards.iter()).flat_map(|shard| shard.seqs.iter().map(|(id, s)| (id, s)))
    }
}

/// The locked shard of a single-sequence operation, bound to that sequence's id.
pub(crate) struct LockedSeq<'a> {
    shard: MutexGuard<'a, Shard>,
    id: SeqId,
    len: &'a AtomicUsize,
}

impl LockedSeq<'_> {
    /// The sequence, if live.
    pub(crate) fn get(&mut self) -> Option<&mut Sequence> {
        self.shard.get(self.id)
    }

    /// The sequence, if live, to read.
    pub(crate) fn get_ref(&self) -> Option<&Sequence> {
        self.shard.get_ref(self.id)
    }

    /// Adds the sequence.
    pub(crate) fn insert(&mut self, seq: Sequence) {
        self.shard.insert(self.id, seq);
        self.len.fetch_add(1, Ordering::Relaxed);
    }

    /// Removes the sequence.
    pub(crate) fn remove(&mut self) -> Option<Sequence> {
        let seq = self.shard.remove(self.id);
        if seq.is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
        seq
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn sequence(len: usize) -> Sequence {
        Sequence::new(vec![7; len], vec![0], Vec::new(), Vec::new(), [0; 32], 0, 0)
    }

    /// Removing a sequence moves the shard's last one into its place, still found by its id.
    #[test]
    fn removal_keeps_every_other_sequence_found() {
        let mut shard = Shard::default();
        for id in 1..=3 {
            shard.insert(id, sequence(id as usize));
        }
        assert_eq!(shard.remove(1).unwrap().tokens.len(), 1);
        assert!(shard.remove(1).is_none());
        assert_eq!(shard.get(3).unwrap().tokens.len(), 3);
        assert_eq!(shard.get(2).unwrap().tokens.len(), 2);
        shard.insert(4, sequence(4));
        assert_eq!(shard.remove(3).unwrap().tokens.len(), 3);
        assert_eq!(shard.get(4).unwrap().tokens.len(), 4);
        assert_eq!(shard.get(2).unwrap().tokens.len(), 2);
    }

    /// Sequence versions are never reused, across sequences.
    #[test]
    fn versions_are_unique() {
        let (mut a, b) = (sequence(1), sequence(1));
        assert_ne!(a.version, b.version);
        let before = a.version;
        a.table_changed();
        assert!(a.version != before && a.version != b.version);
    }
}
