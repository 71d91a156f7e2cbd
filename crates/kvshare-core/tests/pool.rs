//! Block pool scenarios: the engine's attach flow, LRU order (deep blocks before shared
//! prefixes), copy-on-write, duplicate registration, extension into a partial block, misuse.

use kvshare_core::hash::{chain_key, hash_blocks, root_key, BlockKey};
use kvshare_core::pool::{BlockId, BlockPool, BlockState, PoolStats};
use kvshare_core::CoreError;

const BS: usize = 4;

fn root() -> BlockKey {
    root_key(b"model", "f16", BS as u32, None)
}

/// Write a whole prompt into fresh blocks, registering full ones. Returns the block table.
fn fill(p: &mut BlockPool, tokens: &[u32]) -> Vec<BlockId> {
    let r = root();
    let keys = hash_blocks(&r, tokens, BS, b"");
    let mut table = Vec::new();
    let mut parent = r;
    for (i, chunk) in tokens.chunks(BS).enumerate() {
        let id = p.allocate(parent).unwrap();
        p.append_tokens(id, chunk).unwrap();
        if chunk.len() == BS {
            assert_eq!(p.register(id, keys[i]).unwrap(), id);
            parent = keys[i];
        }
        table.push(id);
    }
    table
}

#[test]
fn release_is_last_block_first_and_eviction_takes_lru_head() {
    let mut p = BlockPool::new(6, BS).unwrap();
    let prompt: Vec<u32> = (0..12).collect();
    let a = fill(&mut p, &prompt); // 3 full blocks
                                   // a second sequence shares the first two blocks and adds its own
    p.acquire(&a[..2]).unwrap();
    let keys = hash_blocks(&root(), &prompt, BS, b"");
    let b3 = p.allocate(keys[1]).unwrap();
    p.append_tokens(b3, &[100, 101]).unwrap();
    let b = vec![a[0], a[1], b3];
    assert_eq!(p.stats().shared, 2);
    p.release(&a).unwrap();
    assert_eq!(
        p.lru_order(),
        vec![a[2]],
        "only a's private deep block is cached"
    );
    p.release(&b).unwrap();
    // b: b3 first, then a[1], then a[0]
    assert_eq!(p.lru_order(), vec![a[2], b3, a[1], a[0]]);
    assert_eq!(
        p.stats(),
        PoolStats {
            total: 6,
            used: 0,
            free: 2,
            cached: 4,
            shared: 0,
            tokens_held: 0
        }
    );
    // fill the two free blocks, then evictions follow the LRU head
    let x = p.allocate(root()).unwrap();
    let y = p.allocate(root()).unwrap();
    assert!(![x, y].contains(&a[0]));
    let e1 = p.allocate(root()).unwrap();
    assert_eq!(e1, a[2]);
    assert_eq!(
        p.match_prefix(&keys),
        (vec![a[0], a[1]], 8),
        "evicted key left the index"
    );
    assert_eq!(p.allocate(root()).unwrap(), b3);
    assert_eq!(p.allocate(root()).unwrap(), a[1]);
    assert_eq!(p.match_prefix(&keys), (vec![a[0]], 4));
    assert_eq!(p.allocate(root()).unwrap(), a[0]);
    assert!(matches!(p.allocate(root()), Err(CoreError::OutOfBlocks(_))));
    p.check_invariants().unwrap();
}

#[test]
fn attach_reuses_cached_prefix_and_extends_into_partial_block() {
    let mut p = BlockPool::new(8, BS).unwrap();
    let prompt: Vec<u32> = (0..10).collect(); // 2 full + partial [8, 9]
    let t = fill(&mut p, &prompt);
    p.release(&t).unwrap();
    assert_eq!(p.stats().cached, 3);
    // a new prompt sharing 9 tokens then diverging
    let mut other: Vec<u32> = (0..9).collect();
    other.extend([50, 51]);
    let keys = hash_blocks(&root(), &other, BS, b"");
    let (ids, n) = p.match_prefix(&keys);
    assert_eq!((ids.clone(), n), (t[..2].to_vec(), 8));
    p.acquire(&ids).unwrap();
    assert_eq!(p.state(t[0]).unwrap(), BlockState::Used);
    let (src, m) = p.extend_match(keys[1], &other[8..]).unwrap();
    assert_eq!((src, m), (t[2], 1));
    let c = p.cow(src, m).unwrap();
    assert_ne!(c, src);
    assert_eq!(p.tokens(c).unwrap(), &[8]);
    assert_eq!(p.parent(c).unwrap(), keys[1]);
    assert_eq!(
        p.tokens(src).unwrap(),
        &[8, 9],
        "cow leaves the source untouched"
    );
    p.append_tokens(c, &[50, 51]).unwrap();
    assert_eq!(p.stats().tokens_held, 8 + 3);
    p.check_invariants().unwrap();
}

