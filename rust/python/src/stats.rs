//! The `Stats` Python class: a mirror of the core's `Stats`, declared once from its field list.

use pyo3::prelude::*;

use pagedkv as core;

/// How a field's value reads in the repr.
trait Shown {
    fn shown(&self) -> String;
}

impl Shown for usize {
    fn shown(&self) -> String {
        self.to_string()
    }
}

impl Shown for u64 {
    fn shown(&self) -> String {
        self.to_string()
    }
}

impl Shown for f64 {
    fn shown(&self) -> String {
        format!("{self:.4}")
    }
}

/// Declares `Stats` with one read-only attribute per field of `core::Stats` (the conversion
/// destructures it exhaustively, so a field added to the core fails to compile here until it
/// is mirrored), and its repr.
macro_rules! mirror {
    ($($(#[doc = $doc:literal])+ $field:ident: $ty:ty,)+) => {
        /// A snapshot of the pool and the prefix cache.
        #[pyclass(frozen, get_all, module = "pagedkv._core")]
        pub(crate) struct Stats {
            $($(#[doc = $doc])+ $field: $ty,)+
        }

        impl From<core::Stats> for Stats {
            fn from(stats: core::Stats) -> Stats {
                let core::Stats { $($field),+ } = stats;
                Stats { $($field),+ }
            }
        }

        #[pymethods]
        impl Stats {
            fn __repr__(&self) -> String {
                let fields = [$(format!(concat!(stringify!($field), "={}"), self.$field.shown())),+];
                format!("Stats({})", fields.join(", "))
            }
        }
    };
}

mirror! {
    /// Blocks in the GPU pool.
    num_blocks: usize,
    /// FREE blocks: unreferenced, not cached.
    num_free: usize,
    /// CACHED blocks: unreferenced, kept for prefix reuse.
    num_cached: usize,
    /// HELD blocks: referenced by a sequence.
    num_held: usize,
    /// `num_held / num_blocks`.
    usage: f64,
    /// Stored tokens over the slots of held blocks.
    token_usage: f64,
    /// Tokens stored in held blocks, each physical block once.
    stored_tokens: usize,
    /// Prompt tokens looked up in the prefix cache.
    prefix_query_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    prefix_hit_tokens: u64,
    /// Prompt tokens this manager alone could have served (a hybrid hit is the least of its
    /// groups').
    prefix_allowed_tokens: u64,
    /// Cached blocks evicted to make room.
    evictions: u64,
    /// Tokens of live sequences whose KV is computed (per sequence).
    computed_tokens: u64,
    /// Tokens of live sequences whose KV is pending (per sequence).
    pending_tokens: u64,
    /// Prompt tokens after the GPU hit looked up in an external store.
    external_query_tokens: u64,
    /// Tokens loaded from an external store and confirmed.
    external_hit_tokens: u64,
    /// Blocks handed out for an external load that was not confirmed.
    external_failures: u64,
}
