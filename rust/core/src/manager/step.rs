//! Appending and planning: `append`, `step` (one decode token per sequence), `step_batch` (the
//! same for a persistent [`Batch`]) and `plan` (any batch), with the copy-on-write of a shared
//! last block.

use crate::batch::{Appends, Batch, RowPass};
use crate::block::BlockSize;
use crate::error::invalid;
use crate::hash_lanes::{self, LANES, LANE_TOKENS};
use crate::manager::taking::Takes;
use crate::manager::{
    check_room, no_gap, not_loading, one_each, visit, visit_hinted, BlockManager, MAX_TOKENS,
};
use crate::plan::Plan;
use crate::prefix::{Chain, PrefixCache};
use crate::sequence::{LockedBatch, Member, PendingCopy, Sequence, SequenceMap, Slots};
use crate::stats::Counters;
use crate::sync::prefetch_write;
use crate::{BlockId, Error, SeqId, Token};

impl BlockManager {
    /// Appends tokens to a running sequence, copying a shared last block on write. The tokens'
    /// KV is pending until a plan computes it; the copy comes back with that plan.
    pub fn append(&self, seq: SeqId, tokens: &[Token]) -> Result<(), Error> {
        if tokens.is_empty() {
            return Err(invalid("append needs at least one token"));
        }
        let mut one = self.seqs.lock_one(seq);
        let s = one.get().ok_or(Error::UnknownSequence(seq))?;
        if s.swapped {
            return Err(Error::SwappedOut(seq));
        }
        not_loading(seq, s)?;
        check_room(s.tokens.len(), tokens.len())?;
        self.settle(self.auto_commit(s));
        let needed = self.blocks_to_append(s, tokens.len());
        self.reserve_gpu(needed)?;
        let new_blocks = self.bs.pages(s.tokens.len() + tokens.len()) - s.table.len();
        let mut takes = Takes::at_least(new_blocks);
        self.append_reserved(s, tokens, &mut takes);
        self.count_evictions(takes.evictions);
        self.gpu.unreserve(needed - takes.blocks);
        self.gpu.add_stored(tokens.len());
        Counters::add(&self.counters.pending_tokens, tokens.len() as u64);
        Ok(())
    }

    /// One decode step: appends `tokens[i]` to `seqs[i]` for the whole batch (all or nothing),
    /// then writes the plan for one query token per sequence into `plan`. On an error `plan`
    /// is left empty.
    pub fn step(&self, seqs: &[SeqId], tokens: &[Token], plan: &mut Plan) -> Result<(), Error> {
        let mut rows = Listed {
            seqs,
            members: Vec::with_capacity(seqs.len()),
            plan,
        };
        self.decode(&mut rows, tokens)
            .inspect_err(|_| rows.plan.begin(0, 0, 0, self.bs))
    }

    /// One decode step of a persistent batch: appends `tokens[r]` to row `r`'s sequence for
    /// every row (all or nothing), then writes the rows' attention inputs
    /// ([`Batch::inputs`]) and the table entries that changed ([`Batch::updates`]). Host work
    /// is `O(rows)` plus the blocks that changed, however long the sequences. Same semantics
    /// and errors as [`BlockManager::step`] for the rows in order; on an error the batch is
    /// as it was.
    pub fn step_batch(&self, batch: &mut Batch, tokens: &[Token]) -> Result<(), Error> {
        self.decode(batch, tokens)
    }

    /// Writes the plan for any batch into `plan`: sequence `seqs[i]`'s last `query_lens[i]`
    /// tokens are the queries (prefill, chunked prefill, decode or a mix). On an error `plan` is
    /// left empty.
    pub fn plan(&self, seqs: &[SeqId], query_lens: &[u32], plan: &mut Plan) -> Result<(), Error> {
        self.fill_plan(seqs, query_lens, plan)
            .inspect_err(|_| plan.begin(0, 0, 0, self.bs))
    }

