//! `BlockManager` hot paths: per-token `append`, a decode step at batch 256 through a persistent
//! `Batch` against the one-shot `step` + plan, a speculative verify step (4 drafts a row) against
//! that decode step, and the admission of a 1024-token prompt through its prefill (hit and miss,
//! against caching off).
//! The same decode step with two KV-cache groups (full attention and a sliding window of 128
//! tokens, as gpt-oss has) against one group, and against the sum of the full-attention step and
//! the window's step alone.
//! Targets: a decode step at batch 256 through a `Batch` <= 15 us; a verify step with 4 drafts
//! <= 3x that step; two groups <= 2x one group; 1024-token hit (allocate, prefill plan, commit,
//! free) <= 5 us.
//!
//! Bookkeeping that keeps lengths bounded (freeing and re-admitting sequences) runs outside the
//! timed part, through `iter_custom`.

#[path = "support/decoding.rs"]
mod decoding;
#[path = "support/splitmix64.rs"]
mod splitmix64;
#[path = "support/timing.rs"]
mod timing;
#[path = "support/tokens.rs"]
mod tokens;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use decoding::{Decoding, Managed, Stepping};
use pagedkv::{Attention, BlockManager, Config, HybridManager, Plan, SeqId, Token};
use timing::{mean_ns, record, short_runs, show_ratio, show_us};
use tokens::Tokens;

const BLOCK_SIZE: u32 = 16;

fn manager(num_blocks: u32, prefix_caching: bool) -> BlockManager {
    let mut cfg = Config::new(num_blocks, BLOCK_SIZE);
    cfg.enable_prefix_caching = prefix_caching;
    BlockManager::new(cfg).unwrap()
}

/// One token at a time onto a long-running sequence; it is replaced after `MAX_LEN` tokens.
fn bench_append(c: &mut Criterion) {
    const MAX_LEN: usize = 8192;
    let mgr = manager(4096, true);
    let mut tokens = Tokens::new(1);
    let mut seq: SeqId = 0;
    mgr.allocate(seq, &tokens.take(32), None).unwrap();
    let mut len = 32;

    c.bench_function("append/1_token", |b| {
        b.iter_custom(|iters| {
            let mut elapsed = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let chunk = left.min(MAX_LEN - len);
                let batch = tokens.take(chunk);
                let start = Instant::now();
                for t in &batch {
                    mgr.append(seq, std::slice::from_ref(t)).unwrap();
                }
                elapsed += start.elapsed();
                left -= chunk;
                len += chunk;
                if len == MAX_LEN {
                    mgr.free(seq).unwrap();
                    seq += 1;
                    mgr.allocate(seq, &tokens.take(32), None).unwrap();
                    len = 32;
                }
            }
            record("append", elapsed, iters)
        })
    });
}

/// Each iteration is one decode step of 256 sequences (one token each) with its attention
/// inputs, which also commits the previous step (its filled blocks become shareable): the
/// one-shot `step` into a reused `Plan` (the whole CSR), and `step_batch` on a persistent
/// `Batch` (only what changed), with prefix caching on and off. A batch's first step, which
/// also commits its prefill, is not timed.
fn bench_step(c: &mut Criterion) {
    let blocks = 2 * Decoding::blocks();
    let mut decoding = Decoding::new(Managed::One(Arc::new(manager(blocks, true))));
    let mut g = c.benchmark_group("decode");
    g.bench_function("step_plan/batch256", |b| {
        b.iter_custom(|iters| record("step", decoding.time(iters, Stepping::OneShot), iters))
    });
    g.bench_function("step_batch/batch256", |b| {
        b.iter_custom(|iters| {
            let elapsed = decoding.time(iters, Stepping::Persistent);
            record("step_batch", elapsed, iters)
        })
    });
    // Speculative decoding: each row appends its last token and 4 drafts, then drops the
    // rejected ones (0 to 4, pseudo-random).
    g.bench_function("verify_batch/batch256_k4", |b| {
        b.iter_custom(|iters| {
            let elapsed = decoding.time(iters, Stepping::Verify);
            record("verify_batch", elapsed, iters)
        })
    });
    // Without prefix caching no filled block is registered, hashed or evicted: what is left is
    // the per-sequence work.
    let mut uncached = Decoding::new(Managed::One(Arc::new(manager(blocks, false))));
    g.bench_function("step_batch/batch256_caching_off", |b| {
        b.iter_custom(|iters| {
            let elapsed = uncached.time(iters, Stepping::Persistent);
            record("step_batch_off", elapsed, iters)
        })
    });
    // Two groups over one pool: each step appends to both tables, and the window's releases
    // the block that left it every 16 steps a row.
    let groups = [Attention::Full, Attention::SlidingWindow(128)];
    let hybrid = HybridManager::new(Config::new(2 * blocks, BLOCK_SIZE), &groups).unwrap();
    let mut two = Decoding::new(Managed::Groups(Arc::new(hybrid)));
    g.bench_function("step_batch/batch256_two_groups", |b| {
        b.iter_custom(|iters| {
            let elapsed = two.time(iters, Stepping::Persistent);
            record("step_batch_groups", elapsed, iters)
        })
    });
    // The window's group alone, so that the two-group step can be set against the sum of its
    // groups' own steps (what composing them costs beyond doing both).
    let mut cfg = Config::new(blocks, BLOCK_SIZE);
    cfg.attention = Attention::SlidingWindow(128);
    let mut window = Decoding::new(Managed::One(Arc::new(BlockManager::new(cfg).unwrap())));
    g.bench_function("step_batch/batch256_window_only", |b| {
        b.iter_custom(|iters| {
            let elapsed = window.time(iters, Stepping::Persistent);
            record("step_batch_window", elapsed, iters)
        })
    });
    g.finish();
}

