//! Model-based property test of the RAM tier: random puts, gets, removes, budget changes and
//! checkpoint holds. After every step: held bytes == sum of entry sizes <= budget, LRU order ==
//! the model's, contents round-trip, and the checkpoint account == distinct live Arcs.

use kvshare_core::checkpoint::{Checkpoint, CheckpointAccount};
use kvshare_core::hash::BlockKey;
use kvshare_core::ram_tier::{EntryKind, RamTier};
use kvshare_core::CoreError;
use proptest::prelude::*;
use std::collections::{HashSet, VecDeque};
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
}

fn key(i: u8) -> BlockKey {
    BlockKey([i; 32])
}

/// Block sizes derive from the key so "same key = same content" holds.
fn block_size_of(i: u8) -> usize {
    (i as usize * 37) % 120
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..12).prop_map(|i| Op::PutBlock(i, block_size_of(i))),
        3 => (0u8..12).prop_map(Op::GetBlock),
        1 => (0u8..12).prop_map(Op::Remove),
        2 => (0u8..6, 0usize..150).prop_map(|(i, n)| Op::PutCkpt(i, n)),
        2 => (0u8..6).prop_map(Op::GetCkpt),
        1 => Just(Op::DropHeld),
        1 => (50u64..600).prop_map(Op::Budget),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn ram_tier_matches_model(budget in 50u64..600, ops in prop::collection::vec(op(), 1..60)) {
        let acct = CheckpointAccount::new();
        let mut t = RamTier::new(budget, acct.clone());
        let mut budget = budget;
        // model: LRU list of (kind, key id, size), head = least recent
        let mut lru: VecDeque<(EntryKind, u8, u64)> = VecDeque::new();
        let mut held: Vec<Arc<Checkpoint>> = Vec::new(); // outside holders (sequences)
        let (mut hits, mut misses, mut evictions) = (0u64, 0u64, 0u64);
        let touch = |lru: &mut VecDeque<(EntryKind, u8, u64)>, kind, i| -> bool {
            if let Some(p) = lru.iter().position(|e| e.0 == kind && e.1 == i) {
                let e = lru.remove(p).unwrap();
                lru.push_back(e);
                true
            } else {
                false
            }
        };
        let make_room = |lru: &mut VecDeque<(EntryKind, u8, u64)>, need: u64, budget: u64, ev: &mut u64| {
            while lru.iter().map(|e| e.2).sum::<u64>() + need > budget {
                lru.pop_front().unwrap();
                *ev += 1;
            }
        };
        for op in &ops {
            match op {
                Op::PutBlock(i, n) => {
                    let data = vec![*i; *n];
                    let r = t.put_block(key(*i), &data);
                    if touch(&mut lru, EntryKind::Block, *i) {
                        prop_assert_eq!(r.unwrap(), false);
                    } else if *n as u64 > budget {
                        prop_assert!(matches!(r, Err(CoreError::OverBudget(_))));
                    } else {
                        prop_assert_eq!(r.unwrap(), true);
                        make_room(&mut lru, *n as u64, budget, &mut evictions);
                        lru.push_back((EntryKind::Block, *i, *n as u64));
                    }
                }
                Op::GetBlock(i) => {
                    let got = t.get_block(&key(*i));
                    if touch(&mut lru, EntryKind::Block, *i) {
                        hits += 1;
                        prop_assert_eq!(got.unwrap(), vec![*i; block_size_of(*i)]);
                    } else {
                        misses += 1;
                        prop_assert!(got.is_none());
                    }
                }
                Op::Remove(i) => {
                    let present = lru.iter().position(|e| e.0 == EntryKind::Block && e.1 == *i);
                    prop_assert_eq!(t.remove_block(&key(*i)), present.is_some());
                    if let Some(p) = present {
                        lru.remove(p);
                    }
                    let cp = lru.iter().position(|e| e.0 == EntryKind::Checkpoint && e.1 == *i);
                    prop_assert_eq!(t.remove_checkpoint(&key(*i)).is_some(), cp.is_some());
                    if let Some(p) = cp {
                        lru.remove(p);
                    }
                }
                Op::PutCkpt(i, n) => {
                    let c = Checkpoint::new(&acct, 1, key(*i), key(0), vec![], vec![*i; *n], String::new()).unwrap();
                    let r = t.put_checkpoint(c.clone());
                    if let Some(e) = lru.iter().find(|e| e.0 == EntryKind::Checkpoint && e.1 == *i) {
                        let size = e.2;
                        touch(&mut lru, EntryKind::Checkpoint, *i);
                        prop_assert_eq!(r.unwrap(), false);
                        prop_assert_eq!(t.get_checkpoint(&key(*i)).unwrap().data.len() as u64, size);
                        hits += 1;
                        touch(&mut lru, EntryKind::Checkpoint, *i);
                    } else if *n as u64 > budget {
                        prop_assert!(matches!(r, Err(CoreError::OverBudget(_))));
                    } else {
                        prop_assert_eq!(r.unwrap(), true);
                        make_room(&mut lru, *n as u64, budget, &mut evictions);
                        lru.push_back((EntryKind::Checkpoint, *i, *n as u64));
                    }
                    held.push(c);
                }
                Op::GetCkpt(i) => {
                    let got = t.get_checkpoint(&key(*i));
                    if touch(&mut lru, EntryKind::Checkpoint, *i) {
                        hits += 1;
                        held.push(got.unwrap());
                    } else {
                        misses += 1;
                        prop_assert!(got.is_none());
                    }
                }
                Op::DropHeld => held.clear(),
                Op::Budget(b) => {
                    budget = *b;
                    t.set_budget(budget);
                    make_room(&mut lru, 0, budget, &mut evictions);
                }
            }
            // ---- checks after every step ----
            t.check_invariants().map_err(TestCaseError::fail)?;
            let sum: u64 = lru.iter().map(|e| e.2).sum();
            prop_assert_eq!(t.held_bytes(), sum);
            prop_assert!(t.held_bytes() <= budget);
            let order: Vec<(EntryKind, BlockKey)> = lru.iter().map(|e| (e.0, key(e.1))).collect();
            prop_assert_eq!(t.lru_order(), order);
            let s = t.stats();
            prop_assert_eq!((s.hits, s.misses, s.evictions), (hits, misses, evictions));
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
