//! Model-based property test: the real `BlockManager` against a plain single-threaded model of
//! SEMANTICS.md.
//!
//! The model uses the most obvious data structures (a `Vec` as the free stack, a `VecDeque` as the
//! cached queue, a `HashMap` from `(salt, token prefix)` to block, refcount vectors, each
//! sequence's `computed <= planned <= len` with its copies, swap source and external loads), so
//! that a reader can check it against SEMANTICS.md line by line. Random operation sequences run
//! on both; after every operation the test compares results, errors, every live sequence's
//! tokens, block table (exact physical ids) and computed count, stats, plans (copies included)
//! and events (block ids and media included), and runs `check()`. A quarter of the cases run
//! without auto-commit. At the end the test asserts that the run really exercised prefix hits,
//! copies, swaps, evictions, CPU-tier events, external loads and both commit modes.
//!
//! Where SEMANTICS.md leaves an order open (which of several validation errors wins), the model
//! returns every error that applies and the real one must be among them; capacity errors
//! (`OutOfBlocks`) are exact. Set `PROPTEST_CASES` to change the number of cases.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use pagedkv::{
    Batch as PersistentBatch, BlockId, BlockManager, Config, Error, Event, EventKind, Plan,
    PoolKind, SeqId, Stats, Token,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestRunner;

/// Cases when `PROPTEST_CASES` is unset: 25-60 s on two cores optimized (the intended way to
/// run this test), and a smoke run in unoptimized builds, which are some twenty times slower.
const DEFAULT_CASES: u32 = if cfg!(optimized) { 30_000 } else { 1_000 };
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

/// A copy-on-write copy a sequence still holds the source of.
#[derive(Clone, Debug)]
struct Copy {
    src: BlockId,
    dst: BlockId,
    /// Tokens of `src` the copy carries.
    fill: usize,
    /// Done once the sequence is computed up to here (set when a plan delivers it).
    until: usize,
}

#[derive(Clone, Debug)]
struct ModelSeq {
    tokens: Vec<Token>,
    /// GPU block ids, or CPU block ids while swapped out.
    table: Vec<BlockId>,
    salt: Option<Vec<u8>>,
    swapped: bool,
    computed: usize,
    planned: usize,
    /// Full blocks `0..registered` were offered to the prefix cache.
    registered: usize,
    /// Copies recorded by appends, not yet in a plan.
    copies: Vec<Copy>,
    /// Copies delivered by a plan, not yet committed.
    copying: Vec<Copy>,
    /// The other pool's table of an unconfirmed swap (GPU while swapped out, else CPU).
    swap_source: Option<Vec<BlockId>>,
    /// External loads: logical blocks `first..first + count`.
    loading: Option<(usize, usize)>,
}

impl ModelSeq {
    fn swap_in_pending(&self) -> bool {
        !self.swapped && self.swap_source.is_some()
    }
}

#[derive(Clone, Debug)]
enum ModelEvent {
    Stored {
        key: Key,
        token_ids: Vec<Token>,
        block_id: BlockId,
        medium: PoolKind,
    },
    Removed {
        key: Key,
        block_id: BlockId,
        medium: PoolKind,
    },
    Cleared,
}

/// A model result: `Err` lists every error SEMANTICS.md allows for the call.
type Expect<T> = Result<T, Vec<Error>>;

/// What a run exercised, counted on successful operations.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    copies: u64,
    swap_outs: u64,
    swap_ins: u64,
    cpu_events: u64,
    commits: u64,
    out_of_blocks: u64,
    /// Successful `step_batch` calls, and those whose rows carried copies.
    batch_steps: u64,
    batch_copies: u64,
    /// Successful `verify_batch` calls with drafts, and tokens rolled back.
    verify_steps: u64,
    rolled_back: u64,
}