    /// The decode step shared by `step` and `step_batch`.
    fn decode<R: DecodeRows>(&self, rows: &mut R, tokens: &[Token]) -> Result<(), Error> {
        let n = rows.len();
        one_each(R::CALL, n, tokens.len(), "tokens")?;
        let stamp = (!R::DISTINCT).then(|| self.next_stamp());
        let mut batch = rows.lock(&self.seqs);
        let untouched = rows.untouched(&batch);
        let mut to_hash = self.lanes().then(ToHash::default);
        // A row whose sequence is as the batch's last step left it is checked from what the
        // batch kept; any other is found and checked in full.
        let mut appends = rows.settle(untouched, self.bs);
        // Pages of the rows checked in full (a list's plan reserves its CSR for them).
        let (mut needed, mut copying, mut nnz) = (0, false, 0);
        // A settled row whose token takes a block may register one, with prefix caching on.
        let registering = self.prefix.is_some() && self.config.auto_commit;
        let mut next = rows.to_visit_from(0, registering);
        while let Some(row) = next {
            next = rows.to_visit_from(row + 1, registering);
            if rows.is_settled(row) {
                // Settled, and takes a block: only the block its commit may register to
                // prepare.
                if rows.may_register(row) {
                    let member = rows.member(row);
                    self.prepare_commit(batch.at(member), member, to_hash.as_mut());
                    if let Some(pending) = to_hash.as_mut().filter(|p| p.n == LANES) {
                        self.hash_together(&mut batch, pending);
                    }
                }
                continue;
            }
            let s = rows.visit(&mut batch, row, stamp)?;
            decodable(rows.id(row), s)?;
            self.prepare_commit(s, rows.member(row), to_hash.as_mut());
            copying |= !s.copying.is_empty();
            needed += usize::from(self.must_copy_tail(s));
            nnz += appends.add(s.tokens.len(), s.table.len(), self.bs);
            if let Some(pending) = to_hash.as_mut().filter(|p| p.n == LANES) {
                self.hash_together(&mut batch, pending);
            }
        }
        let Appends { new_blocks, widest } = appends;
        needed += new_blocks;
        if let Some(pending) = &mut to_hash {
            self.hash_together(&mut batch, pending);
        }
        // Members with copies in flight are committed first: a completed copy releases its
        // source, which may be another member's tail that then needs no copy-on-write, so
        // `needed` is counted again after them. Any other commit changes no refcount, so it
        // waits for its own member's turn below (one pass over the batch fewer).
        if copying && self.config.auto_commit {
            let mut computed = 0;
            for row in 0..n {
                let s = batch.at(rows.member(row));
                if !s.copying.is_empty() {
                    computed += self.auto_commit(s);
                }
            }
            self.settle(computed);
            needed = (0..n)
                .map(|row| self.blocks_to_append(batch.at(rows.member(row)), 1))
                .sum();
        }
        rows.fit(widest)?;
        self.reserve_gpu(needed)?;
        rows.begin(nnz, self.bs);
        // Every new block is taken; copies may turn out unneeded (a holder let go meanwhile).
        let (mut takes, mut computed) = (Takes::at_least(new_blocks), 0);
        let mut slots = batch.slots();
        if R::KEEPS_ROWS {
            // What the pass reads of each row, and the auto-commit flag, come from locals:
            // through `self` or the batch, they would be loaded again (and the rows bounds
            // checked) after every store to a sequence.
            let auto_commit = self.config.auto_commit;
            let pass = rows.take_pass();
            let mut row = 0;
            loop {
                // The settled rows up to the next row to check in full or taking a block need
                // only their token: a loop that reads no flag.
                let end = pass.next_to_check(row).unwrap_or(n);
                let run = (&tokens[row..end], &pass.members[row..end]);
                debug_assert!(
                    run.1
                        .iter()
                        .all(|member| self.bs.offset(slots.at(found(member)).tokens.len()) != 0),
                    "a settled row taking a block"
                );
                computed += if auto_commit {
                    append_settled::<true>(&mut slots, run)
                } else {
                    append_settled::<false>(&mut slots, run)
                };
                let Some((&token, member)) = tokens.get(end).zip(pass.members.get(end)) else {
                    break;
                };
                row = end;
                let s = slots.at(found(member));
                if !pass.settled[row] {
                    computed += self.append_checked(rows, row, s, token, &mut takes);
                } else {
                    debug_assert_eq!(self.bs.offset(s.tokens.len()), 0);
                    computed += commit_settled(s, auto_commit);
                    if registering && rows.may_register(row) {
                        self.register_settled(s);
                        rows.record_row(row, self.settled_below(s));
                    }
                    push_settled(s, token);
                    let block = self.take(&mut takes);
                    s.table.push(block);
                    rows.push_settled_block(row, block);
                }
                row += 1;
            }
            rows.restore_pass(pass);
        } else {
            for (row, &token) in tokens.iter().enumerate() {
                let s = slots.at(rows.member(row));
                computed += self.append_checked(rows, row, s, token, &mut takes);
            }
        }
        rows.finish(&batch, self.bs);
        self.settle(computed);
        self.count_evictions(takes.evictions);
        self.gpu.unreserve(needed - takes.blocks);
        self.gpu.add_stored(n);
        Counters::add(&self.counters.pending_tokens, n as u64);
        Ok(())
    }

    /// The length below which `s`, just stepped (all tokens planned), decodes as settled while
    /// nothing else touches it: with no check but its length, since it has room for a token
    /// and at most one block for a step's auto-commit to register, at the last of those
    /// lengths ([`BlockManager::register_settled`]). 0 unless it is quiet.
    fn settled_below(&self, s: &Sequence) -> usize {
        if !s.is_quiet() {
            return 0;
        }
        if self.prefix.is_some() && self.config.auto_commit {
            // The auto-commit of a step at length `(registered + 1) * block_size` registers
            // block `registered`, then full.
            MAX_TOKENS.min((s.registered + 1) * self.bs.get() + 1)
        } else {
            MAX_TOKENS
        }
    }

