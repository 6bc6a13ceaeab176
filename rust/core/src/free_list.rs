//! A lock-free LIFO stack of block ids (a Treiber stack over an index array).

use crate::bookkeeping::{try_boxed, TooLarge};
use crate::sync::{AtomicU32, AtomicU64, Backoff, Ordering};
use crate::BlockId;

const NIL: u32 = u32::MAX;

/// Free blocks, most recently freed on top. The head packs `(tag << 32) | top`; the tag counts
/// successful operations so a pop that read a stale `next` can never succeed (no ABA).
pub(crate) struct FreeList {
    head: AtomicU64,
    next: Box<[AtomicU32]>,
}

fn pack(tag: u64, top: u32) -> u64 {
    (tag << 32) | u64::from(top)
}

fn top(head: u64) -> u32 {
    head as u32
}

fn tag(head: u64) -> u64 {
    head >> 32
}

impl FreeList {
    /// A stack holding every block, `0` on top, then `1`, `2`, ...
    pub(crate) fn full(num_blocks: u32) -> Result<FreeList, TooLarge> {
        let next = try_boxed(num_blocks as usize, |b| {
            let after = b as u32 + 1;
            AtomicU32::new(if after < num_blocks { after } else { NIL })
        })?;
        let first = if num_blocks == 0 { NIL } else { 0 };
        Ok(FreeList {
            head: AtomicU64::new(pack(0, first)),
            next,
        })
    }

    /// Pushes a block that nobody else references.
    pub(crate) fn push(&self, block: BlockId) {
        let mut backoff = Backoff::default();
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            self.next[block as usize].store(top(head), Ordering::Relaxed);
            // Release: our `next` store, and the host metadata the pusher wrote about the block
            // (its state word), happen before the pop that takes it. Not the GPU's KV writes:
            // streams and events order those.
            match self.head.compare_exchange_weak(
                head,
                pack(tag(head) + 1, block),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(current) => {
                    head = current;
                    backoff.snooze();
                }
            }
        }
    }

    /// Pops the most recently pushed block, or `None` when the stack is empty.
    pub(crate) fn pop(&self) -> Option<BlockId> {
        // Acquire: pairs with `push`'s release so `next[top]` is the pushed value.
        let mut backoff = Backoff::default();
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let block = top(head);
            if block == NIL {
                return None;
            }
            // A stale read here is harmless: the tag makes the exchange below fail.
            let next = self.next[block as usize].load(Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                head,
                pack(tag(head) + 1, next),
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(block),
                Err(current) => {
                    head = current;
                    backoff.snooze();
                }
            }
        }
    }

    /// The blocks from top to bottom. Only meaningful while no thread pushes or pops.
    pub(crate) fn snapshot(&self) -> Vec<BlockId> {
        let mut blocks = Vec::new();
        let mut block = top(self.head.load(Ordering::Acquire));
        while block != NIL && blocks.len() <= self.next.len() {
            blocks.push(block);
            block = self.next[block as usize].load(Ordering::Relaxed);
        }
        blocks
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn lifo_order_from_zero() {
        let list = FreeList::full(3).unwrap();
        assert_eq!(list.snapshot(), vec![0, 1, 2]);
        assert_eq!(list.pop(), Some(0));
        assert_eq!(list.pop(), Some(1));
        list.push(0);
        assert_eq!(list.pop(), Some(0));
        assert_eq!(list.pop(), Some(2));
        assert_eq!(list.pop(), None);
        list.push(2);
        assert_eq!(list.snapshot(), vec![2]);
    }

    #[test]
    fn empty_list() {
        let list = FreeList::full(0).unwrap();
        assert_eq!(list.pop(), None);
        assert!(list.snapshot().is_empty());
    }

    #[test]
    fn threads_never_share_a_block() {
        let list = std::sync::Arc::new(FreeList::full(64).unwrap());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let list = list.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let a = list.pop().unwrap();
                        let b = list.pop().unwrap();
                        assert_ne!(a, b);
                        list.push(a);
                        list.push(b);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let mut all = list.snapshot();
        all.sort_unstable();
        assert_eq!(all, (0..64).collect::<Vec<_>>());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    #[test]
    fn concurrent_pops_get_distinct_blocks() {
        loom::model(|| {
            let list = Arc::new(FreeList::full(2).unwrap());
            let other = list.clone();
            let t = loom::thread::spawn(move || other.pop());
            let mine = list.pop();
            let theirs = t.join().unwrap();
            assert!(mine.is_some() && theirs.is_some());
            assert_ne!(mine, theirs);
            assert_eq!(list.pop(), None);
        });
    }

    #[test]
    fn push_pop_race_loses_nothing() {
        loom::model(|| {
            let list = Arc::new(FreeList::full(2).unwrap());
            let a = list.pop().unwrap();
            let other = list.clone();
            let t = loom::thread::spawn(move || {
                let b = other.pop();
                if let Some(b) = b {
                    other.push(b);
                }
            });
            list.push(a);
            t.join().unwrap();
            let mut all = list.snapshot();
            all.sort_unstable();
            assert_eq!(all, vec![0, 1]);
        });
    }
}
