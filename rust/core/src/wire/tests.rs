use std::sync::Arc;

use super::*;

fn stored(hash: BlockHash, parent: Option<BlockHash>, medium: PoolKind, salt: &str) -> Event {
    Event {
        seq_no: 0,
        kind: EventKind::BlockStored {
            block_hash: hash,
            parent_hash: parent,
            token_ids: vec![hash as u32; 2],
            block_id: 0,
            medium,
            salt: (!salt.is_empty()).then(|| Arc::from(salt.as_bytes())),
            lora_name: None,
            extra_keys: Vec::new(),
        },
    }
}

fn removed(hash: BlockHash, medium: PoolKind) -> Event {
    Event {
        seq_no: 0,
        kind: EventKind::BlockRemoved {
            block_hash: hash,
            block_id: 0,
            medium,
        },
    }
}

fn header(encoding: Encoding, cleared_first: bool) -> BatchHeader {
    BatchHeader {
        ts: 1.5,
        data_parallel_rank: None,
        block_size: 2,
        encoding,
        cleared_first,
    }
}

#[test]
fn runs_group_chains_and_removals_of_one_medium() {
    use PoolKind::{Cpu, Gpu};
    let events = [
        stored(1, None, Gpu, ""),
        stored(2, Some(1), Gpu, ""),
        stored(3, Some(1), Gpu, ""),
        stored(4, Some(3), Cpu, ""),
        removed(2, Gpu),
        removed(3, Gpu),
        removed(4, Cpu),
        Event {
            seq_no: 0,
            kind: EventKind::AllBlocksCleared,
        },
    ];
    assert_eq!(runs(&events), [0..2, 2..3, 3..4, 4..6, 6..7, 7..8]);
}

#[test]
fn an_empty_batch_and_a_resync_marker() {
    let mut out = Vec::new();
    encode_batch(&header(Encoding::Array, false), &[], &mut out);
    let mut expected = vec![0x93, 0xcb];
    expected.extend_from_slice(&1.5f64.to_be_bytes());
    expected.extend_from_slice(&[0x90, 0xc0]);
    assert_eq!(out, expected);
    out.clear();
    encode_batch(&header(Encoding::Map, true), &[], &mut out);
    assert_eq!(out[10], 0x91, "one event");
    assert_eq!(&out[11..18], b"\x81\xa4type\xb0");
    assert_eq!(&out[18..34], b"AllBlocksCleared");
}

#[test]
fn salts_travel_as_cache_salt_and_first_block_extra_keys() {
    let events = [
        stored(1, None, PoolKind::Gpu, "tenant"),
        stored(2, Some(1), PoolKind::Gpu, "tenant"),
    ];
    let mut map = Vec::new();
    encode_batch(&header(Encoding::Map, false), &events, &mut map);
    assert!(map.windows(18).any(|w| w == b"\xaacache_salt\xa6tenant"));
    assert!(map.windows(10).any(|w| w == b"\x92\x91\xa6tenant\xc0"));
    let mut array = Vec::new();
    encode_batch(&header(Encoding::Array, false), &events, &mut array);
    assert!(!array.windows(10).any(|w| w == b"cache_salt"));
    assert!(array.windows(10).any(|w| w == b"\x92\x91\xa6tenant\xc0"));
}

#[test]
fn a_salt_that_is_not_utf8_is_written_in_hex() {
    assert_eq!(cache_salt(b"tenant-a"), "tenant-a");
    assert_eq!(cache_salt(&[0xff, 0x01]), "hex:ff01");
    assert_eq!(cache_salt(b""), "");
}

#[test]
fn integers_take_msgpack_smallest_form() {
    let mut out = Vec::new();
    for v in [0x7f, 0x80, 0x100, 0x1_0000, 0x1_0000_0000] {
        uint(&mut out, v);
    }
    assert_eq!(
        out,
        [0x7f, 0xcc, 0x80, 0xcd, 1, 0, 0xce, 0, 1, 0, 0, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0]
    );
}

#[test]
fn lora_and_block_keys_lead_each_blocks_extra_keys() {
    let mut events = [
        stored(1, None, PoolKind::Gpu, "s"),
        stored(2, Some(1), PoolKind::Gpu, "s"),
    ];
    for (i, event) in events.iter_mut().enumerate() {
        if let EventKind::BlockStored {
            lora_name,
            extra_keys,
            ..
        } = &mut event.kind
        {
            *lora_name = Some(Arc::from("ad"));
            if i == 1 {
                extra_keys.push("img".to_owned());
            }
        }
    }
    let mut out = Vec::new();
    encode_batch(&header(Encoding::Array, false), &events, &mut out);
    // lora_name, then extra_keys: [["ad", "s"], ["ad", "img"]].
    let expected = b"\xa2ad\x92\x92\xa2ad\xa1s\x92\xa2ad\xa3img\xc0";
    assert!(
        out.windows(expected.len()).any(|w| w == expected),
        "{out:?}"
    );
}
