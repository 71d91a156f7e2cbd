//! Model-based property test of the RAM tier: random puts, gets, removes, budget changes,
//! checkpoint holds, chain refreshes and pins. After every step: held bytes == sum of entry sizes
//! <= budget, pinned bytes == sum of pinned sizes <= pin budget <= budget, eviction order == the
//! model's (normal entries least recent first, then pinned ones), contents round-trip, counters
//! match, and the checkpoint account == distinct live Arcs.

use kvshare_core::checkpoint::{Checkpoint, CheckpointAccount};
use kvshare_core::hash::BlockKey;
use kvshare_core::ram_tier::{EntryKind, RamTier};
use kvshare_core::CoreError;
use proptest::prelude::*;
use std::collections::HashSet;
use std::sync::Arc;

#[derive(Clone, Debug)]
enum Op {
    PutBlock(u8, usize),
    GetBlock(u8),
    Remove(u8),
    PutCkpt(u8, usize),
    GetCkpt(u8),
    DropHeld,
    Budget(u64),
    PinBudget(u64),
    /// Pin (or only refresh) the chain of block keys `start, start+1, ...` of this length.
    PinChain(u8, u8),
    TouchChain(u8, u8),
    PinCkpt(u8),
    Unpin(bool, u8),
}

const N_KEYS: u8 = 12;

fn key(i: u8) -> BlockKey {
    BlockKey([i; 32])
}

/// Block sizes derive from the key so "same key = same content" holds.
fn block_size_of(i: u8) -> usize {
    (i as usize * 37) % 120
}

fn chain(start: u8, len: u8) -> Vec<u8> {
    (0..len).map(|j| (start + j) % N_KEYS).collect()
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..N_KEYS).prop_map(|i| Op::PutBlock(i, block_size_of(i))),
        3 => (0u8..N_KEYS).prop_map(Op::GetBlock),
        1 => (0u8..N_KEYS).prop_map(Op::Remove),
        2 => (0u8..6, 0usize..150).prop_map(|(i, n)| Op::PutCkpt(i, n)),
        2 => (0u8..6).prop_map(Op::GetCkpt),
        1 => Just(Op::DropHeld),
        1 => (50u64..600).prop_map(Op::Budget),
        1 => (0u64..400).prop_map(Op::PinBudget),
        3 => (0u8..N_KEYS, 1u8..5).prop_map(|(s, n)| Op::PinChain(s, n)),
        1 => (0u8..N_KEYS, 1u8..5).prop_map(|(s, n)| Op::TouchChain(s, n)),
        1 => (0u8..6).prop_map(Op::PinCkpt),
        1 => (any::<bool>(), 0u8..N_KEYS).prop_map(|(b, i)| Op::Unpin(b, i)),
    ]
}

#[derive(Clone, Copy, Debug)]
struct E {
    kind: EntryKind,
    id: u8,
    size: u64,
    pinned: bool,
}

/// The reference: entries in recency order (front = least recent), with a class flag.
#[derive(Default)]
struct Model {
    order: Vec<E>,
    budget: u64,
    pin_budget: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    demotions: u64,
    pinned_evictions: u64,
}

