//! The KV lifecycle: `commit` (and auto-commit) makes planned KV computed, completes the copies
//! plans carried and registers newly computed full blocks; `confirm_loads` does it for external
//! loads.

use crate::error::invalid;
use crate::events::EventKind;
use crate::feed::Registration;
use crate::manager::{one_each, visit, BlockManager};
use crate::prefix::{block_hash_of, Chain, PrefixCache, UNPUBLISHED};
use crate::sequence::Sequence;
use crate::stats::Counters;
use crate::{BlockId, Error, PoolKind, SeqId, Token};

/// A sequence's pending external loads: its hit of `hit` blocks may grow by `count`, and the
/// blocks handed out to load are logical `start..hit + count`.
pub(super) struct Loads {
    pub(super) hit: usize,
    pub(super) count: usize,
    pub(super) start: usize,
}

impl Loads {
    /// How many blocks were handed out to load.
    pub(super) fn handed_out(&self) -> usize {
        self.hit + self.count - self.start
    }
}

impl BlockManager {
    /// Confirms that the first `loaded` blocks handed out by `allocate_loading` hold their KV
    /// (at most the `n` blocks past the hit it was asked for; a windowed manager handed out
    /// fewer, and `loaded` beyond them counts as all of them). The prompt's hit grows by the
    /// longest run those blocks serve (see [`BlockManager::served_loads`]); its KV becomes
    /// computed and shareable, the rest stays pending, to be recomputed.
    pub fn confirm_loads(&self, seq: SeqId, loaded: usize) -> Result<(), Error> {
        let mut one = self.seqs.lock_one(seq);
        let s = one.get().ok_or(Error::UnknownSequence(seq))?;
        let loads = self.pending_loads(seq, s)?;
        if loaded > loads.count {
            return Err(invalid(format!(
                "sequence {seq} was handed {} blocks to load, not {loaded}",
                loads.count
            )));
        }
        let run = loaded.min(loads.handed_out());
        let upto = (loads.hit..=loads.hit + loads.count)
            .rev()
            .find(|&upto| self.served_loads(&loads, run, upto))
            .expect("the hit itself is served");
        self.finish_loads(s, upto);
        Ok(())
    }

    /// The external loads `s` (sequence `seq`) waits for; fails if it waits for none.
    pub(super) fn pending_loads(&self, seq: SeqId, s: &Sequence) -> Result<Loads, Error> {
        let Some((hit, count)) = s.loading else {
            return Err(invalid(format!(
                "sequence {seq} has no external loads to confirm"
            )));
        };
        let start = self.load_start(hit, count);
        Ok(Loads { hit, count, start })
    }

    /// The first logical block to load past a hit of `hit` blocks extended by `count`: the
    /// hit, or with windowed attention the first block the query at the extended hit reads.
    pub(super) fn load_start(&self, hit: usize, count: usize) -> usize {
        let end = hit + count;
        match count {
            0 => hit,
            _ => hit.max(
                self.bs
                    .index(self.config.attention.first_key(end * self.bs.get())),
            ),
        }
    }

    /// Whether a hit of `upto` blocks is served when the first `run` blocks handed out to
    /// load hold their KV: every block a query at `upto` reads from `loads.hit` on is loaded
    /// (the hit itself always is).
    pub(super) fn served_loads(&self, loads: &Loads, run: usize, upto: usize) -> bool {
        let reads = self
            .bs
            .index(self.config.attention.first_key(upto * self.bs.get()));
        upto == loads.hit || (upto <= loads.start + run && loads.hit.max(reads) >= loads.start)
    }

    /// Ends `s`'s external loads with a hit of `upto` blocks: its KV is computed up to there;
    /// blocks the loads skipped (before a window's first loaded block) are never registered.
    pub(super) fn finish_loads(&self, s: &mut Sequence, upto: usize) {
        let (hit, count) = s.loading.take().expect("waits for loads");
        if upto > hit {
            s.registered = s.registered.max(self.load_start(hit, count));
        }
        let tokens = upto * self.bs.get();
        s.planned = s.planned.max(tokens);
        self.commit_to(s, tokens);
        let loaded = upto - hit;
        let hit_tokens = (loaded * self.bs.get()) as u64;
        Counters::add(&self.counters.external_hit_tokens, hit_tokens);
        Counters::add(&self.counters.prefix_hit_tokens, hit_tokens);
        Counters::add(&self.counters.external_failures, (count - loaded) as u64);
    }

