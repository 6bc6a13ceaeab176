//! Python bindings of `pagedkv`: type and error conversion only; all logic lives in the core.

use std::sync::{Arc, Mutex};

use numpy::ndarray::{Array2, ArrayViewMut1, ArrayViewMut2};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyError, PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyInt, PyMemoryView, PySequence, PyString};

use pagedkv as core;

create_exception!(
    _core,
    OutOfBlocks,
    PyRuntimeError,
    "The pool has fewer free or evictable blocks than the operation needs; nothing changed."
);

/// Maps a core error to the Python exception users expect.
fn to_py(err: core::Error) -> PyErr {
    let msg = err.to_string();
    match err {
        core::Error::UnknownSequence(_) => PyKeyError::new_err(msg),
        core::Error::OutOfBlocks { .. } => OutOfBlocks::new_err(msg),
        core::Error::InvariantViolated(_) => PyRuntimeError::new_err(msg),
        core::Error::DuplicateSequence(_)
        | core::Error::SwappedOut(_)
        | core::Error::NotSwappedOut(_)
        | core::Error::InvalidArgument(_) => PyValueError::new_err(msg),
    }
}

/// The integer types ids convert to.
trait Id: Copy {
    const MAX: u64;
    /// The accepted range, as error messages write it.
    const RANGE: &'static str;
    /// `value` is known to be at most `MAX`.
    fn narrow(value: u64) -> Self;
}

impl Id for u32 {
    const MAX: u64 = u32::MAX as u64;
    const RANGE: &'static str = "[0, 2**32)";
    fn narrow(value: u64) -> Self {
        value as u32
    }
}

impl Id for u64 {
    const MAX: u64 = u64::MAX;
    const RANGE: &'static str = "[0, 2**64)";
    fn narrow(value: u64) -> Self {
        value
    }
}

/// `operator.index`, looked up once.
static OPERATOR_INDEX: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A ValueError saying `message`, caused by `err`, the exception a conversion raised. A
/// BaseException that is not an Exception (KeyboardInterrupt, SystemExit) propagates unchanged.
fn invalid_because(py: Python<'_>, err: PyErr, message: String) -> PyErr {
    if !err.is_instance_of::<PyException>(py) {
        return err;
    }
    let wrapped = PyValueError::new_err(message);
    wrapped.set_cause(py, Some(err));
    wrapped
}

/// The name of `obj`'s type, for error messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |name| name.to_string())
}

/// One integer in `[0, T::MAX]`: a Python int or any object with `__index__`. Errors name
/// `what` and the bad value.
fn integer<T: Id>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    let py = obj.py();
    let int = match obj.downcast::<PyInt>() {
        Ok(int) => int.clone(),
        Err(_) => OPERATOR_INDEX
            .import(py, "operator", "index")?
            .call1((obj,))
            .and_then(|value| Ok(value.downcast_into::<PyInt>()?))
            .map_err(|err| {
                let message = format!("{what} must be an int, got {}", type_name(obj));
                invalid_because(py, err, message)
            })?,
    };
    match int.extract::<u64>() {
        Ok(value) if value <= T::MAX => Ok(T::narrow(value)),
        _ => Err(PyValueError::new_err(format!(
            "{what} must be in {}, got {int}",
            T::RANGE
        ))),
    }
}

/// Reads a 1-D integer array or sequence into `T`, naming `what` and the bad value in errors.
/// numpy arrays of any integer dtype are read in place, without a Python object per element.
fn integers<T: Id>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>> {
    let out_of_range =
        |v: i128| PyValueError::new_err(format!("{what} must be in {}, got {v}", T::RANGE));
    let in_range = |v: i128| (0..=i128::from(T::MAX)).contains(&v);
    if let Ok(array) = obj.downcast::<PyUntypedArray>() {
        if array.ndim() != 1 {
            return Err(PyValueError::new_err(format!(
                "{what} must be 1-D, got an array of shape {:?}",
                array.shape()
            )));
        }
        macro_rules! read_as {
            ($($t:ty),*) => {$(
                if array.dtype().is_equiv_to(&numpy::dtype::<$t>(obj.py())) {
                    let typed = array.downcast::<PyArray1<$t>>()?.readonly();
                    let values = typed.as_array();
                    if let Some(&bad) = values.iter().find(|&&v| !in_range(v as i128)) {
                        return Err(out_of_range(bad as i128));
                    }
                    return Ok(values.iter().map(|&v| T::narrow(v as u64)).collect());
                }
            )*};
        }
        read_as!(i64, i32, u32, u64, i16, u16, i8, u8);
        return Err(PyValueError::new_err(format!(
            "{what} must be an integer array, got dtype {}",
            array.dtype()
        )));
    }
    // Text and raw bytes iterate as characters or byte values, never as token ids.
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyMemoryView>()
    {
        return Err(PyValueError::new_err(format!(
            "{what} must be a sequence of ints, not {}",
            type_name(obj)
        )));
    }
    let not_a_sequence = || {
        PyValueError::new_err(format!(
            "{what} must be a 1-D integer array or a sequence of ints, got {}",
            type_name(obj)
        ))
    };
    let sequence = obj.downcast::<PySequence>().map_err(|_| not_a_sequence())?;
    let mut values = Vec::with_capacity(sequence.len().unwrap_or(0));
    for item in sequence.try_iter()? {
        values.push(integer(&item?, what)?);
    }
    Ok(values)
}

fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    integers(obj, "token ids")
}

fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    integers(obj, "sequence ids")
}

fn seq_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    integer(obj, "a sequence id")
}

/// A count argument of the constructor: the object as given (converted in the body, where the
/// argument's name is known) or its default.
enum Count<'py> {
    Given(Bound<'py, PyAny>),
    Default(u32),
}

impl<'py> FromPyObject<'py> for Count<'py> {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(Count::Given(obj.clone()))
    }
}

fn salt_bytes(salt: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
    let Some(salt) = salt else { return Ok(None) };
    if let Ok(s) = salt.downcast::<PyString>() {
        return Ok(Some(s.to_str()?.as_bytes().to_vec()));
    }
    if let Ok(b) = salt.downcast::<PyBytes>() {
        return Ok(Some(b.as_bytes().to_vec()));
    }
    Err(PyValueError::new_err("salt must be bytes, str or None"))
}

fn pairs<'py>(py: Python<'py>, pairs: Vec<[u32; 2]>) -> Bound<'py, PyArray2<i32>> {
    let n = pairs.len();
    let flat: Vec<i32> = pairs.into_iter().flatten().map(|b| b as i32).collect();
    Array2::from_shape_vec((n, 2), flat)
        .expect("n * 2 values")
        .into_pyarray(py)
}

/// The paged KV-cache block manager (see `pagedkv.BlockManager`).
#[pyclass(frozen, module = "pagedkv._core")]
struct BlockManager {
    inner: core::BlockManager,
    /// Buffers of dropped plans, reused by the next steps.
    spare_plans: PlanPool,
}

