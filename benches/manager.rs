//! `BlockManager` hot paths: per-token `append`, a decode step at batch 256 (one-shot plan and
//! persistent batch, the latter also with cold caches), and the
//! admission of a 1024-token prompt through its prefill (hit, miss, and caching off as the
//! baseline).
//! Targets: a decode step at batch 256 <= 5 us (a batch's first step, which also commits the
//! prefill, is timed on its own); 1024-token hit (allocate, prefill plan, commit, free) <= 5 us.
//!
//! Bookkeeping that keeps lengths bounded (freeing and re-admitting sequences) runs outside the
//! timed part, through `iter_custom`.

#[path = "support/decoding.rs"]
mod decoding;
#[path = "support/floor.rs"]
mod floor;
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
use decoding::{Decoding, Stepping};
use floor::{Floor, Registry};
use pagedkv::{BlockManager, Config, Plan, SeqId, Token};
use timing::{mean_ns, record, short_runs, show_fractions, show_us};
use tokens::Tokens;

const BLOCK_SIZE: u32 = 16;
/// Bytes written between two steps of the cold-cache decode bench.
const BETWEEN_STEPS: usize = 2 << 20;

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
/// `Batch` (only what changed), with prefix caching on and off. The plan alone splits the
/// one-shot step's cost; the floor is the least memory traffic of a step (see `Floor`). The
/// first step after an admission, which commits the prefill, is timed alone too, with its own
/// floor, and so are the decode steps without it.
fn bench_step(c: &mut Criterion) {
    let blocks = 2 * Decoding::blocks();
    let mut decoding = Decoding::new(Arc::new(manager(blocks, true)));
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
    // The decode steps alone: each batch's first step, which also commits the prefill (below),
    // runs untimed. Before the KV lifecycle a prompt's blocks were registered when it was
    // allocated, so the step the target was set against (22 us) did no such commit.
    let mut decode = Decoding::new(Arc::new(manager(blocks, true)));
    g.bench_function("step_batch/batch256_decode", |b| {
        b.iter_custom(|iters| record("step_batch_decode", decode.time_decode(iters), iters))
    });
    // Without prefix caching no filled block is registered, hashed or evicted: what is left is
    // the per-sequence work.
    let mut uncached = Decoding::new(Arc::new(manager(blocks, false)));
    g.bench_function("step_batch/batch256_caching_off", |b| {
        b.iter_custom(|iters| {
            let elapsed = uncached.time(iters, Stepping::Persistent);
            record("step_batch_off", elapsed, iters)
        })
    });
    // The same steps as an engine takes them: between two steps its own work (here 2 MiB
    // written, more than a core's L2 cache) leaves the sequences' lines cold.
    let mut cold = Decoding::new(Arc::new(manager(blocks, true)));
    let mut between = vec![0u64; BETWEEN_STEPS / 8];
    g.bench_function("step_batch/batch256_cold", |b| {
        b.iter_custom(|iters| {
            let elapsed = cold.time_cold(iters, &mut between);
            record("step_batch_cold", elapsed, iters)
        })
    });
    // The first step after a batch was admitted and prefilled also commits the prefill: it
    // registers every prompt's full blocks (256 x ~31) and fills every row of the batch's
    // table, which the steps above average in.
    let mut first = Decoding::new(Arc::new(manager(blocks, true)));
    g.bench_function("step_batch/first_after_prefill", |b| {
        b.iter_custom(|iters| record("first_step", first.time_first_steps(iters), iters))
    });
    let query_lens = vec![1u32; decoding::BATCH];
    g.bench_function("plan/batch256", |b| {
        b.iter_custom(|iters| {
            let d = &mut decoding;
            let start = Instant::now();
            for _ in 0..iters {
                d.mgr.plan(&d.seqs, &query_lens, &mut d.plan).unwrap();
            }
            record("plan", start.elapsed(), iters)
        })
    });
    let prefilled = Decoding::new(Arc::new(manager(blocks, false)));
    let mut floor = Floor::new(&prefilled, None);
    g.bench_function("floor/batch256", |b| {
        b.iter_custom(|iters| record("floor", floor.time(iters), iters))
    });
    let mut floor = Floor::new(&prefilled, Some(Registry::new(blocks)));
    g.bench_function("floor/batch256_caching", |b| {
        b.iter_custom(|iters| record("floor_caching", floor.time(iters), iters))
    });
    let mut floor = Floor::new(&prefilled, Some(Registry::new(blocks)));
    g.bench_function("floor/first_after_prefill", |b| {
        b.iter_custom(|iters| record("floor_first", floor.time_first_steps(iters), iters))
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

/// The mean of the steps after a batch's first, in ns, from the mean over all its steps
/// (`name`) and that of its first (`first`): the floor's, which has no decode-only run.
fn after_first(name: &str, first: &str) -> Option<f64> {
    let (t, first) = (mean_ns(name)?, mean_ns(first)?);
    let steps = decoding::MAX_STEPS as f64;
    Some((steps * t - first) / (steps - 1.0))
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    show_us("append", "append, 1 token");
    show_us("step", "step + plan, batch 256 (one-shot plan)");
    show_us(
        "step_batch_decode",
        "decode step_batch, batch 256 (persistent batch, a batch's first step left out; target <= 5 us)",
    );
    show_us(
        "step_batch",
        "step_batch, batch 256, averaged over a batch's 256 steps (the first commits the prefill)",
    );
    show_us(
        "step_batch_off",
        "step_batch, batch 256, prefix caching off (no registration or eviction)",
    );
    show_us(
        "step_batch_cold",
        "step_batch, batch 256, 2 MiB written between steps (caches cold, as in an engine)",
    );
    show_us(
        "first_step",
        "first step_batch after 256 prompts were prefilled (registers ~7,900 blocks, fills the table)",
    );
    show_us(
        "floor",
        "floor of a decode step, batch 256, caching off (least memory traffic)",
    );
    show_us(
        "floor_caching",
        "floor of a decode step, batch 256, caching on (and of registering and evicting blocks)",
    );
    if let (Some(t), Some(before)) = (mean_ns("step_batch"), mean_ns("step")) {
        println!(
            "step_batch takes {:.2}x the time of step + plan",
            t / before
        );
    }
    show_fractions(
        "floor",
        &[
            ("step", "floor_caching", "step + plan"),
            ("step_batch", "floor_caching", "step_batch"),
            ("step_batch_off", "floor", "step_batch, caching off"),
        ],
    );
    show_us(
        "floor_first",
        "floor of a batch's first step (the prompts' blocks registered, the table written)",
    );
    show_fractions(
        "floor",
        &[("first_step", "floor_first", "first step_batch")],
    );
    let decode = mean_ns("step_batch_decode");
    if let (Some(t), Some(floor)) = (decode, after_first("floor_caching", "floor_first")) {
        println!(
            "decode step_batch as a fraction of its memory-bound floor (the floor's steps after its first): {:.3}",
            floor / t
        );
    }
    show_us("plan", "plan alone, batch 256");
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
    for (name, what) in [("hit", "prefix hit"), ("miss", "prefix miss")] {
        if let (Some(t), Some(off)) = (mean_ns(name), mean_ns("off")) {
            println!("{what} takes {:.2}x the time of caching off", t / off);
        }
    }
}