    /// The registration, by a settled sequence's auto-commit (already counted:
    /// [`commit_settled`]), of the block it completed, if any: its block was hashed in the
    /// step's first pass.
    fn register_settled(&self, s: &mut Sequence) {
        if self.bs.index(s.computed) > s.registered {
            self.register_next(s);
        }
    }

    /// The second pass of a row checked in full: its auto-commit, its append and its inputs.
    /// Returns the tokens that became computed.
    #[inline(always)]
    fn append_checked<R: DecodeRows>(
        &self,
        rows: &mut R,
        row: usize,
        s: &mut Sequence,
        token: Token,
        takes: &mut Takes,
    ) -> u64 {
        let computed = self.auto_commit(s);
        self.append_token(s, token, takes);
        let settled_below = if R::KEEPS_ROWS {
            self.settled_below(s)
        } else {
            0
        };
        rows.push(row, s, settled_below, self.bs);
        computed
    }

    /// Whether a decode step hashes the blocks it registers together ([`hash_lanes`]).
    fn lanes(&self) -> bool {
        self.prefix.is_some() && self.bs.get() == LANE_TOKENS && hash_lanes::available()
    }

    /// Prepares what this step's auto-commit of `s` (the batch's `member`) will write, when
    /// its last plan filled a block: hashes the block now, or queues it in `to_hash` when it is
    /// the one block left to hash, and starts fetching the lines its registration writes, so
    /// the registration, a whole pass later, does not wait on them.
    #[inline(always)]
    fn prepare_commit(&self, s: &mut Sequence, member: Member, to_hash: Option<&mut ToHash>) {
        let Some(prefix) = &self.prefix else {
            return;
        };
        let full = self.bs.index(s.planned);
        if self.config.auto_commit && full > s.registered && s.swap_source.is_none() {
            self.prepare_registration(prefix, s, full, member, to_hash);
        }
    }

    /// [`BlockManager::prepare_commit`] of a sequence with blocks to register: kept out of the
    /// per-row loop, which reaches it for about one sequence in `block_size`.
    #[inline(never)]
    fn prepare_registration(
        &self,
        prefix: &PrefixCache,
        s: &mut Sequence,
        full: usize,
        member: Member,
        to_hash: Option<&mut ToHash>,
    ) {
        match to_hash {
            Some(pending) if s.hashes.len() + 1 == full => pending.push(member, s),
            _ => {
                self.hash_blocks(prefix, s, full);
                self.prefetch_registration(prefix, s);
            }
        }
    }

    /// Hashes the blocks queued in `pending` together, then prefetches their registrations.
    #[inline(never)]
    fn hash_together(&self, batch: &mut LockedBatch<'_>, pending: &mut ToHash) {
        let Some(prefix) = &self.prefix else {
            return;
        };
        let chains = hash_lanes::chains(&pending.parents, &pending.blocks, pending.n);
        let queued = pending.members.iter().zip(&pending.blocks).zip(chains);
        for ((&member, block), chain) in queued.take(pending.n) {
            let s = batch.at(member);
            s.keys
                .push(prefix.key_block(s.parent_key(s.hashes.len()), block));
            s.hashes.push(chain);
            self.prefetch_registration(prefix, s);
        }
        pending.n = 0;
    }

    /// Starts fetching the lines the registration of `s`'s next block to register writes.
    fn prefetch_registration(&self, prefix: &PrefixCache, s: &Sequence) {
        let block = s.table[s.registered];
        prefix.prefetch_registration(block, s.keys[s.registered]);
        self.gpu.prefetch_state(block);
    }

    fn fill_plan(&self, seqs: &[SeqId], query_lens: &[u32], plan: &mut Plan) -> Result<(), Error> {
        one_each("plan", seqs.len(), query_lens.len(), "query lengths")?;
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        let (mut nnz, mut num_query_tokens) = (0, 0);
        let mut members = Vec::with_capacity(seqs.len());
        for (&id, &q) in seqs.iter().zip(query_lens) {
            let member = visit(&mut batch, id, stamp, false)?;
            members.push(member);
            let s = batch.at(member);
            not_loading(id, s)?;
            let len = s.tokens.len();
            if q == 0 || q as usize > len {
                return Err(invalid(format!(
                    "query length {q} of sequence {id} must be in 1..={len}"
                )));
            }
            no_gap(id, s, len - q as usize)?;
            nnz += self.bs.pages(len);
            num_query_tokens += q as usize;
        }
        plan.begin(seqs.len(), nnz, num_query_tokens, self.bs);
        let mut computed = 0;
        for (&member, &q) in members.iter().zip(query_lens) {
            let s = batch.at(member);
            computed += self.auto_commit(s);
            self.plan_one(s, q as usize, plan);
        }
        self.settle(computed);
        Ok(())
    }

    /// Adds a validated sequence's last `q` tokens to the plan, with the copies it must apply
    /// first; the plan's forward pass computes the sequence's KV up to its end.
    fn plan_one(&self, s: &mut Sequence, q: usize, plan: &mut Plan) {
        plan.push(&s.table, s.tokens.len(), q, self.bs);
        hand_over_copies(s, plan);
    }