impl Model {
    fn find(&self, kind: EntryKind, id: u8) -> Option<usize> {
        self.order.iter().position(|e| e.kind == kind && e.id == id)
    }
    fn touch(&mut self, kind: EntryKind, id: u8) -> bool {
        match self.find(kind, id) {
            Some(p) => {
                let e = self.order.remove(p);
                self.order.push(e);
                true
            }
            None => false,
        }
    }
    fn held(&self) -> u64 {
        self.order.iter().map(|e| e.size).sum()
    }
    fn pinned(&self) -> u64 {
        self.order.iter().filter(|e| e.pinned).map(|e| e.size).sum()
    }
    fn make_room(&mut self, need: u64) {
        while self.held() + need > self.budget {
            let p = self
                .order
                .iter()
                .position(|e| !e.pinned)
                .or_else(|| self.order.iter().position(|e| e.pinned))
                .unwrap();
            if self.order.remove(p).pinned {
                self.pinned_evictions += 1;
            }
            self.evictions += 1;
        }
    }
    fn demote(&mut self) {
        while self.pinned() > self.pin_budget {
            let p = self.order.iter().position(|e| e.pinned).unwrap();
            self.order[p].pinned = false;
            self.demotions += 1;
        }
    }
    /// Refresh a chain's leading held blocks deepest first, pinning those that fit.
    fn chain(&mut self, ids: &[u8], pin: bool) -> usize {
        let n = ids
            .iter()
            .take_while(|i| self.find(EntryKind::Block, **i).is_some())
            .count();
        for i in ids[..n].iter().rev() {
            self.touch(EntryKind::Block, *i);
            let last = self.order.last_mut().unwrap();
            if pin && last.size <= self.pin_budget {
                last.pinned = true;
            }
        }
        self.demote();
        n
    }
    fn is_pinned(&self, kind: EntryKind, id: u8) -> bool {
        self.find(kind, id).is_some_and(|p| self.order[p].pinned)
    }
    fn eviction_order(&self) -> Vec<(EntryKind, BlockKey)> {
        let normal = self.order.iter().filter(|e| !e.pinned);
        let pinned = self.order.iter().filter(|e| e.pinned);
        normal.chain(pinned).map(|e| (e.kind, key(e.id))).collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn ram_tier_matches_model(budget in 50u64..600, ops in prop::collection::vec(op(), 1..80)) {
        let acct = CheckpointAccount::new();
        let mut t = RamTier::new(budget, acct.clone());
        let mut m = Model { budget, pin_budget: budget / 2, ..Model::default() };
        let mut held: Vec<Arc<Checkpoint>> = Vec::new(); // outside holders (sequences)
        for op in &ops {
            match op {
                Op::PutBlock(i, n) => {
                    let data = vec![*i; *n];
                    let r = t.put_block(key(*i), &data);
                    if m.touch(EntryKind::Block, *i) {
                        prop_assert_eq!(r.unwrap(), false);
                    } else if *n as u64 > m.budget {
                        prop_assert!(matches!(r, Err(CoreError::OverBudget(_))));
                    } else {
                        prop_assert_eq!(r.unwrap(), true);
                        m.make_room(*n as u64);
                        m.order.push(E { kind: EntryKind::Block, id: *i, size: *n as u64, pinned: false });
                    }
                }
                Op::GetBlock(i) => {
                    let got = t.get_block(&key(*i));
                    if m.touch(EntryKind::Block, *i) {
                        m.hits += 1;
                        prop_assert_eq!(got.unwrap(), vec![*i; block_size_of(*i)]);
                    } else {
                        m.misses += 1;
                        prop_assert!(got.is_none());
                    }
                }
                Op::Remove(i) => {
                    for kind in [EntryKind::Block, EntryKind::Checkpoint] {
                        let present = m.find(kind, *i);
                        let removed = match kind {
                            EntryKind::Block => t.remove_block(&key(*i)),
                            EntryKind::Checkpoint => t.remove_checkpoint(&key(*i)).is_some(),
                        };
                        prop_assert_eq!(removed, present.is_some());
                        if let Some(p) = present {
                            m.order.remove(p);
                        }
                    }
                }
                Op::PutCkpt(i, n) => {
                    let c = Checkpoint::new(&acct, 1, key(*i), key(0), vec![], vec![*i; *n], String::new()).unwrap();
                    let r = t.put_checkpoint(c.clone());
                    if let Some(p) = m.find(EntryKind::Checkpoint, *i) {
                        let size = m.order[p].size;
                        m.touch(EntryKind::Checkpoint, *i);
                        prop_assert_eq!(r.unwrap(), false);
                        prop_assert_eq!(t.get_checkpoint(&key(*i)).unwrap().data.len() as u64, size);
                        m.hits += 1;
                        m.touch(EntryKind::Checkpoint, *i);
                    } else if *n as u64 > m.budget {
                        prop_assert!(matches!(r, Err(CoreError::OverBudget(_))));
                    } else {
                        prop_assert_eq!(r.unwrap(), true);
                        m.make_room(*n as u64);
                        m.order.push(E { kind: EntryKind::Checkpoint, id: *i, size: *n as u64, pinned: false });
                    }
                    held.push(c);
                }
                Op::GetCkpt(i) => {
                    let got = t.get_checkpoint(&key(*i));
                    if m.touch(EntryKind::Checkpoint, *i) {
                        m.hits += 1;
                        held.push(got.unwrap());
                    } else {
                        m.misses += 1;
                        prop_assert!(got.is_none());
                    }
                }
                Op::DropHeld => held.clear(),
                Op::Budget(b) => {
                    m.budget = *b;
                    m.pin_budget = m.pin_budget.min(*b);
                    t.set_budget(*b);
                    m.demote();
                    m.make_room(0);
                }
                Op::PinBudget(p) => {
                    m.pin_budget = (*p).min(m.budget);
                    t.set_pin_budget(*p);
                    m.demote();
                }
                Op::PinChain(s, n) | Op::TouchChain(s, n) => {
                    let pin = matches!(op, Op::PinChain(..));
                    let ids = chain(*s, *n);
                    let keys: Vec<BlockKey> = ids.iter().map(|i| key(*i)).collect();
                    let held_n = m.chain(&ids, pin);
                    if pin {
                        let pinned = ids[..held_n].iter().take_while(|i| m.is_pinned(EntryKind::Block, **i)).count();
                        prop_assert_eq!(t.pin_blocks(&keys), pinned);
                    } else {
                        prop_assert_eq!(t.touch_blocks(&keys), held_n);
                    }
                }
                Op::PinCkpt(i) => {
                    if let Some(p) = m.find(EntryKind::Checkpoint, *i) {
                        if m.order[p].size <= m.pin_budget {
                            m.order[p].pinned = true;
                        }
                        m.touch(EntryKind::Checkpoint, *i);
                        m.demote();
                    }
                    prop_assert_eq!(t.pin_checkpoint(&key(*i)), m.is_pinned(EntryKind::Checkpoint, *i));
                }
                Op::Unpin(block, i) => {
                    let kind = if *block { EntryKind::Block } else { EntryKind::Checkpoint };
                    let was = m.is_pinned(kind, *i);
                    if was {
                        let p = m.find(kind, *i).unwrap();
                        m.order[p].pinned = false;
                    }
                    prop_assert_eq!(t.unpin(kind, &key(*i)), was);
                }
            }
            // ---- checks after every step ----
            t.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(t.held_bytes(), m.held());
            prop_assert!(t.held_bytes() <= m.budget);
            prop_assert_eq!(t.pinned_bytes(), m.pinned());
            prop_assert!(t.pinned_bytes() <= t.pin_budget() && t.pin_budget() <= t.budget());
            prop_assert_eq!(t.lru_order(), m.eviction_order());
            let s = t.stats();
            prop_assert_eq!((s.hits, s.misses, s.evictions), (m.hits, m.misses, m.evictions));
            prop_assert_eq!((s.demotions, s.pinned_evictions), (m.demotions, m.pinned_evictions));
            prop_assert_eq!((s.pinned, s.pin_budget), (m.order.iter().filter(|e| e.pinned).count(), m.pin_budget));
            // account: each distinct live Arc (tier entries and outside holders) once
            let mut seen: HashSet<*const Checkpoint> = HashSet::new();
            let mut bytes = 0u64;
            for c in held.iter().chain(t.checkpoints()) {
                if seen.insert(Arc::as_ptr(c)) {
                    bytes += c.data.len() as u64;
                }
            }
            prop_assert_eq!(acct.live_bytes(), bytes);
            prop_assert_eq!(acct.live_count(), seen.len() as u64);
        }
        drop(held);
        t.clear();
        prop_assert_eq!((acct.live_count(), acct.live_bytes()), (0, 0));
    }
}
