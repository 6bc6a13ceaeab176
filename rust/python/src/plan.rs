//! The `Plan` Python class: numpy views of one step's plan buffers, which go back to their
//! manager for reuse once the plan and every view of it are gone.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use numpy::ndarray::{Array2, ArrayViewMut1, ArrayViewMut2};
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;

use pagedkv as core;

use crate::attention::Attention;

/// Plan buffers of dropped plans, kept for reuse: fresh buffers every step would cost page
/// faults once plans get large.
pub(crate) type PlanPool = Arc<Mutex<Vec<core::Plan>>>;

/// Plan buffers to fill: a dropped plan's when there is one (warm, already large enough).
pub(crate) fn spare_plan(pool: &PlanPool) -> core::Plan {
    let spare = pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
    spare.unwrap_or_default()
}

/// Spare plans kept per manager (a step rarely has more than two plans alive).
const SPARE_PLANS: usize = 4;

/// The plan's int32 buffers that Python sees as numpy views, in the order of `Plan::buffers`.
#[derive(Clone, Copy, PartialEq)]
enum Field {
    KvIndptr,
    KvIndices,
    KvLastPageLen,
    QoIndptr,
    SlotMapping,
    Positions,
    /// `(src, dst)` pairs, flat: viewed as `[n, 2]`.
    Copies,
    StateSlots,
    /// `(src, dst)` pairs, flat: viewed as `[n, 2]`.
    StateCopies,
    StateResets,
    /// `(row, tokens, slot)` triples, flat: viewed as `[n, 3]`.
    StateSaves,
}

/// Where one of the plan's buffers is: its address and length, captured once when the plan is
/// handed out, so that no view is ever built from a fresh `&mut` borrow.
#[derive(Clone, Copy)]
struct Buffer {
    ptr: NonNull<i32>,
    len: usize,
}

// SAFETY: a `Buffer` is an address and a length; nothing reads or writes through it but
// `Plan::array`, whose SAFETY comment says why that is sound from any thread.
unsafe impl Send for Buffer {}
// SAFETY: as for `Send`: sharing the address gives no access by itself.
unsafe impl Sync for Buffer {}

impl Buffer {
    fn of(values: &mut Vec<i32>) -> Buffer {
        // `Vec::as_mut_ptr` does not materialize a reference to the elements, so later shared
        // borrows of the Vec (in `block_tables`) do not invalidate this pointer.
        let ptr = NonNull::new(values.as_mut_ptr()).expect("a Vec's pointer is never null");
        Buffer {
            ptr,
            len: values.len(),
        }
    }
}

/// The plan of one step. Its arrays are numpy views of the Rust buffers (no copy); each view
/// keeps the plan alive, and the buffers go back to the manager for reuse only when the plan
/// and every view of it are gone. (Views are not cached on the plan: that would be a reference
/// cycle.)
#[pyclass(frozen, module = "pagedkv._core")]
pub(crate) struct Plan {
    /// The Rust plan. While the plan is alive nothing in Rust resizes, reallocates or writes
    /// its buffers: they are read only by `block_tables`, and written only by numpy, through
    /// `buffers`.
    raw: core::Plan,
    /// The buffers of `raw`, in the order of [`Field`].
    buffers: [Buffer; 11],
    pool: PlanPool,
    #[pyo3(get)]
    batch_size: usize,
    #[pyo3(get)]
    num_query_tokens: usize,
    #[pyo3(get)]
    block_size: u32,
    /// What the plan's queries attend to.
    #[pyo3(get)]
    attention: Attention,
}

impl Plan {
    /// Wraps a filled plan; its buffers return to `pool` when the plan and its views are gone.
    pub(crate) fn new(mut plan: core::Plan, pool: PlanPool) -> Plan {
        let buffers = [
            Buffer::of(&mut plan.kv_indptr),
            Buffer::of(&mut plan.kv_indices),
            Buffer::of(&mut plan.kv_last_page_len),
            Buffer::of(&mut plan.qo_indptr),
            Buffer::of(&mut plan.slot_mapping),
            Buffer::of(&mut plan.positions),
            Buffer::of(&mut plan.copies),
            Buffer::of(&mut plan.state_slots),
            Buffer::of(&mut plan.state_copies),
            Buffer::of(&mut plan.state_resets),
            Buffer::of(&mut plan.state_saves),
        ];
        Plan {
            batch_size: plan.batch_size(),
            num_query_tokens: plan.num_query_tokens(),
            block_size: plan.block_size,
            attention: Attention {
                inner: plan.attention,
            },
            raw: plan,
            buffers,
            pool,
        }
    }