#[test]
fn shared_partial_block_needs_cow() {
    let mut p = BlockPool::new(4, BS).unwrap();
    let a = p.allocate(root()).unwrap();
    p.append_tokens(a, &[1, 2]).unwrap();
    p.acquire(&[a]).unwrap(); // forked
    let err = p.append_tokens(a, &[3]).unwrap_err();
    assert!(matches!(err, CoreError::InvalidArgument(ref m) if m.contains("shared")));
    let b = p.cow(a, 2).unwrap();
    p.release(&[a]).unwrap();
    p.append_tokens(b, &[3]).unwrap();
    p.append_tokens(a, &[4]).unwrap(); // a is private again
    assert_eq!(p.tokens(a).unwrap(), &[1, 2, 4]);
    assert_eq!(p.tokens(b).unwrap(), &[1, 2, 3]);
    assert!(p.cow(a, 4).is_err(), "cannot copy more tokens than held");
    p.check_invariants().unwrap();
}

#[test]
fn duplicate_registration_returns_existing_block() {
    let mut p = BlockPool::new(4, BS).unwrap();
    let toks = [5u32, 6, 7, 8];
    let k = chain_key(&root(), &toks, b"");
    let a = p.allocate(root()).unwrap();
    p.append_tokens(a, &toks).unwrap();
    assert_eq!(p.register(a, k).unwrap(), a);
    assert_eq!(p.register(a, k).unwrap(), a, "idempotent");
    assert!(
        p.register(a, BlockKey([1; 32])).is_err(),
        "a second key is refused"
    );
    let b = p.allocate(root()).unwrap();
    p.append_tokens(b, &toks).unwrap();
    assert_eq!(p.register(b, k).unwrap(), a);
    assert_eq!(p.key(b).unwrap(), None);
    // swap: take a, drop b -> b is redundant and goes to the free list, not the LRU
    p.acquire(&[a]).unwrap();
    p.release(&[b]).unwrap();
    assert_eq!(p.state(b).unwrap(), BlockState::Free);
    assert_eq!(p.ref_count(a).unwrap(), 2);
    p.release(&[a, a]).unwrap();
    assert_eq!(p.lru_order(), vec![a]);
    assert_eq!(p.lookup(&k), Some(a));
    p.check_invariants().unwrap();
}

#[test]
fn extend_match_prefers_longest_then_lowest_id() {
    let mut p = BlockPool::new(6, BS).unwrap();
    let r = root();
    let mk = |p: &mut BlockPool, t: &[u32]| {
        let id = p.allocate(r).unwrap();
        p.append_tokens(id, t).unwrap();
        id
    };
    let a = mk(&mut p, &[1, 2]);
    let b = mk(&mut p, &[1, 2, 3]);
    let c = mk(&mut p, &[1, 9]);
    let _empty = p.allocate(r).unwrap();
    assert_eq!(p.extend_match(r, &[1, 2, 3, 4]), Some((b, 3)));
    assert_eq!(
        p.extend_match(r, &[1, 2, 7]),
        Some((a, 2)),
        "tie at 2 -> lowest id"
    );
    assert_eq!(p.extend_match(r, &[1, 9]), Some((c, 2)));
    assert_eq!(p.extend_match(r, &[1]), Some((a, 1)));
    assert_eq!(p.extend_match(r, &[4]), None);
    assert_eq!(p.extend_match(r, &[]), None);
    assert_eq!(p.extend_match(BlockKey([3; 32]), &[1]), None);
    // cached partial blocks are still found; once evicted they are not
    p.release(&[b]).unwrap();
    assert_eq!(p.extend_match(r, &[1, 2, 3]), Some((b, 3)));
    assert_eq!(p.evict_all_cached(), 1);
    assert_eq!(p.extend_match(r, &[1, 2, 3]), Some((a, 2)));
    p.check_invariants().unwrap();
}

