//! Which vector instructions this CPU has beyond the x86-64 baseline (SSE2), detected at run
//! time: the loops that gain from AVX2 (the lanes of `hash_lanes`, a decode step's passes over
//! its rows' arrays) have a copy compiled for it.

/// Whether this CPU has AVX2 (never under loom, which models no vector code).
pub(crate) fn has_avx2() -> bool {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    return std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    false
}