    /// Confirms the engine's forward passes: each sequence's KV is computed up to `upto[i]`
    /// tokens (`None`: up to the end of its latest plan). Copies that plans carried are done,
    /// and newly computed full blocks become shareable. Counts may not exceed what was planned;
    /// counts below what is already computed change nothing.
    pub fn commit(&self, seqs: &[SeqId], upto: Option<&[usize]>) -> Result<(), Error> {
        if let Some(upto) = upto {
            one_each("commit", seqs.len(), upto.len(), "token counts")?;
        }
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        let mut members = Vec::with_capacity(seqs.len());
        for (b, &id) in seqs.iter().enumerate() {
            let member = visit(&mut batch, id, stamp, false)?;
            let s = batch.at(member);
            if let Some(n) = upto.map(|u| u[b]) {
                if n > s.planned {
                    return Err(invalid(format!(
                        "sequence {id}: cannot commit {n} tokens, only {} are planned",
                        s.planned
                    )));
                }
            }
            members.push(member);
        }
        let mut computed = 0;
        for (b, &member) in members.iter().enumerate() {
            let s = batch.at(member);
            let n = upto.map_or(s.planned, |u| u[b]);
            computed += self.commit_uncounted(s, n);
        }
        self.count_computed(computed);
        Ok(())
    }

    /// Tokens of the sequence whose KV is computed.
    pub fn num_computed(&self, seq: SeqId) -> Result<usize, Error> {
        let one = self.seqs.lock_one(seq);
        Ok(one.get_ref().ok_or(Error::UnknownSequence(seq))?.computed)
    }

    /// With `auto_commit`, a call naming a sequence first commits its latest plan. Returns the
    /// tokens that became computed, for [`BlockManager::count_computed`].
    #[inline(always)]
    pub(super) fn auto_commit(&self, s: &mut Sequence) -> u64 {
        if self.config.auto_commit {
            self.commit_uncounted(s, s.planned)
        } else {
            0
        }
    }

    /// Commits `s` up to `upto` and counts them in the token gauges.
    pub(super) fn commit_to(&self, s: &mut Sequence, upto: usize) {
        let computed = self.commit_uncounted(s, upto);
        self.count_computed(computed);
    }

    /// Moves `tokens` from the pending gauge to the computed one: once per call, not per
    /// sequence, so a batch pays two atomic additions however large it is.
    pub(super) fn count_computed(&self, tokens: u64) {
        if tokens > 0 {
            Counters::add(&self.counters.computed_tokens, tokens);
            Counters::sub(&self.counters.pending_tokens, tokens);
        }
    }

    /// Marks the sequence's KV computed up to `upto` (at most `planned`), completes the copies
    /// of committed plans and registers the newly computed full blocks. Returns the tokens that
    /// became computed; the caller counts them ([`BlockManager::count_computed`]).
    #[inline(always)]
    fn commit_uncounted(&self, s: &mut Sequence, upto: usize) -> u64 {
        debug_assert!(upto <= s.planned);
        let mut computed = 0;
        if upto > s.computed {
            computed = (upto - s.computed) as u64;
            s.computed = upto;
        }
        if !s.copying.is_empty() {
            let computed = s.computed;
            s.copying.retain(|copy| {
                let done = copy.until <= computed;
                if done {
                    self.gpu.release_block(copy.src, copy.fill);
                }
                !done
            });
        }
        let full = self.bs.index(s.computed);
        let registers = self.prefix.is_some() && !s.swapped && s.swap_source.is_none();
        if full > s.registered && registers && s.loading.is_none() {
            self.register_full(s, full);
        }
        computed
    }

    /// Hashes the sequence's full blocks `0..n` that are not hashed yet (chaining values and
    /// map keys). Only group 0 publishes hashes without the block feed: the chaining values of
    /// other groups' blocks then stay [`UNPUBLISHED`].
    pub(super) fn hash_blocks(&self, prefix: &PrefixCache, s: &mut Sequence, n: usize) {
        let bs = self.bs.get();
        while s.hashes.len() < n {
            let i = s.hashes.len();
            let tokens = &s.tokens[i * bs..(i + 1) * bs];
            let digest = s.extra.digest(i, bs);
            let key = prefix.key_block(prefix.link(s.parent_key(i), digest.as_ref()), tokens);
            s.hashes.push(match self.publishes_hashes() {
                true => prefix.hash_block(&s.parent_chain(i), tokens, digest.as_ref()),
                false => UNPUBLISHED,
            });
            s.keys.push(key);
        }
    }

    /// Registers the sequence's full blocks `registered..upto` (all computed) in the prefix
    /// cache, in logical order; a block whose parent block is not registered (its key was
    /// taken by another copy, or a reset withdrew it) is never registered.
    fn register_full(&self, s: &mut Sequence, upto: usize) {
        let Some(prefix) = &self.prefix else {
            return;
        };
        if s.registered >= upto {
            return;
        }
        self.hash_blocks(prefix, s, upto);
        // Blocks that left the attention window before their KV was computed were released
        // unregistered; they may reach past `upto`, whose parent key is then not hashed yet.
        let (from, bs) = (s.registered.max(s.first), self.bs.get());
        let announced = self.announces();
        for i in from..upto {
            let (block, key, chain) = (s.block(i), s.keys[i], &s.hashes[i]);
            let tokens = &s.tokens[i * bs..(i + 1) * bs];
            let parent = prefix.link(s.parent_key(i), s.extra.digest(i, bs).as_ref());
            // Announced blocks only under the sequence's own registered block (SEMANTICS.md,
            // "one tree"): it holds that block, so the parent outlives the child in the cache.
            let linked = || !announced || i == 0 || self.gpu.state(s.block(i - 1)).hashed();
            let publish = || self.publish(s, i, block, chain, tokens);
            let group = self.group;
            prefix.register(block, key, parent, chain, tokens, group, linked, publish);
        }
        s.registered = upto;
    }

