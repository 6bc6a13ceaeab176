//! Multi-thread stress tests of `BlockManager`: several threads drive their own sequences over
//! shared prompt prefixes on a pool small enough that eviction, copy-on-write and `OutOfBlocks`
//! are routine; afterwards every invariant must hold and every block must come back.
//!
//! Besides `check()`, the tests verify what no single thread can see: a physical block shared by
//! several live sequences must hold the same tokens for all of them (a lost race between a prefix
//! hit reviving a cached block and an eviction reusing it would break exactly this).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::thread;

use pagedkv::{BlockManager, Config, Error, Event, EventKind, Plan, PoolKind, SeqId, Token};

/// A small deterministic generator (SplitMix64), so each thread's choices are reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn token(&mut self) -> Token {
        // Far above the shared prefixes' ids, so suffixes share nothing by accident.
        1000 + self.below(1 << 20) as Token
    }
}

/// One thread's view of a sequence it owns.
struct Owned {
    id: SeqId,
    tokens: Vec<Token>,
    swapped: bool,
}

/// Tallies across threads, to show the run exercised what it claims to.
#[derive(Debug, Default)]
struct Tally {
    out_of_blocks: AtomicU64,
    allocated: AtomicU64,
    steps: AtomicU64,
    forks: AtomicU64,
    swaps: AtomicU64,
}

fn shared_prefixes(bs: usize) -> Vec<Vec<Token>> {
    (0..3u32)
        .map(|p| {
            (0..(2 + p as usize) * bs)
                .map(|i| p * 100 + i as Token)
                .collect()
        })
        .collect()
}

/// Replays the event stream: it must be gapless from 0, a hash may be stored only while absent
/// and removed only while present (the cache is never reset in these tests).
#[derive(Default)]
struct Replay {
    next_seq_no: u64,
    cached: HashSet<u128>,
    removed: u64,
}

impl Replay {
    fn feed(&mut self, events: &[Event]) {
        for e in events {
            let n = e.seq_no;
            assert_eq!(n, self.next_seq_no, "event sequence numbers");
            self.next_seq_no += 1;
            match &e.kind {
                EventKind::BlockStored { block_hash, .. } => {
                    assert!(self.cached.insert(*block_hash), "event {n}: stored twice");
                }
                EventKind::BlockRemoved { block_hash } => {
                    assert!(
                        self.cached.remove(block_hash),
                        "event {n}: removed while absent"
                    );
                    self.removed += 1;
                }
                EventKind::AllBlocksCleared => panic!("event {n}: nobody reset the cache"),
            }
        }
    }
}

/// Asserts that the sequence's tokens and table agree with what its owner expects.
fn verify_owned(mgr: &BlockManager, o: &Owned) {
    let bs = mgr.config().block_size as usize;
    assert_eq!(mgr.tokens(o.id).unwrap(), o.tokens, "tokens of {}", o.id);
    assert_eq!(mgr.num_tokens(o.id).unwrap(), o.tokens.len());
    match mgr.block_table(o.id) {
        Err(Error::SwappedOut(id)) => assert!(o.swapped && id == o.id),
        Ok(table) => {
            assert!(!o.swapped, "sequence {} should be swapped out", o.id);
            assert_eq!(table.len(), o.tokens.len().div_ceil(bs));
            assert!(table.iter().all(|&b| b < mgr.config().num_blocks));
        }
        Err(e) => panic!("block_table({}): {e}", o.id),
    }
}

