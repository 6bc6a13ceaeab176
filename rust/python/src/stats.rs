//! The `Stats` and `StateStats` Python classes: mirrors of the core's, each declared once from
//! its field list.

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

/// Declares `$name` with one read-only attribute per field of `core::$name` (the conversion
/// destructures it exhaustively, so a field added to the core fails to compile here until it
/// is mirrored), and its repr.
macro_rules! mirror {
    ($(#[doc = $what:literal])+ $name:ident { $($(#[doc = $doc:literal])+ $field:ident: $ty:ty,)+ }) => {
        $(#[doc = $what])+
        #[pyclass(frozen, get_all, module = "pagedkv._core")]
        pub(crate) struct $name {
            $($(#[doc = $doc])+ $field: $ty,)+
        }

        impl From<core::$name> for $name {
            fn from(stats: core::$name) -> $name {
                let core::$name { $($field),+ } = stats;
                $name { $($field),+ }
            }
        }

        #[pymethods]
        impl $name {
            fn __repr__(&self) -> String {
                let fields = [$(format!(concat!(stringify!($field), "={}"), self.$field.shown())),+];
                format!(concat!(stringify!($name), "({})"), fields.join(", "))
            }
        }
    };
}

mirror! {
    /// A snapshot of the pool and the prefix cache.
    Stats {
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
}

mirror! {
    /// A snapshot of a hybrid manager's state pool.
    StateStats {
    /// Slots of the pool.
    num_slots: usize,
    /// Slots free.
    num_free: usize,
    /// Working slots of live sequences.
    num_working: usize,
    /// Slots holding committed checkpoints.
    num_checkpoints: usize,
    /// Slots a planned pass saves a checkpoint into (not committed yet).
    num_saving: usize,
    /// Slots holding draft states of speculative passes not committed yet.
    num_drafts: usize,
    /// Slots of the CPU state pool.
    num_cpu_slots: usize,
    /// Free slots of the CPU state pool.
    num_cpu_free: usize,
    /// Prompt tokens a checkpoint could have resumed (what the state group alone allowed).
    prefix_allowed_tokens: u64,
    /// Prompt tokens resumed from a checkpoint.
    prefix_hit_tokens: u64,
    /// Checkpoints registered.
    saved: u64,
    /// Checkpoint saves skipped: the budget was full of checkpoints in use.
    skipped: u64,
    /// Checkpoints evicted to make room.
    evictions: u64,
    /// Checkpoints dropped by the per-sequence cap.
    dropped: u64,
    }
}
