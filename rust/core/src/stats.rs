//! Counters and the `Stats` snapshot.

use crate::sync::{AtomicU64, Ordering};

/// A snapshot of the pool and the prefix cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    /// Blocks in the GPU pool.
    pub num_blocks: usize,
    /// FREE blocks: unreferenced and not cached.
    pub num_free: usize,
    /// CACHED blocks: unreferenced, kept for prefix reuse, evictable.
    pub num_cached: usize,
    /// HELD blocks: referenced by at least one sequence.
    pub num_held: usize,
    /// `num_held / num_blocks`.
    pub usage: f64,
    /// `stored_tokens / (num_held * block_size)`: how full the held blocks are.
    pub token_usage: f64,
    /// Tokens stored in held blocks, each physical block counted once.
    pub stored_tokens: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_query_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Prompt tokens this manager (or group of a [`crate::HybridManager`]) alone could have
    /// served from its cache: a hybrid hit is the least any group allows.
    pub prefix_allowed_tokens: u64,
    /// CACHED blocks evicted to make room.
    pub evictions: u64,
    /// Tokens of live sequences whose KV the engine has confirmed (per sequence: a token shared
    /// by forks counts once for each).
    pub computed_tokens: u64,
    /// Tokens of live sequences assigned to slots whose KV is not confirmed yet (same counting).
    pub pending_tokens: u64,
    /// Prompt tokens after the GPU prefix hit that admissions looked up in an external store
    /// (`allocate_loading`).
    pub external_query_tokens: u64,
    /// Tokens loaded from an external store and confirmed (also counted as prefix hits).
    pub external_hit_tokens: u64,
    /// Blocks handed out for an external load that was not confirmed (recomputed instead).
    pub external_failures: u64,
}

/// Monotonic counters shared by all threads.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) prefix_query_tokens: AtomicU64,
    pub(crate) prefix_hit_tokens: AtomicU64,
    pub(crate) prefix_allowed_tokens: AtomicU64,
    pub(crate) evictions: AtomicU64,
    pub(crate) computed_tokens: AtomicU64,
    pub(crate) pending_tokens: AtomicU64,
    pub(crate) external_query_tokens: AtomicU64,
    pub(crate) external_hit_tokens: AtomicU64,
    pub(crate) external_failures: AtomicU64,
}

impl Counters {
    /// Adds `n` to `counter`.
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Subtracts `n` from `counter` (a gauge that `add` raised before).
    pub(crate) fn sub(counter: &AtomicU64, n: u64) {
        counter.fetch_sub(n, Ordering::Relaxed);
    }

    /// Reads `counter`.
    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