    /// Blocks an append of `count` tokens takes: a copy-on-write of a shared partial last
    /// block, plus the new blocks.
    fn blocks_to_append(&self, s: &Sequence, count: usize) -> usize {
        let bs = self.bs;
        usize::from(self.must_copy_tail(s)) + bs.pages(s.tokens.len() + count) - s.table.len()
    }

    /// Whether the last block is partial and shared (by another sequence, or as the source of
    /// a copy not yet done), so writing to it needs a private copy.
    #[inline]
    fn must_copy_tail(&self, s: &Sequence) -> bool {
        s.shared_tail
            && self.bs.offset(s.tokens.len()) != 0
            && self
                .gpu
                .state(*s.table.last().expect("a sequence has a block"))
                .refcount()
                > 1
    }

    /// Appends with blocks already reserved, taking them through `takes`. The caller
    /// counts the appended tokens into the pool's stored tokens (once per batch).
    fn append_reserved(&self, s: &mut Sequence, tokens: &[Token], takes: &mut Takes) {
        self.unshare_tail(s, takes);
        s.tokens.extend_from_slice(tokens);
        let pages = self.bs.pages(s.tokens.len());
        while s.table.len() < pages {
            s.table.push(self.take(takes));
        }
    }

    /// [`BlockManager::append_reserved`] of a decode step's single token.
    #[inline(always)]
    fn append_token(&self, s: &mut Sequence, token: Token, takes: &mut Takes) {
        self.unshare_tail(s, takes);
        let full = self.bs.offset(s.tokens.len()) == 0;
        s.tokens.push(token);
        if full {
            s.table.push(self.take(takes));
        }
    }

    /// Before an append: copies the last block if it must be (a reserved block), and makes the
    /// tail private either way.
    #[inline]
    fn unshare_tail(&self, s: &mut Sequence, takes: &mut Takes) {
        if !s.shared_tail {
            return;
        }
        // A partial block gains holders only through forks and swaps of sequences holding it,
        // so one this sequence held alone when the blocks were counted is still private here:
        // a copy is never taken without a reserved block.
        if self.must_copy_tail(s) {
            self.copy_tail(s, takes);
        }
        s.shared_tail = false;
    }

    /// Replaces the shared partial last block by a fresh (reserved) block that a copy will fill;
    /// the sequence's reference to the old block now belongs to the copy, until it is done.
    #[inline(never)]
    fn copy_tail(&self, s: &mut Sequence, takes: &mut Takes) {
        let fill = self.bs.offset(s.tokens.len()) as u32;
        let dst = self.take(takes);
        let last = s.table.last_mut().expect("a sequence has a block");
        let src = *last;
        s.copies.push(PendingCopy {
            src,
            dst,
            fill,
            until: 0,
        });
        *last = dst;
        s.table_changed();
        self.gpu.add_stored(fill as usize);
    }
}

/// The auto-commit of a settled sequence (see [`BlockManager::settled_below`]), which reads
/// only what it writes: it completes no copy, and the one block it may register is the
/// caller's ([`BlockManager::register_settled`]). Returns the tokens that became computed.
#[inline(always)]
fn commit_settled(s: &mut Sequence, auto_commit: bool) -> u64 {
    debug_assert!(s.is_quiet() && s.planned == s.tokens.len());
    let mut computed = 0;
    if auto_commit {
        computed = (s.planned - s.computed) as u64;
        s.computed = s.planned;
    }
    computed
}

/// Where a settled row's sequence is: its last step, or this one, found it.
#[inline(always)]
fn found(member: &Option<Member>) -> Member {
    member.expect("a settled row's last step, or this one, found it")
}

/// The auto-commit ([`commit_settled`]) and append ([`push_settled`]) of each settled row of a
/// run whose tokens take no block: `(tokens, members)` of its rows. Returns the tokens that
/// became computed. Out of line: inlined in the step, the loop would share its registers and
/// keep its sum and bounds on the stack.
#[inline(never)]
fn append_settled<const AUTO_COMMIT: bool>(
    slots: &mut Slots<'_>,
    (tokens, members): (&[Token], &[Option<Member>]),
) -> u64 {
    let mut computed = 0;
    for (&token, member) in tokens.iter().zip(members) {
        let s = slots.at(found(member));
        computed += commit_settled(s, AUTO_COMMIT);
        push_settled(s, token);
    }
    computed
}

/// The append of a settled sequence, which copies no tail: marks its tokens planned (it hands
/// over no copies). A block the token needs is the caller's to add.
#[inline(always)]
fn push_settled(s: &mut Sequence, token: Token) {
    s.tokens.push(token);
    s.planned = s.tokens.len();
}

/// Blocks a decode step's first pass queued to hash together: each the one block its
/// sequence has left to hash, of [`LANE_TOKENS`] tokens.
#[derive(Default)]
struct ToHash {
    members: [Member; LANES],
    parents: [Chain; LANES],
    blocks: [[Token; LANE_TOKENS]; LANES],
    n: usize,
}

