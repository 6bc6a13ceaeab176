//! The one seam between `std` and `loom`: every atomic and lock of the crate comes from here, so
//! `RUSTFLAGS="--cfg loom"` model-checks the real code.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering},
    Mutex, MutexGuard,
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering},
    Mutex, MutexGuard,
};

/// Locks `mutex`, ignoring poisoning: every critical section of the crate leaves its data
/// consistent before anything that could panic, so a poisoned lock holds valid data.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Exponential backoff for a retry loop: after a failed compare-and-swap, waiting a little
/// (longer each time) lets the winner's cache line settle instead of every thread retrying into
/// it at once. Under loom it yields, so the model checker can run the other threads.
#[derive(Default)]
pub(crate) struct Backoff(u32);

impl Backoff {
    /// Waits after one more failed attempt.
    pub(crate) fn snooze(&mut self) {
        #[cfg(loom)]
        loom::thread::yield_now();
        #[cfg(not(loom))]
        for _ in 0..1u32 << self.0 {
            std::hint::spin_loop();
        }
        self.0 = (self.0 + 1).min(6);
    }
}
