//! Unit-style tests of the RAM tier: LRU, budget and dedup; pinned prefix entries against a
//! flood, pin-budget demotion and pinned evictions. (The model-based test is prop_ram.rs.)

use kvshare_core::checkpoint::CheckpointAccount;
use kvshare_core::hash::BlockKey;
use kvshare_core::ram_tier::{EntryKind, RamTier};
use kvshare_core::CoreError;

fn k(i: u8) -> BlockKey {
    BlockKey([i; 32])
}

#[test]
fn lru_budget_and_dedup() {
    let mut t = RamTier::new(100, CheckpointAccount::new());
    assert!(t.put_block(k(1), &[1; 40]).unwrap());
    assert!(t.put_block(k(2), &[2; 40]).unwrap());
    assert!(!t.put_block(k(1), &[1; 40]).unwrap());
    assert_eq!(t.held_bytes(), 80);
    // k(1) is now most recent: inserting 40 more evicts k(2)
    assert!(t.put_block(k(3), &[3; 40]).unwrap());
    assert!(!t.contains_block(&k(2)));
    assert_eq!(t.get_block(&k(1)).unwrap(), vec![1; 40]);
    assert!(matches!(
        t.put_block(k(4), &[0; 101]),
        Err(CoreError::OverBudget(_))
    ));
    assert!(t.put_block(k(1), &[1; 3]).is_err());
    let mut out = [0u8; 40];
    assert!(t.get_block_into(&k(3), &mut out).unwrap());
    assert_eq!(out, [3; 40]);
    assert!(!t.get_block_into(&k(9), &mut out).unwrap());
    let s = t.stats();
    assert_eq!((s.hits, s.misses, s.evictions, s.entries), (2, 1, 1, 2));
    t.check_invariants().unwrap();
}

#[test]
fn pinned_chains_outlive_a_flood_and_keep_their_head() {
    let mut t = RamTier::new(100, CheckpointAccount::new());
    t.set_pin_budget(40);
    let chain = [k(1), k(2), k(3)];
    for key in &chain {
        t.put_block(*key, &[key.0[0]; 10]).unwrap();
    }
    assert_eq!(t.pin_blocks(&chain), 3);
    assert_eq!(t.pinned_bytes(), 30);
    // A flood of normal entries never evicts a pin while normal entries are left.
    for i in 10..40 {
        t.put_block(k(i), &[i; 10]).unwrap();
        t.check_invariants().unwrap();
    }
    assert_eq!(t.match_prefix(&chain), 3);
    // Pinning a second chain past the pin budget (50 > 40) demotes the least recent pin:
    // the deepest block of the older chain.
    let other = [k(50), k(51)];
    for key in &other {
        t.put_block(*key, &[1; 10]).unwrap();
    }
    assert_eq!(t.pin_blocks(&other), 2);
    assert!(!t.is_pinned(EntryKind::Block, &k(3)));
    assert!(t.is_pinned(EntryKind::Block, &k(1)) && t.is_pinned(EntryKind::Block, &k(2)));
    assert_eq!((t.stats().demotions, t.pinned_bytes()), (1, 40));
    // An insert larger than budget - pinned evicts pins only after every normal entry, the
    // least recent first (k2, k1, k51); the newest chain's head stays.
    t.put_block(k(60), &[0; 90]).unwrap();
    assert_eq!(t.len(), 2);
    assert!(t.is_pinned(EntryKind::Block, &k(50)));
    assert_eq!(t.stats().pinned_evictions, 3);
    t.check_invariants().unwrap();
}
