//! Windowed attention and KV-cache groups: what a windowed manager holds and releases, the
//! eviction order of released window blocks, and a `HybridManager` over one pool.

use pagedkv::{Attention, Batch, BlockManager, Config, Error, HybridManager, Plan, PoolKind};

fn config(num_blocks: u32, block_size: u32) -> Config {
    let mut config = Config::new(num_blocks, block_size);
    config.hash_key = Some([3; 32]);
    config.watermark = 0.0;
    config.num_cpu_blocks = num_blocks;
    config
}

fn windowed(num_blocks: u32, block_size: u32, attention: Attention) -> BlockManager {
    let mut config = config(num_blocks, block_size);
    config.attention = attention;
    BlockManager::new(config).unwrap()
}

fn hybrid(num_blocks: u32, block_size: u32, groups: &[Attention]) -> HybridManager {
    HybridManager::new(config(num_blocks, block_size), groups).unwrap()
}

fn plans(n: usize) -> Vec<Plan> {
    (0..n).map(|_| Plan::new()).collect()
}

/// A sliding window of 8 tokens over blocks of 4: a decode query at position `p` reads
/// `p - 7..=p`, so the sequence holds the blocks from `(p - 7) / 4` on.
#[test]
fn a_sliding_window_holds_only_the_blocks_its_queries_read() {
    let mgr = windowed(32, 4, Attention::SlidingWindow(8));
    let prompt: Vec<u32> = (0..20).collect();
    mgr.allocate(1, &prompt, None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[20], &mut plan).unwrap();
    // The prefill's queries read from position 0: every block stays.
    assert_eq!(plan.kv_indptr, vec![0, 5]);
    assert_eq!(plan.attention, Attention::SlidingWindow(8));
    assert_eq!(mgr.first_block(1).unwrap(), 0);
    mgr.step(&[1], &[20], &mut plan).unwrap();
    // Query 20 reads 13..=20: blocks 3, 4 and 5.
    assert_eq!(mgr.first_block(1).unwrap(), 3);
    assert_eq!(plan.kv_indptr, vec![0, 3]);
    assert_eq!(plan.kv_last_page_len, vec![1]);
    assert_eq!(plan.positions, vec![20]);
    let table = mgr.block_table(1).unwrap();
    assert_eq!(table.len(), 3);
    assert_eq!(plan.slot_mapping, vec![table[2] as i32 * 4]);
    mgr.check().unwrap();
    // The released blocks were computed: they stay cached, so a prompt resuming at the end
    // of the first 12 tokens finds the window it needs.
    let st = mgr.stats();
    assert_eq!((st.num_held, st.num_cached), (3, 3));
    let again: Vec<u32> = (0..13).collect();
    assert_eq!(mgr.cached_prefix_blocks(&again, None), 3);
    assert_eq!(mgr.allocate(2, &again, None).unwrap(), 12);
    // Query 12 reads 5..=12: blocks 1 and 2 are hits, block 0 is not needed.
    assert_eq!(mgr.first_block(2).unwrap(), 1);
    mgr.check().unwrap();
    mgr.plan(&[2], &[1], &mut plan).unwrap();
    for _ in 0..40 {
        mgr.step(&[1, 2], &[7, 7], &mut plan).unwrap();
        assert!(
            plan.max_blocks() <= 3,
            "a window of 8 spans at most 3 blocks of 4"
        );
    }
    mgr.check().unwrap();
    mgr.free(1).unwrap();
    mgr.free(2).unwrap();
    mgr.check().unwrap();
}

/// Chunked-local attention of 8 tokens: a query reads only its own chunk, so a sequence holds
/// the blocks of its current chunk, and resuming at a chunk start needs no cached block.
#[test]
fn chunked_attention_holds_the_current_chunk() {
    let mgr = windowed(32, 4, Attention::ChunkedLocal(8));
    mgr.allocate(1, &[1; 7], None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[7], &mut plan).unwrap();
    mgr.step(&[1], &[2], &mut plan).unwrap();
    // Query 7 reads 0..=7.
    assert_eq!(
        (mgr.first_block(1).unwrap(), plan.kv_indptr.clone()),
        (0, vec![0, 2])
    );
    mgr.step(&[1], &[2], &mut plan).unwrap();
    // Query 8 starts the next chunk.
    assert_eq!(
        (mgr.first_block(1).unwrap(), plan.kv_indptr.clone()),
        (2, vec![0, 1])
    );
    for _ in 0..7 {
        mgr.step(&[1], &[2], &mut plan).unwrap();
    }
    assert_eq!(mgr.first_block(1).unwrap(), 2);
    mgr.step(&[1], &[2], &mut plan).unwrap();
    assert_eq!(mgr.first_block(1).unwrap(), 4);
    mgr.check().unwrap();
    // A prompt of 9 tokens resumes at position 8, where a query reads nothing before it.
    assert_eq!(mgr.allocate(2, &[5; 9], None).unwrap(), 8);
    assert_eq!(mgr.first_block(2).unwrap(), 2);
    mgr.check().unwrap();
}

