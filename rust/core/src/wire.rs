//! KV events as KV-aware routers read them: vLLM's `EventBatch` in msgpack.
//!
//! A batch is `[ts, events, data_parallel_rank]`. Stored blocks are grouped into chain runs
//! (consecutive stored events of one medium, each the next one's parent) and consecutive
//! removals of one medium into one `BlockRemoved`. Each event is a map tagged by `"type"`
//! ([`Encoding::Map`]) or an array whose first element is the tag ([`Encoding::Array`]).
//! Hashes are the low 64 bits of the block hashes. A stored run carries its sequence's LoRA
//! adapter as `lora_name`, its salt as `cache_salt` (map only), and `extra_keys` as vLLM writes
//! them: per block, the LoRA adapter, the block's extra keys, then (first block only) the salt;
//! `None` for a block without any, and no field when no block has any.

use std::ops::Range;

use crate::events::{Event, EventKind};
use crate::{BlockHash, PoolKind};

/// How each event of a batch is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// A map with a `"type"` key, what current vLLM writes.
    Map,
    /// A tagged positional array, what older vLLM wrote (and llm-d reads).
    Array,
}

/// The batch-level fields of an encoded batch.
#[derive(Clone, Copy, Debug)]
pub struct BatchHeader {
    /// Seconds since the epoch.
    pub ts: f64,
    /// The engine's data-parallel rank, written as nil when `None`.
    pub data_parallel_rank: Option<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// How events are written.
    pub encoding: Encoding,
    /// Put `AllBlocksCleared` first (the subscriber missed earlier batches).
    pub cleared_first: bool,
}

/// The 64-bit wire hash of a block hash: its low 64 bits.
pub fn wire_hash(hash: BlockHash) -> u64 {
    hash as u64
}

/// The `cache_salt` string of a salt: the salt itself when it is UTF-8, else `"hex:"` and its
/// bytes in lowercase hex.
pub fn cache_salt(salt: &[u8]) -> String {
    match std::str::from_utf8(salt) {
        Ok(text) => text.to_owned(),
        Err(_) => {
            let hex: String = salt.iter().map(|b| format!("{b:02x}")).collect();
            format!("hex:{hex}")
        }
    }
}

/// Appends the msgpack `EventBatch` of `events` (one take of the manager's events) to `out`.
pub fn encode_batch(header: &BatchHeader, events: &[Event], out: &mut Vec<u8>) {
    let runs = runs(events);
    array_len(out, 3);
    out.push(0xcb);
    out.extend_from_slice(&header.ts.to_be_bytes());
    array_len(out, runs.len() + usize::from(header.cleared_first));
    if header.cleared_first {
        tag(out, header.encoding, "AllBlocksCleared", 0);
    }
    for run in runs {
        let run = &events[run];
        match run[0].kind {
            EventKind::BlockStored { .. } => stored(out, header, run),
            EventKind::BlockRemoved { .. } => removed(out, header.encoding, run),
            EventKind::AllBlocksCleared => tag(out, header.encoding, "AllBlocksCleared", 0),
        }
    }
    match header.data_parallel_rank {
        Some(rank) => uint(out, u64::from(rank)),
        None => out.push(0xc0),
    }
}