impl BlockManager {
    /// Plan buffers to fill: a dropped plan's when there is one (warm, already large enough).
    fn fresh_plan(&self) -> core::Plan {
        let spare = self
            .spare_plans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        spare.unwrap_or_default()
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
        hash_key = None, enable_events = false, auto_commit = true),
        text_signature = "(num_blocks, block_size=16, *, num_cpu_blocks=0, \
        enable_prefix_caching=True, watermark=0.01, hash_key=None, enable_events=False, \
        auto_commit=True)")]
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
    ) -> PyResult<Self> {
        let count = |name: &str, v: Count<'_>| match v {
            Count::Given(v) => integer::<u32>(&v, name),
            Count::Default(v) => Ok(v),
        };
        let hash_key = hash_key
            .map(|k| {
                <[u8; 32]>::try_from(k).map_err(|_| {
                    PyValueError::new_err(format!("hash_key must be 32 bytes, got {}", k.len()))
                })
            })
            .transpose()?;
        let config = core::Config {
            num_blocks: count("num_blocks", num_blocks)?,
            block_size: count("block_size", block_size)?,
            num_cpu_blocks: count("num_cpu_blocks", num_cpu_blocks)?,
            enable_prefix_caching,
            watermark,
            hash_key,
            enable_events,
            auto_commit,
        };
        let inner = core::BlockManager::new(config).map_err(to_py)?;
        Ok(BlockManager {
            inner,
            spare_plans: PlanPool::default(),
        })
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

    /// Admits a sequence whose prompt blocks `0..loadable_blocks` are on the GPU or in an
    /// external store; returns the GPU-reused tokens and the int32 GPU blocks to load.
    #[pyo3(signature = (seq_id, token_ids, loadable_blocks, *, salt = None))]
    fn allocate_loading<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
        token_ids: &Bound<'py, PyAny>,
        loadable_blocks: &Bound<'py, PyAny>,
        salt: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(usize, Bound<'py, PyArray1<i32>>)> {
        let (id, tokens, salt) = (
            self::seq_id(seq_id)?,
            self::token_ids(token_ids)?,
            salt_bytes(salt)?,
        );
        let loadable_blocks = integer::<u64>(loadable_blocks, "loadable_blocks")? as usize;
        let (reused, blocks) = py
            .detach(|| {
                self.inner
                    .allocate_loading(id, &tokens, loadable_blocks, salt.as_deref())
            })
            .map_err(to_py)?;
        let blocks: Vec<i32> = blocks.into_iter().map(|b| b as i32).collect();
        Ok((reused, blocks.into_pyarray(py)))
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
    #[pyo3(signature = (token_ids, *, salt = None))]
    fn block_hashes(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u128>> {
        let (tokens, salt) = (self::token_ids(token_ids)?, salt_bytes(salt)?);
        py.detach(|| self.inner.block_hashes(&tokens, salt.as_deref()))
            .map_err(to_py)
    }

    /// The 128-bit hashes of the computed blocks a tier holds, `medium` "GPU" or "CPU" (the
    /// CPU tier is tracked while events are on).
    #[pyo3(signature = (medium = "GPU"))]
    fn stored_hashes(&self, medium: &str) -> PyResult<Vec<u128>> {
        let pool = match medium {
            "GPU" => core::PoolKind::Gpu,
            "CPU" => core::PoolKind::Cpu,
            other => {
                return Err(PyValueError::new_err(format!(
                    "medium must be \"GPU\" or \"CPU\", got {other:?}"
                )))
            }
        };
        Ok(self.inner.stored_hashes(pool))
    }

    /// Leading full blocks of the prompt the GPU prefix cache holds now.
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

    /// Appends tokens to a sequence (copy-on-write of a shared last block).
    fn append(&self, seq_id: &Bound<'_, PyAny>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let (id, tokens) = (self::seq_id(seq_id)?, self::token_ids(token_ids)?);
        self.inner.append(id, &tokens).map_err(to_py)
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
        let upto: Option<Vec<usize>> = num_computed
            .map(|n| integers::<u64>(n, "token counts"))
            .transpose()?
            .map(|n| n.into_iter().map(|v| v as usize).collect());
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
        Ok(table
            .into_iter()
            .map(|b| b as i32)
            .collect::<Vec<_>>()
            .into_pyarray(py))
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
        Stats(self.inner.stats())
    }

    /// Prefix-cache events since the last call (empty unless `enable_events`).
    fn take_events(&self) -> Vec<Event> {
        self.inner
            .take_events()
            .into_iter()
            .map(Event::from)
            .collect()
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

/// Plan buffers of dropped plans, kept for reuse: fresh buffers every step would cost page
/// faults once plans get large.
type PlanPool = Arc<Mutex<Vec<core::Plan>>>;

/// Spare plans kept per manager (a step rarely has more than two plans alive).
const SPARE_PLANS: usize = 4;

/// The plan of one step. Its arrays are numpy views of the Rust buffers (no copy); each view
/// keeps the plan alive, and the buffers go back to the manager for reuse only when the plan
/// and every view of it are gone. (Views are not cached on the plan: that would be a reference
/// cycle.)
#[pyclass(frozen, module = "pagedkv._core")]
struct Plan {
    raw: Mutex<core::Plan>,
    pool: PlanPool,
    #[pyo3(get)]
    batch_size: usize,
    #[pyo3(get)]
    num_query_tokens: usize,
    #[pyo3(get)]
    block_size: u32,
}

impl Plan {
    fn new(plan: core::Plan, pool: PlanPool) -> Plan {
        Plan {
            batch_size: plan.batch_size(),
            num_query_tokens: plan.num_query_tokens(),
            block_size: plan.block_size,
            raw: Mutex::new(plan),
            pool,
        }
    }

    /// The Rust plan.
    fn raw(&self) -> std::sync::MutexGuard<'_, core::Plan> {
        self.raw.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A numpy view of field `index` of the Rust plan: 1-D, or `[n, 2]` for the copies.
    fn array(this: &Bound<'_, Self>, index: usize) -> Py<PyAny> {
        let mut raw = this.get().raw();
        let pairs = raw.num_copies();
        let container = this.clone().into_any();
        let field = match index {
            0 => &mut raw.kv_indptr,
            1 => &mut raw.kv_indices,
            2 => &mut raw.kv_last_page_len,
            3 => &mut raw.qo_indptr,
            4 => &mut raw.slot_mapping,
            5 => &mut raw.positions,
            _ => &mut raw.copies,
        };
        // SAFETY: the array's base is this plan, which owns the buffer and never resizes or
        // frees it while alive (it hands it back to the pool in `Drop`, when no view is left).
        // The view comes from a mutable borrow, so numpy may write through it.
        unsafe {
            if index == 6 {
                let view = ArrayViewMut2::from_shape((pairs, 2), &mut field[..])
                    .expect("pairs * 2 values");
                PyArray2::borrow_from_array(&view, container)
                    .into_any()
                    .unbind()
            } else {
                let view = ArrayViewMut1::from(&mut field[..]);
                PyArray1::borrow_from_array(&view, container)
                    .into_any()
                    .unbind()
            }
        }
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        let raw = std::mem::take(self.raw.get_mut().unwrap_or_else(|p| p.into_inner()));
        let mut spare = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < SPARE_PLANS {
            spare.push(raw);
        }
    }
}

#[pymethods]
impl Plan {
    /// `[B + 1]` int32 offsets into `kv_indices`.
    #[getter]
    fn kv_indptr(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, 0)
    }
    /// `[nnz]` int32 physical blocks of the batch, concatenated.
    #[getter]
    fn kv_indices(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, 1)
    }
    /// `[B]` int32 tokens in each sequence's last block.
    #[getter]
    fn kv_last_page_len(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, 2)
    }
    /// `[B + 1]` int32 offsets of each sequence's query tokens.
    #[getter]
    fn qo_indptr(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, 3)
    }
    /// `[num_query_tokens]` int32 KV slot of each new token.
    #[getter]
    fn slot_mapping(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, 4)
    }
    /// `[num_query_tokens]` int32 position of each new token.
    #[getter]
    fn positions(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, 5)
    }
    /// `[B, max_blocks]` int32 block tables padded with -1, built from the pages on each access
    /// (a new array, not a view); MemoryError when it does not fit.
    #[getter]
    fn block_tables<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let raw = self.raw();
        let (rows, cols) = (self.batch_size, raw.max_blocks());
        let tables = raw.block_tables().map_err(|_| {
            PyMemoryError::new_err(format!(
                "plan.block_tables needs {rows} x {cols} int32 entries, which cannot be allocated"
            ))
        })?;
        drop(raw);
        let tables = Array2::from_shape_vec((rows, cols), tables).expect("rows * cols values");
        Ok(tables.into_pyarray(py))
    }
    /// `[n, 2]` int32 copy-on-write `(src, dst)` pairs to apply before this step's forward pass.
    #[getter]
    fn copies(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, 6)
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(batch_size={}, num_query_tokens={}, block_size={})",
            self.batch_size, self.num_query_tokens, self.block_size
        )
    }
}