/// Released window blocks are evicted before every other cached block, but for those a
/// request resuming at the end of the prompt reads: they keep their place.
#[test]
fn blocks_resuming_the_prompt_outlive_other_window_blocks() {
    let mgr = windowed(12, 4, Attention::SlidingWindow(4));
    let prompt: Vec<u32> = (100..109).collect(); // a resume point after block 1
    mgr.allocate(1, &prompt, None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[9], &mut plan).unwrap();
    for t in 0..12 {
        mgr.step(&[1], &[t], &mut plan).unwrap();
    }
    mgr.commit(&[1], None).unwrap();
    let st = mgr.stats();
    assert!(st.num_cached >= 3, "blocks left the window cached: {st:?}");
    // Resuming after block 1 needs block 1 (query 8 reads 5..=8): still cached.
    assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 2);
    // Fill the pool: the evictions take the other window blocks first.
    let available = st.num_free + st.num_cached;
    let others = available - 2;
    mgr.allocate(2, &vec![9; 4 * others], None).unwrap();
    assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 2);
    assert!(mgr.stats().evictions > 0);
    mgr.check().unwrap();
}

#[test]
fn windowed_rollbacks_and_plans_never_read_released_blocks() {
    let mgr = windowed(32, 4, Attention::SlidingWindow(4));
    mgr.allocate(1, &[1; 12], None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[12], &mut plan).unwrap();
    let mut batch = Batch::new();
    batch.add(1).unwrap();
    mgr.verify_batch(&mut batch, &[5, 6, 7], &[3]).unwrap();
    // Query 12 reads 9..=12: block 2 on.
    assert_eq!(mgr.first_block(1).unwrap(), 2);
    mgr.rollback_batch(&mut batch, &[2]).unwrap();
    // Planning queries from position 4 would read block 0, which is gone.
    assert!(matches!(
        mgr.plan(&[1], &[9], &mut plan),
        Err(Error::InvalidArgument(_))
    ));
    mgr.check().unwrap();
}

#[test]
fn groups_plan_each_their_blocks_over_one_pool() {
    let mgr = hybrid(64, 4, &[Attention::Full, Attention::SlidingWindow(8)]);
    let prompt: Vec<u32> = (0..20).collect();
    assert_eq!(mgr.allocate(1, &prompt, None).unwrap(), 0);
    assert_eq!(
        mgr.stats(0).unwrap().num_held,
        10,
        "5 blocks per group, one pool"
    );
    let mut p = plans(2);
    mgr.plan(&[1], &[20], &mut p).unwrap();
    mgr.step(&[1], &[20], &mut p).unwrap();
    assert_eq!(p[0].kv_indptr, vec![0, 6]);
    assert_eq!(p[1].kv_indptr, vec![0, 3]);
    assert_eq!(p[0].attention, Attention::Full);
    assert_eq!(p[1].attention, Attention::SlidingWindow(8));
    assert_eq!(p[0].positions, p[1].positions);
    assert_ne!(p[0].slot_mapping, p[1].slot_mapping);
    mgr.check().unwrap();

    // A second request: the full group serves 4 blocks, the window the blocks query 16 reads.
    let again: Vec<u32> = (0..17).collect();
    assert_eq!(mgr.cached_prefix_blocks(&again, None), 4);
    assert_eq!(mgr.allocate(2, &again, None).unwrap(), 16);
    assert_eq!(mgr.first_block(2, 1).unwrap(), 2);
    assert_eq!(mgr.first_block(2, 0).unwrap(), 0);
    assert_eq!(mgr.stats(1).unwrap().prefix_allowed_tokens, 16);

    // Persistent batches, one per group.
    let mut batches = vec![Batch::new(), Batch::new()];
    for b in &mut batches {
        b.add(1).unwrap();
        b.add(2).unwrap();
    }
    mgr.plan(&[2], &[1], &mut p).unwrap();
    for t in 0..10 {
        mgr.step_batch(&mut batches, &[t, t]).unwrap();
    }
    assert!(batches[1].inputs().max_blocks() <= 3);
    mgr.fork(1, 3).unwrap();
    mgr.check().unwrap();
    for seq in [1, 2, 3] {
        mgr.free(seq).unwrap();
    }
    mgr.check().unwrap();
    assert_eq!(mgr.stats(0).unwrap().num_held, 0);
}