/// The index ranges of the wire events (see the module docs).
fn runs(events: &[Event]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for i in 0..events.len() {
        match runs.last_mut() {
            Some(run) if joins(&events[i - 1].kind, &events[i].kind) => run.end = i + 1,
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

/// Whether `next` continues the wire event that `prev` ends.
fn joins(prev: &EventKind, next: &EventKind) -> bool {
    match (prev, next) {
        (
            EventKind::BlockStored {
                block_hash, medium, ..
            },
            EventKind::BlockStored {
                parent_hash: Some(parent),
                medium: next_medium,
                ..
            },
        ) => block_hash == parent && medium == next_medium,
        (
            EventKind::BlockRemoved { medium, .. },
            EventKind::BlockRemoved {
                medium: next_medium,
                ..
            },
        ) => medium == next_medium,
        _ => false,
    }
}

/// A `BlockStored` of a chain run.
fn stored(out: &mut Vec<u8>, header: &BatchHeader, run: &[Event]) {
    let EventKind::BlockStored {
        parent_hash,
        medium,
        salt,
        lora_name,
        ..
    } = &run[0].kind
    else {
        unreachable!("a stored run starts with a stored event");
    };
    let salt = salt.as_deref().map(cache_salt);
    let first_salt = salt.as_deref().filter(|_| parent_hash.is_none());
    let extra = lora_name.is_some()
        || first_salt.is_some()
        || run.iter().any(|e| !block_keys(e).is_empty());
    let map = header.encoding == Encoding::Map;
    let fields = 7 + usize::from(extra) + usize::from(map && salt.is_some());
    tag(out, header.encoding, "BlockStored", fields);
    key(out, map, "block_hashes");
    array_len(out, run.len());
    for event in run {
        if let EventKind::BlockStored { block_hash, .. } = &event.kind {
            uint(out, wire_hash(*block_hash));
        }
    }
    key(out, map, "parent_block_hash");
    match parent_hash {
        Some(parent) => uint(out, wire_hash(*parent)),
        None => out.push(0xc0),
    }
    key(out, map, "token_ids");
    array_len(out, run.len() * header.block_size as usize);
    for event in run {
        if let EventKind::BlockStored { token_ids, .. } = &event.kind {
            for &token in token_ids {
                uint(out, u64::from(token));
            }
        }
    }
    key(out, map, "block_size");
    uint(out, u64::from(header.block_size));
    key(out, map, "lora_id");
    out.push(0xc0);
    key(out, map, "medium");
    str(out, medium_name(*medium));
    key(out, map, "lora_name");
    match lora_name {
        Some(name) => str(out, name),
        None => out.push(0xc0),
    }
    if extra {
        key(out, map, "extra_keys");
        array_len(out, run.len());
        for (i, event) in run.iter().enumerate() {
            let keys = block_keys(event);
            let salt = first_salt.filter(|_| i == 0);
            let n = usize::from(lora_name.is_some()) + keys.len() + usize::from(salt.is_some());
            if n == 0 {
                out.push(0xc0);
                continue;
            }
            array_len(out, n);
            for key in lora_name
                .as_deref()
                .into_iter()
                .chain(keys.iter().map(String::as_str))
            {
                str(out, key);
            }
            if let Some(salt) = salt {
                str(out, salt);
            }
        }
    }
    if let (true, Some(salt)) = (map, &salt) {
        key(out, map, "cache_salt");
        str(out, salt);
    }
}

/// A stored event's own extra keys.
fn block_keys(event: &Event) -> &[String] {
    match &event.kind {
        EventKind::BlockStored { extra_keys, .. } => extra_keys,
        _ => &[],
    }
}

/// A `BlockRemoved` of a removal run.
fn removed(out: &mut Vec<u8>, encoding: Encoding, run: &[Event]) {
    let map = encoding == Encoding::Map;
    tag(out, encoding, "BlockRemoved", 2);
    key(out, map, "block_hashes");
    array_len(out, run.len());
    let mut medium = PoolKind::Gpu;
    for event in run {
        if let EventKind::BlockRemoved {
            block_hash,
            medium: m,
            ..
        } = &event.kind
        {
            uint(out, wire_hash(*block_hash));
            medium = *m;
        }
    }
    key(out, map, "medium");
    str(out, medium_name(medium));
}

fn medium_name(medium: PoolKind) -> &'static str {
    match medium {
        PoolKind::Gpu => "GPU",
        PoolKind::Cpu => "CPU",
    }
}

/// An event's header: a map of `fields + 1` entries starting with `"type"`, or an array of
/// `fields + 1` elements starting with the tag.
fn tag(out: &mut Vec<u8>, encoding: Encoding, name: &str, fields: usize) {
    match encoding {
        Encoding::Map => {
            map_len(out, fields + 1);
            str(out, "type");
        }
        Encoding::Array => array_len(out, fields + 1),
    }
    str(out, name);
}

/// A field's key (map encoding only).
fn key(out: &mut Vec<u8>, map: bool, name: &str) {
    if map {
        str(out, name);
    }
}

/// msgpack's smallest form of an unsigned integer.
fn uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v <= 0xff {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= 0xffff {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= 0xffff {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

fn array_len(out: &mut Vec<u8>, n: usize) {
    header(out, n, 0x90, 0xdc, 0xdd);
}

fn map_len(out: &mut Vec<u8>, n: usize) {
    header(out, n, 0x80, 0xde, 0xdf);
}

fn header(out: &mut Vec<u8>, n: usize, fix: u8, short: u8, long: u8) {
    if n < 16 {
        out.push(fix | n as u8);
    } else if n <= 0xffff {
        out.push(short);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(long);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
