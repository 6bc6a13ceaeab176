//! The crate's error type.

use std::fmt;

use crate::{BlockId, SeqId};

/// Which block pool ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolKind {
    /// The GPU pool that holds the KV cache.
    Gpu,
    /// The CPU pool that swapped-out sequences move to.
    Cpu,
}

/// Everything that can go wrong. An operation that returns an error has changed nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// No live sequence has this id.
    UnknownSequence(SeqId),
    /// A live sequence already has this id.
    DuplicateSequence(SeqId),
    /// The pool has fewer available blocks (free or evictable) than the operation needs.
    OutOfBlocks {
        /// The pool that ran out.
        pool: PoolKind,
        /// Blocks the operation needed.
        needed: usize,
        /// Blocks that were available.
        available: usize,
    },
    /// The state pool has fewer available slots (free, or evictable checkpoints) than the
    /// operation needs.
    OutOfStateSlots {
        /// Slots the operation needed.
        needed: usize,
        /// Slots that were available.
        available: usize,
    },
    /// The sequence is swapped out to the CPU pool; swap it in first.
    SwappedOut(SeqId),
    /// The sequence is on the GPU, not swapped out.
    NotSwappedOut(SeqId),
    /// An argument is malformed; the message says which and why.
    InvalidArgument(String),
    /// `check()` found a broken invariant; the message names the first one.
    InvariantViolated(String),
    /// A structure the operation needs cannot be allocated (the machine's memory).
    TooLarge {
        /// What could not be allocated.
        what: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::UnknownSequence(id) => write!(f, "unknown sequence {id}"),
            Error::DuplicateSequence(id) => write!(f, "sequence {id} already exists"),
            Error::OutOfBlocks {
                pool,
                needed,
                available,
            } => {
                let pool = match pool {
                    PoolKind::Gpu => "GPU",
                    PoolKind::Cpu => "CPU",
                };
                write!(
                    f,
                    "out of {pool} blocks: needed {needed}, {available} available"
                )
            }
            Error::OutOfStateSlots { needed, available } => write!(
                f,
                "out of state slots: needed {needed}, {available} available"
            ),
            Error::SwappedOut(id) => write!(f, "sequence {id} is swapped out"),
            Error::NotSwappedOut(id) => write!(f, "sequence {id} is not swapped out"),
            Error::InvalidArgument(msg) => write!(f, "invalid argument: {msg}"),
            Error::InvariantViolated(msg) => write!(f, "invariant violated: {msg}"),
            Error::TooLarge { what } => write!(f, "{what} cannot be allocated"),
        }
    }
}

impl std::error::Error for Error {}

/// Shorthand for `Error::InvalidArgument`.
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// Shorthand for `Error::InvariantViolated` about one block.
pub(crate) fn violated(block: BlockId, msg: impl fmt::Display) -> Error {
    Error::InvariantViolated(format!("block {block}: {msg}"))
}
