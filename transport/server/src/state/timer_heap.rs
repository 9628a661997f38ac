//! The connections' timers: one deadline per connection slot, earliest
//! first, in a binary heap with lazy deletion.
//!
//! Each slot keeps its current deadline and a generation; the heap holds
//! `(deadline, slot, generation)` entries. Moving or clearing a deadline
//! only bumps the slot's generation: the old entry stays in the heap,
//! stale, and is skipped when it reaches the top. An entry is 16 bytes:
//! the deadline as signed nanoseconds from the first deadline set (exact,
//! and ordered as the instants are), the slot and generation as `u32`s.
//! Popping walks the heap from the root to a leaf, so a small entry keeps
//! more of its levels in cache (a calm server holds one per connection). The top entry is always
//! live (stale ones are popped as soon as they surface), so the earliest
//! deadline is read without a mutable borrow. When stale entries outnumber
//! twice the live ones (past a floor), the heap is rebuilt from the live
//! ones, so it stays within three times the live count.
//!
//! A heap rather than a timer wheel: deadlines are quinn-proto's exact
//! instants, and the order must be exact and deterministic (earliest
//! deadline, then lowest slot, as the B-tree set it replaces had), since
//! the simulator replays the server from seeds; a wheel would round
//! deadlines to its ticks and need sorting within a tick to keep that
//! order. A heap is one contiguous array, with no allocation per timer.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// Stale entries tolerated however few timers are live (a rebuild of a
/// small heap would happen too often to pay for itself).
const REBUILD_FLOOR: usize = 64;

/// A heap entry: ordered by deadline (nanoseconds from
/// [`TimerHeap::origin`]), then slot (the generation never decides between
/// live entries: a slot has at most one).
type Entry = (i64, u32, u32);

#[derive(Clone, Copy, Default)]
struct Slot {
    at: Option<Instant>,
    generation: u32,
}

#[derive(Default)]
pub(crate) struct TimerHeap {
    heap: BinaryHeap<Reverse<Entry>>,
    slots: Vec<Slot>,
    live: usize,
    /// The first deadline set: entries count from it.
    origin: Option<Instant>,
}

impl TimerHeap {
    /// The slot's deadline.
    pub fn get(&self, slot: usize) -> Option<Instant> {
        self.slots.get(slot).and_then(|s| s.at)
    }

    /// Sets (or, with `None`, clears) the slot's deadline.
    pub fn set(&mut self, slot: usize, at: Option<Instant>) {
        if self.get(slot) == at {
            return;
        }
        if self.slots.len() <= slot {
            self.slots.resize(slot + 1, Slot::default());
        }
        let s = &mut self.slots[slot];
        // A wrapped generation cannot meet its old entry: a rebuild drops
        // every stale entry long before 2^32 moves of one slot.
        s.generation = s.generation.wrapping_add(1);
        let was = std::mem::replace(&mut s.at, at);
        let generation = s.generation;
        match (was, at) {
            (None, Some(_)) => self.live += 1,
            (Some(_), None) => self.live -= 1,
            _ => {}
        }
        if let Some(at) = at {
            let key = self.key(at);
            // Slots are connection indexes, far below 2^32.
            let slot = u32::try_from(slot).expect("a timer slot past u32::MAX");
            self.heap.push(Reverse((key, slot, generation)));
        }
        let stale = self.heap.len() - self.live;
        if stale > REBUILD_FLOOR && stale > 2 * self.live {
            self.rebuild();
        } else {
            self.skip_stale();
        }
    }

    /// The earliest deadline and its slot (the lowest slot among equal
    /// deadlines).
    pub fn first(&self) -> Option<(Instant, usize)> {
        let Reverse((_, slot, _)) = self.heap.peek()?;
        let slot = *slot as usize;
        // The top entry is live: its slot holds its deadline.
        self.slots[slot].at.map(|at| (at, slot))
    }

    /// Takes the earliest timer if it is due at `now`: clears its slot and
    /// returns the slot.
    pub fn pop_due(&mut self, now: Instant) -> Option<usize> {
        let (at, slot) = self.first()?;
        if at > now {
            return None;
        }
        self.heap.pop();
        let s = &mut self.slots[slot];
        s.at = None;
        s.generation = s.generation.wrapping_add(1);
        self.live -= 1;
        self.skip_stale();
        Some(slot)
    }

