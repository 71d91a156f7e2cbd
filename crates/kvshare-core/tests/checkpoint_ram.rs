//! Checkpoints (Arc sharing, accounting, deepest lookup) and the RAM tier (budget, LRU,
//! content addressing, copy-out semantics, checkpoint bytes counted fully here but once in the
//! account).

use kvshare_core::checkpoint::{Checkpoint, CheckpointAccount, CheckpointStore};
use kvshare_core::hash::{hash_blocks, prefix_key, root_key, BlockKey};
use kvshare_core::ram_tier::{EntryKind, RamTier};
use kvshare_core::CoreError;
use std::sync::Arc;

fn root() -> BlockKey {
    root_key(b"model", "f16", 4, None)
}

/// Position of the deepest checkpoint along tokens 0..20 at or before `max`.
fn d(s: &CheckpointStore, max: u64) -> Option<u64> {
    let toks: Vec<u32> = (0..20).collect();
    s.deepest(&root(), &hash_blocks(&root(), &toks, 4, b""), &toks, max)
        .map(|c| c.position)
}

fn ckpt(acct: &CheckpointAccount, toks: &[u32], size: usize) -> Arc<Checkpoint> {
    Checkpoint::at(
        acct,
        &root(),
        toks,
        4,
        b"",
        vec![toks.len() as u8; size],
        "{\"shape\":[1]}".into(),
    )
    .unwrap()
}

#[test]
fn checkpoint_fields() {
    let acct = CheckpointAccount::new();
    let toks: Vec<u32> = (0..10).collect();
    let c = ckpt(&acct, &toks, 7);
    let keys = hash_blocks(&root(), &toks, 4, b"");
    assert_eq!(c.position, 10);
    assert_eq!(c.anchor, keys[1]);
    assert_eq!(c.tail, vec![8, 9]);
    assert_eq!(c.anchor_position(), 8);
    assert_eq!(c.key, prefix_key(&root(), &toks, 4, b""));
    assert_eq!(c.nbytes(), 7);
    assert!(c.account().same_as(&acct));
    let aligned = ckpt(&acct, &toks[..8], 1);
    assert_eq!(
        (aligned.key, aligned.anchor, aligned.tail.len()),
        (keys[1], keys[1], 0)
    );
    let at_root = ckpt(&acct, &[], 1);
    assert_eq!(at_root.key, root());
    assert!(Checkpoint::new(&acct, 1, root(), root(), vec![1, 2], vec![], String::new()).is_err());
    assert!(Checkpoint::at(&acct, &root(), &toks, 0, b"", vec![], String::new()).is_err());
    assert_eq!(
        acct.live_count(),
        3,
        "the failed constructors registered nothing"
    );
}

#[test]
fn account_is_per_distinct_checkpoint() {
    let acct = CheckpointAccount::new();
    let toks: Vec<u32> = (0..6).collect();
    let a = ckpt(&acct, &toks, 1000);
    let b = ckpt(&acct, &toks[..5], 500);
    let mut store = CheckpointStore::new(acct.clone());
    let mut ram = RamTier::new(10_000, acct.clone());
    store.insert(a.clone());
    ram.put_checkpoint(a.clone()).unwrap();
    ram.put_checkpoint(b.clone()).unwrap();
    let holders = vec![a.clone(), a.clone(), b.clone()];
    assert_eq!((acct.live_count(), acct.live_bytes()), (2, 1500));
    assert_eq!(
        ram.held_bytes(),
        1500,
        "the RAM tier counts what it holds fully"
    );
    assert_eq!(store.unique_bytes(), 1000);
    drop((a, b, holders));
    assert_eq!(
        acct.live_bytes(),
        1500,
        "still held by the store and the RAM tier"
    );
    ram.clear();
    assert_eq!((acct.live_count(), acct.live_bytes()), (1, 1000));
    drop(store);
    assert_eq!((acct.live_count(), acct.live_bytes()), (0, 0));
}

#[test]
fn store_keeps_existing_and_walks_anchors() {
    let acct = CheckpointAccount::new();
    let toks: Vec<u32> = (0..20).collect();
    let mut s = CheckpointStore::new(acct.clone());
    let first = s.insert(ckpt(&acct, &toks[..6], 10));
    let again = s.insert(ckpt(&acct, &toks[..6], 10));
    assert!(Arc::ptr_eq(&first, &again));
    assert_eq!(acct.live_count(), 1, "the byte-identical save was dropped");
    for n in [0usize, 4, 13, 19] {
        s.insert(ckpt(&acct, &toks[..n], 1));
    }
    assert_eq!(s.len(), 5);
    assert_eq!(d(&s, 100), Some(19));
    assert_eq!(d(&s, 18), Some(13));
    assert_eq!(d(&s, 12), Some(6));
    assert_eq!(d(&s, 5), Some(4));
    assert_eq!(d(&s, 3), Some(0));
    // a prompt that diverges at token 10 only matches up to 6
    let mut other = toks.clone();
    other[10] = 999;
    let okeys = hash_blocks(&root(), &other, 4, b"");
    assert_eq!(
        s.deepest(&root(), &okeys, &other, 100).map(|c| c.position),
        Some(6)
    );
    // diverging inside a tail
    let mut other2 = toks[..14].to_vec();
    other2[12] = 999;
    let okeys2 = hash_blocks(&root(), &other2, 4, b"");
    assert_eq!(
        s.deepest(&root(), &okeys2, &other2, 100)
            .map(|c| c.position),
        Some(6)
    );
    // another salt sees nothing
    let r2 = root_key(b"model", "f16", 4, Some(b"x"));
    assert!(s
        .deepest(&r2, &hash_blocks(&r2, &toks, 4, b""), &toks, 100)
        .is_none());
    let removed = s.remove(&first.key).unwrap();
    assert!(Arc::ptr_eq(&removed, &first));
    assert!(s.remove(&first.key).is_none());
    assert_eq!(d(&s, 12), Some(4));
    s.check_invariants().unwrap();
}

