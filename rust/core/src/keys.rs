//! What a block's hash binds besides its tokens and their prefix: the tenant salt and the LoRA
//! adapter (for the whole sequence, bound into the chain's root), and extra keys over token
//! spans (multimodal content hashes: each block holding a token of the span binds its key).

use std::sync::Arc;

use crate::error::invalid;
use crate::Error;

/// An extra key over the tokens `start..end` (positions in the sequence): every block that
/// holds one of those tokens binds `key` into its hash, in the order the spans were given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtraKey {
    /// First token position of the span.
    pub start: usize,
    /// One past its last token position.
    pub end: usize,
    /// The key, e.g. a multimodal item's content hash.
    pub key: String,
}

/// Everything an admission or a lookup hashes besides the tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct HashKeys<'a> {
    /// The tenant salt (see `SEMANTICS.md`).
    pub salt: Option<&'a [u8]>,
    /// The LoRA adapter the sequence runs with.
    pub lora_name: Option<&'a str>,
    /// Extra keys over spans of the prompt.
    pub extra_keys: &'a [ExtraKey],
}

impl<'a> HashKeys<'a> {
    /// Only a salt (or none).
    pub fn salt(salt: Option<&'a [u8]>) -> HashKeys<'a> {
        HashKeys {
            salt,
            ..HashKeys::default()
        }
    }
}

/// Fails unless every span is non-empty and lies within the tokens `from..to`.
pub(crate) fn check_spans(spans: &[ExtraKey], from: usize, to: usize) -> Result<(), Error> {
    for span in spans {
        if span.start >= span.end || span.start < from || span.end > to {
            return Err(invalid(format!(
                "extra_keys: the span {}..{} of {:?} must be non-empty and within the tokens \
                 {from}..{to}",
                span.start, span.end, span.key
            )));
        }
    }
    Ok(())
}

/// A sequence's extra keys.
#[derive(Clone, Debug, Default)]
pub(crate) struct SequenceKeys {
    /// The salt, kept for events (`None` when events are off).
    pub(crate) salt: Option<Arc<[u8]>>,
    /// The LoRA adapter, kept for events.
    pub(crate) lora_name: Option<Arc<str>>,
    /// Spans in the order they were given.
    pub(crate) spans: Vec<ExtraKey>,
}

impl SequenceKeys {
    /// The keys block `i` (of `bs` tokens) binds, in span order.
    pub(crate) fn of_block(&self, i: usize, bs: usize) -> Vec<String> {
        let (start, end) = (i * bs, (i + 1) * bs);
        self.spans
            .iter()
            .filter(|s| s.start < end && s.end > start)
            .map(|s| s.key.clone())
            .collect()
    }

    /// The digest block `i` binds, `None` without keys.
    pub(crate) fn digest(&self, i: usize, bs: usize) -> Option<Digest> {
        digest_of(&self.spans, i, bs)
    }

    /// Forgets the spans' tokens from `len` on (a rollback).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.spans.retain(|s| s.start < len);
        for span in &mut self.spans {
            span.end = span.end.min(len);
        }
    }
}

/// A block's extra keys as its hashes bind them.
pub(crate) type Digest = [u8; 32];

/// The digest of the keys of `spans` that block `i` (of `bs` tokens) holds, `None` if none.
pub(crate) fn digest_of(spans: &[ExtraKey], i: usize, bs: usize) -> Option<Digest> {
    let (start, end) = (i * bs, (i + 1) * bs);
    let mut held = spans.iter().filter(|s| s.start < end && s.end > start);
    let first = held.next()?;
    let mut hasher = blake3::Hasher::new_derive_key("pagedkv/extra-keys");
    for span in std::iter::once(first).chain(held) {
        hasher.update(&(span.key.len() as u64).to_le_bytes());
        hasher.update(span.key.as_bytes());
    }
    Some(*hasher.finalize().as_bytes())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn span(start: usize, end: usize, key: &str) -> ExtraKey {
        ExtraKey {
            start,
            end,
            key: key.to_owned(),
        }
    }

    #[test]
    fn a_block_binds_the_spans_it_holds_in_order() {
        let spans = [span(1, 3, "a"), span(2, 6, "b")];
        assert_eq!(digest_of(&spans, 2, 4), None);
        let both = digest_of(&spans, 0, 4).unwrap();
        assert_ne!(
            Some(both),
            digest_of(&[span(2, 6, "b"), span(1, 3, "a")], 0, 4)
        );
        assert_ne!(
            Some(both),
            digest_of(&[span(1, 3, "ab")], 0, 4),
            "keys are delimited"
        );
        assert_eq!(digest_of(&spans, 1, 4), digest_of(&[span(4, 5, "b")], 1, 4));
        assert!(check_spans(&spans, 0, 6).is_ok());
        assert!(
            check_spans(&spans, 2, 6).is_err() && check_spans(&[span(3, 3, "a")], 0, 6).is_err()
        );
    }

    #[test]
    fn truncating_cuts_and_drops_spans() {
        let mut keys = SequenceKeys {
            spans: vec![span(1, 3, "a"), span(2, 6, "b"), span(5, 6, "c")],
            ..SequenceKeys::default()
        };
        keys.truncate(5);
        assert_eq!(keys.spans, [span(1, 3, "a"), span(2, 5, "b")]);
        assert_eq!(keys.of_block(1, 4), ["b"]);
    }
}
