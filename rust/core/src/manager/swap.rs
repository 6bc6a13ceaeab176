//! Swapping: sequences move between the GPU and CPU pools in two phases (the copy pairs, then
//! the engine's confirmation), and confirmed swap-outs are announced in the CPU tier.

use std::collections::{HashMap, HashSet};

use crate::error::invalid;
use crate::events::EventKind;
use crate::manager::{not_loading, visit, BlockManager, Taken};
use crate::prefix::block_hash_of;
use crate::sequence::{LockedBatch, Sequence};
use crate::{BlockId, Error, PoolKind, SeqId};

/// Which way a swap moves its sequences.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// From the GPU pool to the CPU pool.
    Out,
    /// From the CPU pool back to the GPU pool.
    In,
}

impl BlockManager {
    /// Moves the sequences to the CPU pool; returns the `[gpu, cpu]` block pairs to copy (a
    /// block shared by several of them is copied once). The GPU blocks stay held until
    /// [`BlockManager::confirm_swap_out`] says the copy ran.
    pub fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<[BlockId; 2]>, Error> {
        self.swap(seqs, Direction::Out)
    }

    /// Brings swapped-out sequences back to the GPU pool; returns the `[cpu, gpu]` pairs. The
    /// CPU blocks stay held, and the GPU blocks unshared, until
    /// [`BlockManager::confirm_swap_in`] says the copy ran.
    pub fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<[BlockId; 2]>, Error> {
        self.swap(seqs, Direction::In)
    }

    /// The engine copied the pairs of `swap_out(seqs)`: their GPU blocks are released.
    pub fn confirm_swap_out(&self, seqs: &[SeqId]) -> Result<(), Error> {
        self.confirm_swap(seqs, Direction::Out)
    }

    /// The engine copied the pairs of `swap_in(seqs)`: their CPU blocks are released and
    /// their computed full blocks become shareable.
    pub fn confirm_swap_in(&self, seqs: &[SeqId]) -> Result<(), Error> {
        self.confirm_swap(seqs, Direction::In)
    }

    /// Announces a swapped-out sequence's computed full blocks in the CPU tier.
    fn announce_cpu(&self, s: &mut Sequence) {
        let Some(prefix) = &self.prefix else {
            return;
        };
        if !self.publishes() {
            return;
        }
        let bs = self.bs.get();
        let full = self.bs.index(s.computed);
        self.hash_blocks(prefix, s, full);
        for i in s.first..full {
            let (block, hash) = (s.block(i), block_hash_of(&s.hashes[i]));
            self.cpu_tier.add(block, hash, || {
                self.events.record(|| EventKind::BlockStored {
                    block_hash: hash,
                    parent_hash: s.parent_hash(i),
                    token_ids: s.tokens[i * bs..(i + 1) * bs].to_vec(),
                    block_id: block,
                    medium: PoolKind::Cpu,
                    salt: s.extra.salt.clone(),
                    lora_name: s.extra.lora_name.clone(),
                    extra_keys: s.extra.of_block(i, bs),
                })
            });
        }
    }

    /// `swap_out` and `swap_in`: the sequences move to fresh blocks of the other pool; their old
    /// blocks stay held until the swap is confirmed.
    fn swap(&self, seqs: &[SeqId], direction: Direction) -> Result<Vec<[BlockId; 2]>, Error> {
        let to_gpu = direction == Direction::In;
        let mut batch = self.seqs.lock(seqs);
        let order = self.swap_order(&mut batch, seqs, direction)?;
        if !to_gpu {
            for &id in seqs {
                self.count_computed(self.auto_commit(batch.get(id).expect("validated above")));
            }
        }
        let (to, kind) = if to_gpu {
            (&self.gpu, PoolKind::Gpu)
        } else {
            (&self.cpu, PoolKind::Cpu)
        };
        to.reserve(order.len())
            .map_err(|available| Error::OutOfBlocks {
                pool: kind,
                needed: order.len(),
                available,
            })?;
        let mut taken = Taken::default();
        let pairs: Vec<[BlockId; 2]> = order
            .iter()
            .map(|&block| {
                let target = if to_gpu {
                    self.take(&mut taken)
                } else {
                    self.cpu.take_reserved().0
                };
                [block, target]
            })
            .collect();
        self.finish_taking(taken.blocks, taken);
        let target_of: HashMap<BlockId, BlockId> = pairs.iter().map(|&[b, t]| (b, t)).collect();
        // Each target starts with one holder; every further reference adds one.
        let mut referenced = HashSet::with_capacity(pairs.len());
        for &id in seqs {
            let s = batch.get(id).expect("validated above");
            let len = s.tokens.len();
            let source = s.table.clone();
            let first = s.first;
            for (j, block) in s.table.iter_mut().enumerate() {
                let target = target_of[block];
                if !referenced.insert(target) {
                    to.share_held(target);
                } else if to_gpu {
                    self.gpu.add_stored(self.bs.fill(first + j, len) as usize);
                }
                *block = target;
            }
            s.swap_source = Some(source);
            s.table_changed();
            s.swapped = !to_gpu;
            // Sequences swapped together keep sharing the blocks they shared.
            s.shared_tail = true;
            if to_gpu {
                // Fresh blocks: registered again once the copy-in is confirmed.
                s.registered = 0;
            }
        }
        Ok(pairs)
    }

