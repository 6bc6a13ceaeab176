//! Python bindings of `pagedkv`: type and error conversion only; all logic lives in the core.

mod attention;
mod batch;
mod conversions;
mod events;
mod feed;
mod hybrid;
mod keys;
mod manager;
mod plan;
mod state;
mod stats;

use pyo3::prelude::*;

/// The compiled core of pagedkv. It does not declare itself free-threading safe: numpy views of
/// a plan's buffers are written by Python code, and the plan reads those buffers (see
/// `plan.rs`), which the GIL orders; on a free-threaded Python, importing it enables the GIL.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<manager::BlockManager>()?;
    m.add_class::<hybrid::HybridManager>()?;
    m.add_class::<attention::Attention>()?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<plan::Plan>()?;
    m.add_class::<stats::Stats>()?;
    m.add_class::<state::StateConfig>()?;
    m.add_class::<stats::StateStats>()?;
    m.add_class::<events::Event>()?;
    m.add_class::<feed::Registration>()?;
    m.add("OutOfBlocks", m.py().get_type::<conversions::OutOfBlocks>())?;
    Ok(())
}
