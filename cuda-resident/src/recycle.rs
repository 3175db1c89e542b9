//! Vectors that batches reuse instead of allocating anew.
//!
//! A batch of thousands of copies builds vectors of hundreds of KiB. Fresh ones cost more
//! than the work itself: the allocator maps them from the system and every page faults on
//! first touch (measured: a batch of 8192 peer copies spent most of its building time in
//! page faults). So a device keeps the vectors of its last few batches, emptied, and lends them
//! to the next ones.

use crate::sync::{Mutex, lock};

/// Spare sets a device keeps per kind of batch: enough for a few threads submitting at once.
const KEEP: usize = 4;

/// Emptied `T`s for reuse.
#[derive(Debug, Default)]
pub(crate) struct Recycler<T> {
    spare: Mutex<Vec<T>>,
}

/// What a recycler can hold: something that can be emptied while keeping its capacity.
pub(crate) trait Reusable: Default {
    fn clear(&mut self);
}

impl<T: Reusable> Recycler<T> {
    /// An empty `T`, with the capacity of an earlier one when there is a spare.
    pub(crate) fn take(&self) -> T {
        lock(&self.spare).pop().unwrap_or_default()
    }

    /// A `T` as [`take`](Recycler::take) gives it, given back when the loan is dropped.
    pub(crate) fn lend(&self) -> Lent<'_, T> {
        Lent { from: self, item: Some(self.take()) }
    }

    /// Empties `item` and keeps it for a later batch (or drops it if enough are kept).
    pub(crate) fn give(&self, mut item: T) {
        item.clear();
        let mut spare = lock(&self.spare);
        if spare.len() < KEEP {
            spare.push(item);
        }
    }
}

/// A `T` lent by a [`Recycler`], given back to it when dropped (on every path out of the
/// code that holds it, errors included).
pub(crate) struct Lent<'a, T: Reusable> {
    from: &'a Recycler<T>,
    item: Option<T>,
}

impl<T: Reusable> std::ops::Deref for Lent<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item.as_ref().expect("lent until dropped")
    }
}

impl<T: Reusable> std::ops::DerefMut for Lent<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.item.as_mut().expect("lent until dropped")
    }
}

impl<T: Reusable> Drop for Lent<'_, T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            self.from.give(item);
        }
    }
}

/// An emptied `Vec` of one element type as a `Vec` of another of the same layout, keeping
/// its allocation: for the vectors of batches that borrow the caller's data (`Source<'a>`),
/// kept between batches as `Source<'static>`. Only an empty vector is converted, so no
/// reference outlives its lifetime.
pub(crate) fn relabel<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    // In-place collection reuses the allocation when `T` and `U` have the same layout.
    v.into_iter().map(|_| unreachable!("the vector is empty")).collect()
}

impl<T> Reusable for Vec<T> {
    fn clear(&mut self) {
        Vec::clear(self);
    }
}

impl<A: Reusable, B: Reusable> Reusable for (A, B) {
    fn clear(&mut self) {
        self.0.clear();
        self.1.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_returned_vector_comes_back_empty_with_its_capacity() {
        let r: Recycler<Vec<u64>> = Recycler::default();
        let mut v = r.take();
        v.extend(0..1000);
        let cap = v.capacity();
        r.give(v);
        let again = r.take();
        assert!(again.is_empty() && again.capacity() == cap);
        assert_eq!(r.take().capacity(), 0, "a fresh one when none is spare");
    }

    #[test]
    fn no_more_than_a_few_are_kept() {
        let r: Recycler<Vec<u64>> = Recycler::default();
        for _ in 0..10 {
            r.give(Vec::with_capacity(8));
        }
        assert_eq!(lock(&r.spare).len(), KEEP);
    }

    #[test]
    fn relabelling_keeps_the_allocation() {
        let data = [1u8, 2, 3];
        let mut v: Vec<&[u8]> = Vec::with_capacity(100);
        v.push(&data);
        let ptr = v.as_ptr() as usize;
        let w: Vec<(usize, usize)> = relabel(v);
        assert!(w.is_empty() && w.capacity() == 100 && w.as_ptr() as usize == ptr);
    }
}
