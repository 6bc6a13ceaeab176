//! The `BlockManager` Python class: converts arguments, releases the GIL around the core's
//! operations, and hands plans out with recycled buffers.

use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use pagedkv as core;

use crate::attention::Attention;
use crate::batch::Batch;
use crate::conversions::{
    blocks, integer, integers, pairs, seq_id, seq_ids, to_py, token_ids, Count,
};
use crate::events::Event;
use crate::keys::{extra_keys_of, Keys};
use crate::plan::{spare_plan, Plan, PlanPool};
use crate::stats::Stats;

/// The paged KV-cache block manager (see `pagedkv.BlockManager`).
#[pyclass(frozen, module = "pagedkv._core")]
pub(crate) struct BlockManager {
    inner: core::BlockManager,
    /// Buffers of dropped plans, reused by the next steps.
    spare_plans: PlanPool,
}

impl BlockManager {
    /// Plan buffers to fill, recycled where possible.
    fn fresh_plan(&self) -> core::Plan {
        spare_plan(&self.spare_plans)
    }

    /// Wraps a filled plan for Python.
    fn hand_out(&self, plan: core::Plan) -> Plan {
        Plan::new(plan, self.spare_plans.clone())
    }
}

#[pymethods]
impl BlockManager {
    /// A manager with every block free; see `pagedkv.BlockManager`.
    #[new]
    #[pyo3(signature = (num_blocks, block_size = Count::Default(16), *,
        num_cpu_blocks = Count::Default(0), enable_prefix_caching = true, watermark = 0.01,
        hash_key = None, enable_events = false, auto_commit = true, attention = None),
        text_signature = "(num_blocks, block_size=16, *, num_cpu_blocks=0, \
        enable_prefix_caching=True, watermark=0.01, hash_key=None, enable_events=False, \
        auto_commit=True, attention=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: Count<'_>,
        block_size: Count<'_>,
        num_cpu_blocks: Count<'_>,
        enable_prefix_caching: bool,
        watermark: f64,
        hash_key: Option<&[u8]>,
        enable_events: bool,
        auto_commit: bool,
        attention: Option<Attention>,
    ) -> PyResult<Self> {
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
            attention: attention.map_or(core::Attention::Full, |a| a.inner),
            ..config
        };
        let inner = core::BlockManager::new(config).map_err(to_py)?;
        Ok(BlockManager {
            inner,
            spare_plans: PlanPool::default(),
        })
    }

    /// What the manager's queries attend to.
    #[getter]
    fn attention(&self) -> Attention {
        Attention {
            inner: self.inner.config().attention,
        }
    }

    /// The logical block the sequence's table starts at (windowed attention releases the
    /// blocks before it).
    fn first_block(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.inner.first_block(self::seq_id(seq_id)?).map_err(to_py)
    }

    /// Blocks in the GPU pool.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.config().num_blocks
    }

    /// Token slots per block.
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.config().block_size
    }

    /// Blocks in the CPU swap pool.
    #[getter]
    fn num_cpu_blocks(&self) -> u32 {
        self.inner.config().num_cpu_blocks
    }

    /// Admits a sequence with its prompt; returns the prompt tokens reused from the prefix cache.
    #[pyo3(signature = (seq_id, token_ids, *, salt = None, lora_name = None, extra_keys = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (id, tokens, keys) = (
            self::seq_id(seq_id)?,
            self::token_ids(token_ids)?,
            Keys::new(salt, lora_name, extra_keys)?,
        );
        py.detach(|| self.inner.allocate_keyed(id, &tokens, &keys.get()))
            .map_err(to_py)
    }

    /// Admits a sequence whose prompt blocks `0..loadable_blocks` are on the GPU or in an
    /// external store; returns the GPU-reused tokens and the int32 GPU blocks to load.
    #[pyo3(signature = (
        seq_id, token_ids, loadable_blocks, *, salt = None, lora_name = None, extra_keys = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_loading<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
        token_ids: &Bound<'py, PyAny>,
        loadable_blocks: &Bound<'py, PyAny>,
        salt: Option<&Bound<'py, PyAny>>,
        lora_name: Option<&Bound<'py, PyAny>>,
        extra_keys: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(usize, Bound<'py, PyArray1<i32>>)> {
        let (id, tokens, keys) = (
            self::seq_id(seq_id)?,
            self::token_ids(token_ids)?,
            Keys::new(salt, lora_name, extra_keys)?,
        );
        let loadable_blocks = integer::<u64>(loadable_blocks, "loadable_blocks")? as usize;
        let (reused, blocks) = py
            .detach(|| {
                self.inner
                    .allocate_loading_keyed(id, &tokens, loadable_blocks, &keys.get())
            })
            .map_err(to_py)?;
        Ok((reused, self::blocks(py, blocks)))
    }

    /// The first `num_loaded` blocks handed out by `allocate_loading` hold their KV now.
    fn confirm_loads(
        &self,
        seq_id: &Bound<'_, PyAny>,
        num_loaded: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let num_loaded = integer::<u64>(num_loaded, "num_loaded")? as usize;
        self.inner
            .confirm_loads(self::seq_id(seq_id)?, num_loaded)
            .map_err(to_py)
    }

    /// The 128-bit chained hashes of the prompt's full blocks.
    #[pyo3(signature = (token_ids, *, salt = None, lora_name = None, extra_keys = None))]
    fn block_hashes(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u128>> {
        let tokens = self::token_ids(token_ids)?;
        let keys = Keys::new(salt, lora_name, extra_keys)?;
        py.detach(|| self.inner.block_hashes_keyed(&tokens, &keys.get()))
            .map_err(to_py)
    }

    /// The 128-bit hashes of the computed blocks a tier holds, `medium` "GPU" or "CPU" (the
    /// CPU tier is tracked while events are on).
    #[pyo3(signature = (medium = "GPU"))]
    fn stored_hashes(&self, medium: &str) -> PyResult<Vec<u128>> {
        Ok(self.inner.stored_hashes(pool_kind(medium)?))
    }

    /// Leading full blocks of the prompt the GPU prefix cache holds now.
    #[pyo3(signature = (token_ids, *, salt = None, lora_name = None, extra_keys = None))]
    fn cached_prefix_blocks(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let tokens = self::token_ids(token_ids)?;
        let keys = Keys::new(salt, lora_name, extra_keys)?;
        py.detach(|| self.inner.cached_prefix_blocks_keyed(&tokens, &keys.get()))
            .map_err(to_py)
    }

    /// 16 hex digits identifying the hash key (None without prefix caching).
    #[getter]
    fn hash_key_fingerprint(&self) -> Option<String> {
        self.inner
            .hash_key_fingerprint()
            .map(|f| format!("{f:016x}"))
    }

    /// Whether the manager records events for `take_events`.
    #[getter]
    fn events_enabled(&self) -> bool {
        self.inner.config().enable_events
    }

    /// Whether a call naming a sequence first commits its latest plan.
    #[getter]
    fn auto_commit(&self) -> bool {
        self.inner.config().auto_commit
    }

    /// Whether the prompt would fit now while keeping the watermark free.
    #[pyo3(signature = (token_ids, *, salt = None, lora_name = None, extra_keys = None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let tokens = self::token_ids(token_ids)?;
        let keys = Keys::new(salt, lora_name, extra_keys)?;
        py.detach(|| self.inner.can_allocate_keyed(&tokens, &keys.get()))
            .map_err(to_py)
    }

    /// Appends tokens to a sequence (copy-on-write of a shared last block).
    #[pyo3(signature = (seq_id, token_ids, *, extra_keys = None))]
    fn append(
        &self,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (id, tokens) = (self::seq_id(seq_id)?, self::token_ids(token_ids)?);
        let extra_keys = extra_keys_of(extra_keys)?;
        self.inner
            .append_keyed(id, &tokens, &extra_keys)
            .map_err(to_py)
    }

    /// One decode token per sequence, then the plan of that step.
    fn step(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Plan> {
        let (ids, tokens) = (self::seq_ids(seq_ids)?, self::token_ids(token_ids)?);
        let mut plan = self.fresh_plan();
        py.detach(|| self.inner.step(&ids, &tokens, &mut plan))
            .map_err(to_py)?;
        Ok(self.hand_out(plan))
    }

    /// One decode step of a persistent batch: appends `token_ids[r]` to row `r`'s sequence
    /// and fills the batch's attention inputs.
    fn step_batch(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, Batch>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let tokens = self::token_ids(token_ids)?;
        on_batch(py, batch, |b| self.inner.step_batch(b, &tokens))
    }

    /// A speculative step of a persistent batch: row `r` appends its next `counts[r]` tokens
    /// of `token_ids` (its last sampled token, then its drafts), all planned as queries.
    fn verify_batch(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, Batch>,
        token_ids: &Bound<'_, PyAny>,
        counts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let tokens = self::token_ids(token_ids)?;
        let counts: Vec<u32> = integers(counts, "counts")?;
        on_batch(py, batch, |b| self.inner.verify_batch(b, &tokens, &counts))
    }

    /// Drops the last `counts[i]` uncommitted tokens of each sequence (rejected drafts).
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

    /// `rollback` of every row of a persistent batch, its table rows trimmed alike.
    fn rollback_batch(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, Batch>,
        counts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let counts = token_counts(counts)?;
        on_batch(py, batch, |b| self.inner.rollback_batch(b, &counts))
    }

    /// The plan of any batch: each sequence's last `query_lens[i]` tokens are its queries.
    fn plan(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        query_lens: &Bound<'_, PyAny>,
    ) -> PyResult<Plan> {
        let ids = self::seq_ids(seq_ids)?;
        let lens: Vec<u32> = integers(query_lens, "query lengths")?;
        let mut plan = self.fresh_plan();
        py.detach(|| self.inner.plan(&ids, &lens, &mut plan))
            .map_err(to_py)?;
        Ok(self.hand_out(plan))
    }

    /// Makes `child_id` share all of `parent_id`'s blocks, copy-on-write.
    fn fork(&self, parent_id: &Bound<'_, PyAny>, child_id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner
            .fork(seq_id(parent_id)?, seq_id(child_id)?)
            .map_err(to_py)
    }

    /// Ends a sequence and releases its blocks, last block first.
    fn free(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.free(self::seq_id(seq_id)?).map_err(to_py)
    }

    /// Confirms forward passes: KV computed up to each sequence's latest plan, or up to
    /// `num_computed[i]` tokens.
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
        self.inner
            .num_computed(self::seq_id(seq_id)?)
            .map_err(to_py)
    }

    /// The engine copied the pairs `swap_out` returned: release the GPU blocks.
    fn confirm_swap_out(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        py.detach(|| self.inner.confirm_swap_out(&ids))
            .map_err(to_py)
    }

    /// The engine copied the pairs `swap_in` returned: release the CPU blocks.
    fn confirm_swap_in(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        py.detach(|| self.inner.confirm_swap_in(&ids))
            .map_err(to_py)
    }

    /// Moves sequences to the CPU pool; returns the `(gpu, cpu)` block pairs to copy.
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = self::seq_ids(seq_ids)?;
        let moved = py.detach(|| self.inner.swap_out(&ids)).map_err(to_py)?;
        Ok(pairs(py, moved))
    }

    /// Brings sequences back to the GPU pool; returns the `(cpu, gpu)` block pairs to copy.
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = self::seq_ids(seq_ids)?;
        let moved = py.detach(|| self.inner.swap_in(&ids)).map_err(to_py)?;
        Ok(pairs(py, moved))
    }

    /// The sequence's GPU block table, int32.
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let table = self
            .inner
            .block_table(self::seq_id(seq_id)?)
            .map_err(to_py)?;
        Ok(blocks(py, table))
    }

    /// Number of tokens in the sequence.
    fn num_tokens(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.inner.num_tokens(self::seq_id(seq_id)?).map_err(to_py)
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

    /// Block counts, token usage and prefix-cache counters.
    fn stats(&self) -> Stats {
        Stats::from(self.inner.stats())
    }

    /// Prefix-cache events since the last call (empty unless `enable_events`).
    fn take_events(&self) -> Vec<Event> {
        self.inner
            .take_events()
            .into_iter()
            .map(Event::from)
            .collect()
    }

    /// Takes the events since the last take as one encoded msgpack `EventBatch` (the bytes a
    /// KV event publisher sends), or None when there are none and `cleared_first` is false.
    #[pyo3(signature = (ts, *, encoding = "map", data_parallel_rank = None, cleared_first = false))]
    fn take_event_batch<'py>(
        &self,
        py: Python<'py>,
        ts: f64,
        encoding: &str,
        data_parallel_rank: Option<i64>,
        cleared_first: bool,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let encoding = match encoding {
            "map" => core::Encoding::Map,
            "array" => core::Encoding::Array,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "encoding must be 'map' or 'array', got {encoding:?}"
                )))
            }
        };
        let data_parallel_rank = data_parallel_rank
            .map(|rank| {
                u32::try_from(rank).map_err(|_| {
                    PyValueError::new_err(format!(
                        "data_parallel_rank must be in 0..2**32, got {rank}"
                    ))
                })
            })
            .transpose()?;
        let header = core::BatchHeader {
            ts,
            data_parallel_rank,
            block_size: self.inner.config().block_size,
            encoding,
            cleared_first,
        };
        let mut out = Vec::new();
        let taken = py.detach(|| self.inner.take_event_batch(&header, &mut out));
        Ok((taken > 0 || cleared_first).then(|| PyBytes::new(py, &out)))
    }

    /// Drops every prefix-cache registration; cached blocks become free.
    fn reset_prefix_cache(&self) {
        self.inner.reset_prefix_cache()
    }

    /// Verifies every invariant; raises RuntimeError naming the first violation.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.check()).map_err(to_py)
    }

    fn __contains__(&self, seq_id: &Bound<'_, PyAny>) -> bool {
        self::seq_id(seq_id).is_ok_and(|id| self.inner.contains(id))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "BlockManager(num_blocks={}, block_size={}, num_cpu_blocks={}, sequences={})",
            c.num_blocks,
            c.block_size,
            c.num_cpu_blocks,
            self.inner.len()
        )
    }
}

