//! Per-sequence state (tokens, block table, block hashes, lifecycle) in a sharded map. An
//! operation locks the shards of the sequences it touches, in shard order, so different
//! sequences can be driven from different threads at once and batches never deadlock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::prefix::{block_hash_of, root_key, BlockHash, Chain, MapKey};
use crate::sync::{lock, AtomicUsize, Mutex, MutexGuard, Ordering};
use crate::{BlockId, SeqId, Token};

/// A sequence's shard is the top bits of a multiplicative hash of its id, and a batch's shards
/// are a bit mask in a `u32`: a power of two, at most 32.
const SHARDS: usize = 32;
const _: () = assert!(SHARDS.is_power_of_two() && SHARDS <= u32::BITS as usize);
/// The shift that leaves the top `log2(SHARDS)` bits of a 64-bit hash.
const SHARD_SHIFT: u32 = u64::BITS - SHARDS.trailing_zeros();

/// One sequence: its tokens, its block table, the hashes of its full blocks and where its KV
/// stands in the lifecycle (pending -> computed). `repr(C)`: the first 64 bytes (`tokens`,
/// `table`, `computed`, `planned`) are all a decode step reads of a settled member, and its
/// [`Slot`] starts them on a cache line; the rest follows, the rarely used fields last.
#[derive(Clone, Debug)]
#[repr(C)]
pub(crate) struct Sequence {
    pub(crate) tokens: Vec<Token>,
    /// GPU block ids, or CPU block ids while `swapped`.
    pub(crate) table: Vec<BlockId>,
    /// Tokens `0..computed` have KV the engine confirmed.
    pub(crate) computed: usize,
    /// Tokens `0..planned` are computed or being computed by a handed-out plan
    /// (`computed <= planned <= len`).
    pub(crate) planned: usize,
    /// Full blocks `0..registered` were offered to the prefix cache (all computed).
    pub(crate) registered: usize,
    /// The last batch that visited this sequence; detects repeats within one batch.
    pub(crate) stamp: u64,
    /// The version of `table`: unique to this sequence, and renewed whenever an entry of the
    /// table is replaced (pushing a block keeps it), so a persistent batch row knows when only
    /// new blocks need copying.
    pub(crate) epoch: u64,
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
    /// prefix caching); at least the registered blocks are hashed.
    pub(crate) hashes: Vec<Chain>,
    /// `keys[i]` is the prefix-map key of full block `i`, hashed along with `hashes[i]`.
    pub(crate) keys: Vec<MapKey>,
    /// Chaining value before block 0 (binds the key and the salt).
    pub(crate) root: Chain,
}

// What a settled member's decode step reads (`tokens`, `table`, `computed`, `planned`, in
// `repr(C)` order) ends within the first line.
const _: () = assert!(std::mem::offset_of!(Sequence, planned) + size_of::<usize>() <= 64);

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
            tokens,
            table,
            keys,
            hashes,
            root,
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
            epoch: next_epoch(),
        }
    }

    /// Marks the table as changed in place (an entry replaced).
    pub(crate) fn table_changed(&mut self) {
        self.epoch = next_epoch();
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

    /// Whether nothing but decoding is in flight: no copies, loads or swaps, and a tail held
    /// by this sequence alone. A decode step of a quiet sequence checks only its length (and
    /// its blocks to register).
    pub(crate) fn is_quiet(&self) -> bool {
        self.copying.is_empty()
            && self.copies.is_empty()
            && self.loading.is_none()
            && self.swap_source.is_none()
            && !self.swapped
            && !self.shared_tail
    }

    /// Whether a swap-in's copy is not confirmed yet: until it is, the sequence's blocks are
    /// not registered through it.
    pub(crate) fn swap_in_pending(&self) -> bool {
        !self.swapped && self.swap_source.is_some()
    }
}

