//! The block pool's allocate + release: one thread, and two threads hammering one pool, each
//! against a `Mutex<Vec<u32>>` free list measured in the same run. Target: one pair <= 20 ns on
//! one thread. The pool is internal; `pagedkv::pool_bench` (hidden) wraps it in handles that
//! release on drop.

#[path = "support/timing.rs"]
mod timing;

use std::hint::black_box;
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use pagedkv::pool_bench::Pool as BlockPool;
use timing::{mean_ns, record, short_runs};

const NUM_BLOCKS: u32 = 4096;

/// The two pools under test, behind one interface.
trait Pool: Sync {
    /// Takes one block and gives it back.
    fn pair(&self);
}

impl Pool for BlockPool {
    fn pair(&self) {
        let block = self.allocate().expect("the pool never runs dry here");
        drop(black_box(block));
    }
}

/// The baseline: the free list most code starts with.
struct MutexPool(Mutex<Vec<u32>>);

impl MutexPool {
    fn new(num_blocks: u32) -> MutexPool {
        MutexPool(Mutex::new((0..num_blocks).rev().collect()))
    }
}

impl Pool for MutexPool {
    fn pair(&self) {
        let block = self.0.lock().unwrap().pop();
        let block = block.expect("the pool never runs dry here");
        self.0.lock().unwrap().push(black_box(block));
    }
}

fn pairs<P: Pool>(pool: &P, n: u64) {
    for _ in 0..n {
        pool.pair();
    }
}

/// Wall time for `threads` threads, started together, to do `iters` pairs each.
///
/// On a machine with few, busy cores the threads may share one core, which hides the cost of
/// cache-line transfers: expect these figures to vary a lot from run to run there.
fn concurrent<P: Pool>(pool: &P, threads: usize, iters: u64) -> Duration {
    let barrier = Barrier::new(threads + 1);
    thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    pairs(pool, iters);
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        for h in handles {
            h.join().unwrap();
        }
        start.elapsed()
    })
}

/// Prints `candidate`'s time per iteration against `baseline`'s.
fn print_ratio(what: &str, baseline: &str, candidate: &str) {
    if let (Some(b), Some(c)) = (mean_ns(baseline), mean_ns(candidate)) {
        println!(
            "{what}: {candidate} {c:.1} ns, {baseline} {b:.1} ns; {candidate} takes {:.2}x the \
             baseline's time",
            c / b
        );
    }
}

fn timed<P: Pool>(name: &'static str, pool: &P, threads: usize, iters: u64) -> Duration {
    let elapsed = if threads == 1 {
        let start = Instant::now();
        pairs(pool, iters);
        start.elapsed()
    } else {
        concurrent(pool, threads, iters)
    };
    record(name, elapsed, iters)
}

fn bench_pool(c: &mut Criterion) {
    let lock_free = BlockPool::new(NUM_BLOCKS);
    let mutex = MutexPool::new(NUM_BLOCKS);

    let mut g = c.benchmark_group("alloc_release_1_thread");
    g.bench_function("BlockPool", |b| {
        b.iter_custom(|n| timed("BlockPool/1", &lock_free, 1, n))
    });
    g.bench_function("Mutex<Vec>", |b| {
        b.iter_custom(|n| timed("Mutex<Vec>/1", &mutex, 1, n))
    });
    g.finish();

    // Time per iteration = both threads doing one pair each, side by side.
    let mut g = c.benchmark_group("alloc_release_2_threads");
    g.bench_function("BlockPool", |b| {
        b.iter_custom(|n| timed("BlockPool/2", &lock_free, 2, n))
    });
    g.bench_function("Mutex<Vec>", |b| {
        b.iter_custom(|n| timed("Mutex<Vec>/2", &mutex, 2, n))
    });
    g.finish();

    assert_eq!(
        lock_free.num_free(),
        NUM_BLOCKS as usize,
        "every block came back"
    );
}

criterion_group! {
    name = benches;
    config = short_runs(2);
    targets = bench_pool
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    print_ratio(
        "1 thread, one pair (target <= 20 ns)",
        "Mutex<Vec>/1",
        "BlockPool/1",
    );
    print_ratio("2 threads, one pair each", "Mutex<Vec>/2", "BlockPool/2");
}
