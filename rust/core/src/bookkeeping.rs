//! Per-block bookkeeping arrays, allocated fallibly: a pool too large for the machine's memory is
//! an error the caller can report, never an abort of the process.

use crate::error::invalid;
use crate::Error;

/// An allocation of `bytes` bytes failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TooLarge {
    pub(crate) bytes: usize,
}

impl TooLarge {
    /// The error to report: `what` (the argument that sized the allocation) is too large.
    pub(crate) fn naming(self, what: String) -> Error {
        invalid(format!(
            "{what} is too large: its bookkeeping cannot be allocated ({} bytes failed)",
            self.bytes
        ))
    }
}

/// `len` values `value(0), value(1), ...`, or the failed allocation.
pub(crate) fn try_boxed<T>(
    len: usize,
    value: impl FnMut(usize) -> T,
) -> Result<Box<[T]>, TooLarge> {
    let mut values = Vec::new();
    values.try_reserve_exact(len).map_err(|_| TooLarge {
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    })?;
    values.extend((0..len).map(value));
    Ok(values.into_boxed_slice())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn fills_in_order_or_reports_the_size() {
        assert_eq!(&*try_boxed(3, |i| i * 2).unwrap(), &[0, 2, 4]);
        let huge = usize::MAX / 8;
        assert_eq!(
            try_boxed(huge, |_| 0u64).unwrap_err(),
            TooLarge { bytes: huge * 8 }
        );
    }
}