#[test]
fn empty_and_unregistered_full_blocks_go_to_free_list() {
    let mut p = BlockPool::new(3, BS).unwrap();
    let e = p.allocate(root()).unwrap();
    let f = p.allocate(root()).unwrap();
    p.append_tokens(f, &[1, 2, 3, 4]).unwrap(); // full, never registered
    p.release(&[e, f]).unwrap();
    assert_eq!(p.state(e).unwrap(), BlockState::Free);
    assert_eq!(p.state(f).unwrap(), BlockState::Free);
    assert!(p.tokens(f).unwrap().is_empty());
    assert_eq!(p.stats().free, 3);
    p.check_invariants().unwrap();
}

#[test]
fn misuse_errors_leave_state_unchanged() {
    let mut p = BlockPool::new(3, BS).unwrap();
    assert!(BlockPool::new(3, 0).is_err());
    let a = p.allocate(root()).unwrap();
    let before = p.stats();
    for r in [
        p.acquire(&[a, 99]),
        p.acquire(&[a, 2]), // 2 is free
        p.release(&[a, a]),
        p.release(&[99]),
        p.append_tokens(99, &[1]),
        p.append_tokens(a, &[0; BS + 1]),
    ] {
        assert!(matches!(r, Err(CoreError::InvalidArgument(_))), "{r:?}");
    }
    assert!(p.register(a, BlockKey([0; 32])).is_err());
    assert!(p.cow(2, 0).is_err());
    assert!(p.ref_count(99).is_err() && p.tokens(99).is_err() && p.parent(2).is_err());
    assert_eq!(p.stats(), before);
    assert_eq!(p.ref_count(a).unwrap(), 1);
    p.release(&[a]).unwrap();
    assert!(p.append_tokens(a, &[1]).is_err(), "writing an unheld block");
    p.check_invariants().unwrap();
}

#[test]
fn zero_block_pool_is_always_out_of_blocks() {
    let mut p = BlockPool::new(0, BS).unwrap();
    assert!(matches!(p.allocate(root()), Err(CoreError::OutOfBlocks(_))));
    assert_eq!(p.available(), 0);
}

#[test]
fn large_prompt_lookup() {
    // 32K tokens, 2048 blocks: match_prefix over the full list finds everything.
    let mut p = BlockPool::new(2100, 16).unwrap();
    let r = root_key(b"m", "f16", 16, None);
    let toks: Vec<u32> = (0..32768u32)
        .map(|i| i.wrapping_mul(2654435761) % 50000)
        .collect();
    let keys = hash_blocks(&r, &toks, 16, b"");
    let mut parent = r;
    for (i, c) in toks.chunks(16).enumerate() {
        let id = p.allocate(parent).unwrap();
        p.append_tokens(id, c).unwrap();
        p.register(id, keys[i]).unwrap();
        parent = keys[i];
    }
    let (ids, n) = p.match_prefix(&keys);
    assert_eq!((ids.len(), n), (2048, 32768));
    assert_eq!(p.stats().tokens_held, 32768);
    p.check_invariants().unwrap();
}

#[test]
fn acquire_prefix_matches_and_takes_references_at_once() {
    let mut p = BlockPool::new(6, BS).unwrap();
    let prompt: Vec<u32> = (0..10).collect();
    let t = fill(&mut p, &prompt);
    p.release(&t).unwrap();
    let keys = hash_blocks(&root(), &prompt, BS, b"");
    let (ids, n) = p.acquire_prefix(&keys);
    assert_eq!((ids.clone(), n), (t[..2].to_vec(), 8));
    assert_eq!(p.lru_order(), vec![t[2]], "acquired blocks left the LRU");
    assert!(ids.iter().all(|&i| p.ref_count(i).unwrap() == 1));
    assert_eq!(p.acquire_prefix(&[BlockKey([9; 32])]), (vec![], 0));
    p.release(&ids).unwrap();
    p.check_invariants().unwrap();
}