impl ToHash {
    /// Queues the next block to hash of `s`, the batch's `member` (at most [`LANES`] queued),
    /// with its parent's chaining value. Its parent's key is only prefetched here: it is read
    /// when the queue is hashed ([`BlockManager::hash_together`]).
    fn push(&mut self, member: Member, s: &Sequence) {
        let i = s.hashes.len();
        self.members[self.n] = member;
        self.parents[self.n] = s.parent_chain(i);
        if let Some(key) = s.keys.last() {
            prefetch_write(key);
        }
        self.blocks[self.n].copy_from_slice(&s.tokens[i * LANE_TOKENS..(i + 1) * LANE_TOKENS]);
        self.n += 1;
    }
}

/// Fails unless the sequence can take a decode token: `append`'s checks, and no unplanned
/// tokens before the query.
#[inline(always)]
fn decodable(id: SeqId, s: &Sequence) -> Result<(), Error> {
    let len = s.tokens.len();
    if s.loading.is_none() && len < MAX_TOKENS && len <= s.planned {
        return Ok(());
    }
    not_loading(id, s)?;
    check_room(len, 1)?;
    no_gap(id, s, len)
}

/// Moves the sequence's recorded copies into the plan that computes its KV up to its end, and
/// marks its tokens planned.
#[inline]
fn hand_over_copies(s: &mut Sequence, plan: &mut Plan) {
    if !s.copies.is_empty() {
        hand_over_recorded(s, plan);
    }
    s.planned = s.tokens.len();
}

/// [`hand_over_copies`] when there are copies: kept out of the decode loop.
#[inline(never)]
fn hand_over_recorded(s: &mut Sequence, plan: &mut Plan) {
    let len = s.tokens.len();
    for mut copy in s.copies.drain(..) {
        plan.push_copy(copy.src, copy.dst);
        copy.until = len;
        s.copying.push(copy);
    }
}

/// The rows of a decode step: where their sequences are and where their inputs go.
trait DecodeRows {
    /// The operation's name, for errors.
    const CALL: &'static str;
    /// Whether the rows' sequences are distinct by construction (else repeats are checked).
    const DISTINCT: bool;
    /// Whether the rows keep what a step left of their sequences (so later steps may find
    /// them settled).
    const KEEPS_ROWS: bool;
    /// The sequence of each row.
    fn seqs(&self) -> &[SeqId];
    /// Where row `row`'s sequence was found last (this step, once visited), if known.
    fn hint(&self, row: usize) -> Option<Member>;
    /// Records where this step found row `row`'s sequence (rows come in order, from 0).
    fn remember(&mut self, row: usize, member: Member);
    /// Locks the shards of every row's sequence.
    fn lock<'m>(&mut self, seqs: &'m SequenceMap) -> LockedBatch<'m>;
    /// The locked shards nothing else locked since these rows' last step.
    fn untouched(&self, batch: &LockedBatch<'_>) -> u32;
    /// Marks the rows whose sequence is as the rows' last step left it, known unchanged since
    /// (its shard in `untouched`), and decodes as settled ([`BlockManager::settled_below`]),
    /// and those of them that take a block; returns what their appends take (blocks of `bs`
    /// tokens).
    fn settle(&mut self, untouched: u32, bs: BlockSize) -> Appends;
    /// Moves out, for the second pass, where each row's sequence is and what
    /// [`DecodeRows::settle`] flagged (kept rows only: [`DecodeRows::KEEPS_ROWS`]).
    fn take_pass(&mut self) -> RowPass;
    /// Puts back what [`DecodeRows::take_pass`] moved out.
    fn restore_pass(&mut self, pass: RowPass);
    /// The first row from `row` on that the first pass visits: not settled or, with `taking`,
    /// settled and taking a block (it may register one).
    fn to_visit_from(&self, row: usize, taking: bool) -> Option<usize>;
    /// Whether [`DecodeRows::settle`] found row `row` settled in this step.
    fn is_settled(&self, row: usize) -> bool;
    /// Whether row `row`, settled and taking a block in this step, may register one (the
    /// sequence decides: [`BlockManager::register_settled`]).
    fn may_register(&self, row: usize) -> bool;
    /// Records that row `row`'s sequence decodes as settled below length `settled_below`
    /// (and at it: [`BlockManager::settled_below`]) in later steps.
    fn record_row(&mut self, row: usize, settled_below: usize);
    /// Makes room for rows of up to `pages` blocks, before anything changes.
    fn fit(&mut self, pages: usize) -> Result<(), Error>;
    /// Starts the inputs: `nnz` pages in the rows checked in full (all of a list's).
    fn begin(&mut self, nnz: usize, bs: BlockSize);
    /// Adds row `row`'s inputs after its append, and hands over its copies; `s` decodes as
    /// settled below length `settled_below` in later steps.
    fn push(&mut self, row: usize, s: &mut Sequence, settled_below: usize, bs: BlockSize);
    /// [`DecodeRows::push`] of a settled row whose append ([`push_settled`]) took `block` (no
    /// copies, still quiet); one that took none needs no push.
    fn push_settled_block(&mut self, row: usize, block: BlockId);
    /// Completes the inputs once every row was pushed, and records the step's shards.
    fn finish(&mut self, batch: &LockedBatch<'_>, bs: BlockSize);

    fn len(&self) -> usize {
        self.seqs().len()
    }
    fn id(&self, row: usize) -> SeqId {
        self.seqs()[row]
    }
    /// Finds and checks row `row`'s sequence (live, on the GPU, once in the batch) and
    /// remembers where it is; rows are visited in order, from 0.
    #[inline(always)]
    fn visit<'b>(
        &mut self,
        batch: &'b mut LockedBatch<'_>,
        row: usize,
        stamp: Option<u64>,
    ) -> Result<&'b mut Sequence, Error> {
        let (member, s) = visit_hinted(batch, self.id(row), self.hint(row), stamp, false)?;
        self.remember(row, member);
        Ok(s)
    }
    /// Where [`DecodeRows::visit`] found row `row`'s sequence.
    fn member(&self, row: usize) -> Member {
        self.hint(row).expect("the row was visited")
    }
}