/// The configuration the constructor's arguments describe (full attention).
#[allow(clippy::too_many_arguments)]
pub(crate) fn build_config(
    num_blocks: Count<'_>,
    block_size: Count<'_>,
    num_cpu_blocks: Count<'_>,
    enable_prefix_caching: bool,
    watermark: f64,
    hash_key: Option<&[u8]>,
    enable_events: bool,
    auto_commit: bool,
) -> PyResult<core::Config> {
    let count = |name: &str, v: Count<'_>| v.get(name);
    let hash_key = hash_key
        .map(|k| {
            <[u8; 32]>::try_from(k).map_err(|_| {
                PyValueError::new_err(format!("hash_key must be 32 bytes, got {}", k.len()))
            })
        })
        .transpose()?;
    Ok(core::Config {
        num_blocks: count("num_blocks", num_blocks)?,
        block_size: count("block_size", block_size)?,
        num_cpu_blocks: count("num_cpu_blocks", num_cpu_blocks)?,
        enable_prefix_caching,
        watermark,
        hash_key,
        enable_events,
        enable_block_feed: false,
        auto_commit,
        attention: core::Attention::Full,
    })
}

/// The pool a `medium` argument names.
pub(crate) fn pool_kind(medium: &str) -> PyResult<core::PoolKind> {
    match medium {
        "GPU" => Ok(core::PoolKind::Gpu),
        "CPU" => Ok(core::PoolKind::Cpu),
        other => Err(PyValueError::new_err(format!(
            "medium must be \"GPU\" or \"CPU\", got {other:?}"
        ))),
    }
}

/// Token counts, one per sequence.
pub(crate) fn token_counts(counts: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let counts = integers::<u64>(counts, "token counts")?;
    Ok(counts.into_iter().map(|n| n as usize).collect())
}

/// Runs `call` on the batch's core, borrowed mutably, without the GIL.
pub(crate) fn on_batch(
    py: Python<'_>,
    batch: &Bound<'_, Batch>,
    call: impl FnOnce(&mut core::Batch) -> Result<(), core::Error> + Send,
) -> PyResult<()> {
    let mut batch = batch.try_borrow_mut()?;
    let batch = &mut batch.inner;
    py.detach(|| call(batch)).map_err(to_py)
}