    /// A writable numpy view of one buffer: 1-D, or `[n, 2]` for the copies.
    fn array(this: &Bound<'_, Self>, field: Field) -> Py<PyAny> {
        let Buffer { ptr, len } = this.get().buffers[field as usize];
        let container = this.clone().into_any();
        // SAFETY: validity: `ptr` and `len` describe a live, initialized buffer of `raw`, which
        // the plan owns and never resizes, reallocates or frees while alive; the view's base is
        // the plan, so the buffer outlives the view (`Drop` hands it back to the pool only when
        // no view is left). Aliasing: no `&mut` borrow of a buffer exists after `Plan::new`;
        // every view, on whatever thread and however many are alive, is built from this same
        // raw pointer, so two live writable views never come from overlapping `&mut` borrows.
        // The only Rust accesses while the plan is alive are `block_tables`'s reads, made with
        // the GIL held, as numpy's own writes through the views are: the module does not
        // declare `gil_used = false` (lib.rs), so a GIL exists even on a free-threaded Python
        // and orders them.
        unsafe {
            match field {
                Field::Copies | Field::StateCopies | Field::StateSaves => {
                    let width = if field == Field::StateSaves { 3 } else { 2 };
                    let view = ArrayViewMut2::from_shape_ptr((len / width, width), ptr.as_ptr());
                    PyArray2::borrow_from_array(&view, container)
                        .into_any()
                        .unbind()
                }
                _ => {
                    let view = ArrayViewMut1::from_shape_ptr(len, ptr.as_ptr());
                    PyArray1::borrow_from_array(&view, container)
                        .into_any()
                        .unbind()
                }
            }
        }
    }
}

impl Plan {
    /// The views are writable: before reading pages through `kv_indptr`, check that it still
    /// starts at 0, never decreases and stays within `kv_indices`.
    fn check_csr(&self) -> PyResult<()> {
        let indptr = &self.raw.kv_indptr;
        let csr = indptr.first().is_none_or(|&first| first == 0)
            && indptr.windows(2).all(|w| w[0] <= w[1])
            && indptr
                .last()
                .is_none_or(|&last| last as usize <= self.raw.kv_indices.len());
        if csr {
            return Ok(());
        }
        Err(PyValueError::new_err(format!(
            "plan.block_tables: kv_indptr was written through its view and no longer indexes \
             kv_indices (it must start at 0, never decrease and end at most at {})",
            self.raw.kv_indices.len()
        )))
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        let raw = std::mem::take(&mut self.raw);
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
        Plan::array(this, Field::KvIndptr)
    }
    /// `[nnz]` int32 physical blocks of the batch, concatenated.
    #[getter]
    fn kv_indices(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::KvIndices)
    }
    /// `[B]` int32 tokens in each sequence's last block.
    #[getter]
    fn kv_last_page_len(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::KvLastPageLen)
    }
    /// `[B + 1]` int32 offsets of each sequence's query tokens.
    #[getter]
    fn qo_indptr(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::QoIndptr)
    }
    /// `[num_query_tokens]` int32 KV slot of each new token; -1 where the KV is cached already
    /// (a state group recomputing its state over a KV hit): write nothing there.
    #[getter]
    fn slot_mapping(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::SlotMapping)
    }
    /// `[num_query_tokens]` int32 position of each new token.
    #[getter]
    fn positions(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::Positions)
    }
    /// `[B, max_blocks]` int32 block tables padded with -1, built from the pages on each access
    /// (a new array, not a view); MemoryError when it does not fit, ValueError when a write
    /// into the `kv_indptr` view broke the CSR.
    #[getter]
    fn block_tables<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        self.check_csr()?;
        let (rows, cols) = (self.batch_size, self.raw.max_blocks());
        let tables = self.raw.block_tables().map_err(|_| {
            PyMemoryError::new_err(format!(
                "plan.block_tables needs {rows} x {cols} int32 entries, which cannot be allocated"
            ))
        })?;
        let tables = Array2::from_shape_vec((rows, cols), tables).expect("rows * cols values");
        Ok(tables.into_pyarray(py))
    }
    /// `[n, 2]` int32 copy-on-write `(src, dst)` pairs to apply before this step's forward pass.
    #[getter]
    fn copies(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::Copies)
    }
    /// `[B]` int32 recurrent-state slot of each row (a hybrid manager with a state group
    /// fills the `state_*` arrays of group 0's plan; they are empty otherwise).
    #[getter]
    fn state_slots(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::StateSlots)
    }
    /// `[n, 2]` int32 state copies `(src, dst)` to apply, in order, before the forward pass.
    #[getter]
    fn state_copies(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::StateCopies)
    }
    /// `[n]` int32 state slots to reset to the initial state before the pass (after the
    /// copies).
    #[getter]
    fn state_resets(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::StateResets)
    }
    /// `[n, 3]` int32 `(row, tokens, slot)`: save row `row`'s state after its first `tokens`
    /// query tokens into `slot` during the pass (a checkpoint once the pass is committed).
    #[getter]
    fn state_saves(this: &Bound<'_, Self>) -> Py<PyAny> {
        Plan::array(this, Field::StateSaves)
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(batch_size={}, num_query_tokens={}, block_size={})",
            self.batch_size, self.num_query_tokens, self.block_size
        )
    }
}
