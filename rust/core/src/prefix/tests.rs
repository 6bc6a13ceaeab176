use super::*;

#[test]
fn hashes_chain_and_depend_on_key_and_salt() {
    let a = PrefixCache::new([1; 32], 4, 4).unwrap();
    let b = PrefixCache::new([2; 32], 4, 4).unwrap();
    let root = a.root(&HashKeys::default(), 0);
    assert_ne!(root, a.root(&HashKeys::salt(Some(b"tenant")), 0));
    assert_ne!(a.root(&HashKeys::salt(Some(b"")), 0), root);
    let h = a.hash_block(&root, &[1, 2, 3, 4], None);
    assert_eq!(h, a.hash_block(&root, &[1, 2, 3, 4], None));
    assert_ne!(h, a.hash_block(&root, &[1, 2, 3, 5], None));
    assert_ne!(h, a.hash_block(&h, &[1, 2, 3, 4], None));
    assert_ne!(
        h,
        b.hash_block(&b.root(&HashKeys::default(), 0), &[1, 2, 3, 4], None)
    );
}

#[test]
fn map_keys_chain_and_depend_on_key_and_salt() {
    let a = PrefixCache::new([1; 32], 4, 4).unwrap();
    let b = PrefixCache::new([2; 32], 4, 4).unwrap();
    let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
    let keys = |c: &PrefixCache, salt: Option<&[u8]>| {
        c.hash_prompt(&tokens, &HashKeys::salt(salt), 0, true).keys
    };
    let k = keys(&a, None);
    assert_eq!(k.len(), 2);
    assert_eq!(k, keys(&a, None));
    assert_eq!(
        k[0],
        a.key_block(root_key(&a.root(&HashKeys::default(), 0)), &tokens[..4])
    );
    assert_eq!(k[1], a.key_block(k[0], &tokens[4..]));
    assert_ne!(
        k[0],
        a.key_block(root_key(&a.root(&HashKeys::default(), 0)), &tokens[4..])
    );
    assert_ne!(k, keys(&a, Some(b"tenant")));
    assert_ne!(k, keys(&b, None));
}

#[test]
fn long_blocks_hash_all_tokens() {
    let c = PrefixCache::new([0; 32], 1, 200).unwrap();
    let tokens: Vec<u32> = (0..200).collect();
    let mut other = tokens.clone();
    other[199] = 7;
    let root = c.root(&HashKeys::default(), 0);
    assert_ne!(
        c.hash_block(&root, &tokens, None),
        c.hash_block(&root, &other, None)
    );
    assert_ne!(c.key_block(0, &tokens), c.key_block(0, &other));
}

/// Every path of `key_block` (short, the usual 16 tokens, a buffer, streamed) is XXH3 of
/// the parent key and the tokens, so the key is one function of them.
#[test]
fn map_keys_are_one_function_of_parent_and_tokens() {
    let c = PrefixCache::new([0; 32], 1, 200).unwrap();
    let parent: MapKey = 0x0123_4567_89ab_cdef << 60 | 42;
    for len in [1, 15, 16, 17, 64, 65, 200] {
        let tokens: Vec<Token> = (0..len).map(|t| t * 31 + 5).collect();
        let mut bytes = parent.to_le_bytes().to_vec();
        bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        let expected = xxh3_128_with_secret(&bytes, &c.secret);
        assert_eq!(c.key_block(parent, &tokens), expected, "{len} tokens");
    }
}

/// A registration stores every token of its block (the usual 16 without a loop, any other
/// size pairwise): each one verifies, and changing any one fails.
#[test]
fn registrations_store_every_token() {
    for bs in [1, 3, 15, 16, 17, 32] {
        let c = PrefixCache::new([0; 32], 2, bs).unwrap();
        let tokens: Vec<Token> = (0..bs as Token).map(|t| t * 7 + 1).collect();
        let chain = c.hash_block(&c.root(&HashKeys::default(), 0), &tokens, None);
        let k = c.key_block(root_key(&c.root(&HashKeys::default(), 0)), &tokens);
        c.register(1, k, 5, &chain, &tokens, 0, || true, || {});
        assert!(c.matches(1, k, 5, &tokens), "{bs} tokens");
        for i in 0..tokens.len() {
            let mut other = tokens.clone();
            other[i] += 1;
            assert!(
                !c.matches(1, k, 5, &other),
                "{bs} tokens, token {i} changed"
            );
        }
    }
}

