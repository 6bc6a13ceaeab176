//! The `manager` bench's decode loop (`Decoding`, batch 256) on two builds of pagedkv in one
//! process: `python benches/compare.py --in-process` generates the crate around this file, with
//! modules `ours` and `base` (the benches' support files on each build). Each round steps one
//! build's batch, then the other's (the order alternates), so both run in the same machine
//! phase. Where a manager's memory lands also moves its time (a build against itself: up to
//! 1.1x), so the rounds are split over `TRIALS` pairs of fresh managers, made in alternating
//! order. It prints the median time of each build and the median of the rounds' ratios, for
//! those steps and for the first step after a batch's prefill (which commits it).

mod base;
mod ours;

use std::sync::Arc;
use std::time::Duration;

/// The block size of the `manager` bench.
pub const BLOCK_SIZE: u32 = 16;
/// Steps of one build per round.
const STEPS: u64 = 512;
/// Pairs of managers the rounds are split over.
const TRIALS: usize = 8;
/// First steps of one build per round (each after a fresh batch's admission and prefill).
const FIRST_STEPS: u64 = 8;
/// Bytes written between two steps of a cold run (as the `manager` bench's cold step).
const BETWEEN_STEPS: usize = 2 << 20;

/// A prefilled batch of `Decoding` on `$side`'s build, prefix caching on or off, warmed up.
macro_rules! decoding {
    ($side:ident, $caching:expr) => {{
        let blocks = 2 * $side::decoding::Decoding::blocks();
        let mut config = $side::pagedkv::Config::new(blocks, BLOCK_SIZE);
        config.enable_prefix_caching = $caching;
        let manager = $side::pagedkv::BlockManager::new(config).unwrap();
        let mut decoding = $side::decoding::Decoding::new(Arc::new(manager));
        decoding.time(2 * STEPS, $side::decoding::Stepping::Persistent);
        decoding
    }};
}

/// Microseconds per step of `STEPS` steps of `$decoding`, on `$side`'s build.
macro_rules! time_steps {
    ($side:ident, $decoding:expr, $between:expr) => {{
        let elapsed = match $between {
            Some(between) => $decoding.time_cold(STEPS, between),
            None => $decoding.time(STEPS, $side::decoding::Stepping::Persistent),
        };
        per_step(elapsed, STEPS)
    }};
}

/// A pair of `decoding!` batches, base then ours, made in the order `$trial` says (even: base
/// first), so neither build always gets the memory the other left.
macro_rules! pair {
    ($trial:expr, $caching:expr) => {{
        if $trial % 2 == 0 {
            let theirs = decoding!(base, $caching);
            (theirs, decoding!(ours, $caching))
        } else {
            let ours = decoding!(ours, $caching);
            (decoding!(base, $caching), ours)
        }
    }};
}

/// Microseconds per step of `elapsed` over `steps`.
fn per_step(elapsed: Duration, steps: u64) -> f64 {
    elapsed.as_secs_f64() * 1e6 / steps as f64
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Runs `rounds` rounds over `TRIALS` pairs of fresh managers and prints the medians. For each
/// trial, `pair(trial)` makes the pair (in alternating order) and returns its timer, which
/// times one round on the base build (`true`) or on ours (`false`); rounds alternate which
/// goes first. `between` is the cold runs' buffer, lent to the timer.
fn compare<T: FnMut(bool, &mut [u64]) -> f64>(
    what: &str,
    rounds: usize,
    round: &str,
    between: &mut [u64],
    mut pair: impl FnMut(usize) -> T,
) {
    let (mut before, mut after, mut ratios) = (vec![], vec![], vec![]);
    for trial in 0..TRIALS {
        let mut time = pair(trial);
        for r in 0..rounds.div_ceil(TRIALS) {
            let (t_base, t_ours) = if r % 2 == 0 {
                let t_base = time(true, between);
                (t_base, time(false, between))
            } else {
                let t_ours = time(false, between);
                (time(true, between), t_ours)
            };
            before.push(t_base);
            after.push(t_ours);
            ratios.push(t_ours / t_base);
        }
    }
    let (t_base, t_ours) = (median(&mut before), median(&mut after));
    println!(
        "{what}: {t_base:.3} -> {t_ours:.3} us, ratio {:.3} (median of {} rounds of {round} \
         each, over {TRIALS} pairs of managers, in one process)",
        median(&mut ratios),
        ratios.len()
    );
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(40, |arg| arg.parse().expect("rounds: a number"));
    let mut between = vec![0u64; BETWEEN_STEPS / 8];
    let steps = format!("{STEPS} steps");
    for (caching, cold, what) in [
        (true, false, "step_batch, batch 256"),
        (false, false, "step_batch, batch 256, prefix caching off"),
        (
            true,
            true,
            "step_batch, batch 256, 2 MiB written between steps",
        ),
    ] {
        compare(what, rounds, &steps, &mut between, |trial| {
            let (mut theirs, mut ours) = pair!(trial, caching);
            move |on_base: bool, between: &mut [u64]| {
                let between = cold.then_some(between);
                if on_base {
                    time_steps!(base, theirs, between)
                } else {
                    time_steps!(ours, ours, between)
                }
            }
        });
    }
    let first = format!("{FIRST_STEPS} first steps");
    let what = "first step_batch after 256 prompts were prefilled";
    compare(what, rounds, &first, &mut between, |trial| {
        let (mut theirs, mut ours) = pair!(trial, true);
        move |on_base: bool, _: &mut [u64]| {
            let elapsed = if on_base {
                theirs.time_first_steps(FIRST_STEPS)
            } else {
                ours.time_first_steps(FIRST_STEPS)
            };
            per_step(elapsed, FIRST_STEPS)
        }
    });
}