    /// Checks a swap of `seqs` and lists the distinct blocks it copies. Changes nothing.
    fn swap_order(
        &self,
        batch: &mut LockedBatch<'_>,
        seqs: &[SeqId],
        direction: Direction,
    ) -> Result<Vec<BlockId>, Error> {
        let to_gpu = direction == Direction::In;
        let stamp = self.next_stamp();
        // Distinct blocks in order of first appearance: a shared block is copied once.
        let mut order: Vec<BlockId> = Vec::new();
        let mut distinct = HashSet::new();
        for &id in seqs {
            let member = visit(batch, id, stamp, to_gpu)?;
            let s = batch.at(member);
            if s.swap_source.is_some() {
                let pending = if to_gpu { "swap-out" } else { "swap-in" };
                return Err(invalid(format!(
                    "sequence {id}: confirm its {pending} before swapping it again"
                )));
            }
            if !to_gpu {
                not_loading(id, s)?;
                let in_flight =
                    !self.config.auto_commit && (s.planned != s.computed || !s.copying.is_empty());
                if in_flight || !s.copies.is_empty() {
                    return Err(invalid(format!(
                        "sequence {id}: plan and commit its pending work before swapping it out"
                    )));
                }
            }
            order.extend(s.table.iter().filter(|&&block| distinct.insert(block)));
        }
        Ok(order)
    }

    /// Blocks of the other pool a swap of `seqs` would take (an error if it cannot run). A
    /// swap-out auto-commits its sequences here, as `swap_out` does before it counts, so the
    /// commits stand even if the pool then lacks blocks.
    pub(super) fn swap_needs(&self, seqs: &[SeqId], to_gpu: bool) -> Result<usize, Error> {
        let direction = if to_gpu {
            Direction::In
        } else {
            Direction::Out
        };
        let mut batch = self.seqs.lock(seqs);
        let needed = self.swap_order(&mut batch, seqs, direction)?.len();
        if !to_gpu {
            for &id in seqs {
                self.count_computed(self.auto_commit(batch.get(id).expect("validated above")));
            }
        }
        Ok(needed)
    }

