//! Taking reserved GPU blocks: an operation that knows it takes at least `n` blocks takes them
//! from the pool in chunks (one LRU lock per chunk, not per block) and hands them out one at a
//! time, in pool order. An evicted block leaves the prefix cache when it is handed out, exactly
//! where a one-at-a-time take would have evicted it, so the chunk changes no outcome; meanwhile
//! the registrations its evictions read are prefetched.

use crate::events::EventKind;
use crate::manager::BlockManager;
use crate::{BlockId, PoolKind};

/// Blocks taken from the pool at once (a chunk is one cache line).
const CHUNK: usize = 16;

/// The blocks one operation takes, in order, and what they cost the cache.
pub(super) struct Takes {
    /// Blocks certain to be taken beyond the current chunk (past them, one at a time).
    ahead: usize,
    chunk: [BlockId; CHUNK],
    /// Bit `i`: `chunk[i]` was evicted from the prefix cache.
    evicted: u16,
    len: usize,
    next: usize,
    /// Blocks handed out.
    pub(super) blocks: usize,
    /// How many of them were evicted from the prefix cache (counted once per operation,
    /// [`BlockManager::count_evictions`]).
    pub(super) evictions: u64,
}

impl Takes {
    /// Takes of which at least `certain` will happen (more are taken one at a time).
    pub(super) fn at_least(certain: usize) -> Takes {
        Takes {
            ahead: certain,
            chunk: [0; CHUNK],
            evicted: 0,
            len: 0,
            next: 0,
            blocks: 0,
            evictions: 0,
        }
    }

    /// Whether `chunk[i]` was evicted from the prefix cache.
    fn evicted(&self, i: usize) -> bool {
        self.evicted >> i & 1 == 1
    }
}

impl Drop for Takes {
    fn drop(&mut self) {
        debug_assert_eq!(
            self.next, self.len,
            "blocks taken from the pool were not handed out"
        );
    }
}

impl BlockManager {
    /// Hands out the next block the caller reserved (FREE first, else the least recently
    /// released CACHED block, which leaves the prefix cache now).
    pub(super) fn take(&self, takes: &mut Takes) -> BlockId {
        if takes.next == takes.len {
            self.take_chunk(takes);
        }
        let (block, evicted) = (takes.chunk[takes.next], takes.evicted(takes.next));
        takes.next += 1;
        takes.blocks += 1;
        if evicted {
            if let Some(prefix) = &self.prefix {
                // The next eviction's registration was prefetched with the chunk: read its key
                // and prefetch its map slot.
                if takes.next < takes.len && takes.evicted(takes.next) {
                    prefix.prefetch_slot(takes.chunk[takes.next]);
                }
                prefix.unregister(block, || {
                    self.events.record(|| EventKind::BlockRemoved {
                        block_hash: prefix.hash_of(block),
                        block_id: block,
                        medium: PoolKind::Gpu,
                    })
                });
            }
            takes.evictions += 1;
        }
        block
    }

    /// Takes the next chunk from the pool: the certain takes left (up to a chunk), or one.
    #[inline(never)]
    fn take_chunk(&self, takes: &mut Takes) {
        let n = takes.ahead.clamp(1, CHUNK);
        takes.ahead = takes.ahead.saturating_sub(n);
        let mut taken = [(0, false); CHUNK];
        let next = self.gpu.take_reserved_into(&mut taken[..n]);
        takes.evicted = 0;
        for (i, &(block, evicted)) in taken[..n].iter().enumerate() {
            takes.chunk[i] = block;
            takes.evicted |= u16::from(evicted) << i;
            if let (true, Some(prefix)) = (evicted, &self.prefix) {
                prefix.prefetch_key(block);
            }
        }
        if let (Some(next), Some(prefix)) = (next, &self.prefix) {
            prefix.prefetch_key(next);
        }
        (takes.len, takes.next) = (n, 0);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::manager::testing::*;
    use crate::Token;

    /// A manager whose pool holds a few FREE blocks and many CACHED ones (released in a
    /// shuffled order), with events on.
    fn warm() -> BlockManager {
        let mgr = manager(64, 2, |c| c.enable_events = true);
        for seq in 0..30u64 {
            let tokens: Vec<Token> = (0..4).map(|t| (seq * 7 + t) as Token).collect();
            mgr.allocate(seq, &tokens, None).unwrap();
            prefill(&mgr, &[seq]);
            mgr.commit(&[seq], None).unwrap();
        }
        for seq in (0..30u64).map(|s| s * 11 % 30) {
            mgr.free(seq).unwrap();
        }
        mgr.take_events();
        mgr
    }

    /// Chunks of blocks taken at once hand out the same blocks, with the same evictions and
    /// events, as blocks taken one at a time.
    #[test]
    fn chunks_change_no_outcome() {
        let (chunked, single) = (warm(), warm());
        let n = 40;
        let take = |mgr: &BlockManager, certain| {
            mgr.gpu.reserve(n).unwrap();
            let mut takes = Takes::at_least(certain);
            let blocks: Vec<BlockId> = (0..n).map(|_| mgr.take(&mut takes)).collect();
            assert_eq!(takes.blocks, n);
            for &block in &blocks {
                mgr.gpu.release_block(block, 0);
            }
            mgr.check().unwrap();
            (blocks, takes.evictions, event_blocks(mgr))
        };
        let expected = take(&single, 0);
        assert!(expected.1 > 16, "more evictions than one chunk");
        assert_eq!(take(&chunked, n), expected);
    }
}