    /// Live timers.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.live
    }

    /// Entries in the heap, live and stale.
    #[cfg(test)]
    pub fn entries(&self) -> usize {
        self.heap.len()
    }

    /// The slots with a deadline, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, Instant)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| s.at.map(|at| (slot, at)))
    }

    /// The heap's own invariants: the live count, one entry per live slot,
    /// a live top, the bound on stale entries.
    pub fn check(&self) -> Result<(), String> {
        let live = self.slots.iter().filter(|s| s.at.is_some()).count();
        if live != self.live {
            return Err(format!("{} timers counted, {live} set", self.live));
        }
        let mut entries = vec![0usize; self.slots.len()];
        for Reverse(entry) in self.heap.iter() {
            if self.is_live(entry) {
                let slot = entry.1 as usize;
                let at = self.slots[slot]
                    .at
                    .zip(self.origin)
                    .map(|(at, o)| offset(o, at));
                if at != Some(entry.0) {
                    return Err(format!("slot {slot}: its entry is not at its deadline"));
                }
                entries[slot] += 1;
            }
        }
        for (slot, s) in self.slots.iter().enumerate() {
            if usize::from(s.at.is_some()) != entries[slot] {
                return Err(format!("slot {slot}: {} live heap entries", entries[slot]));
            }
        }
        if self
            .heap
            .peek()
            .is_some_and(|Reverse(top)| !self.is_live(top))
        {
            return Err("the heap's top entry is stale".into());
        }
        let stale = self.heap.len() - self.live;
        if stale > REBUILD_FLOOR && stale > 2 * self.live {
            return Err(format!("{stale} stale entries for {} live", self.live));
        }
        Ok(())
    }

    /// A slot's every change bumps its generation, so an entry of its
    /// current generation holds its current deadline.
    fn is_live(&self, &(_, slot, generation): &Entry) -> bool {
        self.slots
            .get(slot as usize)
            .is_some_and(|s| s.at.is_some() && s.generation == generation)
    }

    /// `at` as signed nanoseconds from the first deadline set: exact for
    /// deadlines within 292 years of it either way, and in their order.
    fn key(&mut self, at: Instant) -> i64 {
        let origin = *self.origin.get_or_insert(at);
        offset(origin, at)
    }

    fn skip_stale(&mut self) {
        while let Some(Reverse(top)) = self.heap.peek() {
            if self.is_live(top) {
                return;
            }
            self.heap.pop();
        }
    }

    fn rebuild(&mut self) {
        let slots = &self.slots;
        self.heap.retain(|Reverse((_, slot, generation))| {
            let s = &slots[*slot as usize];
            s.at.is_some() && s.generation == *generation
        });
    }
}

