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

/// Backs off inside a retry loop (under loom, lets the other threads run).
pub(crate) fn backoff() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}
