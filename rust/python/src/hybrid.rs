//! The `HybridManager` Python class: KV-cache groups over one pool (see
//! `pagedkv.HybridManager`); conversions only, like `BlockManager`'s.

use numpy::{IntoPyArray, PyArray1, PyArray2, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use pagedkv as core;

use crate::attention::Attention;
use crate::batch::Batch;
use crate::conversions::{
    blocks, integer, integers, pairs, salt_bytes, seq_id, seq_ids, to_py, token_ids, Count,
};
use crate::events::Event;
use crate::feed::Registration;
use crate::manager::{build_config, pool_kind, token_counts};
use crate::plan::{spare_plan, Plan, PlanPool};
use crate::state::StateConfig;
use crate::stats::{StateStats, Stats};

/// KV-cache groups of a hybrid model over one pool (see `pagedkv.HybridManager`).
#[pyclass(frozen, module = "pagedkv._core")]
pub(crate) struct HybridManager {
    inner: core::HybridManager,
    spare_plans: PlanPool,
}

impl HybridManager {
    /// One plan per group to fill, recycled where possible.
    fn fresh_plans(&self) -> Vec<core::Plan> {
        (0..self.inner.num_groups())
            .map(|_| spare_plan(&self.spare_plans))
            .collect()
    }

    fn hand_out(&self, plans: Vec<core::Plan>) -> Vec<Plan> {
        (plans.into_iter())
            .map(|plan| Plan::new(plan, self.spare_plans.clone()))
            .collect()
    }

    /// Runs `call` on the groups' batches, borrowed mutably, without the GIL.
    fn on_batches(
        &self,
        py: Python<'_>,
        batches: &Bound<'_, PyAny>,
        call: impl FnOnce(&mut [core::Batch]) -> Result<(), core::Error> + Send,
    ) -> PyResult<()> {
        let list: Vec<Bound<'_, Batch>> = batches.extract().map_err(|_| {
            PyValueError::new_err("batches must be a sequence of pagedkv.Batch, one per group")
        })?;
        let mut borrowed = Vec::with_capacity(list.len());
        for batch in &list {
            borrowed.push(batch.try_borrow_mut()?);
        }
        let mut cores: Vec<core::Batch> = (borrowed.iter_mut())
            .map(|b| std::mem::take(&mut b.inner))
            .collect();
        let result = py.detach(|| call(&mut cores));
        for (b, core) in borrowed.iter_mut().zip(cores) {
            b.inner = core;
        }
        result.map_err(to_py)
    }

    fn group(group: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(integer::<u64>(group, "group")? as usize)
    }
}

