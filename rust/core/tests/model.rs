//! Model-based property test: the real `BlockManager` against a plain single-threaded model of
//! SEMANTICS.md.
//!
//! The model uses the most obvious data structures (a `Vec` as the free stack, a `VecDeque` as the
//! cached queue, a `HashMap` from `(salt, token prefix)` to block, refcount vectors), so that a
//! reader can check it against SEMANTICS.md line by line. Random operation sequences run on both;
//! after every operation the test compares results, errors, every live sequence's tokens and block
//! table (exact physical ids), stats, plans and events, and runs `check()`.
//!
//! Where SEMANTICS.md leaves an order open (which of several validation errors wins), the model
//! returns every error that applies and the real one must be among them; capacity errors
//! (`OutOfBlocks`) are exact. Set `PROPTEST_CASES` to change the number of cases.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use pagedkv::{
    BlockId, BlockManager, Config, Error, Event, EventKind, Plan, PoolKind, SeqId, Stats, Token,
};
use proptest::prelude::*;
use proptest::sample::Index;

/// Cases when `PROPTEST_CASES` is unset: 25-60 s on two cores in release (the intended way to
/// run this test), and a smoke run in debug builds, which are some twenty times slower.
const DEFAULT_CASES: u32 = if cfg!(debug_assertions) {
    1_000
} else {
    50_000
};
/// Sequence ids the operations draw from (a few more than the pools can usually hold).
const NUM_IDS: u64 = 8;
/// System prompts that many prompts start with, over the same small alphabet as the suffixes.
const SYSTEM_PREFIXES: [&[Token]; 4] = [
    &[],
    &[1, 2, 3, 1, 2, 3, 1, 2],
    &[1, 2, 3, 1, 0, 0, 0, 0, 0, 0],
    &[3, 3, 3, 3, 3, 3],
];
/// Tenant salts; `None` most often. (An empty salt is avoided: SEMANTICS.md does not say whether
/// it equals no salt.)
const SALTS: [Option<&[u8]>; 3] = [None, Some(b"tenant-a"), Some(b"tenant-b")];

// ---------------------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------------------

/// What a block's hash stands for: the salt and every token up to the block's end.
type Key = (Option<Vec<u8>>, Vec<Token>);

#[derive(Clone, Debug)]
struct ModelSeq {
    tokens: Vec<Token>,
    /// GPU block ids, or CPU block ids while swapped out.
    table: Vec<BlockId>,
    salt: Option<Vec<u8>>,
    swapped: bool,
}

#[derive(Clone, Debug)]
enum ModelEvent {
    Stored { key: Key, token_ids: Vec<Token> },
    Removed { key: Key },
    Cleared,
}

/// A model result: `Err` lists every error SEMANTICS.md allows for the call.
type Expect<T> = Result<T, Vec<Error>>;

/// SEMANTICS.md executed literally, one plain data structure per concept.
struct Model {
    bs: usize,
    num_blocks: usize,
    caching: bool,
    events_on: bool,
    watermark: f64,
    /// The GPU free stack; the top is the end.
    free: Vec<BlockId>,
    /// CACHED blocks; the head is the least recently released (the next victim).
    cached: VecDeque<BlockId>,
    refcount: Vec<u32>,
    /// The key a block is registered under (hashed), if any.
    hash: Vec<Option<Key>>,
    /// The prefix map.
    prefix: HashMap<Key, BlockId>,
    cpu_free: Vec<BlockId>,
    cpu_refcount: Vec<u32>,
    seqs: BTreeMap<SeqId, ModelSeq>,
    copies: Vec<[BlockId; 2]>,
    events: Vec<ModelEvent>,
    query_tokens: u64,
    hit_tokens: u64,
    evictions: u64,
}

fn invalid() -> Error {
    Error::InvalidArgument(String::new())
}

fn has_repeats(seqs: &[SeqId]) -> bool {
    let mut seen = HashSet::new();
    !seqs.iter().all(|s| seen.insert(*s))
}

impl Model {
    fn new(cfg: &Config) -> Model {
        let n = cfg.num_blocks as usize;
        Model {
            bs: cfg.block_size as usize,
            num_blocks: n,
            caching: cfg.enable_prefix_caching,
            events_on: cfg.enable_events,
            watermark: cfg.watermark,
            free: (0..cfg.num_blocks).rev().collect(),
            cached: VecDeque::new(),
            refcount: vec![0; n],
            hash: vec![None; n],
            prefix: HashMap::new(),
            cpu_free: (0..cfg.num_cpu_blocks).rev().collect(),
            cpu_refcount: vec![0; cfg.num_cpu_blocks as usize],
            seqs: BTreeMap::new(),
            copies: Vec::new(),
            events: Vec::new(),
            query_tokens: 0,
            hit_tokens: 0,
            evictions: 0,
        }
    }

    fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    fn emit(&mut self, event: ModelEvent) {
        if self.events_on {
            self.events.push(event);
        }
    }