/// A snapshot of the pool and the prefix cache.
#[pyclass(frozen, module = "pagedkv._core")]
struct Stats(core::Stats);

#[pymethods]
impl Stats {
    /// Blocks in the GPU pool.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.0.num_blocks
    }
    /// FREE blocks: unreferenced, not cached.
    #[getter]
    fn num_free(&self) -> usize {
        self.0.num_free
    }
    /// CACHED blocks: unreferenced, kept for prefix reuse.
    #[getter]
    fn num_cached(&self) -> usize {
        self.0.num_cached
    }
    /// HELD blocks: referenced by a sequence.
    #[getter]
    fn num_held(&self) -> usize {
        self.0.num_held
    }
    /// `num_held / num_blocks`.
    #[getter]
    fn usage(&self) -> f64 {
        self.0.usage
    }
    /// Stored tokens over the slots of held blocks.
    #[getter]
    fn token_usage(&self) -> f64 {
        self.0.token_usage
    }
    /// Tokens stored in held blocks, each physical block once.
    #[getter]
    fn stored_tokens(&self) -> usize {
        self.0.stored_tokens
    }
    /// Prompt tokens looked up in the prefix cache.
    #[getter]
    fn prefix_query_tokens(&self) -> u64 {
        self.0.prefix_query_tokens
    }
    /// Prompt tokens served from the prefix cache.
    #[getter]
    fn prefix_hit_tokens(&self) -> u64 {
        self.0.prefix_hit_tokens
    }
    /// Cached blocks evicted to make room.
    #[getter]
    fn evictions(&self) -> u64 {
        self.0.evictions
    }
    /// Tokens of live sequences whose KV is computed (per sequence).
    #[getter]
    fn computed_tokens(&self) -> u64 {
        self.0.computed_tokens
    }
    /// Tokens of live sequences whose KV is pending (per sequence).
    #[getter]
    fn pending_tokens(&self) -> u64 {
        self.0.pending_tokens
    }
    /// Prompt tokens after the GPU hit looked up in an external store.
    #[getter]
    fn external_query_tokens(&self) -> u64 {
        self.0.external_query_tokens
    }
    /// Tokens loaded from an external store and confirmed.
    #[getter]
    fn external_hit_tokens(&self) -> u64 {
        self.0.external_hit_tokens
    }
    /// Blocks handed out for an external load that was not confirmed.
    #[getter]
    fn external_failures(&self) -> u64 {
        self.0.external_failures
    }

    fn __repr__(&self) -> String {
        let s = &self.0;
        format!(
            "Stats(num_blocks={}, num_free={}, num_cached={}, num_held={}, usage={:.4}, \
             token_usage={:.4}, stored_tokens={}, prefix_query_tokens={}, prefix_hit_tokens={}, \
             evictions={}, computed_tokens={}, pending_tokens={}, external_query_tokens={}, \
             external_hit_tokens={}, external_failures={})",
            s.num_blocks,
            s.num_free,
            s.num_cached,
            s.num_held,
            s.usage,
            s.token_usage,
            s.stored_tokens,
            s.prefix_query_tokens,
            s.prefix_hit_tokens,
            s.evictions,
            s.computed_tokens,
            s.pending_tokens,
            s.external_query_tokens,
            s.external_hit_tokens,
            s.external_failures
        )
    }
}

