//! The eviction order of CACHED blocks: an intrusive doubly linked list over block ids, oldest
//! release at the head. Lives under the pool's lock; every operation is O(1).

use crate::bookkeeping::{try_boxed, TooLarge};
use crate::BlockId;

const NIL: u32 = u32::MAX;

/// CACHED blocks in release order.
pub(crate) struct Lru {
    prev: Box<[u32]>,
    next: Box<[u32]>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    /// An empty list over blocks `0..num_blocks`.
    pub(crate) fn new(num_blocks: u32) -> Result<Lru, TooLarge> {
        Ok(Lru {
            prev: try_boxed(num_blocks as usize, |_| NIL)?,
            next: try_boxed(num_blocks as usize, |_| NIL)?,
            head: NIL,
            tail: NIL,
            len: 0,
        })
    }

    /// Appends the most recently released block.
    pub(crate) fn push_back(&mut self, block: BlockId) {
        let b = block as usize;
        self.prev[b] = self.tail;
        self.next[b] = NIL;
        if self.tail == NIL {
            self.head = block;
        } else {
            self.next[self.tail as usize] = block;
        }
        self.tail = block;
        self.len += 1;
    }

    /// Prepends a block to evict before every other.
    pub(crate) fn push_front(&mut self, block: BlockId) {
        let b = block as usize;
        self.prev[b] = NIL;
        self.next[b] = self.head;
        if self.head == NIL {
            self.tail = block;
        } else {
            self.prev[self.head as usize] = block;
        }
        self.head = block;
        self.len += 1;
    }

    /// Number of blocks in the list.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Removes and returns the least recently released block.
    pub(crate) fn pop_front(&mut self) -> Option<BlockId> {
        let block = self.head;
        if block == NIL {
            return None;
        }
        self.remove(block);
        Some(block)
    }

    /// Unlinks a block that is in the list.
    pub(crate) fn remove(&mut self, block: BlockId) {
        let b = block as usize;
        let (prev, next) = (self.prev[b], self.next[b]);
        if prev == NIL {
            self.head = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.prev[next as usize] = prev;
        }
        self.prev[b] = NIL;
        self.next[b] = NIL;
        self.len -= 1;
    }

    /// The blocks from head (next to evict) to tail.
    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut block = self.head;
        let mut left = self.len;
        std::iter::from_fn(move || {
            if block == NIL || left == 0 {
                return None;
            }
            let current = block;
            block = self.next[block as usize];
            left -= 1;
            Some(current)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_with_removal() {
        let mut lru = Lru::new(5).unwrap();
        for b in [3, 1, 4, 0] {
            lru.push_back(b);
        }
        lru.remove(4);
        lru.remove(3);
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![1, 0]);
        lru.push_back(2);
        assert_eq!(lru.pop_front(), Some(1));
        assert_eq!(lru.pop_front(), Some(0));
        assert_eq!(lru.pop_front(), Some(2));
        assert_eq!(lru.pop_front(), None);
        assert_eq!(lru.iter().count(), 0);
    }
}