    /// Pop the free stack, or evict the cached-queue head.
    fn take(&mut self) -> BlockId {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self
                    .cached
                    .pop_front()
                    .expect("model: capacity was checked");
                let key = self.hash[b as usize]
                    .take()
                    .expect("cached block is hashed");
                assert_eq!(self.prefix.remove(&key), Some(b));
                self.evictions += 1;
                self.emit(ModelEvent::Removed { key });
                b
            }
        };
        self.refcount[b as usize] = 1;
        b
    }

    fn release(&mut self, b: BlockId) {
        let rc = &mut self.refcount[b as usize];
        *rc -= 1;
        if *rc == 0 {
            if self.hash[b as usize].is_some() {
                self.cached.push_back(b);
            } else {
                self.free.push(b);
            }
        }
    }

    fn release_cpu(&mut self, b: BlockId) {
        let rc = &mut self.cpu_refcount[b as usize];
        *rc -= 1;
        if *rc == 0 {
            self.cpu_free.push(b);
        }
    }

    fn acquire_hit(&mut self, b: BlockId) {
        if self.refcount[b as usize] == 0 {
            let pos = self
                .cached
                .iter()
                .position(|&c| c == b)
                .expect("hit is cached");
            self.cached.remove(pos);
        }
        self.refcount[b as usize] += 1;
    }

    fn key(&self, salt: &Option<Vec<u8>>, tokens: &[Token], i: usize) -> Key {
        (salt.clone(), tokens[..(i + 1) * self.bs].to_vec())
    }

    /// Register full block `i` (physical `block`) of a sequence with these tokens.
    fn register(&mut self, salt: &Option<Vec<u8>>, tokens: &[Token], block: BlockId, i: usize) {
        if !self.caching {
            return;
        }
        let key = self.key(salt, tokens, i);
        if self.prefix.contains_key(&key) {
            return;
        }
        assert!(
            self.hash[block as usize].is_none(),
            "model: registering a hashed block"
        );
        self.prefix.insert(key.clone(), block);
        self.hash[block as usize] = Some(key.clone());
        let token_ids = tokens[i * self.bs..(i + 1) * self.bs].to_vec();
        self.emit(ModelEvent::Stored { key, token_ids });
    }

    fn lookup(&self, tokens: &[Token], salt: &Option<Vec<u8>>) -> Vec<BlockId> {
        let mut hits = Vec::new();
        if !self.caching || tokens.is_empty() {
            return hits;
        }
        let mut i = 0;
        while (i + 1) * self.bs < tokens.len() {
            match self.prefix.get(&self.key(salt, tokens, i)) {
                Some(&b) => hits.push(b),
                None => break,
            }
            i += 1;
        }
        hits
    }

    fn alloc_needed(&self, tokens: &[Token], hits: &[BlockId]) -> usize {
        let n = tokens.len().div_ceil(self.bs);
        let revived = hits
            .iter()
            .filter(|&&b| self.refcount[b as usize] == 0)
            .count();
        n - hits.len() + revived
    }

    fn out_of_blocks<T>(pool: PoolKind, needed: usize, available: usize) -> Expect<T> {
        Err(vec![Error::OutOfBlocks {
            pool,
            needed,
            available,
        }])
    }

    /// Errors for a sequence that must be live and on the GPU.
    fn gpu_seq_errors(&self, seq: SeqId, errs: &mut Vec<Error>) {
        match self.seqs.get(&seq) {
            None => errs.push(Error::UnknownSequence(seq)),
            Some(s) if s.swapped => errs.push(Error::SwappedOut(seq)),
            Some(_) => {}
        }
    }

    fn allocate(&mut self, seq: SeqId, tokens: &[Token], salt: Option<&[u8]>) -> Expect<usize> {
        let mut errs = Vec::new();
        if self.seqs.contains_key(&seq) {
            errs.push(Error::DuplicateSequence(seq));
        }
        if tokens.is_empty() {
            errs.push(invalid());
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let salt = salt.map(<[u8]>::to_vec);
        let hits = self.lookup(tokens, &salt);
        let needed = self.alloc_needed(tokens, &hits);
        if needed > self.available() {
            return Self::out_of_blocks(PoolKind::Gpu, needed, self.available());
        }
        let k = hits.len();
        let n = tokens.len().div_ceil(self.bs);
        for &b in &hits {
            self.acquire_hit(b);
        }
        let mut table = hits;
        for _ in k..n {
            let b = self.take();
            table.push(b);
        }
        for (i, &b) in table
            .iter()
            .enumerate()
            .take(tokens.len() / self.bs)
            .skip(k)
        {
            self.register(&salt, tokens, b, i);
        }
        self.query_tokens += tokens.len() as u64;
        self.hit_tokens += (k * self.bs) as u64;
        let tokens = tokens.to_vec();
        self.seqs.insert(
            seq,
            ModelSeq {
                tokens,
                table,
                salt,
                swapped: false,
            },
        );
        Ok(k * self.bs)
    }

    fn can_allocate(&self, tokens: &[Token], salt: Option<&[u8]>) -> bool {
        let salt = salt.map(<[u8]>::to_vec);
        let hits = self.lookup(tokens, &salt);
        let needed = self.alloc_needed(tokens, &hits) as i64;
        let reserve = (self.watermark * self.num_blocks as f64).floor() as i64;
        self.available() as i64 - needed >= reserve
    }

    fn append_needed(&self, s: &ModelSeq, m: usize) -> usize {
        let len = s.tokens.len();
        let cow = len % self.bs != 0 && self.refcount[*s.table.last().unwrap() as usize] > 1;
        usize::from(cow) + (len + m).div_ceil(self.bs) - len.div_ceil(self.bs)
    }

    /// Append with capacity already checked: CoW, new blocks, then registration.
    fn do_append(&mut self, seq: SeqId, tokens: &[Token]) {
        let mut s = self.seqs.remove(&seq).expect("model: validated");
        let len = s.tokens.len();
        let last = *s.table.last().unwrap();
        if len % self.bs != 0 && self.refcount[last as usize] > 1 {
            let dst = self.take();
            self.copies.push([last, dst]);
            self.release(last);
            *s.table.last_mut().unwrap() = dst;
        }
        for _ in len.div_ceil(self.bs)..(len + tokens.len()).div_ceil(self.bs) {
            let b = self.take();
            s.table.push(b);
        }
        s.tokens.extend_from_slice(tokens);
        for i in len / self.bs..s.tokens.len() / self.bs {
            self.register(&s.salt, &s.tokens, s.table[i], i);
        }
        self.seqs.insert(seq, s);
    }

    fn append(&mut self, seq: SeqId, tokens: &[Token]) -> Expect<()> {
        let mut errs = Vec::new();
        self.gpu_seq_errors(seq, &mut errs);
        if tokens.is_empty() {
            errs.push(invalid());
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let needed = self.append_needed(&self.seqs[&seq], tokens.len());
        if needed > self.available() {
            return Self::out_of_blocks(PoolKind::Gpu, needed, self.available());
        }
        self.do_append(seq, tokens);
        Ok(())
    }

    fn step(&mut self, seqs: &[SeqId], tokens: &[Token]) -> Expect<Plan> {
        let mut errs = Vec::new();
        if seqs.len() != tokens.len() || has_repeats(seqs) {
            errs.push(invalid());
        }
        for &s in seqs {
            self.gpu_seq_errors(s, &mut errs);
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let needed: usize = seqs
            .iter()
            .map(|s| self.append_needed(&self.seqs[s], 1))
            .sum();
        if needed > self.available() {
            return Self::out_of_blocks(PoolKind::Gpu, needed, self.available());
        }
        for (&s, &t) in seqs.iter().zip(tokens) {
            self.do_append(s, &[t]);
        }
        self.plan(seqs, &vec![1; seqs.len()])
    }

    fn plan(&self, seqs: &[SeqId], query_lens: &[u32]) -> Expect<Plan> {
        let mut errs = Vec::new();
        if seqs.len() != query_lens.len() || has_repeats(seqs) {
            errs.push(invalid());
        }
        for (&s, &q) in seqs.iter().zip(query_lens) {
            self.gpu_seq_errors(s, &mut errs);
            if let Some(m) = self.seqs.get(&s) {
                if q < 1 || q as usize > m.tokens.len() {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let bs = self.bs;
        let mut p = Plan::default();
        p.kv_indptr.push(0);
        p.qo_indptr.push(0);
        p.max_blocks = seqs
            .iter()
            .map(|s| self.seqs[s].table.len())
            .max()
            .unwrap_or(0);
        for (&s, &q) in seqs.iter().zip(query_lens) {
            let m = &self.seqs[&s];
            let kv_len = m.tokens.len();
            let pages = kv_len.div_ceil(bs);
            p.kv_indptr.push(p.kv_indptr.last().unwrap() + pages as i32);
            p.kv_indices
                .extend(m.table[..pages].iter().map(|&b| b as i32));
            p.kv_last_page_len.push((kv_len - (pages - 1) * bs) as i32);
            p.qo_indptr.push(p.qo_indptr.last().unwrap() + q as i32);
            for pos in kv_len - q as usize..kv_len {
                p.positions.push(pos as i32);
                p.slot_mapping
                    .push((m.table[pos / bs] as usize * bs + pos % bs) as i32);
            }
            let mut row: Vec<i32> = m.table.iter().map(|&b| b as i32).collect();
            row.resize(p.max_blocks, -1);
            p.block_tables.extend(row);
        }
        Ok(p)
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> Expect<()> {
        let mut errs = Vec::new();
        self.gpu_seq_errors(parent, &mut errs);
        if self.seqs.contains_key(&child) {
            errs.push(Error::DuplicateSequence(child));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let s = self.seqs[&parent].clone();
        for &b in &s.table {
            self.refcount[b as usize] += 1;
        }
        self.seqs.insert(child, s);
        Ok(())
    }

    fn free(&mut self, seq: SeqId) -> Expect<()> {
        let Some(s) = self.seqs.remove(&seq) else {
            return Err(vec![Error::UnknownSequence(seq)]);
        };
        for &b in s.table.iter().rev() {
            if s.swapped {
                self.release_cpu(b);
            } else {
                self.release(b);
            }
        }
        Ok(())
    }

    /// Distinct blocks of the sequences' tables in first-appearance order, with reference counts.
    fn distinct_blocks(&self, seqs: &[SeqId]) -> Vec<(BlockId, u32)> {
        let mut out: Vec<(BlockId, u32)> = Vec::new();
        for s in seqs {
            for &b in &self.seqs[s].table {
                match out.iter_mut().find(|(x, _)| *x == b) {
                    Some((_, c)) => *c += 1,
                    None => out.push((b, 1)),
                }
            }
        }
        out
    }

    fn swap_out(&mut self, seqs: &[SeqId]) -> Expect<Vec<[BlockId; 2]>> {
        let mut errs = Vec::new();
        if has_repeats(seqs) {
            errs.push(invalid());
        }
        for &s in seqs {
            self.gpu_seq_errors(s, &mut errs);
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let blocks = self.distinct_blocks(seqs);
        if blocks.len() > self.cpu_free.len() {
            return Self::out_of_blocks(PoolKind::Cpu, blocks.len(), self.cpu_free.len());
        }
        let mut pairs = Vec::new();
        for (gpu, count) in blocks {
            let cpu = self.cpu_free.pop().unwrap();
            self.cpu_refcount[cpu as usize] = count;
            pairs.push([gpu, cpu]);
        }
        for s in seqs {
            let mut m = self.seqs.remove(s).unwrap();
            for &b in m.table.iter().rev() {
                self.release(b);
            }
            for b in &mut m.table {
                *b = pairs.iter().find(|p| p[0] == *b).unwrap()[1];
            }
            m.swapped = true;
            self.seqs.insert(*s, m);
        }
        Ok(pairs)
    }

    fn swap_in(&mut self, seqs: &[SeqId]) -> Expect<Vec<[BlockId; 2]>> {
        let mut errs = Vec::new();
        if has_repeats(seqs) {
            errs.push(invalid());
        }
        for &s in seqs {
            match self.seqs.get(&s) {
                None => errs.push(Error::UnknownSequence(s)),
                Some(m) if !m.swapped => errs.push(Error::NotSwappedOut(s)),
                Some(_) => {}
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let blocks = self.distinct_blocks(seqs);
        if blocks.len() > self.available() {
            return Self::out_of_blocks(PoolKind::Gpu, blocks.len(), self.available());
        }
        let mut pairs = Vec::new();
        for (cpu, count) in blocks {
            let gpu = self.take();
            self.refcount[gpu as usize] = count;
            pairs.push([cpu, gpu]);
        }
        for s in seqs {
            let table = self.seqs[s].table.clone();
            for &b in table.iter().rev() {
                self.release_cpu(b);
            }
        }
        for s in seqs {
            let m = self.seqs.get_mut(s).unwrap();
            for b in &mut m.table {
                *b = pairs.iter().find(|p| p[0] == *b).unwrap()[1];
            }
            m.swapped = false;
        }
        for s in seqs {
            let m = self.seqs[s].clone();
            for i in 0..m.tokens.len() / self.bs {
                self.register(&m.salt, &m.tokens, m.table[i], i);
            }
        }
        Ok(pairs)
    }

    fn reset_prefix_cache(&mut self) {
        while let Some(b) = self.cached.pop_front() {
            self.free.push(b);
        }
        self.hash.iter_mut().for_each(|h| *h = None);
        self.prefix.clear();
        self.emit(ModelEvent::Cleared);
    }

    fn stats(&self) -> Stats {
        let mut fill: HashMap<BlockId, usize> = HashMap::new();
        for m in self.seqs.values().filter(|m| !m.swapped) {
            for (i, &b) in m.table.iter().enumerate() {
                let n = (m.tokens.len() - i * self.bs).min(self.bs);
                let prev = fill.insert(b, n);
                assert!(
                    prev.is_none() || prev == Some(n),
                    "model: sharers disagree on fill"
                );
            }
        }
        let held = self.num_blocks - self.free.len() - self.cached.len();
        let stored: usize = fill.values().sum();
        Stats {
            num_blocks: self.num_blocks,
            num_free: self.free.len(),
            num_cached: self.cached.len(),
            num_held: held,
            usage: held as f64 / self.num_blocks as f64,
            token_usage: if held == 0 {
                0.0
            } else {
                stored as f64 / (held * self.bs) as f64
            },
            stored_tokens: stored,
            prefix_query_tokens: self.query_tokens,
            prefix_hit_tokens: self.hit_tokens,
            evictions: self.evictions,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

/// A sequence id, resolved against the model's state when the operation runs (so that most
/// operations name a sequence in the right state, and shrinking keeps them meaningful).
#[derive(Clone, Debug)]
enum SeqRef {
    /// The `i`-th (mod count) live sequence in the state the operation wants.
    Live(Index),
    /// The smallest id that is not live.
    Fresh,
    /// Any id, live or not.
    Raw(SeqId),
}

/// A batch: distinct sequences in the wanted state, then maybe one bad entry.
#[derive(Clone, Debug)]
struct Batch {
    picks: Vec<Index>,
    extra: Extra,
}

#[derive(Clone, Debug)]
enum Extra {
    None,
    /// Repeat the first sequence.
    Repeat,
    /// Add any id (unknown, or live in the wrong state).
    Raw(SeqId),
}

#[derive(Clone, Debug)]
struct Prompt {
    prefix: usize,
    suffix: Vec<Token>,
    salt: usize,
}

impl Prompt {
    fn tokens(&self) -> Vec<Token> {
        let mut t = SYSTEM_PREFIXES[self.prefix].to_vec();
        t.extend_from_slice(&self.suffix);
        t
    }

    fn salt(&self) -> Option<&'static [u8]> {
        SALTS[self.salt]
    }
}

#[derive(Clone, Debug)]
enum QueryLen {
    /// `1 + i % num_tokens`, always valid for a live sequence.
    Valid(u32),
    /// Any value (0 and past the end are errors).
    Raw(u32),
}

#[derive(Clone, Debug)]
enum Op {
    Allocate {
        seq: SeqRef,
        prompt: Prompt,
    },
    CanAllocate {
        prompt: Prompt,
    },
    Append {
        seq: SeqRef,
        tokens: Vec<Token>,
    },
    Step {
        batch: Batch,
        tokens: Vec<Token>,
        extra_token: bool,
    },
    Plan {
        batch: Batch,
        query_lens: Vec<QueryLen>,
    },
    Fork {
        parent: SeqRef,
        child: SeqRef,
    },
    Free {
        seq: SeqRef,
    },
    SwapOut {
        batch: Batch,
    },
    SwapIn {
        batch: Batch,
    },
    ResetPrefixCache,
    TakeCopies,
    TakeEvents,
}

fn token() -> impl Strategy<Value = Token> {
    prop_oneof![30 => 0u32..4, 1 => Just(u32::MAX)]
}

fn prompt() -> impl Strategy<Value = Prompt> {
    (
        0..SYSTEM_PREFIXES.len(),
        prop::collection::vec(token(), 0..=6),
        prop_oneof![6 => Just(0usize), 1 => Just(1), 1 => Just(2)],
    )
        .prop_map(|(prefix, suffix, salt)| Prompt {
            prefix,
            suffix,
            salt,
        })
}

fn live_ref() -> impl Strategy<Value = SeqRef> {
    prop_oneof![12 => any::<Index>().prop_map(SeqRef::Live), 1 => (0..NUM_IDS).prop_map(SeqRef::Raw)]
}

fn new_ref() -> impl Strategy<Value = SeqRef> {
    prop_oneof![12 => Just(SeqRef::Fresh), 1 => (0..NUM_IDS).prop_map(SeqRef::Raw)]
}

fn batch(max: usize) -> impl Strategy<Value = Batch> {
    (
        prop::collection::vec(any::<Index>(), 1..=max),
        prop_oneof![
            30 => Just(Extra::None),
            1 => Just(Extra::Repeat),
            1 => (0..NUM_IDS).prop_map(Extra::Raw),
        ],
    )
        .prop_map(|(picks, extra)| Batch { picks, extra })
}

fn op() -> impl Strategy<Value = Op> {
    let append_tokens = prop_oneof![
        15 => prop::collection::vec(token(), 1..=5),
        1 => Just(Vec::new()),
    ];
    let query_len = prop_oneof![
        15 => any::<u32>().prop_map(QueryLen::Valid),
        1 => (0u32..20).prop_map(QueryLen::Raw),
    ];
    prop_oneof![
        8 => (new_ref(), prompt()).prop_map(|(seq, prompt)| Op::Allocate { seq, prompt }),
        2 => prompt().prop_map(|prompt| Op::CanAllocate { prompt }),
        5 => (live_ref(), append_tokens).prop_map(|(seq, tokens)| Op::Append { seq, tokens }),
        6 => (batch(4), prop::collection::vec(token(), 4), prop::bool::weighted(0.03))
            .prop_map(|(batch, tokens, extra_token)| Op::Step { batch, tokens, extra_token }),
        2 => (batch(4), prop::collection::vec(query_len, 5))
            .prop_map(|(batch, query_lens)| Op::Plan { batch, query_lens }),
        2 => (live_ref(), new_ref()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        6 => live_ref().prop_map(|seq| Op::Free { seq }),
        2 => batch(2).prop_map(|batch| Op::SwapOut { batch }),
        2 => batch(3).prop_map(|batch| Op::SwapIn { batch }),
        1 => Just(Op::ResetPrefixCache),
        2 => Just(Op::TakeCopies),
        2 => Just(Op::TakeEvents),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    (
        4u32..=32,
        1u32..=4,
        prop_oneof![1 => Just(0u32), 4 => 2u32..=8],
        prop::bool::weighted(0.85),
        prop_oneof![Just(0.0), Just(0.01), Just(0.1), Just(0.3)],
        prop::option::weighted(0.2, Just([7u8; 32])),
        prop::bool::weighted(0.7),
    )
        .prop_map(
            |(num_blocks, bs, cpu, caching, watermark, hash_key, events)| {
                let mut c = Config::new(num_blocks, bs);
                c.num_cpu_blocks = cpu;
                c.enable_prefix_caching = caching;
                c.watermark = watermark;
                c.hash_key = hash_key;
                c.enable_events = events;
                c
            },
        )
}

// ---------------------------------------------------------------------------------------------
// The harness: run an operation on both, compare everything
// ---------------------------------------------------------------------------------------------

/// Binds the model's keys to the real manager's hash values; the binding must be a bijection.
#[derive(Default)]
struct HashBinding {
    by_key: HashMap<Key, u128>,
    by_hash: HashMap<u128, Key>,
}

impl HashBinding {
    fn bind(&mut self, key: &Key, hash: u128) -> Result<(), TestCaseError> {
        if let Some(&h) = self.by_key.get(key) {
            prop_assert_eq!(h, hash, "one prefix, two hashes: {:?}", key);
        }
        if let Some(k) = self.by_hash.get(&hash) {
            prop_assert_eq!(k, key, "one hash {:#x}, two prefixes", hash);
        }
        self.by_key.insert(key.clone(), hash);
        self.by_hash.insert(hash, key.clone());
        Ok(())
    }
}

struct Harness {
    real: BlockManager,
    model: Model,
    binding: HashBinding,
    /// Events are numbered from 0 over the manager's life.
    next_seq_no: u64,
    plan: Plan,
}

/// Whether a real error is one the model allows (InvalidArgument messages are free text).
fn allowed(real: &Error, expected: &[Error]) -> bool {
    expected.iter().any(|e| match (real, e) {
        (Error::InvalidArgument(_), Error::InvalidArgument(_)) => true,
        _ => real == e,
    })
}

fn same<T: PartialEq + std::fmt::Debug>(
    real: Result<T, Error>,
    model: Expect<T>,
) -> Result<(), TestCaseError> {
    match (real, model) {
        (Ok(r), Ok(m)) => prop_assert_eq!(r, m),
        (Err(r), Err(m)) => prop_assert!(allowed(&r, &m), "error {:?}, model allows {:?}", r, m),
        (r, m) => prop_assert!(false, "real {:?}, model {:?}", r, m),
    }
    Ok(())
}

fn same_plan(real: &Plan, model: &Plan) -> Result<(), TestCaseError> {
    prop_assert_eq!(&real.kv_indptr, &model.kv_indptr, "kv_indptr");
    prop_assert_eq!(&real.kv_indices, &model.kv_indices, "kv_indices");
    prop_assert_eq!(
        &real.kv_last_page_len,
        &model.kv_last_page_len,
        "kv_last_page_len"
    );
    prop_assert_eq!(&real.qo_indptr, &model.qo_indptr, "qo_indptr");
    prop_assert_eq!(&real.slot_mapping, &model.slot_mapping, "slot_mapping");
    prop_assert_eq!(&real.positions, &model.positions, "positions");
    prop_assert_eq!(&real.block_tables, &model.block_tables, "block_tables");
    prop_assert_eq!(real.max_blocks, model.max_blocks, "max_blocks");
    prop_assert_eq!(
        real.batch_size(),
        model.kv_last_page_len.len(),
        "batch_size"
    );
    prop_assert_eq!(
        real.num_query_tokens(),
        model.positions.len(),
        "num_query_tokens"
    );
    Ok(())
}

impl Harness {
    fn new(cfg: Config) -> Harness {
        let model = Model::new(&cfg);
        let real = BlockManager::new(cfg).expect("valid config");
        Harness {
            real,
            model,
            binding: HashBinding::default(),
            next_seq_no: 0,
            plan: Plan::new(),
        }
    }

    /// Live sequences of the model, on the GPU (`swapped == false`) or CPU.
    fn live(&self, swapped: bool) -> Vec<SeqId> {
        self.model
            .seqs
            .iter()
            .filter(|(_, m)| m.swapped == swapped)
            .map(|(&s, _)| s)
            .collect()
    }

    fn fresh(&self) -> SeqId {
        (0..).find(|s| !self.model.seqs.contains_key(s)).unwrap()
    }

    fn resolve(&self, r: &SeqRef, swapped: bool) -> SeqId {
        match r {
            SeqRef::Live(i) => {
                let live = self.live(swapped);
                if live.is_empty() {
                    self.fresh()
                } else {
                    live[i.index(live.len())]
                }
            }
            SeqRef::Fresh => self.fresh(),
            SeqRef::Raw(s) => *s,
        }
    }

    fn resolve_batch(&self, b: &Batch, swapped: bool) -> Vec<SeqId> {
        let mut pool = self.live(swapped);
        let mut out = Vec::new();
        for p in &b.picks {
            if pool.is_empty() {
                break;
            }
            out.push(pool.remove(p.index(pool.len())));
        }
        match b.extra {
            Extra::None => {}
            Extra::Repeat => {
                if let Some(&first) = out.first() {
                    out.push(first);
                }
            }
            Extra::Raw(s) => out.push(s),
        }
        out
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Allocate { seq, prompt } => {
                let seq = self.resolve(seq, false);
                let tokens = prompt.tokens();
                let real = self.real.allocate(seq, &tokens, prompt.salt());
                same(real, self.model.allocate(seq, &tokens, prompt.salt()))?;
            }
            Op::CanAllocate { prompt } => {
                let tokens = prompt.tokens();
                if !tokens.is_empty() {
                    let real = self.real.can_allocate(&tokens, prompt.salt());
                    prop_assert_eq!(real, self.model.can_allocate(&tokens, prompt.salt()));
                }
            }
            Op::Append { seq, tokens } => {
                let seq = self.resolve(seq, false);
                same(
                    self.real.append(seq, tokens),
                    self.model.append(seq, tokens),
                )?;
            }
            Op::Step {
                batch,
                tokens,
                extra_token,
            } => {
                let seqs = self.resolve_batch(batch, false);
                if seqs.is_empty() {
                    return Ok(());
                }
                let mut tokens: Vec<Token> =
                    (0..seqs.len()).map(|i| tokens[i % tokens.len()]).collect();
                if *extra_token {
                    tokens.push(0);
                }
                let real = self.real.step(&seqs, &tokens, &mut self.plan);
                let model = self.model.step(&seqs, &tokens);
                self.same_planned(real, model)?;
            }
            Op::Plan { batch, query_lens } => {
                let seqs = self.resolve_batch(batch, false);
                if seqs.is_empty() {
                    return Ok(());
                }
                let qs: Vec<u32> = seqs
                    .iter()
                    .zip(query_lens.iter().cycle())
                    .map(|(s, q)| match (q, self.model.seqs.get(s)) {
                        (QueryLen::Valid(i), Some(m)) => 1 + i % m.tokens.len() as u32,
                        (QueryLen::Valid(_), None) => 1,
                        (QueryLen::Raw(q), _) => *q,
                    })
                    .collect();
                let real = self.real.plan(&seqs, &qs, &mut self.plan);
                let model = self.model.plan(&seqs, &qs);
                self.same_planned(real, model)?;
            }
            Op::Fork { parent, child } => {
                let parent = self.resolve(parent, false);
                let child = self.resolve(child, false);
                same(
                    self.real.fork(parent, child),
                    self.model.fork(parent, child),
                )?;
            }
            Op::Free { seq } => {
                // Either state: free works on swapped-out sequences too.
                let seq = match seq {
                    SeqRef::Live(i) if !self.model.seqs.is_empty() => {
                        let ids: Vec<SeqId> = self.model.seqs.keys().copied().collect();
                        ids[i.index(ids.len())]
                    }
                    other => self.resolve(other, false),
                };
                same(self.real.free(seq), self.model.free(seq))?;
            }
            Op::SwapOut { batch } => {
                let seqs = self.resolve_batch(batch, false);
                if !seqs.is_empty() {
                    same(self.real.swap_out(&seqs), self.model.swap_out(&seqs))?;
                }
            }
            Op::SwapIn { batch } => {
                let seqs = self.resolve_batch(batch, true);
                if !seqs.is_empty() {
                    same(self.real.swap_in(&seqs), self.model.swap_in(&seqs))?;
                }
            }
            Op::ResetPrefixCache => {
                self.real.reset_prefix_cache();
                self.model.reset_prefix_cache();
            }
            Op::TakeCopies => self.compare_copies()?,
            Op::TakeEvents => self.compare_events()?,
        }
        self.compare_state()
    }

    fn same_planned(
        &self,
        real: Result<(), Error>,
        model: Expect<Plan>,
    ) -> Result<(), TestCaseError> {
        match (real, model) {
            (Ok(()), Ok(m)) => same_plan(&self.plan, &m),
            (Err(r), Err(m)) => {
                prop_assert!(allowed(&r, &m), "error {:?}, model allows {:?}", r, m);
                Ok(())
            }
            (r, m) => {
                prop_assert!(false, "real {:?}, model {:?}", r, m.map(|_| "plan"));
                Ok(())
            }
        }
    }

    fn compare_copies(&mut self) -> Result<(), TestCaseError> {
        let real = self.real.take_copies();
        let model = std::mem::take(&mut self.model.copies);
        prop_assert_eq!(real, model, "copies");
        Ok(())
    }

    fn compare_events(&mut self) -> Result<(), TestCaseError> {
        let real: Vec<Event> = self.real.take_events();
        let model = std::mem::take(&mut self.model.events);
        prop_assert_eq!(
            real.len(),
            model.len(),
            "event count: real {:?} model {:?}",
            real,
            model
        );
        let bs = self.model.bs;
        for (r, m) in real.iter().zip(&model) {
            prop_assert_eq!(
                r.seq_no,
                self.next_seq_no,
                "events are numbered 0, 1, 2, ..."
            );
            self.next_seq_no += 1;
            match (&r.kind, m) {
                (
                    EventKind::BlockStored {
                        block_hash,
                        parent_hash,
                        token_ids,
                    },
                    ModelEvent::Stored {
                        key,
                        token_ids: m_tokens,
                    },
                ) => {
                    prop_assert_eq!(token_ids, m_tokens);
                    self.binding.bind(key, *block_hash)?;
                    let (salt, prefix) = key;
                    if prefix.len() > bs {
                        let parent = (salt.clone(), prefix[..prefix.len() - bs].to_vec());
                        let Some(parent_hash) = parent_hash else {
                            return Err(TestCaseError::fail(
                                "a non-first block has no parent hash",
                            ));
                        };
                        self.binding.bind(&parent, *parent_hash)?;
                    } else if let Some(h) = parent_hash {
                        // The first block's parent, if reported, is the salt's root hash.
                        let root = (salt.clone(), Vec::new());
                        self.binding.bind(&root, *h)?;
                    }
                }
                (EventKind::BlockRemoved { block_hash }, ModelEvent::Removed { key }) => {
                    let stored = self.binding.by_key.get(key);
                    prop_assert_eq!(stored, Some(block_hash), "removed hash was never stored");
                }
                (EventKind::AllBlocksCleared, ModelEvent::Cleared) => {}
                (r, m) => prop_assert!(false, "event {:?}, model {:?}", r, m),
            }
        }
        Ok(())
    }

    fn compare_state(&self) -> Result<(), TestCaseError> {
        let (real, model) = (&self.real, &self.model);
        if let Err(e) = real.check() {
            return Err(TestCaseError::fail(format!("check(): {e}")));
        }
        prop_assert_eq!(real.len(), model.seqs.len());
        prop_assert_eq!(real.is_empty(), model.seqs.is_empty());
        for s in 0..=NUM_IDS {
            prop_assert_eq!(
                real.contains(s),
                model.seqs.contains_key(&s),
                "contains({})",
                s
            );
        }
        for (&s, m) in &model.seqs {
            prop_assert_eq!(real.tokens(s), Ok(m.tokens.clone()), "tokens of {}", s);
            prop_assert_eq!(
                real.num_tokens(s),
                Ok(m.tokens.len()),
                "num_tokens of {}",
                s
            );
            let table = if m.swapped {
                Err(Error::SwappedOut(s))
            } else {
                Ok(m.table.clone())
            };
            prop_assert_eq!(real.block_table(s), table, "block table of {}", s);
        }
        let (r, m) = (real.stats(), model.stats());
        prop_assert_eq!(r.num_blocks, m.num_blocks);
        prop_assert_eq!(r.num_free, m.num_free, "num_free");
        prop_assert_eq!(r.num_cached, m.num_cached, "num_cached");
        prop_assert_eq!(r.num_held, m.num_held, "num_held");
        prop_assert_eq!(r.stored_tokens, m.stored_tokens, "stored_tokens");
        prop_assert_eq!(
            r.prefix_query_tokens,
            m.prefix_query_tokens,
            "prefix_query_tokens"
        );
        prop_assert_eq!(
            r.prefix_hit_tokens,
            m.prefix_hit_tokens,
            "prefix_hit_tokens"
        );
        prop_assert_eq!(r.evictions, m.evictions, "evictions");
        prop_assert!(
            (r.usage - m.usage).abs() < 1e-9,
            "usage {} vs {}",
            r.usage,
            m.usage
        );
        prop_assert!(
            (r.token_usage - m.token_usage).abs() < 1e-9,
            "token_usage {} vs {}",
            r.token_usage,
            m.token_usage
        );
        Ok(())
    }

    /// Drain what is pending and free every sequence: the pool must end with nothing held.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        self.compare_copies()?;
        let live: Vec<SeqId> = self.model.seqs.keys().copied().collect();
        for s in live {
            same(self.real.free(s), self.model.free(s))?;
            self.compare_state()?;
        }
        self.compare_events()?;
        prop_assert_eq!(self.real.stats().num_held, 0);
        prop_assert_eq!(self.real.stats().stored_tokens, 0);
        Ok(())
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        // A failure prints the shrunk operation list; no regression file in the source tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn manager_matches_model(cfg in config(), ops in prop::collection::vec(op(), 1..=240)) {
        let mut h = Harness::new(cfg);
        for op in &ops {
            h.apply(op)?;
        }
        h.finish()?;
    }
}