#[pymethods]
impl HybridManager {
    /// Groups attending as `groups` over one pool; see `pagedkv.HybridManager`.
    #[new]
    #[pyo3(signature = (num_blocks, block_size, groups, *,
        num_cpu_blocks = Count::Default(0), enable_prefix_caching = true, watermark = 0.01,
        hash_key = None, enable_events = false, auto_commit = true, state = None,
        block_feed = false),
        text_signature = "(num_blocks, block_size, groups, *, num_cpu_blocks=0, \
        enable_prefix_caching=True, watermark=0.01, hash_key=None, enable_events=False, \
        auto_commit=True, state=None, block_feed=False)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: Count<'_>,
        block_size: Count<'_>,
        groups: &Bound<'_, PyAny>,
        num_cpu_blocks: Count<'_>,
        enable_prefix_caching: bool,
        watermark: f64,
        hash_key: Option<&[u8]>,
        enable_events: bool,
        auto_commit: bool,
        state: Option<StateConfig>,
        block_feed: bool,
    ) -> PyResult<Self> {
        let groups: Vec<Attention> = groups
            .extract()
            .map_err(|_| PyValueError::new_err("groups must be a sequence of pagedkv.Attention"))?;
        let config = build_config(
            num_blocks,
            block_size,
            num_cpu_blocks,
            enable_prefix_caching,
            watermark,
            hash_key,
            enable_events,
            auto_commit,
        )?;
        let config = core::Config {
            enable_block_feed: block_feed,
            ..config
        };
        let groups: Vec<core::Attention> = groups.iter().map(|g| g.inner).collect();
        let state = state.map(|s| s.inner);
        let inner = core::HybridManager::with_state(config, &groups, state).map_err(to_py)?;
        Ok(HybridManager {
            inner,
            spare_plans: PlanPool::default(),
        })
    }

    /// Number of groups.
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }

    /// Whether the manager has a state group.
    #[getter]
    fn has_state(&self) -> bool {
        self.inner.has_state()
    }

    /// The state group's working slot of the sequence.
    fn state_slot(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.inner.state_slot(self::seq_id(seq_id)?).map_err(to_py)
    }

    /// The state group's slot counts and checkpoint counters.
    fn state_stats(&self) -> PyResult<StateStats> {
        Ok(self.inner.state_stats().map_err(to_py)?.into())
    }

    /// Each group's attention.
    #[getter]
    fn groups(&self) -> Vec<Attention> {
        (0..self.inner.num_groups())
            .map(|g| Attention {
                inner: self.inner.attention(g).expect("in range"),
            })
            .collect()
    }

    /// Pages in the GPU pool (all groups together).
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.config().num_blocks
    }

    /// Token slots per page.
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.config().block_size
    }

    /// Pages in the CPU swap pool.
    #[getter]
    fn num_cpu_blocks(&self) -> u32 {
        self.inner.config().num_cpu_blocks
    }

    /// Admits a sequence in every group; returns the prompt tokens every group reuses.
    #[pyo3(signature = (seq_id, token_ids, *, salt = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (id, tokens, salt) = (
            self::seq_id(seq_id)?,
            self::token_ids(token_ids)?,
            salt_bytes(salt)?,
        );
        py.detach(|| self.inner.allocate(id, &tokens, salt.as_deref()))
            .map_err(to_py)
    }

    /// `allocate` when an external store holds more of the prompt; returns the reused tokens
    /// and each group's int32 blocks to load.
    #[pyo3(signature = (seq_id, token_ids, loadable_blocks, *, salt = None))]
    fn allocate_loading<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
        token_ids: &Bound<'py, PyAny>,
        loadable_blocks: &Bound<'py, PyAny>,
        salt: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(usize, Vec<Bound<'py, PyArray1<i32>>>)> {
        let (id, tokens, salt) = (
            self::seq_id(seq_id)?,
            self::token_ids(token_ids)?,
            salt_bytes(salt)?,
        );
        let loadable = integer::<u64>(loadable_blocks, "loadable_blocks")? as usize;
        let (reused, loads) = py
            .detach(|| (self.inner).allocate_loading(id, &tokens, loadable, salt.as_deref()))
            .map_err(to_py)?;
        let loads = loads.into_iter().map(|b| blocks(py, b)).collect();
        Ok((reused, loads))
    }

    /// The blocks `allocate_loading` handed out hold their KV: each group's first
    /// `num_loaded` (an int), or group `g`'s first `num_loaded[g]` (one count per group).
    fn confirm_loads(
        &self,
        seq_id: &Bound<'_, PyAny>,
        num_loaded: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let per_group = num_loaded.is_instance_of::<PyList>()
            || num_loaded.is_instance_of::<PyTuple>()
            || (num_loaded.downcast::<PyUntypedArray>()).is_ok_and(|a| a.ndim() > 0);
        let result = if per_group {
            let counts = integers::<u64>(num_loaded, "num_loaded")?;
            let counts: Vec<usize> = counts.into_iter().map(|n| n as usize).collect();
            self.inner.confirm_group_loads(id, &counts)
        } else {
            let num_loaded = integer::<u64>(num_loaded, "num_loaded")? as usize;
            self.inner.confirm_loads(id, num_loaded)
        };
        result.map_err(to_py)
    }

    /// Appends tokens to a sequence in every group.
    fn append(&self, seq_id: &Bound<'_, PyAny>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let (id, tokens) = (self::seq_id(seq_id)?, self::token_ids(token_ids)?);
        self.inner.append(id, &tokens).map_err(to_py)
    }

    /// One decode token per sequence; returns each group's plan.
    fn step(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Plan>> {
        let (ids, tokens) = (self::seq_ids(seq_ids)?, self::token_ids(token_ids)?);
        let mut plans = self.fresh_plans();
        py.detach(|| self.inner.step(&ids, &tokens, &mut plans))
            .map_err(to_py)?;
        Ok(self.hand_out(plans))
    }

    /// One decode step of a persistent batch per group (same rows in each).
    fn step_batch(
        &self,
        py: Python<'_>,
        batches: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let tokens = self::token_ids(token_ids)?;
        self.on_batches(py, batches, |b| self.inner.step_batch(b, &tokens))
    }

    /// A speculative step of a persistent batch per group.
    fn verify_batch(
        &self,
        py: Python<'_>,
        batches: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        counts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let tokens = self::token_ids(token_ids)?;
        let counts: Vec<u32> = integers(counts, "counts")?;
        self.on_batches(py, batches, |b| {
            self.inner.verify_batch(b, &tokens, &counts)
        })
    }

    /// Drops the last `counts[i]` uncommitted tokens of each sequence in every group.
    fn rollback(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        counts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        let counts = token_counts(counts)?;
        py.detach(|| self.inner.rollback(&ids, &counts))
            .map_err(to_py)
    }

    /// `rollback` of every row of each group's persistent batch.
    fn rollback_batch(
        &self,
        py: Python<'_>,
        batches: &Bound<'_, PyAny>,
        counts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let counts = token_counts(counts)?;
        self.on_batches(py, batches, |b| self.inner.rollback_batch(b, &counts))
    }

    /// Each group's plan of any batch: each sequence's last `query_lens[i]` tokens are queries,
    /// the last `drafts[i]` of them drafts (a state group keeps the states a rollback needs).
    #[pyo3(signature = (seq_ids, query_lens, *, drafts = None))]
    fn plan(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        query_lens: &Bound<'_, PyAny>,
        drafts: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Plan>> {
        let ids = self::seq_ids(seq_ids)?;
        let lens: Vec<u32> = integers(query_lens, "query lengths")?;
        let drafts: Option<Vec<u32>> = drafts.map(|d| integers(d, "drafts")).transpose()?;
        let mut plans = self.fresh_plans();
        py.detach(|| match &drafts {
            Some(drafts) => (self.inner).plan_with_drafts(&ids, &lens, drafts, &mut plans),
            None => self.inner.plan(&ids, &lens, &mut plans),
        })
        .map_err(to_py)?;
        Ok(self.hand_out(plans))
    }

    /// Makes `child_id` share all of `parent_id`'s blocks in every group, copy-on-write.
    fn fork(&self, parent_id: &Bound<'_, PyAny>, child_id: &Bound<'_, PyAny>) -> PyResult<()> {
        (self.inner)
            .fork(seq_id(parent_id)?, seq_id(child_id)?)
            .map_err(to_py)
    }

    /// Ends a sequence in every group.
    fn free(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.free(self::seq_id(seq_id)?).map_err(to_py)
    }

    /// Confirms forward passes in every group.
    #[pyo3(signature = (seq_ids, num_computed = None))]
    fn commit(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        num_computed: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        let upto = num_computed.map(token_counts).transpose()?;
        py.detach(|| self.inner.commit(&ids, upto.as_deref()))
            .map_err(to_py)
    }

    /// Tokens of the sequence whose KV is computed.
    fn num_computed(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        (self.inner)
            .num_computed(self::seq_id(seq_id)?)
            .map_err(to_py)
    }

    /// Moves sequences to the CPU pool; returns each group's `(gpu, cpu)` pairs to copy.
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyArray2<i32>>>> {
        let ids = self::seq_ids(seq_ids)?;
        let moved = py.detach(|| self.inner.swap_out(&ids)).map_err(to_py)?;
        Ok(moved.into_iter().map(|p| pairs(py, p)).collect())
    }

    /// Brings sequences back; returns each group's `(cpu, gpu)` pairs to copy.
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyArray2<i32>>>> {
        let ids = self::seq_ids(seq_ids)?;
        let moved = py.detach(|| self.inner.swap_in(&ids)).map_err(to_py)?;
        Ok(moved.into_iter().map(|p| pairs(py, p)).collect())
    }

    /// The engine copied every group's `swap_out` pairs.
    fn confirm_swap_out(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        py.detach(|| self.inner.confirm_swap_out(&ids))
            .map_err(to_py)
    }

    /// The engine copied every group's `swap_in` pairs.
    fn confirm_swap_in(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        py.detach(|| self.inner.confirm_swap_in(&ids))
            .map_err(to_py)
    }

    /// Group `group`'s int32 block table of the sequence, from its `first_block`.
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
        group: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let table = (self.inner)
            .block_table(self::seq_id(seq_id)?, HybridManager::group(group)?)
            .map_err(to_py)?;
        Ok(blocks(py, table))
    }

    /// The logical block group `group`'s table of the sequence starts at.
    fn first_block(&self, seq_id: &Bound<'_, PyAny>, group: &Bound<'_, PyAny>) -> PyResult<usize> {
        (self.inner)
            .first_block(self::seq_id(seq_id)?, HybridManager::group(group)?)
            .map_err(to_py)
    }

    /// The sequence's tokens, uint32.
    fn token_ids<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let tokens = self.inner.tokens(self::seq_id(seq_id)?).map_err(to_py)?;
        Ok(tokens.into_pyarray(py))
    }

    /// Whether the prompt would fit now while keeping the watermark free.
    #[pyo3(signature = (token_ids, *, salt = None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let (tokens, salt) = (self::token_ids(token_ids)?, salt_bytes(salt)?);
        Ok(py.detach(|| self.inner.can_allocate(&tokens, salt.as_deref())))
    }

    /// Number of tokens in the sequence.
    fn num_tokens(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.inner.num_tokens(self::seq_id(seq_id)?).map_err(to_py)
    }

    /// Group `group`'s stats (the pool's counts, the group's own counters).
    fn stats(&self, group: &Bound<'_, PyAny>) -> PyResult<Stats> {
        let stats = self
            .inner
            .stats(HybridManager::group(group)?)
            .map_err(to_py)?;
        Ok(Stats::from(stats))
    }

    /// Leading full blocks of the prompt every group serves from its cache now.
    #[pyo3(signature = (token_ids, *, salt = None))]
    fn cached_prefix_blocks(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (tokens, salt) = (self::token_ids(token_ids)?, salt_bytes(salt)?);
        Ok(py.detach(|| self.inner.cached_prefix_blocks(&tokens, salt.as_deref())))
    }

    /// The 128-bit chained hashes group `group` (0: the ones events carry) publishes for the
    /// prompt's full blocks; a group past 0 publishes them in the block feed.
    #[pyo3(signature = (token_ids, *, salt = None, group = None))]
    fn block_hashes(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        group: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u128>> {
        let (tokens, salt) = (self::token_ids(token_ids)?, salt_bytes(salt)?);
        let group = group.map(Self::group).transpose()?.unwrap_or(0);
        py.detach(|| (self.inner).group_block_hashes(group, &tokens, salt.as_deref()))
            .map_err(to_py)
    }

    /// The 128-bit hashes of group 0's computed blocks a tier holds, `medium` "GPU" or "CPU".
    #[pyo3(signature = (medium = "GPU"))]
    fn stored_hashes(&self, medium: &str) -> PyResult<Vec<u128>> {
        Ok(self.inner.stored_hashes(pool_kind(medium)?))
    }

    /// Group 0's prefix-cache events since the last call (empty unless `enable_events`).
    fn take_events(&self) -> Vec<Event> {
        (self.inner.take_events().into_iter())
            .map(Event::from)
            .collect()
    }

    /// 16 hex digits identifying the hash key (None without prefix caching).
    #[getter]
    fn hash_key_fingerprint(&self) -> Option<String> {
        self.inner
            .hash_key_fingerprint()
            .map(|f| format!("{f:016x}"))
    }

    /// Whether every group's registrations are recorded for `take_registrations`.
    #[getter]
    fn block_feed(&self) -> bool {
        self.inner.config().enable_block_feed
    }

    /// Every group's registrations and evictions since the last call (empty unless
    /// `block_feed`).
    fn take_registrations(&self) -> Vec<Registration> {
        (self.inner.take_registrations().into_iter())
            .map(Registration::from)
            .collect()
    }

    /// Drops every group's prefix-cache registrations.
    fn reset_prefix_cache(&self) {
        self.inner.reset_prefix_cache()
    }

    /// Verifies every invariant of every group; raises RuntimeError naming the first violation.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.check()).map_err(to_py)
    }

    fn __contains__(&self, seq_id: &Bound<'_, PyAny>) -> bool {
        self::seq_id(seq_id).is_ok_and(|id| self.inner.contains(id))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let c = self.inner.config();
        let groups = PyList::new(py, self.groups())?;
        Ok(format!(
            "HybridManager(num_blocks={}, block_size={}, groups={}, sequences={})",
            c.num_blocks,
            c.block_size,
            groups.repr()?,
            self.inner.len()
        ))
    }
}