/// One request's admission through its prefill: allocate, plan the tokens the prefix cache did
/// not cover, commit that forward pass (which registers the computed full blocks), free.
fn admit_prefilled(mgr: &BlockManager, prompt: &[Token], plan: &mut Plan) -> usize {
    let reused = mgr.allocate(1, prompt, None).unwrap();
    mgr.plan(&[1], &[(prompt.len() - reused) as u32], plan)
        .unwrap();
    mgr.commit(&[1], None).unwrap();
    mgr.free(1).unwrap();
    reused
}

/// The admission of a 1024-token prompt through its prefill (`admit_prefilled`): its prefix
/// cached (hit), never seen (miss: hashes computed, nothing matches, the blocks are registered at
/// commit), and with prefix caching off.
fn bench_prefix(c: &mut Criterion) {
    const PROMPT: usize = 1024;
    let mut tokens = Tokens::new(3);
    let prompt = tokens.take(PROMPT);
    let mut plan = Plan::new();

    let mut g = c.benchmark_group("prefix_1024_tokens");
    let mgr = manager(1024, true);
    admit_prefilled(&mgr, &prompt, &mut plan);
    let mut hits = 0;
    let warm_hits = mgr.stats().prefix_hit_tokens;
    g.bench_function("hit", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                black_box(admit_prefilled(&mgr, black_box(&prompt), &mut plan));
            }
            hits += iters;
            record("hit", start.elapsed(), iters)
        })
    });
    // Every allocation reused all but the last block (a hit never covers the last token).
    let reused = (PROMPT - BLOCK_SIZE as usize) as u64;
    assert_eq!(
        mgr.stats().prefix_hit_tokens - warm_hits,
        hits * reused,
        "every allocation must hit"
    );

    let mgr = manager(1024, true);
    let mut miss = prompt.clone();
    let mut first: Token = 100_000;
    g.bench_function("miss", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                // A new first token makes every block's hash new.
                first = first.wrapping_add(1);
                miss[0] = first;
                black_box(admit_prefilled(&mgr, black_box(&miss), &mut plan));
            }
            record("miss", start.elapsed(), iters)
        })
    });
    assert_eq!(mgr.stats().prefix_hit_tokens, 0, "a miss must not hit");

    let mgr = manager(1024, false);
    g.bench_function("caching_off", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                black_box(admit_prefilled(&mgr, black_box(&prompt), &mut plan));
            }
            record("off", start.elapsed(), iters)
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = short_runs(3);
    targets = bench_append, bench_step, bench_prefix
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    show_us("append", "append, 1 token");
    show_us("step", "step + plan, batch 256 (one-shot plan)");
    show_us(
        "step_batch",
        "step_batch, batch 256 (persistent batch; target <= 15 us)",
    );
    show_us(
        "step_batch_off",
        "step_batch, batch 256, prefix caching off (no registration or eviction)",
    );
    show_ratio("step_batch", "step", "step_batch against step + plan");
    show_us(
        "step_batch_groups",
        "step_batch, batch 256, two groups (full + sliding window 128)",
    );
    show_ratio(
        "step_batch_groups",
        "step_batch",
        "two groups against one (target <= 2x)",
    );
    show_us(
        "step_batch_window",
        "step_batch, batch 256, one group of sliding window 128",
    );
    if let (Some(two), Some(full), Some(window)) = (
        mean_ns("step_batch_groups"),
        mean_ns("step_batch"),
        mean_ns("step_batch_window"),
    ) {
        let sum = full + window;
        println!(
            "two groups against the sum of their one-group steps: {:.2}x the time",
            two / sum
        );
    }
    show_us(
        "verify_batch",
        "verify_batch + rollback_batch, batch 256, 4 drafts a row",
    );
    show_ratio(
        "verify_batch",
        "step_batch",
        "verify step (4 drafts) against a decode step (target <= 3x)",
    );
    show_us(
        "hit",
        "1024-token prefix hit, allocate + prefill plan + commit + free (target <= 5 us)",
    );
    show_us(
        "miss",
        "1024-token prefix miss, allocate + prefill plan + commit + free",
    );
    show_us(
        "off",
        "1024-token prompt, prefix caching off, allocate + prefill plan + commit + free",
    );
    // The baseline: the same admission with no hashing at all.
    show_ratio("hit", "off", "prefix hit against caching off");
    show_ratio("miss", "off", "prefix miss against caching off");
}
