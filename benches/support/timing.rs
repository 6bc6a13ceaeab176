//! The timed runs a criterion bench recorded, for the figures and ratios it prints at the end:
//! each `iter_custom` closure returns `record(name, elapsed, iters)`, and `mean_ns(name)` reads
//! them back.

use std::sync::Mutex;
use std::time::Duration;

use criterion::Criterion;

/// Every timed run criterion made: (benchmark, elapsed, iterations).
static RUNS: Mutex<Vec<(&str, Duration, u64)>> = Mutex::new(Vec::new());

/// Records one timed run of `name`; returns `elapsed`, for `iter_custom`.
pub fn record(name: &'static str, elapsed: Duration, iters: u64) -> Duration {
    RUNS.lock().unwrap().push((name, elapsed, iters));
    elapsed
}

/// Nanoseconds per iteration of `name` over all criterion's runs of it (most of the time is in
/// the measured runs, which are the longest).
pub fn mean_ns(name: &str) -> Option<f64> {
    let runs = RUNS.lock().unwrap();
    let (t, n) = runs
        .iter()
        .filter(|r| r.0 == name)
        .fold((0.0, 0u64), |(t, n), r| (t + r.1.as_secs_f64(), n + r.2));
    (n > 0).then(|| t * 1e9 / n as f64)
}

/// Prints `what: <mean> us` for `name`, if criterion ran it.
#[allow(dead_code)] // each bench includes this file; the pool bench prints ratios only
pub fn show_us(name: &str, what: &str) {
    if let Some(ns) = mean_ns(name) {
        println!("{what}: {:.3} us", ns / 1e3);
    }
}

/// Prints `<what>: <ratio>x the time` of `name` over its `baseline`, when criterion ran both.
#[allow(dead_code)] // each bench includes this file; the pool bench prints its own ratios
pub fn show_ratio(name: &str, baseline: &str, what: &str) {
    if let (Some(t), Some(base)) = (mean_ns(name), mean_ns(baseline)) {
        println!("{what}: {:.2}x the time", t / base);
    }
}

/// Criterion's settings for these benches: 1 s of warm-up, then `measurement_secs` of runs.
pub fn short_runs(measurement_secs: u64) -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(measurement_secs))
}