    /// `confirm_swap_out` and `confirm_swap_in`.
    fn confirm_swap(&self, seqs: &[SeqId], direction: Direction) -> Result<(), Error> {
        let to_gpu = direction == Direction::In;
        let stamp = self.next_stamp();
        let mut batch = self.seqs.lock(seqs);
        for &id in seqs {
            let member = visit(&mut batch, id, stamp, !to_gpu)?;
            if batch.at(member).swap_source.is_none() {
                let what = if to_gpu { "swap-in" } else { "swap-out" };
                return Err(invalid(format!("sequence {id} has no {what} to confirm")));
            }
        }
        for &id in seqs {
            let s = batch.get(id).expect("validated above");
            let source = s.swap_source.take().expect("validated above");
            if to_gpu {
                self.release_cpu_blocks(&source);
                self.commit_to(s, s.computed);
            } else {
                self.release_gpu_blocks(&source, s.first, s.first, s.tokens.len());
                self.announce_cpu(s);
            }
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::manager::testing::*;
    use crate::{Error, PoolKind, Token};

    #[test]
    fn swaps_hold_their_sources_until_confirmed() {
        let mgr = manager(4, 4, |c| {
            c.num_cpu_blocks = 4;
            c.enable_events = true;
        });
        let prompt: Vec<Token> = (1..=9).collect();
        mgr.allocate(1, &prompt, None).unwrap();
        prefill(&mgr, &[1]);
        mgr.commit(&[1], None).unwrap();
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Gpu, 0, true), (PoolKind::Gpu, 1, true)]
        );
        assert_eq!(mgr.swap_out(&[1]).unwrap(), vec![[0, 0], [1, 1], [2, 2]]);
        mgr.check().unwrap();
        assert_eq!(mgr.block_table(1), Err(Error::SwappedOut(1)));
        // The GPU blocks are held until the copy is confirmed.
        assert_eq!(mgr.stats().num_held, 3);
        assert_eq!(
            mgr.allocate(2, &(100..108).collect::<Vec<_>>(), None),
            Err(Error::OutOfBlocks {
                pool: PoolKind::Gpu,
                needed: 2,
                available: 1
            })
        );
        assert!(is_invalid(mgr.swap_in(&[1])));
        assert_eq!(mgr.confirm_swap_in(&[1]), Err(Error::SwappedOut(1)));
        assert!(
            mgr.take_events().is_empty(),
            "the CPU tier waits for the copy"
        );
        mgr.confirm_swap_out(&[1]).unwrap();
        mgr.check().unwrap();
        assert!(is_invalid(mgr.confirm_swap_out(&[1])));
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Cpu, 0, true), (PoolKind::Cpu, 1, true)]
        );
        let st = mgr.stats();
        assert_eq!((st.num_held, st.num_cached, st.num_free), (0, 2, 2));

        // Evict the cached copies, so only the swap-in could serve the prefix.
        mgr.allocate(2, &(100..116).collect::<Vec<_>>(), None)
            .unwrap();
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Gpu, 1, false), (PoolKind::Gpu, 0, false)]
        );
        mgr.free(2).unwrap();
        mgr.check().unwrap();

        let pairs = mgr.swap_in(&[1]).unwrap();
        mgr.check().unwrap();
        let table = mgr.block_table(1).unwrap();
        assert_eq!(
            pairs.iter().map(|p| p[0]).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(pairs.iter().map(|p| p[1]).collect::<Vec<_>>(), table);
        // Not hittable, forkable or swappable until the copy-in is confirmed.
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 0);
        assert!(is_invalid(mgr.fork(1, 3)));
        assert!(is_invalid(mgr.swap_out(&[1])));
        assert_eq!(mgr.confirm_swap_out(&[1]), Err(Error::NotSwappedOut(1)));
        assert!(mgr.take_events().is_empty());
        mgr.confirm_swap_in(&[1]).unwrap();
        mgr.check().unwrap();
        assert!(is_invalid(mgr.confirm_swap_in(&[1])));
        // The CPU copies leave (tail first), then the GPU blocks are registered.
        assert_eq!(
            event_blocks(&mgr),
            vec![
                (PoolKind::Cpu, 1, false),
                (PoolKind::Cpu, 0, false),
                (PoolKind::Gpu, table[0], true),
                (PoolKind::Gpu, table[1], true),
            ]
        );
        assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 2);
        mgr.fork(1, 3).unwrap();
        mgr.check().unwrap();
    }

    #[test]
    fn confirming_one_of_two_swapped_in_sharers_registers_their_blocks() {
        let mgr = manager(8, 2, |c| c.num_cpu_blocks = 4);
        mgr.allocate(1, &[1, 2, 3], None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        mgr.swap_out(&[1, 2]).unwrap();
        mgr.confirm_swap_out(&[1, 2]).unwrap();
        mgr.reset_prefix_cache();
        let pairs = mgr.swap_in(&[1, 2]).unwrap();
        assert_eq!(pairs.len(), 2);
        mgr.confirm_swap_in(&[1]).unwrap();
        // Block 0's copy-in is confirmed through sequence 1, though 2 still waits for its own.
        assert_eq!(mgr.cached_prefix_blocks(&[1, 2, 3], None), 1);
        mgr.check().unwrap();
        mgr.free(1).unwrap();
        mgr.check().unwrap();
        mgr.confirm_swap_in(&[2]).unwrap();
        mgr.check().unwrap();
    }

    #[test]
    fn the_cpu_tier_announces_each_hash_once() {
        let mgr = manager(8, 4, |c| {
            c.num_cpu_blocks = 8;
            c.enable_events = true;
        });
        mgr.allocate(1, &(1..=9).collect::<Vec<_>>(), None).unwrap();
        prefill(&mgr, &[1]);
        mgr.fork(1, 2).unwrap();
        mgr.take_events();
        // Shared blocks are copied once.
        assert_eq!(mgr.swap_out(&[1, 2]).unwrap(), vec![[0, 0], [1, 1], [2, 2]]);
        mgr.confirm_swap_out(&[1, 2]).unwrap();
        mgr.check().unwrap();
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Cpu, 0, true), (PoolKind::Cpu, 1, true)]
        );
        mgr.free(1).unwrap();
        assert!(mgr.take_events().is_empty(), "sequence 2 still holds them");
        mgr.free(2).unwrap();
        mgr.check().unwrap();
        assert_eq!(
            event_blocks(&mgr),
            vec![(PoolKind::Cpu, 1, false), (PoolKind::Cpu, 0, false)]
        );
    }

    #[test]
    fn without_auto_commit_a_swap_out_waits_for_commit() {
        let mgr = manager(8, 4, |c| {
            c.num_cpu_blocks = 8;
            c.auto_commit = false;
        });
        mgr.allocate(1, &(1..=9).collect::<Vec<_>>(), None).unwrap();
        prefill(&mgr, &[1]);
        assert!(is_invalid(mgr.swap_out(&[1])));
        mgr.commit(&[1], None).unwrap();
        assert_eq!(mgr.swap_out(&[1]).unwrap().len(), 3);
        mgr.check().unwrap();
    }
}