/// Asserts that a step's plan matches the sequences' tables and lengths.
fn verify_step_plan(mgr: &BlockManager, batch: &[SeqId], plan: &Plan) {
    let bs = mgr.config().block_size as usize;
    assert_eq!(plan.batch_size(), batch.len());
    assert_eq!(plan.num_query_tokens(), batch.len());
    for (b, &s) in batch.iter().enumerate() {
        let table = mgr.block_table(s).unwrap();
        let len = mgr.num_tokens(s).unwrap();
        let (lo, hi) = (plan.kv_indptr[b] as usize, plan.kv_indptr[b + 1] as usize);
        let indices: Vec<u32> = plan.kv_indices[lo..hi].iter().map(|&x| x as u32).collect();
        assert_eq!(indices, table);
        let pos = len - 1;
        assert_eq!(plan.positions[b], pos as i32);
        assert_eq!(
            plan.slot_mapping[b] as usize,
            table[pos / bs] as usize * bs + pos % bs
        );
        assert_eq!(
            plan.kv_last_page_len[b] as usize,
            len - (table.len() - 1) * bs
        );
    }
}

/// Every physical block shared by several live, resident sequences must hold the same tokens
/// for each of them.
fn verify_shared_contents(mgr: &BlockManager, seqs: &[SeqId]) {
    let bs = mgr.config().block_size as usize;
    let mut contents: HashMap<u32, (SeqId, Vec<Token>)> = HashMap::new();
    for &s in seqs {
        let Ok(table) = mgr.block_table(s) else {
            continue;
        };
        let tokens = mgr.tokens(s).unwrap();
        for (i, &b) in table.iter().enumerate() {
            let slice = tokens[i * bs..tokens.len().min((i + 1) * bs)].to_vec();
            if let Some((other, prev)) = contents.get(&b) {
                assert_eq!(
                    prev, &slice,
                    "block {b} holds different tokens for {other} and {s}"
                );
            } else {
                contents.insert(b, (s, slice));
            }
        }
    }
}

fn assert_accounted(mgr: &BlockManager) {
    if let Err(e) = mgr.check() {
        panic!("check(): {e}");
    }
    let st = mgr.stats();
    assert_eq!(st.num_free + st.num_cached + st.num_held, st.num_blocks);
}

/// Frees a random owned sequence (the reaction to `OutOfBlocks`); false when none is owned.
fn free_one(mgr: &BlockManager, rng: &mut Rng, live: &mut Vec<Owned>) -> bool {
    if live.is_empty() {
        return false;
    }
    let o = live.swap_remove(rng.below(live.len()));
    mgr.free(o.id).unwrap();
    true
}