/// A list of sequences with a one-shot plan: the whole CSR is written each step.
struct Listed<'a> {
    seqs: &'a [SeqId],
    members: Vec<Member>,
    plan: &'a mut Plan,
}

impl DecodeRows for Listed<'_> {
    const CALL: &'static str = "step";
    const DISTINCT: bool = false;
    const KEEPS_ROWS: bool = false;
    fn seqs(&self) -> &[SeqId] {
        self.seqs
    }
    fn hint(&self, row: usize) -> Option<Member> {
        self.members.get(row).copied()
    }
    fn remember(&mut self, _row: usize, member: Member) {
        self.members.push(member);
    }
    fn lock<'m>(&mut self, seqs: &'m SequenceMap) -> LockedBatch<'m> {
        seqs.lock(self.seqs)
    }
    fn untouched(&self, _batch: &LockedBatch<'_>) -> u32 {
        0
    }
    fn settle(&mut self, _untouched: u32, _bs: BlockSize) -> Appends {
        Appends::default()
    }
    fn take_pass(&mut self) -> RowPass {
        unreachable!("a list keeps nothing between steps, so its rows are all checked in full")
    }
    fn restore_pass(&mut self, _pass: RowPass) {
        unreachable!("a list keeps nothing between steps, so its rows are all checked in full")
    }
    fn to_visit_from(&self, row: usize, _taking: bool) -> Option<usize> {
        (row < self.seqs.len()).then_some(row)
    }
    fn is_settled(&self, _row: usize) -> bool {
        false
    }
    fn may_register(&self, _row: usize) -> bool {
        false
    }
    fn record_row(&mut self, _row: usize, _settled_below: usize) {}
    fn fit(&mut self, _pages: usize) -> Result<(), Error> {
        Ok(())
    }
    fn begin(&mut self, nnz: usize, bs: BlockSize) {
        let n = self.seqs.len();
        self.plan.begin(n, nnz, n, bs);
    }
    fn push(&mut self, _row: usize, s: &mut Sequence, _settled_below: usize, bs: BlockSize) {
        self.plan.push(&s.table, s.tokens.len(), 1, bs);
        hand_over_copies(s, self.plan);
    }
    fn push_settled_block(&mut self, _row: usize, _block: BlockId) {
        unreachable!("a list keeps nothing between steps, so no row of it is settled")
    }
    fn finish(&mut self, _batch: &LockedBatch<'_>, _bs: BlockSize) {}
}

