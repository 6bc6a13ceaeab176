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
    prefix.register(
        block,
        OLD,
        0,
        &OLD_CHAIN,
        &OLD_TOKENS,
        0,
        || true,
        || pool.mark_hashed(block),
    );
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
            prefix.register(
                block,
                NEW,
                0,
                &NEW_CHAIN,
                &NEW_TOKENS,
                0,
                || true,
                || pool.mark_hashed(block),
            );
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
            prefix.register(
                block,
                key,
                0,
                &[0; 32],
                &tokens,
                0,
                || true,
                || pool.mark_hashed(block),
            );
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