/// A table version no sequence has had (never 0). Process-wide, so a sequence re-admitted
/// under the id of a freed one never repeats its versions.
fn next_epoch() -> u64 {
    static EPOCHS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    EPOCHS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Multiplicative hashing of sequence ids (callers often use consecutive ids).
#[derive(Default)]
pub(crate) struct SeqIdHasher(u64);

const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for SeqIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(MIX);
        }
    }
    fn write_u64(&mut self, n: u64) {
        // Not the multiplier that picks the shard: within one shard the top bits of
        // `n * MIX` are all equal, which would collide every hashbrown tag.
        self.0 = (n ^ (n >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    }
}

/// One shard: its sequences in slots, and the map from id to slot. A batch resolves each id
/// once ([`LockedBatch::find`]) and then reaches the sequence by its slot, however many passes
/// it makes over the batch.
#[derive(Default)]
pub(crate) struct Shard {
    slot_of: HashMap<SeqId, u32, BuildHasherDefault<SeqIdHasher>>,
    slots: Vec<Slot>,
    /// The id in each slot (`None`: vacant), in a dense array of its own: checking a hint
    /// reads it, and a slot's first line is full with what a decode step reads.
    ids: Vec<Option<SeqId>>,
    vacant: Vec<u32>,
    /// Times the shard was locked (counted under the lock): every operation reaches its
    /// sequences through a lock, so an unchanged count means unchanged sequences.
    locks: u64,
}

impl Shard {
    fn slot(&self, id: SeqId) -> Option<u32> {
        self.slot_of.get(&id).copied()
    }

    /// The sequence in `slot`, which is live (found in `slot_of`, or checked with
    /// [`Shard::holds`] under the lock that still holds it).
    #[inline(always)]
    fn at(&mut self, slot: u32) -> &mut Sequence {
        debug_assert!(self.ids[slot as usize].is_some(), "a live slot");
        &mut self.slots[slot as usize].0
    }

    /// Whether `slot` holds `id`.
    #[inline(always)]
    fn holds(&self, slot: u32, id: SeqId) -> bool {
        self.ids.get(slot as usize) == Some(&Some(id))
    }

    fn get(&mut self, id: SeqId) -> Option<&mut Sequence> {
        let slot = self.slot(id)?;
        Some(self.at(slot))
    }

    fn get_ref(&self, id: SeqId) -> Option<&Sequence> {
        Some(&self.slots[self.slot(id)? as usize].0)
    }

    /// Adds `id`, which is not live.
    fn insert(&mut self, id: SeqId, seq: Sequence) {
        let slot = match self.vacant.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Slot(seq);
                self.ids[slot as usize] = Some(id);
                slot
            }
            None => {
                self.slots.push(Slot(seq));
                self.ids.push(Some(id));
                (self.slots.len() - 1) as u32
            }
        };
        self.slot_of.insert(id, slot);
    }

    fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let slot = self.slot_of.remove(&id)?;
        self.vacant.push(slot);
        self.ids[slot as usize] = None;
        let Slot(seq) = std::mem::replace(&mut self.slots[slot as usize], Slot::vacant());
        Some(seq)
    }

    fn iter(&self) -> impl Iterator<Item = (&SeqId, &Sequence)> {
        (self.ids.iter().zip(&self.slots)).filter_map(|(id, slot)| Some((id.as_ref()?, &slot.0)))
    }
}

/// A shard's place for one sequence, on a cache line of its own, so what a decode step reads
/// of a settled member (the first 64 bytes of [`Sequence`]) is one line.
#[repr(align(64))]
struct Slot(Sequence);

impl Slot {
    /// A vacant slot: an empty sequence, which allocates nothing.
    fn vacant() -> Slot {
        let empty = Sequence::new(
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            [0; 32],
            0,
            0,
        );
        Slot(empty)
    }
}

/// The capacity a sequence's vector of `len` items starts with: twice `len`, what a `Vec`
/// grows to on its first push past `len`. Decoding then pushes into room reserved where the
/// sequence was made, instead of reallocating (and copying a whole prompt) under a step's
/// locks.
pub(crate) fn room_for(len: usize) -> usize {
    2 * len
}

/// A copy of `items` with the capacity of [`room_for`] its length.
pub(crate) fn with_room<T: Copy>(items: &[T]) -> Vec<T> {
    let mut copy = Vec::with_capacity(room_for(items.len()));
    copy.extend_from_slice(items);
    copy
}

/// All live sequences.
pub(crate) struct SequenceMap {
    shards: Box<[Mutex<Shard>]>,
    len: AtomicUsize,
    /// Unique to this map in the process, so lock counts of one map are never taken for
    /// another's.
    id: u64,
}

/// The lock counts of a batch's shards when it locked them (see [`LockedBatch::locks`]).
#[derive(Clone, Debug)]
pub(crate) struct ShardLocks {
    map: u64,
    /// The shards locked.
    mask: u32,
    counts: [u64; SHARDS],
}

