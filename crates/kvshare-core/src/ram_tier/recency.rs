//! Recency bookkeeping of the RAM tier: every entry's tick, size and class (normal or pinned),
//! and the eviction order.
//!
//! Two classes, each ordered least recently used first. Eviction takes the normal class first
//! and reaches pinned entries only when no normal entry is left; the owner keeps the pinned
//! bytes under a sub-budget by *demoting* the least recently used pinned entries back to the
//! normal class (they keep their tick, so they rejoin the normal order where their recency
//! puts them). Payloads are not stored here; the owner holds them.

use super::EntryKind;
use crate::hash::BlockKey;
use std::collections::{BTreeMap, HashMap};

type EntryId = (EntryKind, BlockKey);

#[derive(Clone, Copy, Debug)]
struct Slot {
    tick: u64,
    size: u64,
    pinned: bool,
}

/// An entry leaving the tier (eviction or demotion).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Victim {
    pub kind: EntryKind,
    pub key: BlockKey,
    pub size: u64,
    pub pinned: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Recency {
    next_tick: u64,
    slots: HashMap<EntryId, Slot>,
    normal: BTreeMap<u64, EntryId>,
    pinned: BTreeMap<u64, EntryId>,
    pinned_bytes: u64,
}

impl Recency {
    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    fn class(&mut self, pinned: bool) -> &mut BTreeMap<u64, EntryId> {
        if pinned {
            &mut self.pinned
        } else {
            &mut self.normal
        }
    }

    /// A new entry, most recently used, in the normal class.
    pub fn insert(&mut self, kind: EntryKind, key: BlockKey, size: u64) {
        debug_assert!(!self.slots.contains_key(&(kind, key)));
        let tick = self.tick();
        self.slots.insert(
            (kind, key),
            Slot {
                tick,
                size,
                pinned: false,
            },
        );
        self.normal.insert(tick, (kind, key));
    }

    /// Make a held entry the most recently used of its class; `pin` (if Some) also moves it to
    /// that class. Returns false if the entry is not held.
    fn refresh(&mut self, kind: EntryKind, key: &BlockKey, pin: Option<bool>) -> bool {
        let tick = self.tick();
        let Some(slot) = self.slots.get_mut(&(kind, *key)) else {
            return false;
        };
        let (old_tick, was) = (slot.tick, slot.pinned);
        let now = pin.unwrap_or(was);
        slot.tick = tick;
        slot.pinned = now;
        let size = slot.size;
        self.class(was).remove(&old_tick);
        self.class(now).insert(tick, (kind, *key));
        match (was, now) {
            (false, true) => self.pinned_bytes += size,
            (true, false) => self.pinned_bytes -= size,
            _ => {}
        }
        true
    }

    pub fn touch(&mut self, kind: EntryKind, key: &BlockKey) -> bool {
        self.refresh(kind, key, None)
    }

    /// Pin (and refresh) a held entry. False if not held.
    pub fn pin(&mut self, kind: EntryKind, key: &BlockKey) -> bool {
        self.refresh(kind, key, Some(true))
    }

    /// Move a pinned entry back to the normal class, keeping its tick. False if it was not
    /// pinned (or not held).
    pub fn unpin(&mut self, kind: EntryKind, key: &BlockKey) -> bool {
        let Some(slot) = self.slots.get_mut(&(kind, *key)) else {
            return false;
        };
        if !slot.pinned {
            return false;
        }
        slot.pinned = false;
        let (tick, size) = (slot.tick, slot.size);
        self.pinned.remove(&tick);
        self.normal.insert(tick, (kind, *key));
        self.pinned_bytes -= size;
        true
    }

    pub fn remove(&mut self, kind: EntryKind, key: &BlockKey) -> Option<Victim> {
        let slot = self.slots.remove(&(kind, *key))?;
        self.class(slot.pinned).remove(&slot.tick);
        if slot.pinned {
            self.pinned_bytes -= slot.size;
        }
        Some(Victim {
            kind,
            key: *key,
            size: slot.size,
            pinned: slot.pinned,
        })
    }

    /// Remove and return the next entry to evict: the least recently used normal entry, or,
    /// if there is none, the least recently used pinned one.
    pub fn pop_victim(&mut self) -> Option<Victim> {
        let (kind, key) = match self.normal.first_key_value() {
            Some((_, id)) => *id,
            None => *self.pinned.first_key_value()?.1,
        };
        self.remove(kind, &key)
    }

    /// Demote the least recently used pinned entry to the normal class.
    pub fn demote_oldest_pinned(&mut self) -> Option<Victim> {
        let (kind, key) = *self.pinned.first_key_value()?.1;
        let size = self.slots[&(kind, key)].size;
        self.unpin(kind, &key);
        Some(Victim {
            kind,
            key,
            size,
            pinned: false,
        })
    }

    pub fn is_pinned(&self, kind: EntryKind, key: &BlockKey) -> bool {
        self.slots.get(&(kind, *key)).is_some_and(|s| s.pinned)
    }

    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes
    }

    pub fn pinned_len(&self) -> usize {
        self.pinned.len()
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Every entry in eviction order: normal ones least recently used first, then pinned ones.
    pub fn eviction_order(&self) -> Vec<EntryId> {
        self.normal
            .values()
            .chain(self.pinned.values())
            .copied()
            .collect()
    }

    pub fn clear(&mut self) {
        self.slots.clear();
        self.normal.clear();
        self.pinned.clear();
        self.pinned_bytes = 0;
    }

    /// Total size of the entries of one kind (for the owner's byte check).
    pub fn bytes_of(&self, kind: EntryKind) -> u64 {
        self.slots
            .iter()
            .filter(|(id, _)| id.0 == kind)
            .map(|(_, s)| s.size)
            .sum()
    }

    pub fn size_of(&self, kind: EntryKind, key: &BlockKey) -> Option<u64> {
        self.slots.get(&(kind, *key)).map(|s| s.size)
    }

    pub fn check(&self) -> Result<(), String> {
        if self.normal.len() + self.pinned.len() != self.slots.len() {
            return Err("the class orders do not list every entry exactly once".into());
        }
        let mut pinned = 0u64;
        for (class_pinned, order) in [(false, &self.normal), (true, &self.pinned)] {
            for (t, id) in order {
                match self.slots.get(id) {
                    Some(s) if s.tick == *t && s.pinned == class_pinned => {
                        if s.pinned {
                            pinned += s.size;
                        }
                    }
                    _ => return Err(format!("recency entry {t} ({id:?}) is stale")),
                }
            }
        }
        if pinned != self.pinned_bytes {
            return Err(format!(
                "pinned bytes {} != sum of pinned entries {pinned}",
                self.pinned_bytes
            ));
        }
        Ok(())
    }
}