/// A persistent batch: the table rows change only where blocks changed.
impl DecodeRows for Batch {
    const CALL: &'static str = "step_batch";
    const DISTINCT: bool = true;
    const KEEPS_ROWS: bool = true;
    fn seqs(&self) -> &[SeqId] {
        Batch::seqs(self)
    }
    fn hint(&self, row: usize) -> Option<Member> {
        self.member_hint(row)
    }
    fn remember(&mut self, row: usize, member: Member) {
        self.found(row, member);
    }
    fn lock<'m>(&mut self, seqs: &'m SequenceMap) -> LockedBatch<'m> {
        seqs.lock_shards(self.shards())
    }
    fn untouched(&self, batch: &LockedBatch<'_>) -> u32 {
        Batch::untouched(self, batch)
    }
    fn settle(&mut self, untouched: u32, bs: BlockSize) -> Appends {
        Batch::settle(self, untouched, bs)
    }
    fn take_pass(&mut self) -> RowPass {
        Batch::take_pass(self)
    }
    fn restore_pass(&mut self, pass: RowPass) {
        Batch::restore_pass(self, pass)
    }
    #[inline(always)]
    fn to_visit_from(&self, row: usize, taking: bool) -> Option<usize> {
        Batch::to_visit_from(self, row, taking)
    }
    fn is_settled(&self, row: usize) -> bool {
        Batch::is_settled(self, row)
    }
    fn may_register(&self, row: usize) -> bool {
        Batch::may_register(self, row)
    }
    fn record_row(&mut self, row: usize, settled_below: usize) {
        Batch::record_row(self, row, settled_below)
    }
    fn fit(&mut self, pages: usize) -> Result<(), Error> {
        Batch::fit(self, pages)
    }
    fn begin(&mut self, _nnz: usize, _bs: BlockSize) {
        self.inputs.copies.clear();
    }
    #[inline]
    fn push(&mut self, row: usize, s: &mut Sequence, settled_below: usize, _bs: BlockSize) {
        self.sync_row(row, &s.table, s.epoch, s.tokens.len());
        hand_over_copies(s, &mut self.inputs);
        self.record_row(row, settled_below);
    }
    fn push_settled_block(&mut self, row: usize, block: BlockId) {
        self.push_block(row, block);
    }
    fn finish(&mut self, batch: &LockedBatch<'_>, bs: BlockSize) {
        self.write_inputs(bs);
        self.record_locks(batch);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::manager::testing::*;
    use crate::{Config, Plan, SeqId, Token};

    #[test]
    fn a_failed_plan_leaves_it_empty() {
        let mgr = BlockManager::new(Config::new(8, 4)).unwrap();
        mgr.allocate(1, &[1, 2, 3], None).unwrap();
        let mut plan = Plan::new();
        mgr.plan(&[1], &[3], &mut plan).unwrap();
        assert_eq!(plan.batch_size(), 1);
        assert!(mgr.plan(&[1], &[4], &mut plan).is_err());
        assert_eq!(plan.batch_size(), 0);
        mgr.step(&[1], &[4], &mut plan).unwrap();
        assert_eq!(plan.positions, vec![3]);
        assert_eq!(
            mgr.step(&[2], &[4], &mut plan),
            Err(Error::UnknownSequence(2))
        );
        assert_eq!(plan.batch_size(), 0);
        assert!(plan.block_tables().unwrap().is_empty());
        mgr.check().unwrap();
    }

    /// An operation on a manager, between two steps of a batch.
    type Op = fn(&BlockManager);

    /// A persistent batch that checks only what its last step left (rows in shards nothing
    /// else locked since) decides exactly as a new batch, which checks every row, whatever
    /// other operations run between its steps.
    #[test]
    fn a_kept_batch_decides_as_a_new_one() {
        let ops: [(&str, Op); 14] = [
            ("nothing", |_| {}),
            ("nothing again", |_| {}),
            ("append", |m| m.append(2, &[7]).unwrap()),
            ("plan the append", |m| {
                prefill(m, &[2]);
            }),
            ("fork", |m| m.fork(1, 9).unwrap()),
            ("free the fork", |m| m.free(9).unwrap()),
            ("swap out", |m| drop(m.swap_out(&[3]).unwrap())),
            ("confirm it", |m| m.confirm_swap_out(&[3]).unwrap()),
            ("swap in", |m| {
                m.swap_in(&[3]).unwrap();
                m.confirm_swap_in(&[3]).unwrap();
            }),
            ("replace", |m| {
                m.free(2).unwrap();
                m.allocate(2, &[5, 6, 7, 8, 9], None).unwrap();
                prefill(m, &[2]);
            }),
            ("replan", |m| {
                let mut plan = Plan::new();
                m.plan(&[1], &[2], &mut plan).unwrap();
            }),
            ("commit", |m| m.commit(&[1, 2, 3], None).unwrap()),
            ("reset", |m| m.reset_prefix_cache()),
            ("nothing at last", |_| {}),
        ];
        // Without prefix caching, and with it (a row with a block to register is checked in
        // full); each operation runs at several offsets into a block.
        for (caching, steps) in [(false, 3), (false, 5), (true, 3), (true, 5)] {
            kept_decides_as_fresh(&ops, caching, steps);
        }
    }

    /// [`a_kept_batch_decides_as_a_new_one`] with `steps` steps after each operation.
    fn kept_decides_as_fresh(ops: &[(&str, Op)], caching: bool, steps: usize) {
        let managers = [(); 2].map(|_| {
            let m = manager(64, 4, |c| {
                c.num_cpu_blocks = 32;
                c.enable_prefix_caching = caching;
            });
            for seq in 1..=3 {
                m.allocate(seq, &[seq as Token; 6], None).unwrap();
            }
            prefill(&m, &[1, 2, 3]);
            m
        });
        let [kept_mgr, fresh_mgr] = &managers;
        let mut kept = Batch::new();
        for seq in 1..=3 {
            kept.add(seq).unwrap();
        }
        let mut token = 100;
        for &(name, op) in ops {
            for step in 0..steps {
                if step == 0 {
                    op(kept_mgr);
                    op(fresh_mgr);
                }
                token += 1;
                let mut fresh = Batch::new();
                for &seq in kept.seqs() {
                    fresh.add(seq).unwrap();
                }
                let tokens = [token; 3];
                let (a, b) = (
                    kept_mgr.step_batch(&mut kept, &tokens),
                    fresh_mgr.step_batch(&mut fresh, &tokens),
                );
                assert_eq!(a, b, "{name}, step {step}, caching {caching}");
                let (mut pa, mut pb) = (Plan::new(), Plan::new());
                kept.write_plan(&mut pa);
                fresh.write_plan(&mut pb);
                if a.is_ok() {
                    assert_eq!(pa, pb, "{name}, step {step}, caching {caching}");
                }
                // An audit only reads: the kept batch still skips what it kept.
                kept_mgr.check().unwrap();
                fresh_mgr.check().unwrap();
            }
        }
        assert_eq!(kept_mgr.stats(), fresh_mgr.stats());
    }

    /// The blocks a decode step registers together (eight at a time on AVX2, the rest one by
    /// one) publish the hashes `block_hashes` computes.
    #[test]
    fn blocks_hashed_together_publish_their_hashes() {
        let mgr = manager(256, 16, |c| c.enable_events = true);
        let seqs: Vec<SeqId> = (1..=11).collect();
        let prompts: Vec<Vec<Token>> = seqs
            .iter()
            .map(|&seq| (0..31).map(|t| (seq as Token) * 1000 + t).collect())
            .collect();
        for (&seq, prompt) in seqs.iter().zip(&prompts) {
            mgr.allocate(seq, prompt, None).unwrap();
        }
        let mut batch = Batch::new();
        for &seq in &seqs {
            batch.add(seq).unwrap();
        }
        prefill(&mgr, &seqs);
        // The first step commits the prefill (block 0 of each); the one token it adds fills
        // block 1, which the next step registers: eleven blocks hashed in one first pass.
        for token in [5, 6] {
            mgr.step_batch(&mut batch, &vec![token; seqs.len()])
                .unwrap();
        }
        let published: std::collections::HashMap<_, _> = (mgr.take_events().into_iter())
            .filter_map(|event| match event.kind {
                crate::EventKind::BlockStored {
                    block_id,
                    block_hash,
                    ..
                } => Some((block_id, block_hash)),
                _ => None,
            })
            .collect();
        for (&seq, prompt) in seqs.iter().zip(&prompts) {
            let tokens: Vec<Token> = prompt.iter().copied().chain([5]).collect();
            let table = mgr.block_table(seq).unwrap();
            let hashes: Vec<_> = table[..2].iter().map(|b| published[b]).collect();
            assert_eq!(
                hashes,
                mgr.block_hashes(&tokens, None).unwrap(),
                "sequence {seq}"
            );
        }
        mgr.check().unwrap();
    }

    /// A batch stepped on one manager and then on another checks every row on the second.
    #[test]
    fn a_batch_on_another_manager_checks_every_row() {
        let [first, second] = [(); 2].map(|_| {
            let m = manager(16, 4, |c| c.num_cpu_blocks = 8);
            m.allocate(1, &[1, 2, 3, 4, 5], None).unwrap();
            prefill(&m, &[1]);
            m
        });
        let mut batch = Batch::new();
        batch.add(1).unwrap();
        first.step_batch(&mut batch, &[6]).unwrap();
        // The second manager's shard was locked as often, plus once by the swap: the step's
        // lock is one more than the first manager's last step saw.
        second.swap_out(&[1]).unwrap();
        assert_eq!(
            second.step_batch(&mut batch, &[7]),
            Err(Error::SwappedOut(1))
        );
        first.step_batch(&mut batch, &[7]).unwrap();
        assert_eq!(first.num_tokens(1).unwrap(), 7);
        first.check().unwrap();
        second.check().unwrap();
    }

    #[test]
    fn queries_may_not_skip_unplanned_tokens() {
        let mgr = manager(16, 4, |_| {});
        mgr.allocate(1, &(1..=9).collect::<Vec<_>>(), None).unwrap();
        let mut plan = Plan::new();
        assert!(is_invalid(mgr.step(&[1], &[10], &mut plan)));
        assert!(is_invalid(mgr.plan(&[1], &[1], &mut plan)));
        assert!(is_invalid(mgr.plan(&[1], &[5], &mut plan)));
        assert_eq!(mgr.num_tokens(1).unwrap(), 9);
        assert_eq!(plan.batch_size(), 0);
        mgr.check().unwrap();
        // A chunked prefill: the first chunk, then the rest.
        mgr.plan(&[1], &[9], &mut plan).unwrap();
        mgr.append(1, &[10, 11, 12]).unwrap();
        assert!(is_invalid(mgr.plan(&[1], &[1], &mut plan)));
        assert!(is_invalid(mgr.step(&[1], &[13], &mut plan)));
        mgr.plan(&[1], &[3], &mut plan).unwrap();
        assert_eq!(plan.positions, vec![9, 10, 11]);
        mgr.step(&[1], &[13], &mut plan).unwrap();
        assert_eq!(plan.positions, vec![12]);
        // Re-planning already planned tokens is allowed (a recomputation); its auto-commit
        // confirms the step before it.
        mgr.plan(&[1], &[13], &mut plan).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 13);
        mgr.check().unwrap();
    }
}