fn shard_of(id: SeqId) -> usize {
    (id.wrapping_mul(MIX) >> SHARD_SHIFT) as usize
}

/// The bit of `id`'s shard in a mask for [`SequenceMap::lock_shards`].
pub(crate) fn shard_bit(id: SeqId) -> u32 {
    1 << shard_of(id)
}

impl SequenceMap {
    /// No sequences.
    pub(crate) fn new() -> SequenceMap {
        static MAPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        SequenceMap {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            len: AtomicUsize::new(0),
            id: MAPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Number of live sequences.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Locks the shards holding `ids` (in shard order) for the duration of one operation.
    pub(crate) fn lock(&self, ids: &[SeqId]) -> LockedBatch<'_> {
        self.lock_shards(ids.iter().fold(0, |mask, &id| mask | shard_bit(id)))
    }

    /// Locks the one shard holding `id`.
    pub(crate) fn lock_one(&self, id: SeqId) -> LockedSeq<'_> {
        LockedSeq {
            shard: self.lock_shard(shard_of(id)),
            id,
            len: &self.len,
        }
    }

    /// Locks the one shard holding `id` to read it: not counted as a lock, since nothing
    /// can change through it.
    pub(crate) fn read_one(&self, id: SeqId) -> ReadSeq<'_> {
        ReadSeq {
            shard: lock(&self.shards[shard_of(id)]),
            id,
        }
    }

    /// Locks every shard to read them (an audit), uncounted like [`SequenceMap::read_one`].
    pub(crate) fn read_all(&self) -> ReadAll<'_> {
        ReadAll {
            shards: self.shards.iter().map(lock).collect(),
        }
    }

    /// Locks the shards in `mask` (bits from [`shard_bit`]), in shard order.
    pub(crate) fn lock_shards(&self, mut mask: u32) -> LockedBatch<'_> {
        let mut guards: [Option<MutexGuard<'_, Shard>>; SHARDS] = std::array::from_fn(|_| None);
        while mask != 0 {
            let shard = mask.trailing_zeros() as usize;
            guards[shard] = Some(self.lock_shard(shard));
            mask &= mask - 1;
        }
        LockedBatch {
            guards,
            len: &self.len,
            map: self.id,
        }
    }

    /// Locks one shard, counting the lock.
    fn lock_shard(&self, shard: usize) -> MutexGuard<'_, Shard> {
        let mut guard = lock(&self.shards[shard]);
        guard.locks += 1;
        guard
    }
}

/// The locked shards of one batch operation (or of an audit: every shard).
pub(crate) struct LockedBatch<'a> {
    guards: [Option<MutexGuard<'a, Shard>>; SHARDS],
    len: &'a AtomicUsize,
    map: u64,
}

/// The slots (and the ids in them) of a [`LockedBatch`]'s shards; a shard it did not lock
/// has none.
pub(crate) struct Slots<'b>([(&'b mut [Slot], &'b [Option<SeqId>]); SHARDS]);

impl Slots<'_> {
    /// The member found by [`LockedBatch::find`] (in this batch, and still live).
    #[inline(always)]
    pub(crate) fn at(&mut self, member: Member) -> &mut Sequence {
        let (slots, ids) = &mut self.0[member.shard as usize % SHARDS];
        debug_assert!(ids[member.slot as usize].is_some(), "a live slot");
        &mut slots[member.slot as usize].0
    }
}

/// Where a live member of a batch is: found once, then reached without a lookup.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Member {
    shard: u8,
    slot: u32,
}

impl Member {
    /// The bit of the member's shard in a shard mask.
    pub(crate) fn shard_bit(self) -> u32 {
        1 << self.shard
    }
}