#[test]
fn a_group_that_cannot_serve_a_prefix_shortens_the_hit() {
    let mgr = hybrid(64, 4, &[Attention::Full, Attention::SlidingWindow(4)]);
    let prompt: Vec<u32> = (0..24).collect();
    mgr.allocate(1, &prompt, None).unwrap();
    let mut p = plans(2);
    // Chunked prefill: the window releases what the next chunk no longer reads, before its
    // KV is computed, so those blocks never become cached.
    mgr.plan(&[1], &[24], &mut p).unwrap();
    mgr.commit(&[1], None).unwrap();
    mgr.step(&[1], &[1], &mut p).unwrap();
    mgr.free(1).unwrap();
    // Resuming after block 3 needs the window's block 3 (query 16 reads 13..=16): released
    // into the cache. Every group serves it.
    let mid: Vec<u32> = (0..17).collect();
    assert_eq!(mgr.cached_prefix_blocks(&mid, None), 4);
    mgr.reset_prefix_cache();
    assert_eq!(mgr.cached_prefix_blocks(&mid, None), 0);
    mgr.check().unwrap();
}

#[test]
fn a_failed_hybrid_step_changes_nothing() {
    // 2 groups x 3 blocks fit; the next block of each group does not.
    let mgr = hybrid(7, 4, &[Attention::Full, Attention::SlidingWindow(16)]);
    mgr.allocate(1, &[1; 12], None).unwrap();
    let mut p = plans(2);
    mgr.plan(&[1], &[12], &mut p).unwrap();
    let before = (
        mgr.stats(0).unwrap(),
        mgr.block_table(1, 0),
        mgr.block_table(1, 1),
    );
    assert!(matches!(
        mgr.step(&[1], &[5], &mut p),
        Err(Error::OutOfBlocks {
            pool: PoolKind::Gpu,
            needed: 2,
            available: 1
        })
    ));
    let after = (
        mgr.stats(0).unwrap(),
        mgr.block_table(1, 0),
        mgr.block_table(1, 1),
    );
    assert_eq!(before, after);
    assert_eq!(mgr.num_tokens(1).unwrap(), 12);
    assert!(p.iter().all(|plan| plan.batch_size() == 0));
    mgr.check().unwrap();
}

#[test]
fn hybrid_swaps_move_every_group() {
    let mgr = hybrid(32, 4, &[Attention::Full, Attention::ChunkedLocal(8)]);
    mgr.allocate(1, &[1; 10], None).unwrap();
    let mut p = plans(2);
    mgr.plan(&[1], &[10], &mut p).unwrap();
    mgr.step(&[1], &[2], &mut p).unwrap();
    let out = mgr.swap_out(&[1]).unwrap();
    assert_eq!(out.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 1]);
    mgr.confirm_swap_out(&[1]).unwrap();
    mgr.check().unwrap();
    let back = mgr.swap_in(&[1]).unwrap();
    assert_eq!(back.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 1]);
    mgr.confirm_swap_in(&[1]).unwrap();
    mgr.step(&[1], &[3], &mut p).unwrap();
    mgr.check().unwrap();
}

#[test]
fn bad_groups_are_refused() {
    let invalid = |groups: &[Attention]| {
        matches!(
            HybridManager::new(config(8, 4), groups),
            Err(Error::InvalidArgument(_))
        )
    };
    assert!(invalid(&[]));
    assert!(invalid(&[Attention::Full, Attention::SlidingWindow(0)]));
    assert!(invalid(&[Attention::Full, Attention::ChunkedLocal(6)]));
    let mgr = hybrid(8, 4, &[Attention::Full, Attention::SlidingWindow(4)]);
    assert!(matches!(
        mgr.step(&[], &[], &mut plans(1)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(mgr.stats(2), Err(Error::InvalidArgument(_))));
}

/// A verify step's drafts move no window: the blocks a rejected draft's window would have
/// dropped stay until a step whose first query, an accepted token, leaves them behind.
#[test]
fn drafts_release_window_blocks_only_once_accepted() {
    let mgr = windowed(32, 4, Attention::SlidingWindow(4));
    mgr.allocate(1, &[1; 7], None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[7], &mut plan).unwrap();
    let mut batch = Batch::new();
    batch.add(1).unwrap();
    // The last sampled token at 7 and four drafts: query 7 reads 4..=7, so block 0 goes, but
    // block 1, which only the drafts' windows leave behind, stays.
    mgr.verify_batch(&mut batch, &[8, 9, 10, 11, 12], &[5])
        .unwrap();
    assert_eq!(mgr.first_block(1).unwrap(), 1);
    // Every draft rejected: the next query (8) reads 5..=8, still in block 1.
    mgr.rollback_batch(&mut batch, &[4]).unwrap();
    mgr.step_batch(&mut batch, &[13]).unwrap();
    assert_eq!(mgr.first_block(1).unwrap(), 1);
    assert_eq!(batch.inputs().kv_indptr, vec![0, 2]);
    mgr.check().unwrap();
}

/// A prompt admitted in chunks (`allocate` of the first, `append` of the rest) ends where its
/// decode steps begin: the window resuming there keeps its place in the eviction order.
#[test]
fn a_chunked_prompt_keeps_the_window_at_its_end() {
    let mgr = windowed(14, 4, Attention::SlidingWindow(4));
    let prompt: Vec<u32> = (100..117).collect(); // resumes after block 3
    mgr.allocate(1, &prompt[..8], None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[8], &mut plan).unwrap();
    mgr.append(1, &prompt[8..]).unwrap();
    mgr.plan(&[1], &[9], &mut plan).unwrap();
    for t in 0..12 {
        mgr.step(&[1], &[t], &mut plan).unwrap();
    }
    mgr.commit(&[1], None).unwrap();
    assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 4);
    // Fill the pool but for one cached block: the other window blocks go first.
    let st = mgr.stats();
    let others = st.num_free + st.num_cached - 1;
    mgr.allocate(2, &vec![9; 4 * others], None).unwrap();
    assert!(mgr.stats().evictions > 0);
    assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 4);
    mgr.check().unwrap();
}