fn tolerate_oob(result: Result<(), Error>, tally: &Tally) -> bool {
    match result {
        Ok(()) => true,
        Err(Error::OutOfBlocks { .. }) => {
            tally.out_of_blocks.fetch_add(1, Ordering::Relaxed);
            false
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// One worker: drives its own sequences through every operation; returns what it still owns.
fn worker(mgr: &BlockManager, thread_id: u64, ops: usize, tally: &Tally) -> Vec<Owned> {
    let mut rng = Rng(0x5EED ^ thread_id.wrapping_mul(0x1234_5678_9ABC));
    let bs = mgr.config().block_size as usize;
    let prefixes = shared_prefixes(bs);
    let salt = format!("tenant-{thread_id}").into_bytes();
    let mut live: Vec<Owned> = Vec::new();
    let mut next_id = thread_id << 40;
    let mut plan = Plan::new();
    for _ in 0..ops {
        let roll = rng.below(100);
        let resident: Vec<usize> = (0..live.len()).filter(|&i| !live[i].swapped).collect();
        let swapped: Vec<usize> = (0..live.len()).filter(|&i| live[i].swapped).collect();
        match roll {
            0..=21 if live.len() < 6 => {
                let mut tokens = prefixes[rng.below(prefixes.len())].clone();
                tokens.extend((0..1 + rng.below(3 * bs)).map(|_| rng.token()));
                let salt = (rng.below(4) == 0).then_some(salt.as_slice());
                next_id += 1;
                let r = mgr.allocate(next_id, &tokens, salt);
                match r {
                    Ok(reused) => {
                        assert!(reused < tokens.len() && reused % bs == 0);
                        tally.allocated.fetch_add(1, Ordering::Relaxed);
                        live.push(Owned {
                            id: next_id,
                            tokens,
                            swapped: false,
                        });
                    }
                    Err(Error::OutOfBlocks {
                        pool: PoolKind::Gpu,
                        needed,
                        available,
                    }) => {
                        assert!(needed > available);
                        tally.out_of_blocks.fetch_add(1, Ordering::Relaxed);
                        free_one(mgr, &mut rng, &mut live);
                    }
                    Err(e) => panic!("allocate: {e}"),
                }
            }
            22..=54 if !resident.is_empty() => {
                let mut batch: Vec<usize> = resident.clone();
                while batch.len() > 1 && rng.below(3) != 0 {
                    batch.swap_remove(rng.below(batch.len()));
                }
                let ids: Vec<SeqId> = batch.iter().map(|&i| live[i].id).collect();
                let toks: Vec<Token> = batch.iter().map(|_| rng.token()).collect();
                if tolerate_oob(mgr.step(&ids, &toks, &mut plan), tally) {
                    for (&i, &t) in batch.iter().zip(&toks) {
                        live[i].tokens.push(t);
                    }
                    verify_step_plan(mgr, &ids, &plan);
                    tally.steps.fetch_add(1, Ordering::Relaxed);
                } else {
                    free_one(mgr, &mut rng, &mut live);
                }
            }
            55..=64 if !resident.is_empty() => {
                let i = resident[rng.below(resident.len())];
                let toks: Vec<Token> = (0..1 + rng.below(2 * bs)).map(|_| rng.token()).collect();
                if tolerate_oob(mgr.append(live[i].id, &toks), tally) {
                    live[i].tokens.extend_from_slice(&toks);
                    verify_owned(mgr, &live[i]);
                } else {
                    free_one(mgr, &mut rng, &mut live);
                }
            }
            65..=72 if !resident.is_empty() && live.len() < 8 => {
                let i = resident[rng.below(resident.len())];
                next_id += 1;
                mgr.fork(live[i].id, next_id).unwrap();
                let tokens = live[i].tokens.clone();
                live.push(Owned {
                    id: next_id,
                    tokens,
                    swapped: false,
                });
                tally.forks.fetch_add(1, Ordering::Relaxed);
            }
            73..=84 => {
                free_one(mgr, &mut rng, &mut live);
            }
            85..=91 if !resident.is_empty() => {
                let i = resident[rng.below(resident.len())];
                match mgr.swap_out(&[live[i].id]) {
                    Ok(pairs) => {
                        assert!(!pairs.is_empty());
                        live[i].swapped = true;
                        tally.swaps.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(Error::OutOfBlocks {
                        pool: PoolKind::Cpu,
                        ..
                    }) => {
                        tally.out_of_blocks.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("swap_out: {e}"),
                }
                verify_owned(mgr, &live[i]);
            }
            92..=98 if !swapped.is_empty() => {
                let i = swapped[rng.below(swapped.len())];
                match mgr.swap_in(&[live[i].id]) {
                    Ok(pairs) => {
                        assert!(!pairs.is_empty());
                        live[i].swapped = false;
                        verify_owned(mgr, &live[i]);
                    }
                    Err(Error::OutOfBlocks {
                        pool: PoolKind::Gpu,
                        ..
                    }) => {
                        tally.out_of_blocks.fetch_add(1, Ordering::Relaxed);
                        free_one(mgr, &mut rng, &mut live);
                    }
                    Err(e) => panic!("swap_in: {e}"),
                }
            }
            99 => {
                let n = mgr.config().num_blocks;
                for [src, dst] in mgr.take_copies() {
                    assert!(src < n && dst < n && src != dst);
                }
            }
            _ => {}
        }
    }
    for o in &live {
        verify_owned(mgr, o);
    }
    live
}

#[test]
fn four_threads_share_one_manager() {
    const THREADS: u64 = 4;
    let ops = if cfg!(optimized) { 400_000 } else { 20_000 };
    let mut cfg = Config::new(96, 4);
    cfg.num_cpu_blocks = 48;
    cfg.watermark = 0.0;
    cfg.enable_events = true;
    let mgr = BlockManager::new(cfg).unwrap();
    let tally = Tally::default();
    let done = AtomicBool::new(false);

    let (owned, mut replay): (Vec<Owned>, Replay) = thread::scope(|scope| {
        // An observer reading shared state and draining events while the workers run.
        let observer = scope.spawn(|| {
            let mut replay = Replay::default();
            let mut reads = 0u64;
            while !done.load(Ordering::Relaxed) {
                let st = mgr.stats();
                assert_eq!(st.num_blocks, 96);
                assert!((0.0..=1.0).contains(&st.usage));
                let _ = mgr.can_allocate(&shared_prefixes(4)[0], None);
                replay.feed(&mgr.take_events());
                reads += 1;
            }
            assert!(reads > 0);
            replay
        });
        let (mgr, tally) = (&mgr, &tally);
        let workers: Vec<_> = (0..THREADS)
            .map(|t| scope.spawn(move || worker(mgr, t + 1, ops, tally)))
            .collect();
        let owned = workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        done.store(true, Ordering::Relaxed);
        (owned, observer.join().unwrap())
    });

    assert_accounted(&mgr);
    assert_eq!(mgr.len(), owned.len());
    for o in &owned {
        verify_owned(&mgr, o);
    }
    let ids: Vec<SeqId> = owned.iter().map(|o| o.id).collect();
    verify_shared_contents(&mgr, &ids);

    let st = mgr.stats();
    eprintln!("four threads: {tally:?}, {st:?}");
    assert!(st.evictions > 0, "the pool never had to evict");
    assert!(st.prefix_hit_tokens > 0, "no prefix was ever reused");
    assert!(
        tally.out_of_blocks.load(Ordering::Relaxed) > 0,
        "the pool never ran out"
    );
    assert!(tally.forks.load(Ordering::Relaxed) > 0 && tally.swaps.load(Ordering::Relaxed) > 0);
    assert!(tally.steps.load(Ordering::Relaxed) > 0 && tally.allocated.load(Ordering::Relaxed) > 0);

    for o in &owned {
        mgr.free(o.id).unwrap();
    }
    assert_accounted(&mgr);
    let st = mgr.stats();
    assert_eq!((st.num_held, st.stored_tokens), (0, 0));
    assert!(mgr.is_empty());

    // What was stored and not removed is exactly what is cached now (nothing is held).
    replay.feed(&mgr.take_events());
    assert_eq!(replay.cached.len(), st.num_cached);
    assert_eq!(replay.removed, st.evictions);
}

/// Threads hit one cached prefix while others force its blocks out: each hit must either revive
/// the cached block or miss, never share a block that an eviction handed to someone else.
///
/// Every round starts from the same arrangement: the prefix's blocks are the whole cached queue
/// (so they are the next victims) and a held filler leaves only a few FREE blocks. Then two
/// sharers (prefix + own token) and two evictors (one-block prompts that are never cached) start
/// together. A sharer frees its sequence before admitting the next, so the prefix keeps dropping
/// back to CACHED; evictors hold up to eight sequences each (together more than the FREE blocks,
/// so they take the queue head), then free them all at once.
#[test]
fn prefix_revival_races_eviction() {
    const BS: usize = 4;
    const PREFIX_BLOCKS: usize = 8;
    const NUM_BLOCKS: usize = 40;
    const SPARE_FREE: usize = 10;
    const ATTEMPTS: usize = 24;
    let rounds = if cfg!(optimized) { 3_000 } else { 300 };
    let mut cfg = Config::new(NUM_BLOCKS as u32, BS as u32);
    cfg.watermark = 0.0;
    let mgr = &BlockManager::new(cfg).unwrap();
    let prefix: Vec<Token> = (0..(PREFIX_BLOCKS * BS) as Token).collect();
    let next_id = AtomicU64::new(1);
    let full_hits = AtomicU64::new(0);
    let partial_hits = AtomicU64::new(0);

    // Allocates `tokens` as a new sequence kept in `mine`, first freeing the oldest one when
    // `mine` already holds `keep`. Returns the reused token count, `None` on `OutOfBlocks`.
    let admit = |tokens: &[Token], mine: &mut Vec<SeqId>, keep: usize| -> Option<usize> {
        if mine.len() >= keep {
            mgr.free(mine.remove(0)).unwrap();
        }
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        match mgr.allocate(id, tokens, None) {
            Ok(reused) => {
                mine.push(id);
                Some(reused)
            }
            Err(Error::OutOfBlocks { .. }) => None,
            Err(e) => panic!("allocate: {e}"),
        }
    };

    for round in 0..rounds {
        mgr.reset_prefix_cache();
        let warm = next_id.fetch_add(1, Ordering::Relaxed);
        let mut tokens = prefix.clone();
        tokens.push(1_000_000);
        mgr.allocate(warm, &tokens, None).unwrap();
        mgr.free(warm).unwrap();
        let filler = next_id.fetch_add(1, Ordering::Relaxed);
        let filler_blocks = NUM_BLOCKS - PREFIX_BLOCKS - SPARE_FREE;
        let filler_tokens: Vec<Token> = (0..(filler_blocks * BS) as Token)
            .map(|i| 5_000_000 + i)
            .collect();
        mgr.allocate(filler, &filler_tokens, None).unwrap();
        let st = mgr.stats();
        assert_eq!((st.num_cached, st.num_free), (PREFIX_BLOCKS, SPARE_FREE));

        let barrier = &Barrier::new(4);
        let (admit, prefix, full_hits, partial_hits) = (&admit, &prefix, &full_hits, &partial_hits);
        let mut live: Vec<SeqId> = thread::scope(|scope| {
            let sharers: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(move || {
                        barrier.wait();
                        let mut mine = Vec::new();
                        for _ in 0..ATTEMPTS {
                            let mut t = prefix.clone();
                            t.push(2_000_000 + round as Token);
                            if let Some(reused) = admit(&t, &mut mine, 1) {
                                assert!(reused <= prefix.len() && reused % BS == 0);
                                let tally = if reused == prefix.len() {
                                    full_hits
                                } else {
                                    partial_hits
                                };
                                tally.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        mine
                    })
                })
                .collect();
            let evictors: Vec<_> = (0..2)
                .map(|e| {
                    scope.spawn(move || {
                        barrier.wait();
                        let mut mine = Vec::new();
                        for i in 0..ATTEMPTS {
                            // Pressure in waves: hold up to eight, then let all go at once.
                            if mine.len() == 8 {
                                mine.drain(..).for_each(|s| mgr.free(s).unwrap());
                            }
                            // A partial block: never cached, so the cache holds only the prefix.
                            let t = [3_000_000 + (e * ATTEMPTS + i) as Token; BS - 1];
                            if let Some(reused) = admit(&t, &mut mine, usize::MAX) {
                                assert_eq!(reused, 0);
                            }
                        }
                        mine
                    })
                })
                .collect();
            sharers
                .into_iter()
                .chain(evictors)
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        live.push(filler);

        assert_accounted(mgr);
        verify_shared_contents(mgr, &live);
        for &s in &live {
            mgr.free(s).unwrap();
        }
        assert_accounted(mgr);
        assert_eq!(mgr.stats().num_held, 0, "round {round}");
    }
    let (full, partial) = (
        full_hits.load(Ordering::Relaxed),
        partial_hits.load(Ordering::Relaxed),
    );
    // Only the prefix is ever cached, so every eviction took one of its blocks.
    let evictions = mgr.stats().evictions;
    eprintln!(
        "revival race: {full} full hits, {partial} partial or no hits, {evictions} evictions"
    );
    assert!(full > 0, "the prefix was never reused whole");
    assert!(evictions > 0, "the prefix was never evicted");
}
