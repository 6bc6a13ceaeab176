use super::*;

fn cached_block(pool: &BlockPool) -> BlockId {
    let block = pool.allocate().unwrap();
    pool.mark_hashed(block);
    assert_eq!(pool.release_block(block, 0), Released::Cached);
    block
}

/// A pool of 40 held blocks, hashed or not, some shared twice, their tokens counted stored.
fn mixed_pool() -> (BlockPool, Vec<BlockId>) {
    let pool = BlockPool::new(40).unwrap();
    let blocks: Vec<_> = (0..40).map(|_| pool.allocate().unwrap()).collect();
    for &b in &blocks {
        if b % 3 != 0 {
            pool.mark_hashed(b);
        }
        if b % 5 == 0 {
            pool.share_held(b);
        }
    }
    pool.add_stored(40 * 16);
    (pool, blocks)
}

fn same_audit(a: &BlockPool, b: &BlockPool) {
    let (a, b) = (a.audit(), b.audit());
    assert_eq!(a.states, b.states);
    assert_eq!(a.free, b.free);
    assert_eq!(a.cached, b.cached);
    assert_eq!(
        (a.num_cached, a.available, a.stored_tokens),
        (b.num_cached, b.available, b.stored_tokens)
    );
}

#[test]
fn runs_change_nothing_but_the_locking() {
    // Releases: 40 blocks (more than a chunk), some shared, some unhashed.
    let (one, blocks) = mixed_pool();
    let (run, _) = mixed_pool();
    let fill = |b: BlockId| 1 + b % 16;
    let released: Vec<_> = blocks
        .iter()
        .rev()
        .map(|&b| one.release_block(b, fill(b)))
        .collect();
    assert!(released.contains(&Released::Held) && released.contains(&Released::Freed));
    run.release_blocks(blocks.iter().rev().map(|&b| (b, fill(b))));
    same_audit(&one, &run);
    // Revivals and shares, stopping at the first stale snapshot.
    let mut hits: Vec<_> = blocks.iter().map(|&b| (b, one.state(b))).collect();
    hits.retain(|&(_, state)| state.hashed());
    // A snapshot of an older incarnation.
    hits[20].1 = hits[20].1.fresh().with_hashed(true);
    one.reserve(20).unwrap();
    run.reserve(20).unwrap();
    let mut acquired = (0, 0);
    for &(block, seen) in &hits {
        match one.acquire_hit(block, seen, 16) {
            Some(hit) => {
                acquired.0 += 1;
                acquired.1 += usize::from(hit == Hit::Revived);
            }
            None => break,
        }
    }
    assert_eq!(acquired.0, 20);
    assert!(
        acquired.1 > 0 && acquired.1 < 20,
        "both revivals and shares"
    );
    assert_eq!(run.acquire_hits(&hits, 16), acquired);
    same_audit(&one, &run);
}

#[test]
fn free_blocks_go_before_cached_ones_and_eviction_is_lru() {
    let pool = BlockPool::new(3).unwrap();
    let a = cached_block(&pool);
    let b = cached_block(&pool);
    assert_eq!((a, b), (0, 1), "free blocks go before cached ones");
    let pool = BlockPool::new(3).unwrap();
    let held: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    for &block in &held {
        pool.mark_hashed(block);
    }
    pool.release_block(held[2], 0);
    pool.release_block(held[0], 0);
    pool.release_block(held[1], 0);
    assert_eq!(pool.num_cached(), 3);
    pool.reserve(3).unwrap();
    let order: Vec<_> = (0..3).map(|_| pool.take_reserved()).collect();
    assert_eq!(order, vec![(2, true), (0, true), (1, true)]);
}

#[test]
fn reservations_are_all_or_nothing() {
    let pool = BlockPool::new(4).unwrap();
    assert_eq!(pool.reserve(5), Err(4));
    pool.reserve(3).unwrap();
    assert_eq!(pool.reserve(2), Err(1));
    pool.unreserve(3);
    assert_eq!(pool.available(), 4);
}

#[test]
fn hits_share_or_revive_the_same_incarnation_only() {
    let pool = BlockPool::new(2).unwrap();
    let block = cached_block(&pool);
    let seen = pool.state(block);
    pool.reserve(1).unwrap();
    assert_eq!(pool.acquire_hit(block, seen, 0), Some(Hit::Revived));
    let held = pool.state(block);
    assert_eq!(pool.acquire_hit(block, held, 0), Some(Hit::Shared));
    assert_eq!(pool.state(block).refcount(), 2);
    assert_eq!(
        pool.acquire_hit(block, seen, 0),
        None,
        "stale cached snapshot"
    );
    pool.clear_hashes([block].into_iter());
    assert_eq!(
        pool.acquire_hit(block, held, 0),
        None,
        "no longer registered"
    );
    assert_eq!(pool.release_block(block, 0), Released::Held);
    assert_eq!(pool.release_block(block, 0), Released::Freed);
    assert_eq!(pool.num_free(), 2);
}

#[test]
fn bench_handles_release_exactly_once() {
    let pool = bench::Pool::new(2);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    assert_ne!(a.id(), b.id());
    assert!(pool.allocate().is_none());
    drop((a, b));
    assert_eq!(pool.num_free(), 2);
}

#[test]
fn releases_uncount_stored_tokens() {
    let pool = BlockPool::new(2).unwrap();
    let block = pool.allocate().unwrap();
    pool.add_stored(5);
    pool.share_held(block);
    assert_eq!(pool.release_block(block, 5), Released::Held);
    assert_eq!(pool.stored_tokens(), 5);
    assert_eq!(pool.release_block(block, 5), Released::Freed);
    assert_eq!(pool.stored_tokens(), 0);
}