/// Without auto-commit, steps may release window blocks whose KV is still being computed, past
/// the prompt's hashed blocks; a later commit that covers only some of them registers none of
/// them, and never reads the map keys of blocks past what it commits.
#[test]
fn a_commit_short_of_the_window_registers_nothing_released() {
    let mut config = config(32, 4);
    config.attention = Attention::SlidingWindow(4);
    config.auto_commit = false;
    let mgr = BlockManager::new(config).unwrap();
    mgr.allocate(1, &[0, 1, 2, 3], None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[4], &mut plan).unwrap();
    for t in 4..16 {
        mgr.step(&[1], &[t], &mut plan).unwrap();
    }
    // Query 15 reads 12..=15: blocks 0 to 2 left the window before their KV was committed.
    assert_eq!(mgr.first_block(1).unwrap(), 3);
    assert_eq!(mgr.stats().num_held, 1);
    mgr.commit(&[1], Some(&[4])).unwrap();
    mgr.check().unwrap();
    assert_eq!(mgr.stats().num_cached, 0, "released unregistered");
    mgr.commit(&[1], None).unwrap();
    mgr.check().unwrap();
    // Block 3 is registered now: a request resuming at position 16 reads only it.
    let resume: Vec<u32> = (0..17).collect();
    assert_eq!(mgr.cached_prefix_blocks(&resume, None), 4);
}

/// A hybrid swap-out that finds too few CPU blocks has already auto-committed its sequences in
/// every group, as a single manager's swap-out does before it counts.
#[test]
fn a_hybrid_swap_out_commits_before_it_counts_cpu_blocks() {
    let mut config = config(32, 4);
    config.num_cpu_blocks = 2;
    let mgr = HybridManager::new(config, &[Attention::Full, Attention::SlidingWindow(4)]).unwrap();
    mgr.allocate(1, &[1; 10], None).unwrap();
    let mut p = plans(2);
    mgr.plan(&[1], &[10], &mut p).unwrap();
    assert_eq!(
        mgr.swap_out(&[1]),
        Err(Error::OutOfBlocks {
            pool: PoolKind::Cpu,
            needed: 6,
            available: 2
        })
    );
    assert_eq!(mgr.num_computed(1).unwrap(), 10);
    for group in 0..2 {
        assert_eq!(mgr.stats(group).unwrap().computed_tokens, 10);
    }
    mgr.check().unwrap();
}

/// A windowed sequence rolled back to the block its next query starts at holds no block, and
/// grows again from there.
#[test]
fn a_window_rolled_back_to_a_block_boundary_holds_no_block() {
    let mut config = config(16, 4);
    config.attention = Attention::ChunkedLocal(8);
    config.auto_commit = false;
    let mgr = BlockManager::new(config).unwrap();
    mgr.allocate(1, &[1; 8], None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[8], &mut plan).unwrap();
    mgr.commit(&[1], None).unwrap();
    mgr.step(&[1], &[2], &mut plan).unwrap();
    // Query 8 starts a chunk: blocks 0 and 1 left it.
    assert_eq!(mgr.first_block(1).unwrap(), 2);
    mgr.rollback(&[1], &[1]).unwrap();
    assert_eq!(mgr.block_table(1).unwrap(), Vec::<u32>::new());
    mgr.check().unwrap();
    mgr.step(&[1], &[3], &mut plan).unwrap();
    assert_eq!(plan.kv_indptr, vec![0, 1]);
    mgr.check().unwrap();
}
