//! A lock-free paged KV-cache block manager for LLM serving (PagedAttention).
//!
//! The KV cache is cut into fixed-size blocks stored anywhere in a pool; each sequence has a
//! block table mapping its logical positions to physical blocks. Full blocks are shared between
//! sequences with the same prefix (chained keyed hashes), forks share blocks copy-on-write,
//! unreferenced cached blocks are evicted least recently released first, and sequences can be
//! swapped to a CPU pool. Each step's attention inputs come out as one [`Plan`], or, for decode
//! steps of a persistent [`Batch`], as per-row arrays plus the block-table entries that changed.
//! Only KV the engine has committed as computed is ever shared (see `SEMANTICS.md`, "KV
//! lifecycle").
//!
//! ```
//! use pagedkv::{Batch, BlockManager, Config, Plan};
//!
//! let mgr = BlockManager::new(Config::new(64, 16)).unwrap();
//! let system: Vec<u32> = (0..40).collect();
//! assert_eq!(mgr.allocate(1, &system, None).unwrap(), 0);
//! let mut plan = Plan::new();
//! mgr.plan(&[1], &[40], &mut plan).unwrap(); // the prefill; the engine computes its KV
//! mgr.step(&[1], &[7], &mut plan).unwrap(); // commits the prefill, plans one decode token
//! // A second request with the same 32-token prefix reuses its two full, computed blocks.
//! assert_eq!(mgr.allocate(2, &system, None).unwrap(), 32);
//! mgr.plan(&[2], &[8], &mut plan).unwrap();
//!
//! mgr.step(&[1, 2], &[8, 7], &mut plan).unwrap(); // one decode token each
//! assert_eq!(plan.kv_indptr, vec![0, 3, 6]);
//! assert_eq!(plan.kv_last_page_len, vec![10, 9]);
//!
//! // The same decode through a persistent batch: only what changed is written.
//! let mut batch = Batch::new();
//! batch.add(1).unwrap();
//! batch.add(2).unwrap();
//! mgr.step_batch(&mut batch, &[9, 8]).unwrap();
//! assert_eq!(batch.inputs().kv_indptr, vec![0, 3, 6]);
//! assert_eq!(batch.inputs().positions, vec![42, 41]);
//! mgr.free(1).unwrap();
//! mgr.free(2).unwrap();
//! mgr.check().unwrap();
//! ```
//!
//! Exact semantics of every operation: `SEMANTICS.md` in the crate.
//!
//! # Versions and stamps
//! The crate's only counters that version state, each with one job:
//! - **Call stamps** (`BlockManager`): each batch call draws a new stamp and marks every
//!   sequence it visits with it, so a sequence named twice in one call is found at once.
//! - **Table versions** (per sequence, drawn from one process-wide counter): a sequence's
//!   block table gets a new version whenever an entry is replaced (a copy-on-write, a swap) or
//!   the sequence is new; pushing a block keeps it. A [`Batch`] row that mirrors the same
//!   version copies only the blocks pushed since.
//! - **Block generations** (in each block's state word): bumped whenever a block is handed out
//!   fresh, so a prefix lookup's snapshot of a block can only be acquired while the block is
//!   still the incarnation that was verified.
//! - **Free-list tag** (in the free stack's head): counts pops and pushes, so a pop that read a
//!   stale next pointer cannot succeed (no ABA).

#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod batch;
mod block;
mod bookkeeping;
mod config;
mod cpu_tier;
mod error;
mod events;
mod feed;
mod free_list;
mod keys;
mod lru;
mod manager;
mod plan;
mod pool;
mod prefix;
mod prefix_map;
mod sequence;
mod state;
mod stats;
mod sync;
mod wire;

pub use batch::{Batch, TableUpdates};
pub use config::{Attention, Config};
pub use error::{Error, PoolKind};
pub use events::{Event, EventKind};
pub use feed::Registration;
pub use keys::{ExtraKey, HashKeys};
pub use manager::{BlockManager, HybridManager};

pub use plan::Plan;
#[doc(hidden)]
pub use pool::bench as pool_bench;
pub use prefix::BlockHash;
pub use state::{SlotId, StateConfig, StateStats};
pub use stats::Stats;
pub use wire::{cache_salt, encode_batch, wire_hash, BatchHeader, Encoding};

/// Physical block id, `0..num_blocks`.
pub type BlockId = u32;
/// Caller-chosen sequence id.
pub type SeqId = u64;
/// Token id.
pub type Token = u32;
