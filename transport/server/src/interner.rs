//! Names to ids and back, with a cap and generations: how the hub, the
//! cluster's edge and each owner shard hold user and device names as
//! small ids.

use std::collections::HashMap;
use std::sync::Arc;

/// Names to ids and back, with a cap on the names held at once. An id is a
/// slot index in its low 32 bits and that slot's generation in the high 32:
/// a freed slot is reused for another name under a new generation, so an id
/// kept from before (a dirty-user list, a stale session) never names the next
/// owner. Each name also counts references its owner takes and drops
/// ([`Interner::acquire`], [`Interner::drop_ref`]).
#[derive(Debug, Default)]
pub struct Interner {
    ids: HashMap<Arc<str>, u64>,
    slots: Vec<NameSlot>,
    free: Vec<u32>,
    live: usize,
    cap: usize,
}

#[derive(Debug, Default)]
struct NameSlot {
    name: Option<Arc<str>>,
    generation: u32,
    refs: u32,
}

fn id_of(index: u32, generation: u32) -> u64 {
    u64::from(index) | (u64::from(generation) << 32)
}

impl Interner {
    pub fn new(cap: usize) -> Interner {
        Interner {
            cap,
            ..Interner::default()
        }
    }

    pub fn get(&self, name: &str) -> Option<u64> {
        self.ids.get(name).copied()
    }

    fn slot(&self, id: u64) -> Option<&NameSlot> {
        let slot = self.slots.get(usize::try_from(id & 0xffff_ffff).ok()?)?;
        (u64::from(slot.generation) == id >> 32 && slot.name.is_some()).then_some(slot)
    }

    fn slot_mut(&mut self, id: u64) -> Option<&mut NameSlot> {
        let slot = self
            .slots
            .get_mut(usize::try_from(id & 0xffff_ffff).ok()?)?;
        (u64::from(slot.generation) == id >> 32 && slot.name.is_some()).then_some(slot)
    }

    /// The id of `name`, interning it if new; `None` at the cap.
    pub fn intern(&mut self, name: &str) -> Option<u64> {
        if let Some(id) = self.get(name) {
            return Some(id);
        }
        if self.live >= self.cap {
            return None;
        }
        let name: Arc<str> = Arc::from(name);
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                let index = u32::try_from(self.slots.len()).ok()?;
                self.slots.push(NameSlot::default());
                index
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.name = Some(name.clone());
        slot.refs = 0;
        let id = id_of(index, slot.generation);
        self.ids.insert(name, id);
        self.live += 1;
        Some(id)
    }

    pub fn name(&self, id: u64) -> Option<&Arc<str>> {
        self.slot(id).and_then(|s| s.name.as_ref())
    }

    /// Takes a reference on a live name.
    pub fn acquire(&mut self, id: u64) {
        if let Some(slot) = self.slot_mut(id) {
            slot.refs = slot.refs.saturating_add(1);
        }
    }

    /// Drops a reference; the references left.
    pub fn drop_ref(&mut self, id: u64) -> u32 {
        match self.slot_mut(id) {
            Some(slot) => {
                slot.refs = slot.refs.saturating_sub(1);
                slot.refs
            }
            None => 0,
        }
    }

    /// References held on a live name (0 for an unknown id).
    pub fn refs(&self, id: u64) -> u32 {
        self.slot(id).map_or(0, |s| s.refs)
    }

    /// Forgets a name; its slot comes back under the next generation (a slot
    /// whose generation would wrap is retired instead).
    pub fn remove(&mut self, id: u64) -> bool {
        let index = (id & 0xffff_ffff) as u32;
        let Some(slot) = self.slot_mut(id) else {
            return false;
        };
        let name = slot.name.take();
        slot.refs = 0;
        let reusable = slot.generation < u32::MAX;
        slot.generation = slot.generation.wrapping_add(1);
        if let Some(name) = name {
            self.ids.remove(&name);
        }
        if reusable {
            self.free.push(index);
        }
        self.live -= 1;
        true
    }

    /// The id of the live name in slot `index`, if any (a sweep walks the
    /// slots round robin).
    pub(crate) fn id_at(&self, index: usize) -> Option<u64> {
        let slot = self.slots.get(index)?;
        slot.name.as_ref()?;
        Some(id_of(u32::try_from(index).ok()?, slot.generation))
    }

    /// Slots, live or free: the range of [`Interner::id_at`].
    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Names held.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }
}

#[cfg(test)]
mod tests {
    use super::Interner;

    #[test]
    fn a_freed_slot_never_answers_to_its_old_id() {
        let mut names = Interner::new(2);
        let ann = names.intern("ann").unwrap();
        let bob = names.intern("bob").unwrap();
        assert_eq!(names.intern("cy"), None, "at the cap");
        assert!(names.remove(ann));
        assert!(!names.remove(ann), "already gone");
        let cy = names.intern("cy").unwrap();
        assert_eq!(cy & 0xffff_ffff, ann & 0xffff_ffff, "the slot is reused");
        assert_ne!(cy, ann);
        assert_eq!(names.name(ann), None);
        assert_eq!(names.name(cy).map(|n| &**n), Some("cy"));
        assert_eq!(names.get("ann"), None);
        names.acquire(bob);
        assert_eq!(names.drop_ref(bob), 0);
        assert_eq!(names.len(), 2);
    }
}