#[test]
fn ram_tier_blocks() {
    let acct = CheckpointAccount::new();
    let mut t = RamTier::new(1000, acct);
    let k = |i: u8| BlockKey([i; 32]);
    for i in 0..4u8 {
        assert!(t.put_block(k(i), &vec![i; 300]).unwrap());
    }
    // 4 * 300 > 1000: the first one went
    assert!(!t.contains_block(&k(0)));
    assert_eq!(t.held_bytes(), 900);
    assert_eq!(t.stats().evictions, 1);
    assert_eq!(t.match_prefix(&[k(1), k(2), k(0), k(3)]), 2);
    // get copies out and refreshes recency; the entry stays
    assert_eq!(t.get_block(&k(1)).unwrap(), vec![1; 300]);
    assert!(t.contains_block(&k(1)));
    t.put_block(k(9), &[9; 300]).unwrap();
    assert!(!t.contains_block(&k(2)), "k(2) was least recently used");
    assert!(t.contains_block(&k(1)));
    assert_eq!(
        t.lru_order(),
        vec![
            (EntryKind::Block, k(3)),
            (EntryKind::Block, k(1)),
            (EntryKind::Block, k(9))
        ]
    );
    assert!(matches!(
        t.put_block(k(7), &[0; 1001]),
        Err(CoreError::OverBudget(_))
    ));
    assert_eq!(t.held_bytes(), 900, "a refused put evicts nothing");
    let mut small = [0u8; 10];
    assert!(matches!(
        t.get_block_into(&k(1), &mut small),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(t.remove_block(&k(1)));
    assert!(!t.remove_block(&k(1)));
    assert_eq!(t.held_bytes(), 600);
    t.set_budget(350);
    assert_eq!((t.held_bytes(), t.len()), (300, 1));
    assert!(t.contains_block(&k(9)));
    t.check_invariants().unwrap();
}

#[test]
fn ram_tier_checkpoints_share_lru_with_blocks() {
    let acct = CheckpointAccount::new();
    let mut t = RamTier::new(100, acct.clone());
    let toks: Vec<u32> = (0..8).collect();
    let c = ckpt(&acct, &toks[..4], 60); // aligned: same key as block 0
    let block_key = hash_blocks(&root(), &toks, 4, b"")[0];
    assert_eq!(c.key, block_key);
    assert!(t.put_block(block_key, &[1; 30]).unwrap());
    assert!(t.put_checkpoint(c.clone()).unwrap());
    assert!(
        !t.put_checkpoint(ckpt(&acct, &toks[..4], 60)).unwrap(),
        "same key stored once"
    );
    assert_eq!(
        t.stats().entries,
        2,
        "blocks and checkpoints are separate key spaces"
    );
    let got = t.get_checkpoint(&block_key).unwrap();
    assert!(Arc::ptr_eq(&got, &c));
    let keys = hash_blocks(&root(), &toks, 4, b"");
    assert!(Arc::ptr_eq(
        &t.deepest_checkpoint(&root(), &keys, &toks, 8).unwrap(),
        &c
    ));
    assert!(t.deepest_checkpoint(&root(), &keys, &toks, 3).is_none());
    // a 40-byte block evicts the LRU head (the block) only; the next one the checkpoint
    t.put_block(BlockKey([5; 32]), &[5; 40]).unwrap();
    assert!(!t.contains_block(&block_key));
    assert!(t.contains_checkpoint(&c.key));
    t.put_block(BlockKey([6; 32]), &[6; 50]).unwrap();
    assert!(!t.contains_checkpoint(&c.key));
    assert_eq!(t.held_bytes(), 90);
    assert!(matches!(
        t.put_checkpoint(ckpt(&acct, &toks, 101)),
        Err(CoreError::OverBudget(_))
    ));
    assert!(t.get_checkpoint(&c.key).is_none());
    let s = t.stats();
    assert_eq!((s.hits, s.misses, s.evictions), (2, 2, 2));
    t.check_invariants().unwrap();
}