impl LockedBatch<'_> {
    fn shard(&mut self, id: SeqId) -> &mut Shard {
        self.guards[shard_of(id)]
            .as_mut()
            .expect("the batch locked this sequence's shard")
    }

    /// Where the sequence is, if live.
    pub(crate) fn find(&mut self, id: SeqId) -> Option<Member> {
        let shard = shard_of(id);
        let slot = self.shard(id).slot(id)?;
        Some(Member {
            shard: shard as u8,
            slot,
        })
    }

    /// Where the sequence is, if live, trying `hint` (where it was found before) first.
    #[inline(always)]
    pub(crate) fn find_hinted(&mut self, id: SeqId, hint: Option<Member>) -> Option<Member> {
        match hint {
            Some(member) if self.shard(id).holds(member.slot, id) => Some(member),
            _ => self.find(id),
        }
    }

    /// The member found by [`LockedBatch::find`] (in this batch, and still live).
    #[inline(always)]
    pub(crate) fn at(&mut self, member: Member) -> &mut Sequence {
        self.guards[member.shard as usize]
            .as_mut()
            .expect("the batch locked this member's shard")
            .at(member.slot)
    }

    /// The locked shards' slots, to reach many members in a row (a decode step's appends):
    /// each through two indexes, with no guard to check.
    pub(crate) fn slots(&mut self) -> Slots<'_> {
        Slots(self.guards.each_mut().map(|guard| match guard {
            Some(guard) => {
                let Shard { slots, ids, .. } = &mut **guard;
                (&mut slots[..], &ids[..])
            }
            None => Default::default(),
        }))
    }

    /// The lock counts of the locked shards, for [`LockedBatch::untouched`] in a later batch.
    pub(crate) fn locks(&self) -> ShardLocks {
        let mut mask = 0;
        let counts = std::array::from_fn(|shard| match &self.guards[shard] {
            Some(guard) => {
                mask |= 1 << shard;
                guard.locks
            }
            None => 0,
        });
        ShardLocks {
            map: self.map,
            mask,
            counts,
        }
    }

    /// The mask of locked shards that nothing else locked since `seen` (this batch's lock is
    /// the one more): their sequences are exactly as `seen`'s batch left them.
    pub(crate) fn untouched(&self, seen: &ShardLocks) -> u32 {
        if seen.map != self.map {
            return 0;
        }
        let mut mask = 0;
        for (shard, guard) in self.guards.iter().enumerate() {
            if guard
                .as_ref()
                .is_some_and(|g| g.locks == seen.counts[shard] + 1)
            {
                mask |= 1 << shard;
            }
        }
        mask & seen.mask
    }

    /// The sequence, if live.
    pub(crate) fn get(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.shard(id).get(id)
    }

    /// Whether `id` is live.
    pub(crate) fn contains(&mut self, id: SeqId) -> bool {
        self.shard(id).slot(id).is_some()
    }

    /// Adds a new sequence.
    pub(crate) fn insert(&mut self, id: SeqId, seq: Sequence) {
        self.shard(id).insert(id, seq);
        self.len.fetch_add(1, Ordering::Relaxed);
    }
}

/// One shard locked to read one sequence.
pub(crate) struct ReadSeq<'a> {
    shard: MutexGuard<'a, Shard>,
    id: SeqId,
}

impl ReadSeq<'_> {
    /// The sequence, if live.
    pub(crate) fn get(&self) -> Option<&Sequence> {
        self.shard.get_ref(self.id)
    }
}

/// Every shard, locked to read them.
pub(crate) struct ReadAll<'a> {
    shards: Vec<MutexGuard<'a, Shard>>,
}

impl ReadAll<'_> {
    /// Every live sequence.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&SeqId, &Sequence)> {
        self.shards.iter().flat_map(|shard| shard.iter())
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

    /// A removed sequence's slot holds no id (a hint to it fails) until an insert reuses it.
    #[test]
    fn a_vacated_slot_holds_no_id_until_reused() {
        let mut shard = Shard::default();
        shard.insert(1, sequence(3));
        shard.insert(2, sequence(5));
        let slot = shard.slot(1).unwrap();
        assert!(shard.holds(slot, 1) && !shard.holds(slot, 2));
        assert_eq!(shard.remove(1).unwrap().tokens.len(), 3);
        assert!(!shard.holds(slot, 1));
        assert_eq!(shard.get(1).map(|s| s.tokens.len()), None);
        let live: Vec<SeqId> = shard.iter().map(|(&id, _)| id).collect();
        assert_eq!(live, [2]);
        shard.insert(3, sequence(4));
        assert_eq!(shard.slot(3), Some(slot));
        assert!(shard.holds(slot, 3) && !shard.holds(slot, 1));
        assert_eq!(shard.at(slot).tokens.len(), 4);
        assert!(!shard.holds(2, 3), "a slot past the end holds nothing");
    }
}