/// SEMANTICS.md executed literally, one plain data structure per concept.
struct Model {
    bs: usize,
    num_blocks: usize,
    caching: bool,
    events_on: bool,
    auto_commit: bool,
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
    /// The CPU tier: announced CPU blocks and how many hold each key.
    cpu_tier: HashMap<BlockId, Key>,
    cpu_copies: HashMap<Key, u32>,
    seqs: BTreeMap<SeqId, ModelSeq>,
    events: Vec<ModelEvent>,
    query_tokens: u64,
    hit_tokens: u64,
    evictions: u64,
    external_query: u64,
    external_hit: u64,
    external_failures: u64,
    seen: Seen,
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
            auto_commit: cfg.auto_commit,
            watermark: cfg.watermark,
            free: (0..cfg.num_blocks).rev().collect(),
            cached: VecDeque::new(),
            refcount: vec![0; n],
            hash: vec![None; n],
            prefix: HashMap::new(),
            cpu_free: (0..cfg.num_cpu_blocks).rev().collect(),
            cpu_refcount: vec![0; cfg.num_cpu_blocks as usize],
            cpu_tier: HashMap::new(),
            cpu_copies: HashMap::new(),
            seqs: BTreeMap::new(),
            events: Vec::new(),
            query_tokens: 0,
            hit_tokens: 0,
            evictions: 0,
            external_query: 0,
            external_hit: 0,
            external_failures: 0,
            seen: Seen::default(),
        }
    }

    fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    fn emit(&mut self, event: ModelEvent) {
        if self.events_on {
            if let ModelEvent::Stored {
                medium: PoolKind::Cpu,
                ..
            }
            | ModelEvent::Removed {
                medium: PoolKind::Cpu,
                ..
            } = event
            {
                self.seen.cpu_events += 1;
            }
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
                self.emit(ModelEvent::Removed {
                    key,
                    block_id: b,
                    medium: PoolKind::Gpu,
                });
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

    /// Releases a CPU block; a freed block leaves the CPU tier (its key's last copy: an event).
    fn release_cpu(&mut self, b: BlockId) {
        let rc = &mut self.cpu_refcount[b as usize];
        *rc -= 1;
        if *rc == 0 {
            self.cpu_free.push(b);
            if let Some(key) = self.cpu_tier.remove(&b) {
                let copies = self.cpu_copies.get_mut(&key).expect("model: counted");
                *copies -= 1;
                if *copies == 0 {
                    self.cpu_copies.remove(&key);
                    self.emit(ModelEvent::Removed {
                        key,
                        block_id: b,
                        medium: PoolKind::Cpu,
                    });
                }
            }
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
        self.emit(ModelEvent::Stored {
            key,
            token_ids,
            block_id: block,
            medium: PoolKind::Gpu,
        });
    }

    /// Commit `id` up to `upto`: computed, completed copies, then registration.
    fn commit_to(&mut self, id: SeqId, upto: usize) {
        let mut s = self.seqs.remove(&id).expect("model: validated");
        assert!(upto <= s.planned, "model: committing past the plan");
        s.computed = s.computed.max(upto);
        let (done, left): (Vec<Copy>, Vec<Copy>) = std::mem::take(&mut s.copying)
            .into_iter()
            .partition(|c| c.until <= s.computed);
        s.copying = left;
        for c in done {
            self.release(c.src);
        }
        if !s.swapped && s.swap_source.is_none() && s.loading.is_none() {
            let full = s.computed / self.bs;
            for i in s.registered..full {
                // Only under its own registered block: one tree (SEMANTICS.md).
                if i > 0 && self.hash[s.table[i - 1] as usize].is_none() {
                    continue;
                }
                self.register(&s.salt, &s.tokens, s.table[i], i);
            }
            s.registered = s.registered.max(full);
        }
        self.seqs.insert(id, s);
    }

    fn auto_commit(&mut self, id: SeqId) {
        if self.auto_commit {
            let planned = self.seqs[&id].planned;
            self.commit_to(id, planned);
        }
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

    fn out_of_blocks<T>(&mut self, pool: PoolKind, needed: usize, available: usize) -> Expect<T> {
        self.seen.out_of_blocks += 1;
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
            Some(s) if s.loading.is_some() => errs.push(invalid()),
            Some(_) => {}
        }
    }

    /// `allocate` (`loadable == None`) and `allocate_loading`.
    fn admit(
        &mut self,
        seq: SeqId,
        tokens: &[Token],
        salt: Option<&[u8]>,
        loadable: Option<usize>,
    ) -> Expect<(usize, Vec<BlockId>)> {
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
            let available = self.available();
            return self.out_of_blocks(PoolKind::Gpu, needed, available);
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
        let hittable = n - 1;
        let m = match loadable {
            Some(l) if self.caching => l.min(hittable).saturating_sub(k),
            _ => 0,
        };
        if loadable.is_some() {
            self.external_query += ((hittable - k) * self.bs) as u64;
        }
        let loads = table[k..k + m].to_vec();
        self.query_tokens += tokens.len() as u64;
        self.hit_tokens += (k * self.bs) as u64;
        self.seqs.insert(
            seq,
            ModelSeq {
                tokens: tokens.to_vec(),
                table,
                salt,
                swapped: false,
                computed: k * self.bs,
                planned: k * self.bs,
                registered: k,
                copies: Vec::new(),
                copying: Vec::new(),
                swap_source: None,
                loading: (m > 0).then_some((k, m)),
            },
        );
        Ok((k * self.bs, loads))
    }

    fn confirm_loads(&mut self, seq: SeqId, loaded: usize) -> Expect<()> {
        let Some(s) = self.seqs.get_mut(&seq) else {
            return Err(vec![Error::UnknownSequence(seq)]);
        };
        let Some((first, count)) = s.loading else {
            return Err(vec![invalid()]);
        };
        if loaded > count {
            return Err(vec![invalid()]);
        }
        s.loading = None;
        let upto = (first + loaded) * self.bs;
        s.planned = s.planned.max(upto);
        self.commit_to(seq, upto);
        self.external_hit += (loaded * self.bs) as u64;
        self.hit_tokens += (loaded * self.bs) as u64;
        self.external_failures += (count - loaded) as u64;
        Ok(())
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
        let cow =
            !len.is_multiple_of(self.bs) && self.refcount[*s.table.last().unwrap() as usize] > 1;
        usize::from(cow) + (len + m).div_ceil(self.bs) - len.div_ceil(self.bs)
    }

    /// Append with capacity already checked: CoW (the copy keeps the source), then new blocks.
    fn do_append(&mut self, seq: SeqId, tokens: &[Token]) {
        let mut s = self.seqs.remove(&seq).expect("model: validated");
        let len = s.tokens.len();
        let last = *s.table.last().unwrap();
        if !len.is_multiple_of(self.bs) && self.refcount[last as usize] > 1 {
            let dst = self.take();
            s.copies.push(Copy {
                src: last,
                dst,
                fill: len % self.bs,
                until: 0,
            });
            *s.table.last_mut().unwrap() = dst;
        }
        for _ in len.div_ceil(self.bs)..(len + tokens.len()).div_ceil(self.bs) {
            let b = self.take();
            s.table.push(b);
        }
        s.tokens.extend_from_slice(tokens);
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
        self.auto_commit(seq);
        let needed = self.append_needed(&self.seqs[&seq], tokens.len());
        if needed > self.available() {
            let available = self.available();
            return self.out_of_blocks(PoolKind::Gpu, needed, available);
        }
        self.do_append(seq, tokens);
        Ok(())
    }

    /// The sequence's plan row for its last `q` tokens; delivers its recorded copies.
    fn plan_row(&mut self, seq: SeqId, q: usize, p: &mut Plan) {
        let bs = self.bs;
        let s = self.seqs.get_mut(&seq).expect("model: validated");
        let kv_len = s.tokens.len();
        let pages = kv_len.div_ceil(bs);
        assert_eq!(pages, s.table.len());
        p.kv_indptr.push(p.kv_indptr.last().unwrap() + pages as i32);
        p.kv_indices.extend(s.table.iter().map(|&b| b as i32));
        p.kv_last_page_len.push((kv_len - (pages - 1) * bs) as i32);
        p.qo_indptr.push(p.qo_indptr.last().unwrap() + q as i32);
        for pos in kv_len - q..kv_len {
            p.positions.push(pos as i32);
            p.slot_mapping
                .push((s.table[pos / bs] as usize * bs + pos % bs) as i32);
        }
        for mut c in s.copies.drain(..) {
            p.copies.extend([c.src as i32, c.dst as i32]);
            c.until = kv_len;
            s.copying.push(c);
        }
        s.planned = kv_len;
    }

    fn begin_plan(&self) -> Plan {
        let mut p = Plan::default();
        p.kv_indptr.push(0);
        p.qo_indptr.push(0);
        p.block_size = self.bs as u32;
        p
    }

    /// Counts the plan's copies once every sequence is in.
    fn finish_plan(&mut self, p: &mut Plan) {
        self.seen.copies += p.copies.len() as u64 / 2;
    }

    fn step(&mut self, seqs: &[SeqId], tokens: &[Token]) -> Expect<Plan> {
        self.verify(seqs, tokens, &vec![1; seqs.len()])
    }

    /// `step` with `counts[i]` tokens for `seqs[i]` (`verify_batch`; `step` is all ones).
    fn verify(&mut self, seqs: &[SeqId], tokens: &[Token], counts: &[u32]) -> Expect<Plan> {
        let mut errs = Vec::new();
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        if seqs.len() != counts.len()
            || total != tokens.len()
            || counts.contains(&0)
            || has_repeats(seqs)
        {
            errs.push(invalid());
        }
        for &s in seqs {
            self.gpu_seq_errors(s, &mut errs);
            if let Some(m) = self.seqs.get(&s) {
                if m.planned != m.tokens.len() {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        // A completed copy may unshare another member's tail: those commits come first.
        for &s in seqs {
            if !self.seqs[&s].copying.is_empty() {
                self.auto_commit(s);
            }
        }
        let needed: usize = seqs
            .iter()
            .zip(counts)
            .map(|(s, &c)| self.append_needed(&self.seqs[s], c as usize))
            .sum();
        if needed > self.available() {
            let available = self.available();
            return self.out_of_blocks(PoolKind::Gpu, needed, available);
        }
        let mut p = self.begin_plan();
        let mut rest = tokens;
        for (&s, &c) in seqs.iter().zip(counts) {
            let (appended, after) = rest.split_at(c as usize);
            rest = after;
            self.auto_commit(s);
            self.do_append(s, appended);
            self.plan_row(s, c as usize, &mut p);
        }
        self.finish_plan(&mut p);
        Ok(p)
    }

    /// `rollback`: drops the last `counts[i]` (uncommitted) tokens of `seqs[i]`; the blocks
    /// past the new length are released, last first.
    fn rollback(&mut self, seqs: &[SeqId], counts: &[usize]) -> Expect<()> {
        let mut errs = Vec::new();
        if seqs.len() != counts.len() || has_repeats(seqs) {
            errs.push(invalid());
        }
        for (&seq, &count) in seqs.iter().zip(counts) {
            self.gpu_seq_errors(seq, &mut errs);
            if let Some(m) = self.seqs.get(&seq) {
                let len = m.tokens.len();
                if m.swap_source.is_some() || count > len - m.computed || count == len {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for (&seq, &count) in seqs.iter().zip(counts) {
            let m = self.seqs.get_mut(&seq).expect("model: validated");
            let len = m.tokens.len() - count;
            let pages = len.div_ceil(self.bs);
            let dropped: Vec<BlockId> = m.table.drain(pages..).rev().collect();
            m.tokens.truncate(len);
            m.planned = m.planned.min(len);
            for c in &mut m.copying {
                c.until = c.until.min(len);
            }
            for b in dropped {
                self.release(b);
            }
            self.seen.rolled_back += count as u64;
        }
        Ok(())
    }

    fn plan(&mut self, seqs: &[SeqId], query_lens: &[u32]) -> Expect<Plan> {
        let mut errs = Vec::new();
        if seqs.len() != query_lens.len() || has_repeats(seqs) {
            errs.push(invalid());
        }
        for (&s, &q) in seqs.iter().zip(query_lens) {
            self.gpu_seq_errors(s, &mut errs);
            if let Some(m) = self.seqs.get(&s) {
                let len = m.tokens.len();
                if q < 1 || q as usize > len || len - q as usize > m.planned {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let mut p = self.begin_plan();
        for (&s, &q) in seqs.iter().zip(query_lens) {
            self.auto_commit(s);
            self.plan_row(s, q as usize, &mut p);
        }
        self.finish_plan(&mut p);
        Ok(p)
    }

    fn commit(&mut self, seqs: &[SeqId], upto: Option<&[usize]>) -> Expect<()> {
        let mut errs = Vec::new();
        if upto.is_some_and(|u| u.len() != seqs.len()) || has_repeats(seqs) {
            errs.push(invalid());
        }
        for (b, &s) in seqs.iter().enumerate() {
            match self.seqs.get(&s) {
                None => errs.push(Error::UnknownSequence(s)),
                Some(m) if m.swapped => errs.push(Error::SwappedOut(s)),
                Some(m) => {
                    if upto.and_then(|u| u.get(b)).is_some_and(|&n| n > m.planned) {
                        errs.push(invalid());
                    }
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for (b, &s) in seqs.iter().enumerate() {
            let n = upto.map_or(self.seqs[&s].planned, |u| u[b]);
            self.commit_to(s, n);
        }
        self.seen.commits += 1;
        Ok(())
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> Expect<()> {
        let mut errs = Vec::new();
        self.gpu_seq_errors(parent, &mut errs);
        if self
            .seqs
            .get(&parent)
            .is_some_and(ModelSeq::swap_in_pending)
        {
            errs.push(invalid());
        }
        if self.seqs.contains_key(&child) {
            errs.push(Error::DuplicateSequence(child));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        self.auto_commit(parent);
        let p = &self.seqs[&parent];
        if p.computed != p.tokens.len() {
            return Err(vec![invalid()]);
        }
        let copy = ModelSeq {
            tokens: p.tokens.clone(),
            table: p.table.clone(),
            salt: p.salt.clone(),
            swapped: false,
            computed: p.computed,
            planned: p.computed,
            registered: p.registered,
            copies: Vec::new(),
            copying: Vec::new(),
            swap_source: None,
            loading: None,
        };
        for &b in &copy.table {
            self.refcount[b as usize] += 1;
        }
        self.seqs.insert(child, copy);
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
        if let Some(source) = &s.swap_source {
            for &b in source.iter().rev() {
                if s.swapped {
                    self.release(b);
                } else {
                    self.release_cpu(b);
                }
            }
        }
        for c in s.copies.iter().chain(&s.copying) {
            self.release(c.src);
        }
        if let Some((_, count)) = s.loading {
            self.external_failures += count as u64;
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

    /// Errors of a swap or swap confirmation: the sequences must be live, distinct and
    /// swapped out (`swapped`) or not.
    fn side_errors(&self, seqs: &[SeqId], swapped: bool) -> Vec<Error> {
        let mut errs = Vec::new();
        if has_repeats(seqs) {
            errs.push(invalid());
        }
        for &s in seqs {
            match self.seqs.get(&s) {
                None => errs.push(Error::UnknownSequence(s)),
                Some(m) if m.swapped && !swapped => errs.push(Error::SwappedOut(s)),
                Some(m) if !m.swapped && swapped => errs.push(Error::NotSwappedOut(s)),
                Some(_) => {}
            }
        }
        errs
    }

    /// Moves the sequences' tables to fresh blocks of the other pool; the old tables become
    /// their swap sources.
    fn move_tables(&mut self, seqs: &[SeqId], pairs: &[[BlockId; 2]], to_gpu: bool) {
        for s in seqs {
            let m = self.seqs.get_mut(s).unwrap();
            m.swap_source = Some(m.table.clone());
            for b in &mut m.table {
                *b = pairs.iter().find(|p| p[0] == *b).unwrap()[1];
            }
            m.swapped = !to_gpu;
            if to_gpu {
                m.registered = 0;
            }
        }
    }

    fn swap_out(&mut self, seqs: &[SeqId]) -> Expect<Vec<[BlockId; 2]>> {
        let mut errs = self.side_errors(seqs, false);
        for &s in seqs {
            if let Some(m) = self.seqs.get(&s).filter(|m| !m.swapped) {
                let in_flight =
                    !self.auto_commit && (m.planned != m.computed || !m.copying.is_empty());
                if m.swap_source.is_some()
                    || m.loading.is_some()
                    || !m.copies.is_empty()
                    || in_flight
                {
                    errs.push(invalid());
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for &s in seqs {
            self.auto_commit(s);
        }
        let blocks = self.distinct_blocks(seqs);
        if blocks.len() > self.cpu_free.len() {
            let available = self.cpu_free.len();
            return self.out_of_blocks(PoolKind::Cpu, blocks.len(), available);
        }
        let mut pairs = Vec::new();
        for (gpu, count) in blocks {
            let cpu = self.cpu_free.pop().unwrap();
            self.cpu_refcount[cpu as usize] = count;
            pairs.push([gpu, cpu]);
        }
        self.move_tables(seqs, &pairs, false);
        Ok(pairs)
    }

    fn confirm_swap_out(&mut self, seqs: &[SeqId]) -> Expect<()> {
        let mut errs = self.side_errors(seqs, true);
        for &s in seqs {
            if self
                .seqs
                .get(&s)
                .is_some_and(|m| m.swapped && m.swap_source.is_none())
            {
                errs.push(invalid());
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for &s in seqs {
            let source = self.seqs.get_mut(&s).unwrap().swap_source.take().unwrap();
            for &b in source.iter().rev() {
                self.release(b);
            }
            self.announce_cpu(s);
        }
        self.seen.swap_outs += 1;
        Ok(())
    }

    /// The computed full blocks of a swapped-out sequence enter the CPU tier in logical order.
    fn announce_cpu(&mut self, seq: SeqId) {
        if !self.caching || !self.events_on {
            return;
        }
        let s = self.seqs[&seq].clone();
        for i in 0..s.computed / self.bs {
            let block = s.table[i];
            if self.cpu_tier.contains_key(&block) {
                continue;
            }
            let key = self.key(&s.salt, &s.tokens, i);
            self.cpu_tier.insert(block, key.clone());
            let copies = self.cpu_copies.entry(key.clone()).or_insert(0);
            *copies += 1;
            if *copies == 1 {
                let token_ids = s.tokens[i * self.bs..(i + 1) * self.bs].to_vec();
                self.emit(ModelEvent::Stored {
                    key,
                    token_ids,
                    block_id: block,
                    medium: PoolKind::Cpu,
                });
            }
        }
    }

    fn swap_in(&mut self, seqs: &[SeqId]) -> Expect<Vec<[BlockId; 2]>> {
        let mut errs = self.side_errors(seqs, true);
        for &s in seqs {
            if self
                .seqs
                .get(&s)
                .is_some_and(|m| m.swapped && m.swap_source.is_some())
            {
                errs.push(invalid());
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let blocks = self.distinct_blocks(seqs);
        if blocks.len() > self.available() {
            let available = self.available();
            return self.out_of_blocks(PoolKind::Gpu, blocks.len(), available);
        }
        let mut pairs = Vec::new();
        for (cpu, count) in blocks {
            let gpu = self.take();
            self.refcount[gpu as usize] = count;
            pairs.push([cpu, gpu]);
        }
        self.move_tables(seqs, &pairs, true);
        Ok(pairs)
    }

    fn confirm_swap_in(&mut self, seqs: &[SeqId]) -> Expect<()> {
        let mut errs = self.side_errors(seqs, false);
        for &s in seqs {
            if self
                .seqs
                .get(&s)
                .is_some_and(|m| !m.swapped && m.swap_source.is_none())
            {
                errs.push(invalid());
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        for &s in seqs {
            let source = self.seqs.get_mut(&s).unwrap().swap_source.take().unwrap();
            for &b in source.iter().rev() {
                self.release_cpu(b);
            }
            let computed = self.seqs[&s].computed;
            self.commit_to(s, computed);
        }
        self.seen.swap_ins += 1;
        Ok(())
    }

    fn reset_prefix_cache(&mut self) {
        while let Some(b) = self.cached.pop_front() {
            self.free.push(b);
        }
        self.hash.iter_mut().for_each(|h| *h = None);
        self.prefix.clear();
        self.cpu_tier.clear();
        self.cpu_copies.clear();
        self.emit(ModelEvent::Cleared);
    }

    fn stats(&self) -> Stats {
        let mut fill: HashMap<BlockId, usize> = HashMap::new();
        let mut hold = |b: BlockId, n: usize| {
            let prev = fill.insert(b, n);
            assert!(
                prev.is_none() || prev == Some(n),
                "model: holders disagree on the fill of block {b}"
            );
        };
        let (mut computed, mut pending) = (0, 0);
        for m in self.seqs.values() {
            let len = m.tokens.len();
            computed += m.computed as u64;
            pending += (len - m.computed) as u64;
            let gpu_table = if m.swapped {
                m.swap_source.as_ref()
            } else {
                Some(&m.table)
            };
            for (i, &b) in gpu_table.into_iter().flatten().enumerate() {
                hold(b, (len - i * self.bs).min(self.bs));
            }
            for c in m.copies.iter().chain(&m.copying) {
                hold(c.src, c.fill);
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
            prefix_allowed_tokens: self.hit_tokens,
            evictions: self.evictions,
            computed_tokens: computed,
            pending_tokens: pending,
            external_query_tokens: self.external_query,
            external_hit_tokens: self.external_hit,
            external_failures: self.external_failures,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

/// Which live sequences an operation wants to name.
#[derive(Clone, Copy, Debug)]
enum Want {
    /// On the GPU.
    Resident,
    /// On the GPU with every token planned (a step or fork can succeed).
    Ready,
    /// Swapped out, the swap-out not yet confirmed.
    SwapOutPending,
    /// Swapped out and confirmed (a swap-in can succeed).
    SwappedOut,
    /// Swapped in, not yet confirmed.
    SwapInPending,
    /// Waiting for `confirm_loads`.
    Loading,
    /// Any live sequence.
    Any,
}

impl Want {
    fn matches(self, m: &ModelSeq) -> bool {
        match self {
            Want::Resident => !m.swapped,
            Want::Ready => !m.swapped && m.loading.is_none() && m.planned == m.tokens.len(),
            Want::SwapOutPending => m.swapped && m.swap_source.is_some(),
            Want::SwappedOut => m.swapped && m.swap_source.is_none(),
            Want::SwapInPending => m.swap_in_pending(),
            Want::Loading => m.loading.is_some(),
            Want::Any => true,
        }
    }
}

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
    /// The prompt's tokens, each repeated `stretch` times.
    fn tokens(&self, stretch: usize) -> Vec<Token> {
        let mut t = SYSTEM_PREFIXES[self.prefix].to_vec();
        t.extend_from_slice(&self.suffix);
        stretched(&t, stretch)
    }

    fn salt(&self) -> Option<&'static [u8]> {
        SALTS[self.salt]
    }
}

/// A count resolved against a sequence: a query length for `plan`, a token count for `commit`
/// or a block count for `confirm_loads`.
#[derive(Clone, Debug)]
enum Count {
    /// The natural one: every unplanned token (at least 1), everything planned, every load.
    Rest,
    /// Some valid value, picked by `i`.
    Valid(u32),
    /// Any value (0 and past the end are often errors).
    Raw(u32),
}

impl Count {
    /// Resolves within the valid range `lo..=hi` (`rest` for `Rest`).
    fn resolve(&self, lo: usize, hi: usize, rest: usize) -> usize {
        match self {
            Count::Rest => rest,
            Count::Valid(i) => lo + *i as usize % (hi - lo + 1),
            Count::Raw(n) => *n as usize,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Allocate {
        seq: SeqRef,
        prompt: Prompt,
    },
    AllocateLoading {
        seq: SeqRef,
        prompt: Prompt,
        loadable: usize,
    },
    ConfirmLoads {
        seq: SeqRef,
        loaded: Count,
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
        ready: bool,
        tokens: Vec<Token>,
        extra_token: bool,
        /// Through the harness's persistent batch (`step_batch`), its rows made those of
        /// `batch` first, instead of `step`.
        persistent: bool,
    },
    Plan {
        batch: Batch,
        query_lens: Vec<Count>,
    },
    /// `verify_batch` through the harness's persistent batch, its rows made those of `batch`
    /// first: each row appends its drafted tokens, 1 to 5 (or a raw, possibly bad, count).
    Verify {
        batch: Batch,
        counts: Vec<Count>,
        tokens: Vec<Token>,
        extra_token: bool,
    },
    /// `rollback` of up to each sequence's uncommitted tokens, or `rollback_batch` of the
    /// harness's persistent batch, its rows made those of `batch` first.
    Rollback {
        batch: Batch,
        counts: Vec<Count>,
        persistent: bool,
    },
    Commit {
        batch: Batch,
        upto: Option<Vec<Count>>,
        extra_count: bool,
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
    ConfirmSwapOut {
        batch: Batch,
    },
    SwapIn {
        batch: Batch,
    },
    ConfirmSwapIn {
        batch: Batch,
    },
    ResetPrefixCache,
    TakeEvents,
}

/// Each of `tokens` repeated `stretch` times: prompts and appends scaled to a block size, so
/// that blocks of 16 or 32 tokens fill, share and copy as often as blocks of 2 to 4.
fn stretched(tokens: &[Token], stretch: usize) -> Vec<Token> {
    (tokens.iter())
        .flat_map(|&t| std::iter::repeat_n(t, stretch))
        .collect()
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

fn count() -> impl Strategy<Value = Count> {
    prop_oneof![
        10 => Just(Count::Rest),
        5 => any::<u32>().prop_map(Count::Valid),
        1 => (0u32..20).prop_map(Count::Raw),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let append_tokens = prop_oneof![
        15 => prop::collection::vec(token(), 1..=5),
        1 => Just(Vec::new()),
    ];
    prop_oneof![
        8 => (new_ref(), prompt()).prop_map(|(seq, prompt)| Op::Allocate { seq, prompt }),
        2 => (new_ref(), prompt(), 0usize..6)
            .prop_map(|(seq, prompt, loadable)| Op::AllocateLoading { seq, prompt, loadable }),
        2 => (live_ref(), count()).prop_map(|(seq, loaded)| Op::ConfirmLoads { seq, loaded }),
        2 => prompt().prop_map(|prompt| Op::CanAllocate { prompt }),
        4 => (live_ref(), append_tokens).prop_map(|(seq, tokens)| Op::Append { seq, tokens }),
        7 => (
            batch(4),
            prop::bool::weighted(0.9),
            prop::collection::vec(token(), 4),
            prop::bool::weighted(0.03),
            any::<bool>(),
        )
            .prop_map(|(batch, ready, tokens, extra_token, persistent)| Op::Step {
                batch,
                ready,
                tokens,
                extra_token,
                persistent,
            }),
        6 => (batch(4), prop::collection::vec(count(), 5))
            .prop_map(|(batch, query_lens)| Op::Plan { batch, query_lens }),
        4 => (
            batch(4),
            prop::collection::vec(count(), 4),
            prop::collection::vec(token(), 8),
            prop::bool::weighted(0.03),
        )
            .prop_map(|(batch, counts, tokens, extra_token)| Op::Verify {
                batch,
                counts,
                tokens,
                extra_token,
            }),
        4 => (batch(3), prop::collection::vec(count(), 3), any::<bool>())
            .prop_map(|(batch, counts, persistent)| Op::Rollback { batch, counts, persistent }),
        3 => (
            batch(3),
            prop::option::weighted(0.3, prop::collection::vec(count(), 4)),
            prop::bool::weighted(0.05),
        )
            .prop_map(|(batch, upto, extra_count)| Op::Commit { batch, upto, extra_count }),
        2 => (live_ref(), new_ref()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        5 => live_ref().prop_map(|seq| Op::Free { seq }),
        2 => batch(2).prop_map(|batch| Op::SwapOut { batch }),
        2 => batch(2).prop_map(|batch| Op::ConfirmSwapOut { batch }),
        2 => batch(3).prop_map(|batch| Op::SwapIn { batch }),
        2 => batch(2).prop_map(|batch| Op::ConfirmSwapIn { batch }),
        1 => Just(Op::ResetPrefixCache),
        2 => Just(Op::TakeEvents),
    ]
}

fn config(block_size: impl Strategy<Value = u32>) -> impl Strategy<Value = Config> {
    (
        4u32..=32,
        block_size,
        prop_oneof![1 => Just(0u32), 4 => 2u32..=8],
        prop::bool::weighted(0.85),
        prop_oneof![Just(0.0), Just(0.01), Just(0.1), Just(0.3)],
        prop::option::weighted(0.2, Just([7u8; 32])),
        prop::bool::weighted(0.7),
        prop::bool::weighted(0.75),
    )
        .prop_map(
            |(num_blocks, bs, cpu, caching, watermark, hash_key, events, auto_commit)| {
                let mut c = Config::new(num_blocks, bs);
                c.num_cpu_blocks = cpu;
                c.enable_prefix_caching = caching;
                c.watermark = watermark;
                c.hash_key = hash_key;
                c.enable_events = events;
                c.auto_commit = auto_commit;
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
    /// A persistent batch kept across operations, and a copy of its table kept only by
    /// applying its update logs (as a device copy would be).
    batch: PersistentBatch,
    mirror: Vec<i32>,
    /// How many tokens each generated prompt or appended token stands for.
    stretch: usize,
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
    prop_assert_eq!(real.block_size, model.block_size, "block_size");
    prop_assert_eq!(real.block_tables(), model.block_tables(), "block_tables");
    prop_assert_eq!(&real.copies, &model.copies, "copies");
    prop_assert_eq!(real.num_copies(), model.copies.len() / 2, "num_copies");
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

/// The `(planned, computed, len, loads)` of a live sequence, for resolving counts.
fn progress(m: Option<&ModelSeq>) -> (usize, usize, usize, usize) {
    m.map_or((0, 0, 1, 0), |m| {
        (
            m.planned,
            m.computed,
            m.tokens.len(),
            m.loading.map_or(0, |l| l.1),
        )
    })
}

impl Harness {
    fn new(cfg: Config) -> Harness {
        let model = Model::new(&cfg);
        let stretch = (cfg.block_size as usize / 4).max(1);
        let real = BlockManager::new(cfg).expect("valid config");
        Harness {
            real,
            model,
            binding: HashBinding::default(),
            next_seq_no: 0,
            plan: Plan::new(),
            batch: PersistentBatch::new(),
            mirror: Vec::new(),
            stretch,
        }
    }

    /// Live sequences of the model in the wanted state.
    fn live(&self, want: Want) -> Vec<SeqId> {
        self.model
            .seqs
            .iter()
            .filter(|(_, m)| want.matches(m))
            .map(|(&s, _)| s)
            .collect()
    }

    fn fresh(&self) -> SeqId {
        (0..).find(|s| !self.model.seqs.contains_key(s)).unwrap()
    }

    /// A sequence in the wanted state; failing that any live one; failing that a fresh id.
    fn resolve(&self, r: &SeqRef, want: Want) -> SeqId {
        match r {
            SeqRef::Live(i) => {
                let mut live = self.live(want);
                if live.is_empty() {
                    live = self.live(Want::Any);
                }
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

    fn resolve_batch(&self, b: &Batch, want: Want) -> Vec<SeqId> {
        let mut pool = self.live(want);
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
                let seq = self.resolve(seq, Want::Any);
                let tokens = prompt.tokens(self.stretch);
                let real = self.real.allocate(seq, &tokens, prompt.salt());
                let model = self.model.admit(seq, &tokens, prompt.salt(), None);
                same(real, model.map(|(reused, _)| reused))?;
            }
            Op::AllocateLoading {
                seq,
                prompt,
                loadable,
            } => {
                let seq = self.resolve(seq, Want::Any);
                let tokens = prompt.tokens(self.stretch);
                let real = self
                    .real
                    .allocate_loading(seq, &tokens, *loadable, prompt.salt());
                let model = self
                    .model
                    .admit(seq, &tokens, prompt.salt(), Some(*loadable));
                same(real, model)?;
            }
            Op::ConfirmLoads { seq, loaded } => {
                let seq = self.resolve(seq, Want::Loading);
                let (.., loads) = progress(self.model.seqs.get(&seq));
                let loaded = loaded.resolve(0, loads, loads);
                same(
                    self.real.confirm_loads(seq, loaded),
                    self.model.confirm_loads(seq, loaded),
                )?;
            }
            Op::CanAllocate { prompt } => {
                let tokens = prompt.tokens(self.stretch);
                if !tokens.is_empty() {
                    let real = self.real.can_allocate(&tokens, prompt.salt());
                    prop_assert_eq!(real, self.model.can_allocate(&tokens, prompt.salt()));
                    let salt = prompt.salt().map(<[u8]>::to_vec);
                    prop_assert_eq!(
                        self.real.cached_prefix_blocks(&tokens, prompt.salt()),
                        self.model.lookup(&tokens, &salt).len(),
                        "cached_prefix_blocks"
                    );
                }
            }
            Op::Append { seq, tokens } => {
                let seq = self.resolve(seq, Want::Resident);
                let tokens = &stretched(tokens, self.stretch);
                same(
                    self.real.append(seq, tokens),
                    self.model.append(seq, tokens),
                )?;
            }
            Op::Step {
                batch,
                ready,
                tokens,
                extra_token,
                persistent,
            } => {
                let want = if *ready { Want::Ready } else { Want::Resident };
                let mut seqs = self.resolve_batch(batch, want);
                if seqs.is_empty() {
                    return Ok(());
                }
                let persistent = *persistent && !has_repeats(&seqs);
                if persistent {
                    seqs = self.make_rows(&seqs);
                }
                let mut tokens: Vec<Token> =
                    (0..seqs.len()).map(|i| tokens[i % tokens.len()]).collect();
                if *extra_token {
                    tokens.push(0);
                }
                let model = self.model.step(&seqs, &tokens);
                if persistent {
                    let real = self.real.step_batch(&mut self.batch, &tokens);
                    self.same_batch_step(real, model)?;
                } else {
                    let real = self.real.step(&seqs, &tokens, &mut self.plan);
                    self.same_planned(real, model)?;
                }
            }
            Op::Plan { batch, query_lens } => {
                let seqs = self.resolve_batch(batch, Want::Resident);
                if seqs.is_empty() {
                    return Ok(());
                }
                let qs: Vec<u32> = seqs
                    .iter()
                    .zip(query_lens.iter().cycle())
                    .map(|(s, q)| {
                        let (planned, _, len, _) = progress(self.model.seqs.get(s));
                        let lo = (len - planned).max(1);
                        q.resolve(lo, len, lo) as u32
                    })
                    .collect();
                let real = self.real.plan(&seqs, &qs, &mut self.plan);
                let model = self.model.plan(&seqs, &qs);
                self.same_planned(real, model)?;
            }
            Op::Verify {
                batch,
                counts,
                tokens,
                extra_token,
            } => {
                let seqs = self.resolve_batch(batch, Want::Ready);
                if seqs.is_empty() || has_repeats(&seqs) {
                    return Ok(());
                }
                let seqs = self.make_rows(&seqs);
                let counts: Vec<u32> = (counts.iter().cycle())
                    .take(seqs.len())
                    .map(|c| c.resolve(1, 5, 1) as u32)
                    .collect();
                let total: usize = counts.iter().map(|&c| c as usize).sum();
                let mut tokens: Vec<Token> = tokens.iter().copied().cycle().take(total).collect();
                if *extra_token {
                    tokens.push(0);
                }
                let model = self.model.verify(&seqs, &tokens, &counts);
                let verified = model.is_ok() && counts.iter().any(|&c| c > 1);
                let real = self.real.verify_batch(&mut self.batch, &tokens, &counts);
                self.same_batch_step(real, model)?;
                self.model.seen.verify_steps += u64::from(verified);
            }
            Op::Rollback {
                batch,
                counts,
                persistent,
            } => {
                let mut seqs = self.resolve_batch(batch, Want::Resident);
                if seqs.is_empty() {
                    return Ok(());
                }
                let persistent = *persistent && !has_repeats(&seqs);
                if persistent {
                    seqs = self.make_rows(&seqs);
                }
                let counts: Vec<usize> = seqs
                    .iter()
                    .zip(counts.iter().cycle())
                    .map(|(s, n)| {
                        let (_, computed, len, _) = progress(self.model.seqs.get(s));
                        let uncommitted = (len - computed).min(len - 1);
                        n.resolve(0, uncommitted, uncommitted)
                    })
                    .collect();
                let real = if persistent {
                    self.real.rollback_batch(&mut self.batch, &counts)
                } else {
                    self.real.rollback(&seqs, &counts)
                };
                same(real, self.model.rollback(&seqs, &counts))?;
            }
            Op::Commit {
                batch,
                upto,
                extra_count,
            } => {
                let seqs = self.resolve_batch(batch, Want::Resident);
                if seqs.is_empty() {
                    return Ok(());
                }
                let upto: Option<Vec<usize>> = upto.as_ref().map(|counts| {
                    let mut upto: Vec<usize> = seqs
                        .iter()
                        .zip(counts.iter().cycle())
                        .map(|(s, n)| {
                            let (planned, ..) = progress(self.model.seqs.get(s));
                            n.resolve(0, planned, planned)
                        })
                        .collect();
                    if *extra_count {
                        upto.push(0);
                    }
                    upto
                });
                same(
                    self.real.commit(&seqs, upto.as_deref()),
                    self.model.commit(&seqs, upto.as_deref()),
                )?;
            }
            Op::Fork { parent, child } => {
                let parent = self.resolve(parent, Want::Ready);
                let child = self.resolve(child, Want::Any);
                same(
                    self.real.fork(parent, child),
                    self.model.fork(parent, child),
                )?;
            }
            Op::Free { seq } => {
                let seq = self.resolve(seq, Want::Any);
                same(self.real.free(seq), self.model.free(seq))?;
            }
            Op::SwapOut { batch } => {
                let seqs = self.resolve_batch(batch, Want::Resident);
                if !seqs.is_empty() {
                    same(self.real.swap_out(&seqs), self.model.swap_out(&seqs))?;
                }
            }
            Op::ConfirmSwapOut { batch } => {
                let seqs = self.resolve_batch(batch, Want::SwapOutPending);
                if !seqs.is_empty() {
                    same(
                        self.real.confirm_swap_out(&seqs),
                        self.model.confirm_swap_out(&seqs),
                    )?;
                }
            }
            Op::SwapIn { batch } => {
                let seqs = self.resolve_batch(batch, Want::SwappedOut);
                if !seqs.is_empty() {
                    same(self.real.swap_in(&seqs), self.model.swap_in(&seqs))?;
                }
            }
            Op::ConfirmSwapIn { batch } => {
                let seqs = self.resolve_batch(batch, Want::SwapInPending);
                if !seqs.is_empty() {
                    same(
                        self.real.confirm_swap_in(&seqs),
                        self.model.confirm_swap_in(&seqs),
                    )?;
                }
            }
            Op::ResetPrefixCache => {
                self.real.reset_prefix_cache();
                self.model.reset_prefix_cache();
            }
            Op::TakeEvents => self.compare_events()?,
        }
        self.compare_state()
    }

    /// Makes the persistent batch's rows exactly `seqs` (removing the others, adding the
    /// missing ones at the end) and returns them in row order.
    fn make_rows(&mut self, seqs: &[SeqId]) -> Vec<SeqId> {
        let stale: Vec<SeqId> = (self.batch.seqs().iter())
            .filter(|s| !seqs.contains(s))
            .copied()
            .collect();
        for seq in stale {
            self.batch.remove(seq).expect("a row");
        }
        for &seq in seqs {
            if !self.batch.contains(seq) {
                self.batch.add(seq).expect("a new row");
            }
        }
        self.batch.seqs().to_vec()
    }

    /// Checks a `step_batch` against the model's `step` of the rows in order: the inputs, the
    /// table (each row its sequence's blocks, padded with -1) and the table as rebuilt from the
    /// update logs alone.
    fn same_batch_step(
        &mut self,
        real: Result<(), Error>,
        model: Expect<Plan>,
    ) -> Result<(), TestCaseError> {
        let m = match (real, model) {
            (Ok(()), Ok(m)) => m,
            (Err(r), Err(m)) => {
                prop_assert!(allowed(&r, &m), "error {:?}, model allows {:?}", r, m);
                return Ok(());
            }
            (r, m) => {
                prop_assert!(false, "real {:?}, model {:?}", r, m.map(|_| "plan"));
                return Ok(());
            }
        };
        self.model.seen.batch_steps += 1;
        self.model.seen.batch_copies += u64::from(!m.copies.is_empty());
        let mut plan = Plan::new();
        self.batch.write_plan(&mut plan);
        same_plan(&plan, &m)?;
        prop_assert!(self.batch.inputs().kv_indices.is_empty());
        let width = self.batch.width();
        for (r, row) in self.batch.block_table().chunks(width).enumerate() {
            let pages = &m.kv_indices[m.kv_indptr[r] as usize..m.kv_indptr[r + 1] as usize];
            prop_assert_eq!(&row[..pages.len()], pages, "table row {}", r);
            prop_assert!(
                row[pages.len()..].iter().all(|&b| b == -1),
                "row {} padding",
                r
            );
        }
        let (table, updates) = (self.batch.block_table(), self.batch.updates());
        if updates.full {
            self.mirror = table.to_vec();
        } else {
            for (&at, &block) in updates.index.iter().zip(&updates.blocks) {
                if at as usize >= self.mirror.len() {
                    self.mirror.resize(at as usize + 1, -1);
                }
                self.mirror[at as usize] = block;
            }
        }
        self.mirror.resize(self.mirror.len().max(table.len()), -1);
        prop_assert_eq!(&self.mirror[..table.len()], table, "mirror");
        prop_assert!(
            self.mirror[table.len()..].iter().all(|&b| b == -1),
            "mirror tail"
        );
        self.batch.clear_updates();
        Ok(())
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
                prop_assert_eq!(self.plan.batch_size(), 0, "a failed plan is left empty");
                Ok(())
            }
            (r, m) => {
                prop_assert!(false, "real {:?}, model {:?}", r, m.map(|_| "plan"));
                Ok(())
            }
        }
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
                        block_id,
                        medium,
                        salt: event_salt,
                        lora_name,
                        extra_keys,
                    },
                    ModelEvent::Stored {
                        key,
                        token_ids: m_tokens,
                        block_id: m_block,
                        medium: m_medium,
                    },
                ) => {
                    prop_assert_eq!(token_ids, m_tokens);
                    prop_assert_eq!((block_id, medium), (m_block, m_medium), "stored where");
                    self.binding.bind(key, *block_hash)?;
                    let (salt, prefix) = key;
                    prop_assert_eq!(event_salt.as_deref(), salt.as_deref(), "the event's salt");
                    prop_assert!(lora_name.is_none() && extra_keys.is_empty(), "no keys");
                    if prefix.len() > bs {
                        let parent = (salt.clone(), prefix[..prefix.len() - bs].to_vec());
                        let Some(parent_hash) = parent_hash else {
                            return Err(TestCaseError::fail(
                                "a non-first block has no parent hash",
                            ));
                        };
                        self.binding.bind(&parent, *parent_hash)?;
                    } else {
                        prop_assert_eq!(parent_hash, &None, "a first block has no parent");
                    }
                }
                (
                    EventKind::BlockRemoved {
                        block_hash,
                        block_id,
                        medium,
                    },
                    ModelEvent::Removed {
                        key,
                        block_id: m_block,
                        medium: m_medium,
                    },
                ) => {
                    prop_assert_eq!((block_id, medium), (m_block, m_medium), "removed where");
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
            prop_assert_eq!(
                real.num_computed(s),
                Ok(m.computed),
                "num_computed of {}",
                s
            );
            let table = if m.swapped {
                Err(Error::SwappedOut(s))
            } else {
                Ok(m.table.clone())
            };
            prop_assert_eq!(real.block_table(s), table, "block table of {}", s);
        }
        let bs = real.config().block_size as usize;
        for (salt, prefix) in model.prefix.keys() {
            let parent = (salt.clone(), prefix[..prefix.len() - bs].to_vec());
            prop_assert!(
                prefix.len() == bs || model.prefix.contains_key(&parent),
                "a registered block's parent is registered (one tree)"
            );
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
        prop_assert_eq!(r.computed_tokens, m.computed_tokens, "computed_tokens");
        prop_assert_eq!(r.pending_tokens, m.pending_tokens, "pending_tokens");
        prop_assert_eq!(
            r.external_query_tokens,
            m.external_query_tokens,
            "external_query_tokens"
        );
        prop_assert_eq!(
            r.external_hit_tokens,
            m.external_hit_tokens,
            "external_hit_tokens"
        );
        prop_assert_eq!(
            r.external_failures,
            m.external_failures,
            "external_failures"
        );
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

    /// Free every sequence and drain the events: the pool must end with nothing held.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        let live: Vec<SeqId> = self.model.seqs.keys().copied().collect();
        for s in live {
            same(self.real.free(s), self.model.free(s))?;
            self.compare_state()?;
        }
        self.compare_events()?;
        let st = self.real.stats();
        prop_assert_eq!((st.num_held, st.stored_tokens), (0, 0));
        prop_assert_eq!((st.computed_tokens, st.pending_tokens), (0, 0));
        Ok(())
    }
}

/// What all cases together exercised.
#[derive(Debug, Default)]
struct Summary {
    cases: AtomicU64,
    manual_commit_cases: AtomicU64,
    hit_tokens: AtomicU64,
    external_hit_tokens: AtomicU64,
    evictions: AtomicU64,
    copies: AtomicU64,
    swap_outs: AtomicU64,
    swap_ins: AtomicU64,
    cpu_events: AtomicU64,
    commits: AtomicU64,
    out_of_blocks: AtomicU64,
    batch_steps: AtomicU64,
    batch_copies: AtomicU64,
    verify_steps: AtomicU64,
    rolled_back: AtomicU64,
}

impl Summary {
    fn add(&self, model: &Model) {
        let seen = model.seen;
        for (counter, n) in [
            (&self.cases, 1),
            (&self.manual_commit_cases, u64::from(!model.auto_commit)),
            (&self.hit_tokens, model.hit_tokens - model.external_hit),
            (&self.external_hit_tokens, model.external_hit),
            (&self.evictions, model.evictions),
            (&self.copies, seen.copies),
            (&self.swap_outs, seen.swap_outs),
            (&self.swap_ins, seen.swap_ins),
            (&self.cpu_events, seen.cpu_events),
            (&self.commits, seen.commits),
            (&self.out_of_blocks, seen.out_of_blocks),
            (&self.batch_steps, seen.batch_steps),
            (&self.batch_copies, seen.batch_copies),
            (&self.verify_steps, seen.verify_steps),
            (&self.rolled_back, seen.rolled_back),
        ] {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Runs `cases` random operation lists with block sizes from `block_size` against the model,
/// and checks that they exercised every scenario.
fn run_model(cases: u32, block_size: impl Strategy<Value = u32>) {
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        // A failure prints the shrunk operation list; no regression file in the source tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let summary = Summary::default();
    let strategy = (config(block_size), prop::collection::vec(op(), 1..=240));
    let result = runner.run(&strategy, |(cfg, ops)| {
        let mut h = Harness::new(cfg);
        for op in &ops {
            h.apply(op)?;
        }
        h.finish()?;
        summary.add(&h.model);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    eprintln!("model test: {summary:?}");
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    if get(&summary.cases) < 200 {
        return; // Too few cases (PROPTEST_CASES) to expect every scenario.
    }
    for (what, counter) in [
        ("cases without auto-commit", &summary.manual_commit_cases),
        ("prefix hits", &summary.hit_tokens),
        ("external loads", &summary.external_hit_tokens),
        ("evictions", &summary.evictions),
        ("copies delivered in plans", &summary.copies),
        ("confirmed swap-outs", &summary.swap_outs),
        ("confirmed swap-ins", &summary.swap_ins),
        ("CPU-tier events", &summary.cpu_events),
        ("explicit commits", &summary.commits),
        ("OutOfBlocks", &summary.out_of_blocks),
        ("persistent batch steps", &summary.batch_steps),
        ("copies in persistent batch steps", &summary.batch_copies),
        ("verify steps with drafts", &summary.verify_steps),
        ("rolled-back tokens", &summary.rolled_back),
    ] {
        assert!(get(counter) > 0, "the run never exercised {what}");
    }
}

#[test]
fn manager_matches_model() {
    run_model(cases(), 1u32..=4);
}

/// The block sizes servers use (16) and a larger one, with prompts and appends stretched to
/// match: the paths a benchmark times are checked against the model too.
#[test]
fn manager_matches_model_at_serving_block_sizes() {
    run_model((cases() / 3).max(1), prop_oneof![Just(16u32), Just(32u32)]);
}
