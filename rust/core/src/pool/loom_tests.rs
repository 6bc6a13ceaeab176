//! Loom models of the pool's races: revival against eviction, sharing against the last
//! release, a registration against another holder's release, allocation against release,
//! reset against the last release, the runs of releases and revivals against hits and
//! evictions, and a release to the head of the eviction order against an eviction.

use super::*;
use loom::sync::Arc;

/// A pool whose blocks are all CACHED, LRU order 0, 1, ...
fn all_cached(n: u32) -> BlockPool {
    let pool = BlockPool::new(n).unwrap();
    let blocks: Vec<_> = (0..n).map(|_| pool.allocate().unwrap()).collect();
    for &b in &blocks {
        pool.mark_hashed(b);
        pool.release_block(b, 0);
    }
    pool
}

fn assert_consistent(pool: &BlockPool) {
    let audit = pool.audit();
    assert_eq!(audit.available, audit.free.len() + audit.cached.len());
    assert_eq!(audit.num_cached, audit.cached.len());
    for &b in &audit.free {
        assert!(audit.states[b as usize].free());
    }
    for &b in &audit.cached {
        assert!(audit.states[b as usize].cached());
    }
}

#[test]
fn revive_and_evict_never_both_win() {
    loom::model(|| {
        let pool = Arc::new(all_cached(2));
        let seen = pool.state(0);
        pool.reserve(2).unwrap();
        let evictor = {
            let pool = pool.clone();
            loom::thread::spawn(move || pool.take_reserved())
        };
        let revived = pool.acquire_hit(0, seen, 0);
        let (evicted, was_cached) = evictor.join().unwrap();
        assert!(was_cached);
        match revived {
            Some(hit) => {
                assert_eq!(hit, Hit::Revived);
                assert_eq!(evicted, 1, "the evictor must take the other block");
                assert!(pool.state(0).hashed());
            }
            None => {
                assert_eq!(evicted, 0);
                assert!(!pool.state(0).hashed());
                pool.unreserve(1);
            }
        }
        assert_eq!(pool.state(0).refcount(), 1);
        assert_consistent(&pool);
    });
}

#[test]
fn share_races_last_release() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(1).unwrap());
        let block = pool.allocate().unwrap();
        pool.mark_hashed(block);
        let seen = pool.state(block);
        let owner = {
            let pool = pool.clone();
            loom::thread::spawn(move || pool.release_block(block, 0))
        };
        let hit = pool.acquire_hit(block, seen, 0);
        let released = owner.join().unwrap();
        match hit {
            Some(Hit::Shared) => {
                assert_eq!(released, Released::Held);
                assert_eq!(pool.state(block).refcount(), 1);
            }
            Some(Hit::Revived) => unreachable!("a held snapshot never revives"),
            None => {
                assert_eq!(released, Released::Cached);
                assert!(pool.state(block).cached());
            }
        }
        assert_consistent(&pool);
    });
}

/// A registration marks a block that another holder lets go meanwhile: neither change is
/// lost (a plain store of the hashed flag is only for a block's one holder).
#[test]
fn mark_hashed_races_another_holders_release() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(1).unwrap());
        let block = pool.allocate().unwrap();
        pool.share_held(block);
        let other = {
            let pool = pool.clone();
            loom::thread::spawn(move || pool.release_block(block, 0))
        };
        pool.mark_hashed(block);
        assert_eq!(other.join().unwrap(), Released::Held);
        let state = pool.state(block);
        assert!(state.hashed());
        assert_eq!(state.refcount(), 1);
        assert_eq!(pool.release_block(block, 0), Released::Cached);
        assert_consistent(&pool);
    });
}

#[test]
fn allocate_races_release() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(1).unwrap());
        let block = pool.allocate().unwrap();
        let releaser = {
            let pool = pool.clone();
            loom::thread::spawn(move || pool.release_block(block, 0))
        };
        let got = pool.allocate();
        releaser.join().unwrap();
        match got {
            Some(b) => {
                assert_eq!(b, block);
                assert_eq!(pool.state(b).refcount(), 1);
                assert_eq!(pool.available(), 0);
            }
            None => assert_eq!(pool.available(), 1),
        }
        assert_consistent(&pool);
    });
}

#[test]
fn reset_races_last_release() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(1).unwrap());
        let block = pool.allocate().unwrap();
        pool.mark_hashed(block);
        let owner = {
            let pool = pool.clone();
            loom::thread::spawn(move || pool.release_block(block, 0))
        };
        pool.clear_hashes([block].into_iter());
        owner.join().unwrap();
        let state = pool.state(block);
        assert!(state.free(), "reset leaves no block cached");
        assert_consistent(&pool);
    });
}

