//! `check`: the manager's invariant auditor, over the pools' audits and every sequence.

use crate::error::violated;
use crate::manager::BlockManager;
use crate::pool::PoolAudit;
use crate::prefix::block_hash_of;
use crate::sequence::ReadAll;
use crate::stats::Counters;
use crate::{BlockId, Error};

/// What the audited sequences hold, block by block, summed over the groups sharing the pools.
struct Holders {
    gpu_refs: Vec<u32>,
    gpu_fill: Vec<u32>,
    cpu_refs: Vec<u32>,
}

impl BlockManager {
    /// Verifies every invariant (block counts, refcount == holders, free list and cache
    /// membership, prefix map <-> hashed blocks, token counts, the KV lifecycle); reports the
    /// first violation.
    pub fn check(&self) -> Result<(), Error> {
        BlockManager::check_groups(&[self])
    }

    /// [`BlockManager::check`] of the groups of one hybrid manager, which share the pools and
    /// the prefix cache.
    pub(crate) fn check_groups(groups: &[&BlockManager]) -> Result<(), Error> {
        let this = groups[0];
        let seqs: Vec<_> = groups.iter().map(|g| g.seqs.read_all()).collect();
        let regions = this.prefix.as_ref().map(|p| p.lock_all());
        let gpu = this.gpu.audit();
        let cpu = this.cpu.audit();
        let mut holders = Holders {
            gpu_refs: vec![0u32; gpu.states.len()],
            gpu_fill: vec![0u32; gpu.states.len()],
            cpu_refs: vec![0u32; cpu.states.len()],
        };
        for (group, batch) in groups.iter().zip(&seqs) {
            group.audit_sequences(batch, &gpu, &mut holders)?;
        }
        let Holders {
            gpu_refs,
            gpu_fill,
            cpu_refs,
        } = holders;
        for (pool, audit, refs) in [("GPU", &gpu, &gpu_refs), ("CPU", &cpu, &cpu_refs)] {
            let mut listed = vec![false; audit.states.len()];
            for &block in &audit.free {
                if std::mem::replace(&mut listed[block as usize], true) {
                    return Err(violated(block, format!("twice in the {pool} free list")));
                }
                if !audit.states[block as usize].free() {
                    return Err(violated(block, "in the free list but not FREE"));
                }
            }
            for &block in &audit.cached {
                if std::mem::replace(&mut listed[block as usize], true) {
                    return Err(violated(block, "both free and cached, or cached twice"));
                }
                if !audit.states[block as usize].cached() {
                    return Err(violated(block, "in the eviction list but not CACHED"));
                }
            }
            for (b, (state, &holders)) in audit.states.iter().zip(refs.iter()).enumerate() {
                if state.refcount() != holders {
                    return Err(violated(
                        b as BlockId,
                        format!("{pool} refcount {} but {holders} holders", state.refcount()),
                    ));
                }
                if holders == 0 && !listed[b] {
                    return Err(violated(
                        b as BlockId,
                        "unreferenced but neither free nor cached",
                    ));
                }
            }
            if audit.num_cached != audit.cached.len() {
                return Err(Error::InvariantViolated(format!(
                    "{pool} cached count {} but {} in the eviction list",
                    audit.num_cached,
                    audit.cached.len()
                )));
            }
            if audit.available != audit.free.len() + audit.cached.len() {
                return Err(Error::InvariantViolated(format!(
                    "{pool} available {} but {} free + {} cached",
                    audit.available,
                    audit.free.len(),
                    audit.cached.len()
                )));
            }
        }
        let stored: usize = gpu_fill
            .iter()
            .zip(&gpu_refs)
            .filter(|(_, &refs)| refs > 0)
            .map(|(&f, _)| f as usize)
            .sum();
        if stored != gpu.stored_tokens {
            return Err(Error::InvariantViolated(format!(
                "stored tokens {} but held blocks hold {stored}",
                gpu.stored_tokens
            )));
        }
        for group in groups {
            for (block, _) in group.cpu_tier.blocks() {
                if cpu_refs.get(block as usize).copied().unwrap_or(0) == 0 {
                    return Err(violated(block, "announced in the CPU tier but not held"));
                }
            }
        }
        let hashed = gpu.states.iter().filter(|s| s.hashed()).count();
        if let (Some(prefix), Some(regions)) = (&this.prefix, &regions) {
            let mut mapped = 0;
            for region in regions {
                for block in region.blocks() {
                    mapped += 1;
                    let key = prefix.key_of(block);
                    let found = region.get(key, |block| prefix.key_of(block));
                    if !gpu.states[block as usize].hashed() || found != Some(block) {
                        return Err(violated(
                            block,
                            "mapped in the prefix cache but not registered there",
                        ));
                    }
                }
            }
            if mapped != hashed {
                return Err(Error::InvariantViolated(format!(
                    "{hashed} hashed blocks but {mapped} prefix-cache entries"
                )));
            }
        } else if hashed != 0 {
            return Err(Error::InvariantViolated(format!(
                "{hashed} hashed blocks without prefix caching"
            )));
        }
        Ok(())
    }

