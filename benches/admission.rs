//! The prefix lookup and what admission costs the decode loop:
//! - the read-only lookup (`cached_prefix_blocks`) of a 1024-token prompt whose 63 hittable
//!   blocks are cached (target <= 5 us), and of one that misses at its first block (<= 1 us),
//!   against the baseline of hashing the same prompt (`block_hashes`, the BLAKE3 chain a map
//!   keyed by the published hash would compute before its first probe);
//! - a decode step at batch 256 (`step` and `step_batch`) alone, and while another thread
//!   admits and frees 8K-token prompts (a sequence shard held during an admission stalls a step
//!   that needs it).

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_group, Criterion};
use decoding::{Decoding, Managed, Stepping};
use pagedkv::{BlockManager, Config, Plan, SeqId, Token};
use timing::{record, short_runs, show_ratio, show_us};
use tokens::Tokens;

#[path = "support/decoding.rs"]
mod decoding;
#[path = "support/splitmix64.rs"]
mod splitmix64;
#[path = "support/timing.rs"]
mod timing;
#[path = "support/tokens.rs"]
mod tokens;

const BLOCK_SIZE: u32 = 16;
const PROMPT: usize = 1024;

fn manager(num_blocks: u32) -> BlockManager {
    let mut cfg = Config::new(num_blocks, BLOCK_SIZE);
    cfg.watermark = 0.0;
    BlockManager::new(cfg).unwrap()
}

/// A manager whose prefix cache holds `prompt`'s full blocks (admitted, prefilled, committed,
/// freed: they stay CACHED).
fn cached(prompt: &[Token]) -> BlockManager {
    let mgr = manager(1024);
    let mut plan = Plan::new();
    mgr.allocate(1, prompt, None).unwrap();
    mgr.plan(&[1], &[prompt.len() as u32], &mut plan).unwrap();
    mgr.commit(&[1], None).unwrap();
    mgr.free(1).unwrap();
    mgr
}

fn bench_lookup(c: &mut Criterion) {
    let prompt = Tokens::new(3).take(PROMPT);
    let mgr = cached(&prompt);
    let hittable = PROMPT / BLOCK_SIZE as usize - 1;
    assert_eq!(mgr.cached_prefix_blocks(&prompt, None), hittable);
    let mut miss = prompt.clone();
    miss[0] = 100_000;
    assert_eq!(mgr.cached_prefix_blocks(&miss, None), 0);

    let mut g = c.benchmark_group("lookup_1024_tokens");
    g.bench_function("hit", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                black_box(mgr.cached_prefix_blocks(black_box(&prompt), None));
            }
            record("hit", start.elapsed(), iters)
        })
    });
    g.bench_function("miss_first_block", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                black_box(mgr.cached_prefix_blocks(black_box(&miss), None));
            }
            record("miss", start.elapsed(), iters)
        })
    });
    g.bench_function("block_hashes", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                black_box(mgr.block_hashes(black_box(&prompt), None).unwrap());
            }
            record("block_hashes", start.elapsed(), iters)
        })
    });
    g.finish();
}

/// Admits and frees 8K-token prompts (each new, so every block is hashed and misses) on another
/// thread until told to stop; counts the admissions.
fn admit_long_prompts(mgr: Arc<BlockManager>, stop: Arc<AtomicBool>, count: Arc<AtomicU64>) {
    const LONG: usize = 8192;
    let mut tokens = Tokens::new(9);
    let mut prompt = tokens.take(LONG);
    // Ids far from the decode batch's, spread over every sequence shard.
    let mut id: SeqId = 1 << 40;
    while !stop.load(Ordering::Relaxed) {
        prompt[0] = prompt[0].wrapping_add(1);
        id += 1;
        mgr.allocate(id, &prompt, None).unwrap();
        mgr.free(id).unwrap();
        count.fetch_add(1, Ordering::Relaxed);
    }
}

fn bench_step_under_admission(c: &mut Criterion) {
    let long_blocks = 8192 / BLOCK_SIZE + 1;
    let mgr = Arc::new(manager(2 * Decoding::blocks() + 2 * long_blocks));
    let mut decoding = Decoding::new(Managed::One(mgr.clone()));
    let mut g = c.benchmark_group("decode_batch256");
    let kinds = [
        (Stepping::OneShot, "step", ["step_alone", "step_admitting"]),
        (
            Stepping::Persistent,
            "step_batch",
            ["batch_alone", "batch_admitting"],
        ),
    ];
    for (how, what, [alone, _]) in kinds {
        g.bench_function(format!("{what}_alone"), |b| {
            b.iter_custom(|iters| record(alone, decoding.time(iters, how), iters))
        });
    }
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let admitter = {
        let (mgr, stop, count) = (mgr.clone(), stop.clone(), count.clone());
        std::thread::spawn(move || admit_long_prompts(mgr, stop, count))
    };
    // The steps are timed only once admissions are under way.
    while count.load(Ordering::Relaxed) == 0 {
        std::thread::yield_now();
    }
    let before = count.load(Ordering::Relaxed);
    for (how, what, [_, admitting]) in kinds {
        g.bench_function(format!("{what}_while_admitting_8k_prompts"), |b| {
            b.iter_custom(|iters| record(admitting, decoding.time(iters, how), iters))
        });
    }
    stop.store(true, Ordering::Relaxed);
    admitter.join().unwrap();
    println!(
        "8K-token admissions while the steps ran: {}",
        count.load(Ordering::Relaxed) - before
    );
    g.finish();
}

criterion_group! {
    name = benches;
    config = short_runs(3);
    targets = bench_lookup, bench_step_under_admission
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    show_us("hit", "lookup 1024-token prompt, hit (target <= 5 us)");
    show_us(
        "miss",
        "lookup 1024-token prompt, first-block miss (target <= 1 us)",
    );
    show_us("block_hashes", "block_hashes 1024-token prompt (BLAKE3)");
    show_us("step_alone", "step + plan, batch 256");
    show_us(
        "step_admitting",
        "step + plan, batch 256, while another thread admits 8K-token prompts",
    );
    show_us("batch_alone", "step_batch, batch 256");
    show_us(
        "batch_admitting",
        "step_batch, batch 256, while another thread admits 8K-token prompts",
    );
    show_ratio("hit", "block_hashes", "lookup hit against block_hashes");
    show_ratio(
        "step_admitting",
        "step_alone",
        "step + plan while admitting against alone",
    );
    show_ratio(
        "batch_admitting",
        "batch_alone",
        "step_batch while admitting against alone",
    );
}
