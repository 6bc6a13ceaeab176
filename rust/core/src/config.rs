//! `Config`: how a `BlockManager` is built, and the validation of its fields.

use crate::error::invalid;
use crate::Error;

/// How a `BlockManager` is built.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Blocks in the GPU pool.
    pub num_blocks: u32,
    /// Token slots per block.
    pub block_size: u32,
    /// Blocks in the CPU pool that `swap_out` moves sequences to (0: no swapping).
    pub num_cpu_blocks: u32,
    /// Reuse full blocks across sequences with the same prefix.
    pub enable_prefix_caching: bool,
    /// Fraction of the GPU pool `can_allocate` keeps free for running sequences to grow.
    pub watermark: f64,
    /// Key of the block hash; `None` draws a random one (pass one to share hashes across
    /// processes, e.g. for a KV-aware router).
    pub hash_key: Option<[u8; 32]>,
    /// Record prefix-cache events for `take_events`.
    pub enable_events: bool,
    /// Record every group's registrations and their removals for `take_registrations` (what
    /// an external KV tier saves). Groups past 0 then compute their blocks' published hashes.
    pub enable_block_feed: bool,
    /// A call that names a sequence (`step`, `plan`, `append`, `fork`, `swap_out`) first
    /// commits that sequence's latest plan: right for an engine that runs each forward pass
    /// before its next call. Engines that plan ahead of their forward passes turn it off and
    /// call `commit`.
    pub auto_commit: bool,
    /// What the layers of this manager's blocks attend to: every earlier token, or only a
    /// window of them. A windowed manager holds only the blocks its queries can still read.
    pub attention: Attention,
}

/// The keys a query at position `p` attends to, which decides what a sequence must hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Attention {
    /// Every token `0..=p`.
    #[default]
    Full,
    /// The last `window` tokens, `p + 1 - window..=p` (Mistral, Gemma, gpt-oss).
    SlidingWindow(u32),
    /// The tokens of `p`'s own chunk, `p / chunk * chunk..=p` (Llama 4's local layers).
    ChunkedLocal(u32),
}

impl Attention {
    /// The first token a query at `position` reads.
    pub fn first_key(self, position: usize) -> usize {
        match self {
            Attention::Full => 0,
            Attention::SlidingWindow(window) => (position + 1).saturating_sub(window as usize),
            Attention::ChunkedLocal(chunk) => position / chunk as usize * chunk as usize,
        }
    }
}

impl Config {
    /// `num_blocks` blocks of `block_size` tokens with the defaults: no CPU pool, prefix
    /// caching on, watermark 0.01, random hash key, no events, no block feed, auto-commit,
    /// full attention.
    pub fn new(num_blocks: u32, block_size: u32) -> Config {
        Config {
            num_blocks,
            block_size,
            num_cpu_blocks: 0,
            enable_prefix_caching: true,
            watermark: 0.01,
            hash_key: None,
            enable_events: false,
            enable_block_feed: false,
            auto_commit: true,
            attention: Attention::Full,
        }
    }

    /// Fails naming the first field out of range.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.num_blocks == 0 {
            return Err(invalid("num_blocks must be at least 1"));
        }
        if self.block_size == 0 {
            return Err(invalid("block_size must be at least 1"));
        }
        for (name, blocks) in [
            ("num_blocks", self.num_blocks),
            ("num_cpu_blocks", self.num_cpu_blocks),
        ] {
            if u64::from(blocks) * u64::from(self.block_size) > i32::MAX as u64 {
                return Err(invalid(format!(
                    "{name} * block_size = {} exceeds the int32 slot range",
                    u64::from(blocks) * u64::from(self.block_size)
                )));
            }
        }
        match self.attention {
            Attention::Full => {}
            Attention::SlidingWindow(0) => {
                return Err(invalid(
                    "attention: a sliding window must be at least 1 token",
                ))
            }
            Attention::ChunkedLocal(chunk) if chunk == 0 || chunk % self.block_size != 0 => {
                return Err(invalid(format!(
                    "attention: the chunk ({chunk}) must be a positive multiple of block_size ({})",
                    self.block_size
                )))
            }
            _ => {}
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return Err(invalid(format!(
                "watermark must be in [0, 1), got {}",
                self.watermark
            )));
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::BlockManager;

    #[test]
    fn config_is_validated() {
        let bad = |edit: fn(&mut Config)| {
            let mut config = Config::new(8, 4);
            edit(&mut config);
            matches!(BlockManager::new(config), Err(Error::InvalidArgument(_)))
        };
        assert!(bad(|c| c.num_blocks = 0));
        assert!(bad(|c| c.block_size = 0));
        assert!(bad(|c| c.watermark = 1.0));
        assert!(bad(|c| c.watermark = f64::NAN));
        assert!(bad(|c| c.num_blocks = u32::MAX / 2));
        assert!(bad(|c| c.num_cpu_blocks = u32::MAX / 2));
        assert!(bad(|c| c.attention = Attention::SlidingWindow(0)));
        assert!(bad(|c| c.attention = Attention::ChunkedLocal(0)));
        assert!(bad(|c| c.attention = Attention::ChunkedLocal(6)));
        assert!(!bad(|c| c.attention = Attention::ChunkedLocal(8)));
        assert!(BlockManager::new(Config::new(8, 4)).is_ok());
    }
}
