//! Deterministic prompts for the benches: token ids drawn from SplitMix64, so prompts never
//! share a prefix by accident.

use crate::splitmix64::SplitMix64;
use pagedkv::Token;

/// A token stream; `Tokens::new(seed)` starts one.
pub struct Tokens(SplitMix64);

impl Tokens {
    /// The stream of seed `seed`.
    pub fn new(seed: u64) -> Tokens {
        Tokens(SplitMix64(seed))
    }

    /// The next token id, below 50,000.
    pub fn next(&mut self) -> Token {
        (self.0.next() % 50_000) as Token
    }

    /// The next `n` token ids.
    pub fn take(&mut self, n: usize) -> Vec<Token> {
        (0..n).map(|_| self.next()).collect()
    }
}