/// Signed nanoseconds from `origin` to `at`.
fn offset(origin: Instant, at: Instant) -> i64 {
    let nanos = |d: std::time::Duration| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
    match at.checked_duration_since(origin) {
        Some(after) => nanos(after),
        None => -nanos(origin - at),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::time::Duration;

    /// A small deterministic generator (xorshift), so each run is the same.
    struct Gen(u64);
    impl Gen {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Random sets, clears and pops against the B-tree set of
    /// `(deadline, slot)` the heap replaces: the same timers come out in
    /// the same order, equal deadlines by slot.
    #[test]
    fn pops_in_the_order_of_the_btree_set() {
        let base = Instant::now();
        let mut heap = TimerHeap::default();
        let mut model: BTreeSet<(Instant, usize)> = BTreeSet::new();
        let mut model_at: Vec<Option<Instant>> = vec![None; 50];
        // The first deadline is an hour ahead: every later one counts back
        // from it.
        let far = base + Duration::from_secs(3600);
        heap.set(49, Some(far));
        model.insert((far, 49));
        model_at[49] = Some(far);
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        let mut now = base;
        let mut popped = 0;
        for step in 0..200_000 {
            match g.below(10) {
                0..=5 => {
                    let slot = g.below(50) as usize;
                    // Few distinct deadlines, so many are equal.
                    let at = now + Duration::from_millis(g.below(8) * 10);
                    let at = (g.below(6) != 0).then_some(at);
                    heap.set(slot, at);
                    if let Some(old) = model_at[slot].take() {
                        model.remove(&(old, slot));
                    }
                    if let Some(at) = at {
                        model.insert((at, slot));
                        model_at[slot] = Some(at);
                    }
                }
                _ => {
                    now += Duration::from_millis(g.below(3) * 10);
                    loop {
                        let expected = model.first().filter(|&&(at, _)| at <= now).copied();
                        let got = heap.pop_due(now);
                        assert_eq!(got, expected.map(|(_, slot)| slot));
                        let Some(entry) = expected else { break };
                        model.remove(&entry);
                        model_at[entry.1] = None;
                        popped += 1;
                    }
                }
            }
            assert_eq!(heap.first(), model.first().copied());
            assert_eq!(heap.len(), model.len());
            if step % 1000 == 0 {
                heap.check().unwrap();
            }
        }
        heap.check().unwrap();
        assert!(popped > 10_000, "the run popped {popped} timers");
    }

    /// Equal deadlines come out lowest slot first, whatever the order in
    /// which they were set.
    #[test]
    fn equal_deadlines_by_slot() {
        let at = Instant::now();
        let mut heap = TimerHeap::default();
        for slot in [7, 3, 9, 0, 5] {
            heap.set(slot, Some(at));
        }
        let order: Vec<usize> = std::iter::from_fn(|| heap.pop_due(at)).collect();
        assert_eq!(order, [0, 3, 5, 7, 9]);
    }

    /// A moved or cleared deadline never fires at its old time, and a slot
    /// moved back to an earlier deadline fires once.
    #[test]
    fn stale_entries_are_skipped() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut heap = TimerHeap::default();
        heap.set(1, Some(ms(10)));
        heap.set(2, Some(ms(20)));
        heap.set(3, Some(ms(5)));
        heap.set(1, Some(ms(30))); // moved later
        heap.set(3, None); // cleared
        heap.set(2, Some(ms(40)));
        heap.set(2, Some(ms(20))); // moved back: two entries (20, 2) in the heap
                                   // ...of which only the newest is live: one live entry per timer is
                                   // what bounds the heap (a rebuild keeps what is live).
        heap.check().unwrap();
        assert_eq!(heap.first(), Some((ms(20), 2)));
        assert_eq!(heap.pop_due(ms(25)), Some(2));
        assert_eq!(heap.pop_due(ms(25)), None, "slot 2 fired twice");
        assert_eq!(heap.first(), Some((ms(30), 1)));
        assert_eq!(heap.pop_due(ms(100)), Some(1));
        assert_eq!(heap.pop_due(ms(100)), None);
        assert_eq!(heap.len(), 0);
        heap.check().unwrap();
    }

    /// Deadlines moved while an earlier timer holds the top (so their
    /// stale entries sink and are never popped) keep the heap within three
    /// times the live timers.
    #[test]
    fn rebuilds_when_stale_entries_pile_up() {
        let t0 = Instant::now();
        let mut heap = TimerHeap::default();
        let anchor = 1000;
        heap.set(anchor, Some(t0));
        let moving = 100;
        let mut most = 0;
        for round in 1..=1000u64 {
            for slot in 0..moving {
                heap.set(slot, Some(t0 + Duration::from_secs(round)));
                most = most.max(heap.entries());
            }
        }
        heap.check().unwrap();
        assert_eq!(heap.len(), moving + 1);
        let bound = 3 * (moving + 1) + REBUILD_FLOOR;
        assert!(most <= bound, "{most} entries for {} timers", moving + 1);
        // Deadlines moved back and forth between two instants: an old
        // entry at the slot's current instant is stale all the same.
        let mut rebuilds = 0;
        for round in 0..1000u64 {
            for slot in 0..moving {
                let before = heap.entries();
                heap.set(slot, Some(t0 + Duration::from_secs(1 + round % 2)));
                most = most.max(heap.entries());
                // With the anchor on top nothing is popped: fewer entries
                // means a rebuild, which keeps exactly the live ones.
                if heap.entries() < before {
                    assert_eq!(heap.entries(), heap.len(), "a rebuild kept stale entries");
                    rebuilds += 1;
                }
            }
        }
        assert!(rebuilds > 100, "{rebuilds} rebuilds");
        assert!(most <= bound, "{most} entries for {} timers", moving + 1);
        // Clearing them leaves at most the floor of stale entries.
        for slot in 0..moving {
            heap.set(slot, None);
        }
        assert!(
            heap.entries() <= REBUILD_FLOOR + 1,
            "{} entries",
            heap.entries()
        );
        assert_eq!(heap.pop_due(t0), Some(anchor));
        assert_eq!(heap.first(), None);
        heap.check().unwrap();
    }
}
