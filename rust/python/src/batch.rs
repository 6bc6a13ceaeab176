//! The `Batch` Python class: a persistent decode batch. Its arrays are copies (a row count of
//! ints each), since the batch rewrites its buffers in place at every step; the block table is
//! copied only when asked for, and a device copy follows it through `take_updates`.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;

use pagedkv as core;

use crate::attention::Attention;
use crate::conversions::{seq_id, to_py};

/// A decode batch that persists across steps (see `pagedkv.Batch`).
#[pyclass(module = "pagedkv._core")]
pub(crate) struct Batch {
    pub(crate) inner: core::Batch,
}

fn int32<'py>(py: Python<'py>, values: &[i32]) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_slice(py, values)
}

/// A copy of flat int32 `values` as rows of `width`.
fn rows_of<'py>(py: Python<'py>, values: &[i32], width: usize) -> Bound<'py, PyArray2<i32>> {
    let rows =
        Array2::from_shape_vec((values.len() / width, width), values.to_vec()).expect("whole rows");
    rows.into_pyarray(py)
}

#[pymethods]
impl Batch {
    /// An empty batch.
    #[new]
    fn new() -> Batch {
        Batch {
            inner: core::Batch::new(),
        }
    }

    /// Adds a row for `seq_id` at the end; ValueError if it has one.
    fn add(&mut self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.add(self::seq_id(seq_id)?).map_err(to_py)
    }

    /// Removes the row of `seq_id` (the last row moves into its place); ValueError if none.
    fn remove(&mut self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.remove(self::seq_id(seq_id)?).map_err(to_py)
    }

    /// Removes every row.
    fn clear(&mut self) {
        self.inner.clear();
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Whether `seq_id` has a row; False for anything that is not a sequence id, as for
    /// `seq_id in manager`.
    fn __contains__(&self, seq_id: &Bound<'_, PyAny>) -> bool {
        self::seq_id(seq_id).is_ok_and(|id| self.inner.contains(id))
    }

    /// The row of `seq_id`, or None.
    fn row(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        Ok(self.inner.row(self::seq_id(seq_id)?))
    }

    /// `[B]` uint64 sequence id of each row.
    #[getter]
    fn seq_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_slice(py, self.inner.seqs())
    }

    /// `[B + 1]` int32 offsets of each row's pages in `kv_indices` (last step).
    #[getter]
    fn kv_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.inner.inputs().kv_indptr)
    }

    /// `[nnz]` int32 blocks of every row, concatenated: built from the table on each access.
    #[getter]
    fn kv_indices<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let mut out = Vec::new();
        self.inner.write_kv_indices(&mut out);
        out.into_pyarray(py)
    }

    /// `[B]` int32 tokens in each row's last block (last step).
    #[getter]
    fn kv_last_page_len<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.inner.inputs().kv_last_page_len)
    }

    /// `[B + 1]` int32 query offsets: one token per row (last step).
    #[getter]
    fn qo_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.inner.inputs().qo_indptr)
    }

    /// `[B]` int32 KV slot of each row's new token (last step).
    #[getter]
    fn slot_mapping<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.inner.inputs().slot_mapping)
    }

    /// `[B]` int32 position of each row's new token (last step).
    #[getter]
    fn positions<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.inner.inputs().positions)
    }

    /// `[n, 2]` int32 copy-on-write `(src, dst)` pairs to apply before the last step's
    /// forward pass.
    #[getter]
    fn copies<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<i32>> {
        rows_of(py, &self.inner.inputs().copies, 2)
    }

    /// `[B]` int32 recurrent-state slot of each row (group 0's batch of a hybrid manager with
    /// a state group; empty otherwise).
    #[getter]
    fn state_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.inner.inputs().state_slots)
    }

    /// `[n, 2]` int32 state copies `(src, dst)` to apply, in order, before the last step's pass.
    #[getter]
    fn state_copies<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<i32>> {
        rows_of(py, &self.inner.inputs().state_copies, 2)
    }

    /// `[n]` int32 state slots to reset before the last step's pass (after the copies).
    #[getter]
    fn state_resets<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.inner.inputs().state_resets)
    }

    /// `[n, 3]` int32 `(row, tokens, slot)` state saves of the last step's pass.
    #[getter]
    fn state_saves<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<i32>> {
        rows_of(py, &self.inner.inputs().state_saves, 3)
    }

    /// Token slots per block of the manager that stepped the batch (0 before any step).
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.inputs().block_size
    }

    /// What the last step's queries attend to (the manager's attention).
    #[getter]
    fn attention(&self) -> Attention {
        Attention {
            inner: self.inner.inputs().attention,
        }
    }

    /// Columns of the block table.
    #[getter]
    fn width(&self) -> usize {
        self.inner.width()
    }

    /// `[B, width]` int32 block table, each row its sequence's blocks padded with -1 (a copy).
    #[getter]
    fn block_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let (rows, cols) = (self.inner.len(), self.inner.width());
        let mut table = Vec::new();
        table.try_reserve_exact(rows * cols).map_err(|_| {
            PyMemoryError::new_err(format!(
                "batch.block_table needs {rows} x {cols} int32 entries, which cannot be allocated"
            ))
        })?;
        table.extend_from_slice(self.inner.block_table());
        Ok(Array2::from_shape_vec((rows, cols), table)
            .expect("rows * cols entries")
            .into_pyarray(py))
    }

    /// The table entries written since the last call, and clears the log: `(full, index,
    /// blocks)`. `full` means copy the whole `block_table` (the layout changed); otherwise
    /// write `blocks[i]` at flat position `index[i]` (int64) of a `[*, width]` copy, in order.
    fn take_updates<'py>(
        &mut self,
        py: Python<'py>,
    ) -> (bool, Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i32>>) {
        let updates = self.inner.updates();
        let taken = (
            updates.full,
            PyArray1::from_slice(py, &updates.index),
            int32(py, &updates.blocks),
        );
        self.inner.clear_updates();
        taken
    }

    fn __repr__(&self) -> String {
        format!(
            "Batch(len={}, width={})",
            self.inner.len(),
            self.inner.width()
        )
    }
}