    /// Publishes `s`'s full block `i` (`block`, of `chain` and `tokens`) once its registration
    /// is written: flags it hashed and records it in the block feed and its stored event.
    fn publish(&self, s: &Sequence, i: usize, block: BlockId, chain: &Chain, tokens: &[Token]) {
        self.gpu.mark_hashed(block);
        self.feed.record(|| Registration::Stored {
            group: self.group,
            block,
            hash: block_hash_of(chain),
        });
        if !self.announces() {
            return;
        }
        self.events.record(|| EventKind::BlockStored {
            block_hash: block_hash_of(chain),
            parent_hash: s.parent_hash(i),
            token_ids: tokens.to_vec(),
            block_id: block,
            medium: PoolKind::Gpu,
            salt: s.extra.salt.clone(),
            lora_name: s.extra.lora_name.clone(),
            extra_keys: s.extra.of_block(i, self.bs.get()),
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::manager::testing::*;
    use crate::{Error, Plan, PoolKind, Token};

    #[test]
    fn blocks_are_hittable_only_once_committed() {
        let mgr = manager(16, 4, |c| c.enable_events = true);
        let prompt: Vec<Token> = (1..=9).collect();
        assert_eq!(mgr.allocate(1, &prompt, None).unwrap(), 0);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 0);
        assert!(mgr.take_events().is_empty(), "allocate registers nothing");
        let plan = prefill(&mgr, &[1]);
        assert_eq!(plan.positions, (0..9).collect::<Vec<i32>>());
        // Planned is not computed: a second request still recomputes the prefix.
        assert_eq!(mgr.allocate(2, &prompt, None).unwrap(), 0);
        mgr.free(2).unwrap();
        let st = mgr.stats();
        assert_eq!((st.computed_tokens, st.pending_tokens), (0, 9));
        mgr.commit(&[1], None).unwrap();
        mgr.check().unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 9);
        let st = mgr.stats();
        assert_eq!((st.computed_tokens, st.pending_tokens), (9, 0));
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Gpu, 0, true), (PoolKind::Gpu, 1, true)]
        );
        assert_eq!(mgr.allocate(3, &prompt, None).unwrap(), 8);
        assert_eq!(mgr.block_table(3).unwrap()[..2], [0, 1]);
        mgr.check().unwrap();

        // Auto-commit: the next step's call commits the decode token planned by the last one.
        let mut plan = Plan::new();
        mgr.step(&[1], &[10], &mut plan).unwrap();
        mgr.step(&[1], &[11], &mut plan).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 10);
        assert_eq!(
            mgr.cached_prefix_blocks(&(1..=13).collect::<Vec<_>>(), None),
            2
        );
        mgr.step(&[1], &[12], &mut plan).unwrap();
        mgr.step(&[1], &[13], &mut plan).unwrap();
        assert_eq!(
            mgr.cached_prefix_blocks(&(1..=13).collect::<Vec<_>>(), None),
            3
        );
        mgr.check().unwrap();
    }

    #[test]
    fn without_auto_commit_only_commit_computes() {
        let mgr = manager(16, 4, |c| c.auto_commit = false);
        let prompt: Vec<Token> = (1..=9).collect();
        mgr.allocate(1, &prompt, None).unwrap();
        prefill(&mgr, &[1]);
        let mut plan = Plan::new();
        mgr.step(&[1], &[10], &mut plan).unwrap();
        mgr.append(1, &[11]).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 0);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 0);
        // Beyond what was planned (10 tokens) is refused, and changes nothing.
        assert!(is_invalid(mgr.commit(&[1], Some(&[11]))));
        assert!(is_invalid(mgr.commit(&[1], Some(&[4, 4]))));
        assert!(is_invalid(mgr.commit(&[1, 1], None)));
        assert_eq!(mgr.commit(&[7], None), Err(Error::UnknownSequence(7)));
        assert_eq!(mgr.num_computed(1).unwrap(), 0);
        mgr.commit(&[1], Some(&[5])).unwrap();
        mgr.check().unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 5);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 1);
        // A count below what is computed changes nothing.
        mgr.commit(&[1], Some(&[2])).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 5);
        mgr.commit(&[1], None).unwrap();
        assert_eq!(mgr.num_computed(1).unwrap(), 10);
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 2);
        let st = mgr.stats();
        assert_eq!((st.computed_tokens, st.pending_tokens), (10, 1));
        mgr.check().unwrap();
    }
}
