//! Multi-thread stress tests of `BlockManager`: several threads drive their own sequences over
//! shared prompt prefixes on a pool small enough that eviction, copy-on-write and `OutOfBlocks`
//! are routine; afterwards every invariant must hold and every block must come back.
//!
//! Besides `check()`, the tests verify what no single thread can see: a physical block shared by
//! several live sequences must hold the same tokens for all of them, and (in
//! `threads_read_back_their_kv`) a simulated engine that writes each token's KV only where a plan
//! says, applies the plan's copies and the swaps' pairs, and reads every sequence's whole KV
//! back through its block table after each step must never read anything but its own KV.

#[path = "../../../benches/support/splitmix64.rs"]
mod splitmix64;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::thread;

use pagedkv::{
    Batch, BlockId, BlockManager, Config, Error, Event, EventKind, Plan, PoolKind, SeqId, Token,
};
use splitmix64::{mix, SplitMix64};

/// Each thread's deterministic choices, so they are reproducible.
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(SplitMix64(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.next()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn token(&mut self) -> Token {
        // Far above the shared prefixes' ids, so suffixes share nothing by accident.
        1000 + self.below(1 << 20) as Token
    }
}

/// A swap the engine has not confirmed yet.
enum PendingSwap {
    Out,
    In,
}

/// One thread's view of a sequence it owns.
struct Owned {
    id: SeqId,
    tokens: Vec<Token>,
    /// Tokens some plan covered (the rest were appended since).
    planned: usize,
    swapped: bool,
    pending: Option<PendingSwap>,
}

impl Owned {
    fn new(id: SeqId, tokens: Vec<Token>, planned: usize) -> Owned {
        Owned {
            id,
            tokens,
            planned,
            swapped: false,
            pending: None,
        }
    }

    /// On the GPU, nothing pending, every token planned: it may step, fork or swap out.
    fn ready(&self) -> bool {
        !self.swapped && self.pending.is_none() && self.planned == self.tokens.len()
    }
}

/// Tallies across threads, to show the run exercised what it claims to.
#[derive(Debug, Default)]
struct Tally {
    out_of_blocks: AtomicU64,
    allocated: AtomicU64,
    steps: AtomicU64,
    /// Steps through a persistent batch (also counted in `steps`).
    batch_steps: AtomicU64,
    prefills: AtomicU64,
    copies: AtomicU64,
    forks: AtomicU64,
    swaps: AtomicU64,
    commits: AtomicU64,
}

impl Tally {
    fn count(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
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

/// Replays the event stream: it must be gapless from 0, and in each medium a hash may be stored
/// only while absent and removed only while present (the cache is never reset in these tests).
#[derive(Default)]
struct Replay {
    next_seq_no: u64,
    gpu: HashSet<u128>,
    cpu: HashSet<u128>,
    gpu_removed: u64,
    cpu_stored: u64,
}

impl Replay {
    fn feed(&mut self, events: &[Event]) {
        for e in events {
            let n = e.seq_no;
            assert_eq!(n, self.next_seq_no, "event sequence numbers");
            self.next_seq_no += 1;
            match &e.kind {
                EventKind::BlockStored {
                    block_hash, medium, ..
                } => {
                    let tier = match medium {
                        PoolKind::Gpu => &mut self.gpu,
                        PoolKind::Cpu => {
                            self.cpu_stored += 1;
                            &mut self.cpu
                        }
                    };
                    assert!(tier.insert(*block_hash), "event {n}: stored twice");
                }
                EventKind::BlockRemoved {
                    block_hash, medium, ..
                } => {
                    let tier = match medium {
                        PoolKind::Gpu => {
                            self.gpu_removed += 1;
                            &mut self.gpu
                        }
                        PoolKind::Cpu => &mut self.cpu,
                    };
                    assert!(tier.remove(block_hash), "event {n}: removed while absent");
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
    assert!(mgr.num_computed(o.id).unwrap() <= o.planned);
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

/// Asserts that a plan matches the sequences' tables and lengths, with `query_lens[b]` queries
/// each, and that its copies are well formed; returns how many copies it carried.
fn verify_plan(mgr: &BlockManager, batch: &[SeqId], query_lens: &[usize], plan: &Plan) -> u64 {
    let bs = mgr.config().block_size as usize;
    let n = mgr.config().num_blocks as i32;
    assert_eq!(plan.batch_size(), batch.len());
    assert_eq!(plan.num_query_tokens(), query_lens.iter().sum::<usize>());
    for (b, &s) in batch.iter().enumerate() {
        let table = mgr.block_table(s).unwrap();
        let len = mgr.num_tokens(s).unwrap();
        let (lo, hi) = (plan.kv_indptr[b] as usize, plan.kv_indptr[b + 1] as usize);
        let indices: Vec<u32> = plan.kv_indices[lo..hi].iter().map(|&x| x as u32).collect();
        assert_eq!(indices, table);
        let q0 = plan.qo_indptr[b] as usize;
        assert_eq!(plan.qo_indptr[b + 1] as usize - q0, query_lens[b]);
        for (j, pos) in (len - query_lens[b]..len).enumerate() {
            assert_eq!(plan.positions[q0 + j], pos as i32);
            assert_eq!(
                plan.slot_mapping[q0 + j] as usize,
                table[pos / bs] as usize * bs + pos % bs
            );
        }
        assert_eq!(
            plan.kv_last_page_len[b] as usize,
            len - (table.len() - 1) * bs
        );
    }
    assert_eq!(plan.copies.len() % 2, 0);
    for pair in plan.copies.chunks(2) {
        assert!((0..n).contains(&pair[0]) && (0..n).contains(&pair[1]) && pair[0] != pair[1]);
    }
    plan.num_copies() as u64
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
fn free_one<T>(mgr: &BlockManager, rng: &mut Rng, live: &mut Vec<T>, id: impl Fn(&T) -> SeqId) {
    if !live.is_empty() {
        let o = live.swap_remove(rng.below(live.len()));
        mgr.free(id(&o)).unwrap();
    }
}

fn tolerate_oob(result: Result<(), Error>, tally: &Tally) -> bool {
    match result {
        Ok(()) => true,
        Err(Error::OutOfBlocks { .. }) => {
            Tally::count(&tally.out_of_blocks, 1);
            false
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// Picks a random subset (at least one) of `candidates`.
fn subset(rng: &mut Rng, mut candidates: Vec<usize>) -> Vec<usize> {
    while candidates.len() > 1 && rng.below(3) != 0 {
        candidates.swap_remove(rng.below(candidates.len()));
    }
    candidates
}

/// Confirms an owned sequence's pending swap (the engine copied its pairs).
fn confirm_pending(mgr: &BlockManager, o: &mut Owned) {
    match o.pending.take() {
        Some(PendingSwap::Out) => mgr.confirm_swap_out(&[o.id]).unwrap(),
        Some(PendingSwap::In) => mgr.confirm_swap_in(&[o.id]).unwrap(),
        None => {}
    }
}

/// One worker: drives its own sequences through every operation; returns what it still owns.
/// Makes the persistent batch's rows exactly the sequences `live[i]` for `i` in `chosen`;
/// returns their indices in row order.
fn make_rows(rows: &mut Batch, live: &[Owned], chosen: &[usize]) -> Vec<usize> {
    let ids: Vec<SeqId> = chosen.iter().map(|&i| live[i].id).collect();
    for seq in rows.seqs().to_vec() {
        if !ids.contains(&seq) {
            rows.remove(seq).unwrap();
        }
    }
    for &seq in &ids {
        if !rows.contains(seq) {
            rows.add(seq).unwrap();
        }
    }
    let index_of = |seq: SeqId| chosen[ids.iter().position(|&s| s == seq).unwrap()];
    rows.seqs().iter().map(|&seq| index_of(seq)).collect()
}

/// Each row of the batch's table holds its sequence's blocks, padded with -1.
fn verify_rows(mgr: &BlockManager, rows: &Batch) {
    let width = rows.width();
    for (r, &seq) in rows.seqs().iter().enumerate() {
        let table = mgr.block_table(seq).unwrap();
        let row = &rows.block_table()[r * width..(r + 1) * width];
        assert!(
            table.iter().zip(row).all(|(&b, &e)| b as i32 == e),
            "row {r}"
        );
        assert!(
            row[table.len()..].iter().all(|&e| e == -1),
            "row {r} padding"
        );
    }
}

fn worker(mgr: &BlockManager, thread_id: u64, ops: usize, tally: &Tally) -> Vec<Owned> {
    let mut rng = Rng::new(0x5EED ^ thread_id.wrapping_mul(0x1234_5678_9ABC));
    let bs = mgr.config().block_size as usize;
    let prefixes = shared_prefixes(bs);
    let salt = format!("tenant-{thread_id}").into_bytes();
    let mut live: Vec<Owned> = Vec::new();
    let mut next_id = thread_id << 40;
    let mut plan = Plan::new();
    // A persistent batch for some decode steps; its rows of freed sequences stay until a
    // step's rows are drawn without them.
    let mut rows = Batch::new();
    let id = |o: &Owned| o.id;
    for _ in 0..ops {
        let roll = rng.below(100);
        let on_gpu = |o: &Owned| !o.swapped && o.pending.is_none();
        let ready: Vec<usize> = (0..live.len()).filter(|&i| live[i].ready()).collect();
        let unplanned: Vec<usize> = (0..live.len())
            .filter(|&i| on_gpu(&live[i]) && !live[i].ready())
            .collect();
        let resident: Vec<usize> = (0..live.len()).filter(|&i| on_gpu(&live[i])).collect();
        let pending: Vec<usize> = (0..live.len())
            .filter(|&i| live[i].pending.is_some())
            .collect();
        let swapped: Vec<usize> = (0..live.len())
            .filter(|&i| live[i].swapped && live[i].pending.is_none())
            .collect();
        match roll {
            0..=19 if live.len() < 6 => {
                let mut tokens = prefixes[rng.below(prefixes.len())].clone();
                tokens.extend((0..1 + rng.below(3 * bs)).map(|_| rng.token()));
                let salt = (rng.below(4) == 0).then_some(salt.as_slice());
                next_id += 1;
                match mgr.allocate(next_id, &tokens, salt) {
                    Ok(reused) => {
                        assert!(reused < tokens.len() && reused % bs == 0);
                        Tally::count(&tally.allocated, 1);
                        live.push(Owned::new(next_id, tokens, reused));
                    }
                    Err(Error::OutOfBlocks {
                        pool: PoolKind::Gpu,
                        needed,
                        available,
                    }) => {
                        assert!(needed > available);
                        Tally::count(&tally.out_of_blocks, 1);
                        free_one(mgr, &mut rng, &mut live, id);
                    }
                    Err(e) => panic!("allocate: {e}"),
                }
            }
            20..=31 if !unplanned.is_empty() => {
                // A prefill (or chunk after appends): plan every unplanned token.
                let batch = subset(&mut rng, unplanned);
                let ids: Vec<SeqId> = batch.iter().map(|&i| live[i].id).collect();
                let qs: Vec<usize> = batch
                    .iter()
                    .map(|&i| live[i].tokens.len() - live[i].planned)
                    .collect();
                let q32: Vec<u32> = qs.iter().map(|&q| q as u32).collect();
                mgr.plan(&ids, &q32, &mut plan).unwrap();
                Tally::count(&tally.copies, verify_plan(mgr, &ids, &qs, &plan));
                for &i in &batch {
                    live[i].planned = live[i].tokens.len();
                }
                Tally::count(&tally.prefills, 1);
            }
            32..=54 if !ready.is_empty() => {
                let mut batch = subset(&mut rng, ready);
                let persistent = rng.below(2) == 0;
                if persistent {
                    batch = make_rows(&mut rows, &live, &batch);
                }
                let ids: Vec<SeqId> = batch.iter().map(|&i| live[i].id).collect();
                let toks: Vec<Token> = batch.iter().map(|_| rng.token()).collect();
                let stepped = if persistent {
                    let result = mgr.step_batch(&mut rows, &toks);
                    if result.is_ok() {
                        rows.write_plan(&mut plan);
                        verify_rows(mgr, &rows);
                        Tally::count(&tally.batch_steps, 1);
                    }
                    result
                } else {
                    mgr.step(&ids, &toks, &mut plan)
                };
                if tolerate_oob(stepped, tally) {
                    for (&i, &t) in batch.iter().zip(&toks) {
                        live[i].tokens.push(t);
                        live[i].planned += 1;
                    }
                    let ones = vec![1; ids.len()];
                    Tally::count(&tally.copies, verify_plan(mgr, &ids, &ones, &plan));
                    Tally::count(&tally.steps, 1);
                } else {
                    free_one(mgr, &mut rng, &mut live, id);
                }
            }
            55..=62 if !resident.is_empty() => {
                let i = resident[rng.below(resident.len())];
                let toks: Vec<Token> = (0..1 + rng.below(2 * bs)).map(|_| rng.token()).collect();
                if tolerate_oob(mgr.append(live[i].id, &toks), tally) {
                    live[i].tokens.extend_from_slice(&toks);
                    verify_owned(mgr, &live[i]);
                } else {
                    free_one(mgr, &mut rng, &mut live, id);
                }
            }
            63..=70 if !ready.is_empty() && live.len() < 8 => {
                let i = ready[rng.below(ready.len())];
                next_id += 1;
                mgr.fork(live[i].id, next_id).unwrap();
                let tokens = live[i].tokens.clone();
                live.push(Owned::new(next_id, tokens.clone(), tokens.len()));
                Tally::count(&tally.forks, 1);
            }
            71..=80 => free_one(mgr, &mut rng, &mut live, id),
            81..=86 if !ready.is_empty() => {
                let i = ready[rng.below(ready.len())];
                match mgr.swap_out(&[live[i].id]) {
                    Ok(pairs) => {
                        assert!(!pairs.is_empty());
                        live[i].swapped = true;
                        live[i].pending = Some(PendingSwap::Out);
                        Tally::count(&tally.swaps, 1);
                    }
                    Err(Error::OutOfBlocks {
                        pool: PoolKind::Cpu,
                        ..
                    }) => Tally::count(&tally.out_of_blocks, 1),
                    Err(e) => panic!("swap_out: {e}"),
                }
                verify_owned(mgr, &live[i]);
            }
            87..=92 if !swapped.is_empty() => {
                let i = swapped[rng.below(swapped.len())];
                match mgr.swap_in(&[live[i].id]) {
                    Ok(pairs) => {
                        assert!(!pairs.is_empty());
                        live[i].swapped = false;
                        live[i].pending = Some(PendingSwap::In);
                        verify_owned(mgr, &live[i]);
                    }
                    Err(Error::OutOfBlocks {
                        pool: PoolKind::Gpu,
                        ..
                    }) => {
                        Tally::count(&tally.out_of_blocks, 1);
                        free_one(mgr, &mut rng, &mut live, id);
                    }
                    Err(e) => panic!("swap_in: {e}"),
                }
            }
            93..=96 if !pending.is_empty() => {
                let i = pending[rng.below(pending.len())];
                confirm_pending(mgr, &mut live[i]);
            }
            97..=99 if !resident.is_empty() => {
                let batch = subset(&mut rng, resident);
                let ids: Vec<SeqId> = batch.iter().map(|&i| live[i].id).collect();
                mgr.commit(&ids, None).unwrap();
                for &i in &batch {
                    assert_eq!(mgr.num_computed(live[i].id).unwrap(), live[i].planned);
                }
                Tally::count(&tally.commits, 1);
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
        // Stop the observer even if a worker panicked, then pass the panic on.
        let joined: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        done.store(true, Ordering::Relaxed);
        let owned = joined
            .into_iter()
            .flat_map(|j| j.unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect();
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
        Tally::get(&tally.out_of_blocks) > 0,
        "the pool never ran out"
    );
    for (what, counter) in [
        ("forks", &tally.forks),
        ("swaps", &tally.swaps),
        ("steps", &tally.steps),
        ("persistent batch steps", &tally.batch_steps),
        ("prefills", &tally.prefills),
        ("copies", &tally.copies),
        ("commits", &tally.commits),
        ("allocations", &tally.allocated),
    ] {
        assert!(Tally::get(counter) > 0, "no {what}");
    }

    for o in &owned {
        mgr.free(o.id).unwrap();
    }
    assert_accounted(&mgr);
    let st = mgr.stats();
    assert_eq!((st.num_held, st.stored_tokens), (0, 0));
    assert_eq!((st.computed_tokens, st.pending_tokens), (0, 0));
    assert!(mgr.is_empty());

    // What was stored and not removed is exactly what each tier holds now (nothing is held, so
    // the CPU tier is empty and the GPU one is the cached blocks).
    replay.feed(&mgr.take_events());
    assert!(replay.cpu_stored > 0, "no swap-out reached the CPU tier");
    assert!(replay.cpu.is_empty());
    assert_eq!(replay.gpu.len(), st.num_cached);
    assert_eq!(replay.gpu_removed, st.evictions);
    let stored: HashSet<u128> = mgr.stored_hashes(PoolKind::Gpu).into_iter().collect();
    assert_eq!(stored, replay.gpu);
    assert!(mgr.stored_hashes(PoolKind::Cpu).is_empty());
}

/// The KV a simulated engine keeps: one value per slot of the GPU pool and of the CPU pool.
/// Position `p` of a sequence holds `kv(tokens[..=p])`, so a slot read back through a block
/// table proves which prefix wrote it.
struct Engine {
    bs: usize,
    gpu: Vec<AtomicU64>,
    cpu: Vec<AtomicU64>,
}

/// The KV values of every position of a prompt with this salt.
fn kv_values(salt: u64, tokens: &[Token]) -> Vec<u64> {
    let mut v = mix(salt ^ 0xC0FF_EE00);
    tokens
        .iter()
        .map(|&t| {
            v = mix(v ^ u64::from(t).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            v
        })
        .collect()
}

/// One thread's sequence with the KV values the engine must read back for it.
struct KvSeq {
    id: SeqId,
    salt: u64,
    tokens: Vec<Token>,
    values: Vec<u64>,
    /// Tokens whose KV the engine wrote (and, with auto-commit off, committed).
    planned: usize,
    /// Swapped out: the CPU table (derived from the swap's pairs).
    cpu_table: Option<Vec<BlockId>>,
    /// A swap whose pairs the engine copies when it confirms.
    pending: Option<Vec<[BlockId; 2]>>,
}

impl KvSeq {
    fn push(&mut self, token: Token) {
        self.tokens.push(token);
        self.values = kv_values(self.salt, &self.tokens);
    }

    fn ready(&self) -> bool {
        self.cpu_table.is_none() && self.pending.is_none() && self.planned == self.tokens.len()
    }
}

impl Engine {
    fn new(config: &Config) -> Engine {
        let slots = |blocks: u32| {
            (0..blocks as usize * config.block_size as usize)
                .map(|_| AtomicU64::new(0))
                .collect()
        };
        Engine {
            bs: config.block_size as usize,
            gpu: slots(config.num_blocks),
            cpu: slots(config.num_cpu_blocks),
        }
    }

    fn copy_block(&self, from: &[AtomicU64], src: BlockId, to: &[AtomicU64], dst: BlockId) {
        for o in 0..self.bs {
            let v = from[src as usize * self.bs + o].load(Ordering::Relaxed);
            to[dst as usize * self.bs + o].store(v, Ordering::Relaxed);
        }
    }

    /// Runs a plan's forward pass: the copies first, then each query token's KV into its slot;
    /// then every sequence of the batch reads its whole KV back through `kv_indices`.
    fn run(&self, plan: &Plan, batch: &[&KvSeq]) -> u64 {
        for pair in plan.copies.chunks(2) {
            self.copy_block(&self.gpu, pair[0] as u32, &self.gpu, pair[1] as u32);
        }
        for (b, s) in batch.iter().enumerate() {
            for j in plan.qo_indptr[b] as usize..plan.qo_indptr[b + 1] as usize {
                let value = s.values[plan.positions[j] as usize];
                self.gpu[plan.slot_mapping[j] as usize].store(value, Ordering::Relaxed);
            }
        }
        for (b, s) in batch.iter().enumerate() {
            let pages =
                &plan.kv_indices[plan.kv_indptr[b] as usize..plan.kv_indptr[b + 1] as usize];
            let kv_len = (pages.len() - 1) * self.bs + plan.kv_last_page_len[b] as usize;
            assert_eq!(kv_len, s.tokens.len());
            let table: Vec<BlockId> = pages.iter().map(|&p| p as BlockId).collect();
            self.read_back(&self.gpu, &table, s, kv_len, "plan");
        }
        plan.num_copies() as u64
    }

    /// Asserts that the first `n` positions of `s` read its own KV through `table`.
    fn read_back(&self, pool: &[AtomicU64], table: &[BlockId], s: &KvSeq, n: usize, when: &str) {
        for p in 0..n {
            let slot = table[p / self.bs] as usize * self.bs + p % self.bs;
            let got = pool[slot].load(Ordering::Relaxed);
            assert_eq!(
                got, s.values[p],
                "{when}: sequence {} reads wrong KV at position {p} (slot {slot})",
                s.id
            );
        }
    }

    /// Copies a swap's pairs (GPU -> CPU for a swap-out, CPU -> GPU for a swap-in).
    fn copy_pairs(&self, pairs: &[[BlockId; 2]], out: bool) {
        let (from, to) = if out {
            (&self.gpu, &self.cpu)
        } else {
            (&self.cpu, &self.gpu)
        };
        for &[src, dst] in pairs {
            self.copy_block(from, src, to, dst);
        }
    }
}

/// Tallies of the slot-content run.
#[derive(Debug, Default)]
struct KvTally {
    hit_reads: AtomicU64,
    copies: AtomicU64,
    swaps: AtomicU64,
    forks: AtomicU64,
    steps: AtomicU64,
    out_of_blocks: AtomicU64,
}

/// Confirms a pending swap after copying its pairs, then reads the KV back where it now lives.
fn confirm_kv(mgr: &BlockManager, engine: &Engine, s: &mut KvSeq) {
    let Some(pairs) = s.pending.take() else {
        return;
    };
    let n = s.planned;
    if let Some(cpu) = &s.cpu_table {
        engine.copy_pairs(&pairs, true);
        mgr.confirm_swap_out(&[s.id]).unwrap();
        engine.read_back(&engine.cpu, cpu, s, n, "swap-out");
    } else {
        engine.copy_pairs(&pairs, false);
        mgr.confirm_swap_in(&[s.id]).unwrap();
        let table = mgr.block_table(s.id).unwrap();
        engine.read_back(&engine.gpu, &table, s, n, "swap-in");
    }
}

/// One thread of the slot-content test: admits prompts over a shared system prompt, prefills,
/// decodes, forks, swaps and frees, running every plan through the engine.
fn kv_worker(mgr: &BlockManager, engine: &Engine, thread_id: u64, ops: usize, tally: &KvTally) {
    let mut rng = Rng::new(0xD00D ^ thread_id.wrapping_mul(0x2545_F491_4F6C_DD1D));
    let bs = engine.bs;
    let auto_commit = mgr.config().auto_commit;
    let system: Vec<Token> = (0..3 * bs as Token + 1).collect();
    let mut live: Vec<KvSeq> = Vec::new();
    let mut next_id = thread_id << 40;
    let mut plan = Plan::new();
    let oob = |r: &Error| matches!(r, Error::OutOfBlocks { .. });
    for _ in 0..ops {
        let ready: Vec<usize> = (0..live.len()).filter(|&i| live[i].ready()).collect();
        let unplanned: Vec<usize> = (0..live.len())
            .filter(|&i| {
                let s = &live[i];
                s.cpu_table.is_none() && s.pending.is_none() && s.planned < s.tokens.len()
            })
            .collect();
        match rng.below(100) {
            0..=17 if live.len() < 5 => {
                let mut tokens = system[..system.len() - rng.below(bs + 1)].to_vec();
                tokens.extend((0..1 + rng.below(2 * bs)).map(|_| rng.token()));
                // A few tenants with their own salt, so salts must keep prefixes apart.
                let salt_id = if rng.below(5) == 0 { thread_id } else { 0 };
                let salt_bytes = salt_id.to_le_bytes();
                let salt = (salt_id != 0).then_some(&salt_bytes[..]);
                next_id += 1;
                match mgr.allocate(next_id, &tokens, salt) {
                    Ok(reused) => {
                        let s = KvSeq {
                            id: next_id,
                            salt: salt_id,
                            values: kv_values(salt_id, &tokens),
                            tokens,
                            planned: reused,
                            cpu_table: None,
                            pending: None,
                        };
                        // A hit must already hold this prefix's KV.
                        let table = mgr.block_table(s.id).unwrap();
                        engine.read_back(&engine.gpu, &table, &s, reused, "hit");
                        if reused > 0 {
                            Tally::count(&tally.hit_reads, 1);
                        }
                        live.push(s);
                    }
                    Err(e) if oob(&e) => {
                        Tally::count(&tally.out_of_blocks, 1);
                        free_one(mgr, &mut rng, &mut live, |s: &KvSeq| s.id);
                    }
                    Err(e) => panic!("allocate: {e}"),
                }
            }
            18..=65 if !ready.is_empty() || !unplanned.is_empty() => {
                // One engine step: the ready sequences decode, the others prefill what no plan
                // covered (a step is only for ready ones, so mixed batches go through `plan`).
                let decode = rng.below(2) == 0 && !ready.is_empty();
                let batch = subset(&mut rng, if decode { ready } else { unplanned });
                let ids: Vec<SeqId> = batch.iter().map(|&i| live[i].id).collect();
                let result = if decode {
                    let toks: Vec<Token> = batch.iter().map(|_| rng.token()).collect();
                    mgr.step(&ids, &toks, &mut plan).inspect(|()| {
                        for (&i, &t) in batch.iter().zip(&toks) {
                            live[i].push(t);
                        }
                    })
                } else {
                    let qs: Vec<u32> = batch
                        .iter()
                        .map(|&i| (live[i].tokens.len() - live[i].planned) as u32)
                        .collect();
                    mgr.plan(&ids, &qs, &mut plan)
                };
                match result {
                    Ok(()) => {
                        let seqs: Vec<&KvSeq> = batch.iter().map(|&i| &live[i]).collect();
                        Tally::count(&tally.copies, engine.run(&plan, &seqs));
                        for &i in &batch {
                            live[i].planned = live[i].tokens.len();
                        }
                        if !auto_commit {
                            mgr.commit(&ids, None).unwrap();
                        }
                        Tally::count(&tally.steps, 1);
                    }
                    Err(e) if oob(&e) => {
                        Tally::count(&tally.out_of_blocks, 1);
                        free_one(mgr, &mut rng, &mut live, |s: &KvSeq| s.id);
                    }
                    Err(e) => panic!("step: {e}"),
                }
            }
            66..=72 if !ready.is_empty() => {
                let i = ready[rng.below(ready.len())];
                let toks: Vec<Token> = (0..1 + rng.below(bs)).map(|_| rng.token()).collect();
                match mgr.append(live[i].id, &toks) {
                    Ok(()) => toks.iter().for_each(|&t| live[i].push(t)),
                    Err(e) if oob(&e) => Tally::count(&tally.out_of_blocks, 1),
                    Err(e) => panic!("append: {e}"),
                }
            }
            73..=79 if !ready.is_empty() && live.len() < 7 => {
                let i = ready[rng.below(ready.len())];
                next_id += 1;
                mgr.fork(live[i].id, next_id).unwrap();
                let parent = &live[i];
                let child = KvSeq {
                    id: next_id,
                    salt: parent.salt,
                    tokens: parent.tokens.clone(),
                    values: parent.values.clone(),
                    planned: parent.planned,
                    cpu_table: None,
                    pending: None,
                };
                live.push(child);
                Tally::count(&tally.forks, 1);
            }
            80..=87 => free_one(mgr, &mut rng, &mut live, |s: &KvSeq| s.id),
            88..=92 if !ready.is_empty() => {
                let i = ready[rng.below(ready.len())];
                let gpu_table = mgr.block_table(live[i].id).unwrap();
                match mgr.swap_out(&[live[i].id]) {
                    Ok(pairs) => {
                        let to: HashMap<BlockId, BlockId> =
                            pairs.iter().map(|&[g, c]| (g, c)).collect();
                        live[i].cpu_table = Some(gpu_table.iter().map(|g| to[g]).collect());
                        live[i].pending = Some(pairs);
                        Tally::count(&tally.swaps, 1);
                    }
                    Err(e) if oob(&e) => Tally::count(&tally.out_of_blocks, 1),
                    Err(e) => panic!("swap_out: {e}"),
                }
            }
            93..=96 => {
                // Swap in a confirmed swapped-out sequence.
                let out: Vec<usize> = (0..live.len())
                    .filter(|&i| live[i].cpu_table.is_some() && live[i].pending.is_none())
                    .collect();
                if let Some(&i) = out.get(rng.below(out.len().max(1))) {
                    match mgr.swap_in(&[live[i].id]) {
                        Ok(pairs) => {
                            let cpu = live[i].cpu_table.take().unwrap();
                            let to: HashMap<BlockId, BlockId> =
                                pairs.iter().map(|&[c, g]| (c, g)).collect();
                            let table: Vec<BlockId> = cpu.iter().map(|c| to[c]).collect();
                            assert_eq!(mgr.block_table(live[i].id).unwrap(), table);
                            live[i].pending = Some(pairs);
                        }
                        Err(e) if oob(&e) => {
                            Tally::count(&tally.out_of_blocks, 1);
                            free_one(mgr, &mut rng, &mut live, |s: &KvSeq| s.id);
                        }
                        Err(e) => panic!("swap_in: {e}"),
                    }
                }
            }
            97..=99 => {
                let pending: Vec<usize> = (0..live.len())
                    .filter(|&i| live[i].pending.is_some())
                    .collect();
                if let Some(&i) = pending.get(rng.below(pending.len().max(1))) {
                    confirm_kv(mgr, engine, &mut live[i]);
                }
            }
            _ => {}
        }
    }
    for mut s in live {
        confirm_kv(mgr, engine, &mut s);
        // A sequence that appended since its last plan may hold a copy-on-write copy that only
        // its next plan delivers: its table's tail is not filled yet, so only the others read.
        if s.cpu_table.is_none() && s.planned == s.tokens.len() {
            let table = mgr.block_table(s.id).unwrap();
            engine.read_back(&engine.gpu, &table, &s, s.planned, "end");
        }
        mgr.free(s.id).unwrap();
    }
}

/// Threads share one manager and one simulated KV cache: prefix hits across threads, forks,
/// copy-on-write, swaps and evictions must never let a sequence read KV that is not its own.
#[test]
fn threads_read_back_their_kv() {
    const THREADS: u64 = 4;
    let ops = if cfg!(optimized) { 60_000 } else { 5_000 };
    for auto_commit in [true, false] {
        let mut cfg = Config::new(64, 4);
        cfg.num_cpu_blocks = 32;
        cfg.watermark = 0.0;
        cfg.auto_commit = auto_commit;
        let mgr = BlockManager::new(cfg.clone()).unwrap();
        let engine = Engine::new(&cfg);
        let tally = KvTally::default();
        thread::scope(|scope| {
            for t in 0..THREADS {
                let (mgr, engine, tally) = (&mgr, &engine, &tally);
                scope.spawn(move || kv_worker(mgr, engine, t + 1, ops, tally));
            }
        });
        assert_accounted(&mgr);
        let st = mgr.stats();
        eprintln!("slot contents (auto_commit {auto_commit}): {tally:?}, {st:?}");
        assert!(mgr.is_empty());
        assert_eq!((st.num_held, st.stored_tokens), (0, 0));
        assert!(st.evictions > 0, "the pool never had to evict");
        for (what, counter) in [
            ("prefix hits read back", &tally.hit_reads),
            ("copies", &tally.copies),
            ("swaps", &tally.swaps),
            ("forks", &tally.forks),
            ("steps", &tally.steps),
            ("OutOfBlocks", &tally.out_of_blocks),
        ] {
            assert!(Tally::get(counter) > 0, "no {what}");
        }
    }
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
        // Its prefill ran: the prefix is computed, so its full blocks become cached.
        let mut plan = Plan::new();
        mgr.plan(&[warm], &[tokens.len() as u32], &mut plan)
            .unwrap();
        mgr.commit(&[warm], None).unwrap();
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
