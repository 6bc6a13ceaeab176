//! The per-block state word: refcount, hashed flag and generation packed in one `u64`, so that
//! every transition of a block is a single compare-and-swap.

/// Bits 0..32: refcount. Bit 32: hashed (registered in the prefix cache). Bits 33..64: generation,
/// bumped each time the block is handed out fresh, so a stale snapshot never matches again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockState(pub(crate) u64);

const REFCOUNT_MASK: u64 = 0xFFFF_FFFF;
const HASHED: u64 = 1 << 32;
const GENERATION_SHIFT: u32 = 33;

impl BlockState {
    /// A FREE block of generation 0.
    pub(crate) const FREE: BlockState = BlockState(0);

    /// Number of holders.
    pub(crate) fn refcount(self) -> u32 {
        (self.0 & REFCOUNT_MASK) as u32
    }

    /// Whether the block is registered in the prefix cache.
    pub(crate) fn hashed(self) -> bool {
        self.0 & HASHED != 0
    }

    /// Whether the block is CACHED: registered and held by nobody.
    pub(crate) fn cached(self) -> bool {
        self.hashed() && self.refcount() == 0
    }

    /// Whether the block is FREE: unregistered and held by nobody.
    pub(crate) fn free(self) -> bool {
        !self.hashed() && self.refcount() == 0
    }

    /// The incarnation counter.
    pub(crate) fn generation(self) -> u64 {
        self.0 >> GENERATION_SHIFT
    }

    /// The same block with another refcount.
    pub(crate) fn with_refcount(self, refcount: u32) -> BlockState {
        BlockState((self.0 & !REFCOUNT_MASK) | u64::from(refcount))
    }

    /// The same block, registered or not.
    pub(crate) fn with_hashed(self, hashed: bool) -> BlockState {
        if hashed {
            BlockState(self.0 | HASHED)
        } else {
            BlockState(self.0 & !HASHED)
        }
    }

    /// The next incarnation: refcount 1, unregistered, generation + 1 (wrapping).
    pub(crate) fn fresh(self) -> BlockState {
        let generation = (self.generation() + 1) & (u64::MAX >> GENERATION_SHIFT);
        BlockState((generation << GENERATION_SHIFT) | 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip() {
        let s = BlockState::FREE.fresh().with_refcount(7).with_hashed(true);
        assert_eq!(s.refcount(), 7);
        assert!(s.hashed());
        assert_eq!(s.generation(), 1);
        assert!(!s.cached());
        assert!(s.with_refcount(0).cached());
        assert!(s.with_refcount(0).with_hashed(false).free());
        assert_eq!(s.fresh().generation(), 2);
        assert_eq!(s.fresh().refcount(), 1);
        assert!(!s.fresh().hashed());
    }

    #[test]
    fn generation_wraps() {
        let last = BlockState(u64::MAX).with_refcount(0);
        assert_eq!(last.fresh().generation(), 0);
    }
}

/// Token slots per block, with shift-and-mask arithmetic when it is a power of two (the usual
/// case), since divisions dominate the per-token cost of a decode step otherwise.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockSize {
    size: usize,
    shift: Option<u32>,
}

impl BlockSize {
    /// Wraps a non-zero block size.
    pub(crate) fn new(size: usize) -> BlockSize {
        BlockSize {
            size,
            shift: size.is_power_of_two().then(|| size.trailing_zeros()),
        }
    }

    /// The size in tokens.
    pub(crate) fn get(self) -> usize {
        self.size
    }

    /// The block holding position `pos`.
    pub(crate) fn index(self, pos: usize) -> usize {
        match self.shift {
            Some(shift) => pos >> shift,
            None => pos / self.size,
        }
    }

    /// The slot of position `pos` within its block.
    pub(crate) fn offset(self, pos: usize) -> usize {
        match self.shift {
            Some(_) => pos & (self.size - 1),
            None => pos % self.size,
        }
    }

    /// Blocks needed for `len` tokens.
    pub(crate) fn pages(self, len: usize) -> usize {
        self.index(len + self.size - 1)
    }

    /// Tokens in block `i` of a sequence of `len` tokens.
    pub(crate) fn fill(self, i: usize, len: usize) -> u32 {
        (len - i * self.size).min(self.size) as u32
    }
}

#[cfg(test)]
mod block_size_tests {
    use super::BlockSize;

    #[test]
    fn matches_plain_arithmetic() {
        for size in [1, 2, 3, 16, 24, 32] {
            let bs = BlockSize::new(size);
            for len in 0..200 {
                assert_eq!(bs.index(len), len / size);
                assert_eq!(bs.offset(len), len % size);
                assert_eq!(bs.pages(len), len.div_ceil(size));
            }
        }
    }
}