/// One change of a tier: kind "stored", "removed" or "cleared"; medium "GPU" or "CPU".
#[pyclass(frozen, get_all, module = "pagedkv._core")]
struct Event {
    kind: &'static str,
    seq_no: u64,
    block_hash: Option<u128>,
    parent_hash: Option<u128>,
    token_ids: Vec<u32>,
    block_id: Option<u32>,
    medium: &'static str,
}

fn medium(pool: core::PoolKind) -> &'static str {
    match pool {
        core::PoolKind::Gpu => "GPU",
        core::PoolKind::Cpu => "CPU",
    }
}

impl From<core::Event> for Event {
    fn from(event: core::Event) -> Event {
        let (kind, block_hash, parent_hash, token_ids, block_id, medium) = match event.kind {
            core::EventKind::BlockStored {
                block_hash,
                parent_hash,
                token_ids,
                block_id,
                medium: pool,
            } => (
                "stored",
                Some(block_hash),
                parent_hash,
                token_ids,
                Some(block_id),
                medium(pool),
            ),
            core::EventKind::BlockRemoved {
                block_hash,
                block_id,
                medium: pool,
            } => (
                "removed",
                Some(block_hash),
                None,
                Vec::new(),
                Some(block_id),
                medium(pool),
            ),
            core::EventKind::AllBlocksCleared => ("cleared", None, None, Vec::new(), None, "GPU"),
        };
        Event {
            kind,
            seq_no: event.seq_no,
            block_hash,
            parent_hash,
            token_ids,
            block_id,
            medium,
        }
    }
}

#[pymethods]
impl Event {
    fn __repr__(&self) -> String {
        format!(
            "Event(kind={:?}, seq_no={}, medium={:?}, block_id={:?}, block_hash={:?}, \
             parent_hash={:?}, token_ids={:?})",
            self.kind,
            self.seq_no,
            self.medium,
            self.block_id,
            self.block_hash,
            self.parent_hash,
            self.token_ids
        )
    }
}

/// The compiled core of pagedkv.
#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BlockManager>()?;
    m.add_class::<Plan>()?;
    m.add_class::<Stats>()?;
    m.add_class::<Event>()?;
    m.add("OutOfBlocks", m.py().get_type::<OutOfBlocks>())?;
    Ok(())
}
