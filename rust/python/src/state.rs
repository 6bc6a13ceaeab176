//! `StateConfig`: the state group of a `HybridManager` (see `pagedkv.StateConfig`);
//! conversions only.

use pyo3::prelude::*;

use pagedkv as core;

use crate::conversions::{integer, Count};

/// How a hybrid manager keeps the recurrent states of its Mamba / linear-attention layers
/// (see `pagedkv.StateConfig`).
#[pyclass(frozen, eq, module = "pagedkv._core")]
#[derive(Clone, PartialEq)]
pub(crate) struct StateConfig {
    pub(crate) inner: core::StateConfig,
}

#[pymethods]
impl StateConfig {
    #[new]
    #[pyo3(signature = (num_slots, *, max_checkpoints = None,
        checkpoint_interval = Count::Default(0), checkpoints_per_sequence = Count::Default(1),
        num_cpu_slots = Count::Default(0)),
        text_signature = "(num_slots, *, max_checkpoints=None, checkpoint_interval=0, \
        checkpoints_per_sequence=1, num_cpu_slots=0)")]
    fn new(
        num_slots: &Bound<'_, PyAny>,
        max_checkpoints: Option<&Bound<'_, PyAny>>,
        checkpoint_interval: Count<'_>,
        checkpoints_per_sequence: Count<'_>,
        num_cpu_slots: Count<'_>,
    ) -> PyResult<StateConfig> {
        let num_slots = integer::<u32>(num_slots, "num_slots")?;
        let mut inner = core::StateConfig::new(num_slots);
        if let Some(max) = max_checkpoints {
            inner.max_checkpoints = integer::<u32>(max, "max_checkpoints")?;
        }
        inner.checkpoint_interval = checkpoint_interval.get("checkpoint_interval")?;
        inner.checkpoints_per_sequence =
            checkpoints_per_sequence.get("checkpoints_per_sequence")?;
        inner.num_cpu_slots = num_cpu_slots.get("num_cpu_slots")?;
        Ok(StateConfig { inner })
    }

    /// Slots of the state pool (working slots, draft states of speculative passes and
    /// checkpoints).
    #[getter]
    fn num_slots(&self) -> u32 {
        self.inner.num_slots
    }

    /// The most slots that hold checkpoints.
    #[getter]
    fn max_checkpoints(&self) -> u32 {
        self.inner.max_checkpoints
    }

    /// Tokens between interval checkpoints (0: prompt ends and branch points only).
    #[getter]
    fn checkpoint_interval(&self) -> u32 {
        self.inner.checkpoint_interval
    }

    /// Checkpoints one sequence keeps along its path (its branch point aside).
    #[getter]
    fn checkpoints_per_sequence(&self) -> u32 {
        self.inner.checkpoints_per_sequence
    }

    /// Slots of the CPU state pool, for swapped-out sequences.
    #[getter]
    fn num_cpu_slots(&self) -> u32 {
        self.inner.num_cpu_slots
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "StateConfig({}, max_checkpoints={}, checkpoint_interval={}, \
             checkpoints_per_sequence={}, num_cpu_slots={})",
            c.num_slots,
            c.max_checkpoints,
            c.checkpoint_interval,
            c.checkpoints_per_sequence,
            c.num_cpu_slots
        )
    }
}