/// Two takes race a third take and a release that makes one more block FREE: every block is
/// taken once, evicted exactly when it was CACHED, and a take waits for the released block if
/// the count it reserved came from it.
#[test]
fn takes_race_take_and_release() {
    loom::model(|| {
        let pool = Arc::new(all_cached(3));
        let held = pool.allocate().unwrap();
        let other = {
            let pool = pool.clone();
            loom::thread::spawn(move || {
                pool.release_block(held, 0);
                pool.reserve(1).unwrap();
                pool.take_reserved()
            })
        };
        while pool.reserve(2).is_err() {
            loom::thread::yield_now();
        }
        let chunk = [pool.take_reserved(), pool.take_reserved()];
        let single = other.join().unwrap();
        let mut taken: Vec<_> = chunk.iter().chain([&single]).copied().collect();
        taken.sort_unstable();
        let blocks: Vec<BlockId> = taken.iter().map(|&(b, _)| b).collect();
        assert!(
            blocks.windows(2).all(|w| w[0] != w[1]),
            "a block taken twice"
        );
        for &(block, evicted) in &taken {
            assert_eq!(evicted, block != held, "evicted exactly the CACHED blocks");
            assert_eq!(pool.state(block).refcount(), 1);
        }
        assert_consistent(&pool);
    });
}

/// A run of releases (a sequence's free: its tail first, one LRU lock for both blocks) races a
/// run of hits on the same held blocks: each block ends held by the hit or CACHED, never both,
/// and the hits stop at the first block already released.
#[test]
fn release_run_races_hit_run() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(2).unwrap());
        let blocks = [pool.allocate().unwrap(), pool.allocate().unwrap()];
        for &b in &blocks {
            pool.mark_hashed(b);
        }
        pool.add_stored(8);
        let hits = blocks.map(|b| (b, pool.state(b)));
        let owner = {
            let pool = pool.clone();
            loom::thread::spawn(move || pool.release_blocks(blocks.iter().rev().map(|&b| (b, 4))))
        };
        let (acquired, revived) = pool.acquire_hits(&hits, 4);
        owner.join().unwrap();
        assert_eq!(revived, 0, "a held snapshot never revives");
        for (i, &block) in blocks.iter().enumerate() {
            let state = pool.state(block);
            if i < acquired {
                assert_eq!(state.refcount(), 1);
            } else {
                assert!(state.cached());
            }
        }
        assert_eq!(pool.stored_tokens(), 4 * acquired);
        assert_consistent(&pool);
    });
}

/// A run of revivals (one LRU lock for both) races an eviction: the eviction takes the first
/// block the run has not revived yet, and the run stops there.
#[test]
fn revival_run_races_eviction() {
    loom::model(|| {
        let pool = Arc::new(all_cached(3));
        let hits = [(0, pool.state(0)), (1, pool.state(1))];
        pool.reserve(3).unwrap();
        let evictor = {
            let pool = pool.clone();
            loom::thread::spawn(move || pool.take_reserved())
        };
        let (acquired, revived) = pool.acquire_hits(&hits, 0);
        let (evicted, was_cached) = evictor.join().unwrap();
        pool.unreserve(3 - 1 - revived);
        assert!(was_cached);
        assert_eq!(revived, acquired);
        assert_eq!(evicted as usize, acquired);
        for block in 0..3 {
            let state = pool.state(block);
            match (block as usize).cmp(&acquired) {
                std::cmp::Ordering::Less => assert!(state.hashed() && state.refcount() == 1),
                std::cmp::Ordering::Equal => assert!(!state.hashed() && state.refcount() == 1),
                std::cmp::Ordering::Greater => assert!(state.cached()),
            }
        }
        assert_consistent(&pool);
    });
}

/// A windowed sequence releases a block to the head of the eviction order while another thread
/// evicts: the eviction takes the head of the moment (the released block, or the oldest cached
/// one), never a block still held, and the order of the rest is kept.
#[test]
fn release_to_the_head_races_eviction() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let blocks: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        for &b in &blocks {
            pool.mark_hashed(b);
        }
        let (oldest, newest, window) = (blocks[0], blocks[1], blocks[2]);
        pool.release_block(oldest, 0);
        pool.release_block(newest, 0);
        pool.reserve(1).unwrap();
        let releaser = {
            let pool = pool.clone();
            loom::thread::spawn(move || pool.release_blocks_as([(window, 0, true)]))
        };
        let (evicted, was_cached) = pool.take_reserved();
        releaser.join().unwrap();
        assert!(was_cached);
        let cached = pool.audit().cached;
        if evicted == window {
            assert_eq!(cached, vec![oldest, newest]);
        } else {
            assert_eq!(evicted, oldest);
            assert_eq!(cached, vec![window, newest]);
        }
        assert_eq!(pool.state(evicted).refcount(), 1);
        assert_consistent(&pool);
    });
}