#[test]
fn register_verify_unregister() {
    let c = PrefixCache::new([0; 32], 2, 2).unwrap();
    let chain = c.hash_block(&c.root(&HashKeys::default(), 0), &[1, 2], None);
    let k = c.key_block(root_key(&c.root(&HashKeys::default(), 0)), &[1, 2]);
    c.register(1, k, 5, &chain, &[1, 2], 0, || true, || {});
    c.register(
        0,
        k,
        5,
        &chain,
        &[1, 2],
        0,
        || true,
        || panic!("already mapped"),
    );
    assert_eq!(c.get(k), Some(1));
    assert_eq!((c.key_of(1), c.chain_of(1)), (k, chain));
    assert_eq!(c.hash_of(1), block_hash_of(&chain));
    assert_eq!(c.hashes(0), vec![block_hash_of(&chain)]);
    assert!(c.matches(1, k, 5, &[1, 2]));
    assert!(!c.matches(1, k, 6, &[1, 2]));
    assert!(!c.matches(1, k, 5, &[1, 3]));
    c.unregister(0, || panic!("not mapped to 0"));
    assert_eq!(c.get(k), Some(1));
    let mut removed = false;
    c.unregister(1, || removed = true);
    assert!(removed);
    assert_eq!(c.get(k), None);
}

/// Tokens are stored two to a word: an odd block's last token has a word of its own, and
/// every token is verified, in blocks spanning several lines.
#[test]
fn every_token_of_odd_and_long_blocks_is_verified() {
    for bs in [1, 3, 17, 33] {
        let c = PrefixCache::new([0; 32], 3, bs).unwrap();
        let tokens: Vec<Token> = (0..bs).map(|t| t * 7 + 1).collect();
        let k = c.key_block(0, &tokens);
        c.register(2, k, 0, &[0; 32], &tokens, 0, || true, || {});
        assert!(c.matches(2, k, 0, &tokens));
        for i in 0..tokens.len() {
            let mut other = tokens.clone();
            other[i] += 1;
            assert!(!c.matches(2, k, 0, &other), "block size {bs}, token {i}");
        }
        assert_eq!(c.key_of(1), 0, "a neighbour's registration is untouched");
    }
}

/// A prompt whose first block is registered: the walk reads the hit's chain, computes the
/// rest once, and a second walk that finds the same hits recomputes nothing.
#[test]
fn prompt_hashes_read_hits_and_compute_the_rest_once() {
    let pool = BlockPool::new(2).unwrap();
    let c = PrefixCache::new([3; 32], 2, 2).unwrap();
    let tokens = [1, 2, 3, 4, 5];
    let root = c.root(&HashKeys::default(), 0);
    let chains = [
        c.hash_block(&root, &tokens[..2], None),
        c.hash_block(
            &c.hash_block(&root, &tokens[..2], None),
            &tokens[2..4],
            None,
        ),
    ];
    let mut prompt = c.hash_prompt(&tokens, &HashKeys::default(), 0, true);
    prompt.find_hits(&c, &pool, &tokens, 2);
    assert!(prompt.hits.is_empty());
    assert_eq!(prompt.chains, chains);
    assert_eq!(prompt.computed_from, 0);

    let block = pool.allocate().unwrap();
    let parent = root_key(&root);
    c.register(
        block,
        prompt.keys[0],
        parent,
        &chains[0],
        &tokens[..2],
        0,
        || true,
        || pool.mark_hashed(block),
    );
    prompt.find_hits(&c, &pool, &tokens, 2);
    assert_eq!(prompt.hits.len(), 1);
    assert_eq!((prompt.hits[0].0, prompt.cached_hits), (block, 0));
    assert_eq!(prompt.chains, chains);
    assert_eq!(prompt.computed_from, 1);
    prompt.chains[1] = [9; 32]; // would be recomputed if the walk started elsewhere
    prompt.find_hits(&c, &pool, &tokens, 2);
    assert_eq!(prompt.chains[1], [9; 32]);
    assert_eq!(
        c.count_hits(&pool, &tokens, &HashKeys::default(), 0, 2),
        (1, 0)
    );
    assert_eq!(
        c.count_hits(&pool, &tokens, &HashKeys::default(), 0, 0),
        (0, 0)
    );
    assert_eq!(
        c.count_hits(&pool, &tokens, &HashKeys::salt(Some(b"s")), 0, 2),
        (0, 0)
    );
}