    /// Checks this group's sequences and adds what they hold to `holders`.
    fn audit_sequences(
        &self,
        batch: &ReadAll<'_>,
        gpu: &PoolAudit,
        holders: &mut Holders,
    ) -> Result<(), Error> {
        let bs = self.bs;
        let (mut computed_tokens, mut pending_tokens) = (0u64, 0u64);
        for (&id, s) in batch.iter() {
            let len = s.tokens.len();
            let err = |msg: String| Error::InvariantViolated(format!("sequence {id}: {msg}"));
            if s.first + s.table.len() != bs.pages(len) {
                return Err(err(format!("{} blocks for {len} tokens", s.table.len())));
            }
            if !(s.computed <= s.planned && s.planned <= len) {
                return Err(err(format!(
                    "computed {} <= planned {} <= {len} tokens fails",
                    s.computed, s.planned
                )));
            }
            if s.registered > bs.index(s.computed) {
                return Err(err(format!(
                    "{} blocks registered but only {} tokens computed",
                    s.registered, s.computed
                )));
            }
            if self.prefix.is_some()
                && !(s.registered <= s.hashes.len()
                    && s.hashes.len() <= bs.index(len)
                    && s.keys.len() == s.hashes.len())
            {
                return Err(err(format!("{} hashes for {len} tokens", s.hashes.len())));
            }
            if s.swapped
                && (s.planned != s.computed || !s.copies.is_empty() || !s.copying.is_empty())
            {
                return Err(err("swapped out with a plan or a copy in flight".into()));
            }
            if let Some((first, _)) = s.loading {
                if s.computed != first * bs.get() || s.planned != s.computed {
                    return Err(err("planned or computed past its external loads".into()));
                }
            }
            computed_tokens += s.computed as u64;
            pending_tokens += (len - s.computed) as u64;
            // A windowed sequence rolled back to the block its next query starts at holds none.
            let private_tail = s.swapped || s.shared_tail || bs.offset(len) == 0;
            if let Some(&tail) = s.table.last().filter(|_| !private_tail) {
                if gpu.states[tail as usize].refcount() != 1 {
                    return Err(err(format!(
                        "partial last block {tail} shared but not marked"
                    )));
                }
            }
            let gpu_fill = &mut holders.gpu_fill;
            let mut hold = |refs: &mut Vec<u32>, block: BlockId, fill: Option<u32>| {
                let Some(count) = refs.get_mut(block as usize) else {
                    return Err(err(format!("block {block} out of range")));
                };
                *count += 1;
                if let Some(fill) = fill {
                    let before = std::mem::replace(&mut gpu_fill[block as usize], fill);
                    if before != fill && *count > 1 {
                        return Err(err(format!(
                            "holders of block {block} disagree on its tokens"
                        )));
                    }
                }
                Ok(())
            };
            for (i, &block) in (s.first..).zip(&s.table) {
                if s.swapped {
                    hold(&mut holders.cpu_refs, block, None)?;
                    continue;
                }
                hold(&mut holders.gpu_refs, block, Some(bs.fill(i, len)))?;
                let state = gpu.states[block as usize];
                if state.hashed() {
                    // A sequence waiting for its swap-in may still hold a registered block:
                    // a sharer swapped in with it confirmed the block's copy.
                    if (i + 1) * bs.get() > s.computed {
                        return Err(err(format!(
                            "block {block} is shared but its KV is not computed"
                        )));
                    }
                    if let Some(prefix) = &self.prefix {
                        if prefix.hash_of(block) != block_hash_of(&s.hashes[i]) {
                            return Err(err(format!(
                                "block {block} registered under another hash"
                            )));
                        }
                    }
                }
                if ((i + 1) * bs.get()).min(len) > s.computed && state.refcount() != 1 {
                    return Err(err(format!("block {block} holds pending KV but is shared")));
                }
            }
            match &s.swap_source {
                Some(source) if s.swapped => {
                    for (i, &block) in (s.first..).zip(source) {
                        hold(&mut holders.gpu_refs, block, Some(bs.fill(i, len)))?;
                    }
                }
                Some(source) => {
                    for &block in source {
                        hold(&mut holders.cpu_refs, block, None)?;
                    }
                }
                None => {}
            }
            for copy in s.copies.iter().chain(&s.copying) {
                hold(&mut holders.gpu_refs, copy.src, Some(copy.fill))?;
            }
        }
        for (name, counted, summed) in [
            ("computed", &self.counters.computed_tokens, computed_tokens),
            ("pending", &self.counters.pending_tokens, pending_tokens),
        ] {
            if Counters::get(counted) != summed {
                return Err(Error::InvariantViolated(format!(
                    "{name} tokens {} but the sequences hold {summed}",
                    Counters::get(counted)
                )));
            }
        }
        Ok(())
    }
}
