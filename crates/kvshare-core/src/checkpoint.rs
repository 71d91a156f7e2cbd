//! Checkpoints: immutable, `Arc`-shared snapshots of a sequence's recurrent state at a token
//! position, and the store that finds the deepest one along a prompt.
//!
//! A [`Checkpoint`] is created once and only ever shared as `Arc<Checkpoint>`: sequences, the
//! [`CheckpointStore`], the RAM tier and the disk writer clone the `Arc`, never the bytes. Every
//! checkpoint registers its payload size with a [`CheckpointAccount`] when it is created and
//! unregisters in `Drop`, i.e. when its last `Arc` goes. The account therefore counts each
//! distinct live checkpoint exactly once, however many holders it has.

use crate::error::{CoreError, Result};
use crate::hash::{anchor_and_tail, partial_key, BlockKey, KeyMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

#[derive(Debug, Default)]
struct AccountInner {
    live: AtomicU64,
    bytes: AtomicU64,
}

/// Shared counters of live (not yet dropped) checkpoints and their payload bytes. Cloning shares
/// the same counters.
#[derive(Clone, Debug, Default)]
pub struct CheckpointAccount {
    inner: Arc<AccountInner>,
}

impl CheckpointAccount {
    pub fn new() -> CheckpointAccount {
        CheckpointAccount::default()
    }

    /// The process-wide account used where no explicit one is given (the Python binding).
    pub fn global() -> &'static CheckpointAccount {
        static GLOBAL: OnceLock<CheckpointAccount> = OnceLock::new();
        GLOBAL.get_or_init(CheckpointAccount::new)
    }

    /// Number of distinct live checkpoints registered with this account.
    pub fn live_count(&self) -> u64 {
        self.inner.live.load(Ordering::Acquire)
    }

    /// Sum of `data.len()` over distinct live checkpoints.
    pub fn live_bytes(&self) -> u64 {
        self.inner.bytes.load(Ordering::Acquire)
    }

    pub fn same_as(&self, other: &CheckpointAccount) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn register(&self, bytes: u64) {
        self.inner.live.fetch_add(1, Ordering::AcqRel);
        self.inner.bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    fn unregister(&self, bytes: u64) {
        self.inner.live.fetch_sub(1, Ordering::AcqRel);
        self.inner.bytes.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// An immutable snapshot at token `position`. Construct with [`Checkpoint::new`] or
/// [`Checkpoint::at`]; both return the one `Arc` every holder clones.
#[derive(Debug)]
pub struct Checkpoint {
    /// Token position n: the state after `tokens[..n]`.
    pub position: u64,
    /// `prefix_key(root, tokens[..n])`.
    pub key: BlockKey,
    /// Key of the last full block at or before `position` (the root if none).
    pub anchor: BlockKey,
    /// Tokens between the anchor and `position` (fewer than a block).
    pub tail: Vec<u32>,
    /// The state bytes (opaque here).
    pub data: Vec<u8>,
    /// Metadata, e.g. JSON of shapes and dtypes.
    pub layout: String,
    account: CheckpointAccount,
}

impl Checkpoint {
    /// Wrap already computed fields. `tail.len() <= position` is required; the key is trusted
    /// (use [`Checkpoint::at`] to derive key, anchor and tail from the tokens).
    pub fn new(
        account: &CheckpointAccount,
        position: u64,
        key: BlockKey,
        anchor: BlockKey,
        tail: Vec<u32>,
        data: Vec<u8>,
        layout: String,
    ) -> Result<Arc<Checkpoint>> {
        if tail.len() as u64 > position {
            return Err(CoreError::InvalidArgument(format!(
                "checkpoint tail of {} tokens is longer than its position {position}",
                tail.len()
            )));
        }
        account.register(data.len() as u64);
        Ok(Arc::new(Checkpoint {
            position,
            key,
            anchor,
            tail,
            data,
            layout,
            account: account.clone(),
        }))
    }

    /// The checkpoint of the state after `tokens` (position `tokens.len()`): key, anchor and tail
    /// are derived with the same chain hashing as the block keys.
    pub fn at(
        account: &CheckpointAccount,
        root: &BlockKey,
        tokens: &[u32],
        block_size: usize,
        extra: &[u8],
        data: Vec<u8>,
        layout: String,
    ) -> Result<Arc<Checkpoint>> {
        if block_size == 0 {
            return Err(CoreError::InvalidArgument("block_size must be > 0".into()));
        }
        let (anchor, tail) = anchor_and_tail(root, tokens, block_size, extra);
        let key = if tail.is_empty() {
            anchor
        } else {
            partial_key(&anchor, tail, extra)
        };
        Checkpoint::new(
            account,
            tokens.len() as u64,
            key,
            anchor,
            tail.to_vec(),
            data,
            layout,
        )
    }

    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    pub fn account(&self) -> &CheckpointAccount {
        &self.account
    }

    /// Position of the anchor (`position - tail.len()`).
    pub fn anchor_position(&self) -> u64 {
        self.position - self.tail.len() as u64
    }
}

impl Drop for Checkpoint {
    fn drop(&mut self) {
        self.account.unregister(self.data.len() as u64);
    }
}

/// Checkpoints by key, and by anchor for the walk along a prompt. Holds one `Arc` per key.
#[derive(Debug, Default)]
pub struct CheckpointStore {
    account: CheckpointAccount,
    by_key: KeyMap<Arc<Checkpoint>>,
    by_anchor: KeyMap<Vec<Arc<Checkpoint>>>,
    bytes: u64,
}

impl CheckpointStore {
    pub fn new(account: CheckpointAccount) -> CheckpointStore {
        CheckpointStore {
            account,
            ..Default::default()
        }
    }

    pub fn account(&self) -> &CheckpointAccount {
        &self.account
    }

    /// Add `ckpt` and return the stored `Arc`. If a checkpoint with the same key is present it is
    /// kept and returned instead (a checkpoint just restored is not replaced by a byte-identical
    /// save).
    pub fn insert(&mut self, ckpt: Arc<Checkpoint>) -> Arc<Checkpoint> {
        if let Some(existing) = self.by_key.get(&ckpt.key) {
            return existing.clone();
        }
        self.bytes += ckpt.data.len() as u64;
        self.by_anchor
            .entry(ckpt.anchor)
            .or_default()
            .push(ckpt.clone());
        self.by_key.insert(ckpt.key, ckpt.clone());
        ckpt
    }

    pub fn get(&self, key: &BlockKey) -> Option<Arc<Checkpoint>> {
        self.by_key.get(key).cloned()
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.by_key.contains_key(key)
    }

    pub fn remove(&mut self, key: &BlockKey) -> Option<Arc<Checkpoint>> {
        let ckpt = self.by_key.remove(key)?;
        if let Some(v) = self.by_anchor.get_mut(&ckpt.anchor) {
            if let Some(pos) = v.iter().position(|c| Arc::ptr_eq(c, &ckpt)) {
                v.swap_remove(pos);
            }
            if v.is_empty() {
                self.by_anchor.remove(&ckpt.anchor);
            }
        }
        self.bytes -= ckpt.data.len() as u64;
        Some(ckpt)
    }

    /// The deepest checkpoint at or before `max_position` along a prompt. `block_keys` are the
    /// prompt's full-block keys (`hash_blocks(root, tokens, ..)`), `tokens` the prompt. Every
    /// anchor along the prompt (`root`, then each full-block key) is visited; a checkpoint at an
    /// anchor matches when its tail equals the prompt's tokens right after that anchor. Ties in
    /// position cannot differ in content (same anchor + same tail = same key).
    pub fn deepest(
        &self,
        root: &BlockKey,
        block_keys: &[BlockKey],
        tokens: &[u32],
        max_position: u64,
    ) -> Option<Arc<Checkpoint>> {
        let max_position = max_position.min(tokens.len() as u64);
        let mut best: Option<&Arc<Checkpoint>> = None;
        for anchor in std::iter::once(root).chain(block_keys.iter()) {
            let Some(cands) = self.by_anchor.get(anchor) else {
                continue;
            };
            for c in cands {
                if c.position > max_position || best.is_some_and(|b| b.position >= c.position) {
                    continue;
                }
                let start = c.anchor_position() as usize;
                if tokens[start..c.position as usize] == c.tail[..] {
                    best = Some(c);
                }
            }
        }
        best.cloned()
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Payload bytes of the checkpoints in this store (each key once).
    pub fn unique_bytes(&self) -> u64 {
        self.bytes
    }

    /// All stored checkpoints (any order).
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Checkpoint>> {
        self.by_key.values()
    }

    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let n_anchor: usize = self.by_anchor.values().map(|v| v.len()).sum();
        if n_anchor != self.by_key.len() {
            return Err(format!(
                "{} by key, {n_anchor} by anchor",
                self.by_key.len()
            ));
        }
        let mut bytes = 0u64;
        for (k, c) in &self.by_key {
            if c.key != *k {
                return Err(format!("checkpoint under {k} has key {}", c.key));
            }
            if !self
                .by_anchor
                .get(&c.anchor)
                .is_some_and(|v| v.iter().any(|x| Arc::ptr_eq(x, c)))
            {
                return Err(format!("checkpoint {k} missing from its anchor list"));
            }
            bytes += c.data.len() as u64;
        }
        if bytes != self.bytes {
            return Err(format!("bytes {} != recomputed {bytes}", self.bytes));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{hash_blocks, prefix_key, root_key};

    #[test]
    fn account_counts_each_arc_once() {
        let acct = CheckpointAccount::new();
        let r = root_key(b"m", "f16", 4, None);
        let c = Checkpoint::at(
            &acct,
            &r,
            &[1, 2, 3, 4, 5],
            4,
            b"",
            vec![0; 100],
            "{}".into(),
        )
        .unwrap();
        assert_eq!(c.key, prefix_key(&r, &[1, 2, 3, 4, 5], 4, b""));
        assert_eq!(c.tail, vec![5]);
        let holders: Vec<_> = (0..5).map(|_| c.clone()).collect();
        assert_eq!((acct.live_count(), acct.live_bytes()), (1, 100));
        drop(c);
        drop(holders);
        assert_eq!((acct.live_count(), acct.live_bytes()), (0, 0));
    }

    #[test]
    fn store_dedups_and_finds_deepest() {
        let acct = CheckpointAccount::new();
        let r = root_key(b"m", "f16", 4, None);
        let toks: Vec<u32> = (0..14).collect();
        let keys = hash_blocks(&r, &toks, 4, b"");
        let mut s = CheckpointStore::new(acct.clone());
        for n in [3usize, 8, 10] {
            s.insert(
                Checkpoint::at(
                    &acct,
                    &r,
                    &toks[..n],
                    4,
                    b"",
                    vec![n as u8; n],
                    String::new(),
                )
                .unwrap(),
            );
        }
        let dup = Checkpoint::at(&acct, &r, &toks[..8], 4, b"", vec![0; 8], String::new()).unwrap();
        let kept = s.insert(dup.clone());
        assert!(!Arc::ptr_eq(&kept, &dup));
        assert_eq!(s.len(), 3);
        assert_eq!(s.unique_bytes(), 21);
        assert_eq!(s.deepest(&r, &keys, &toks, 100).unwrap().position, 10);
        assert_eq!(s.deepest(&r, &keys, &toks, 9).unwrap().position, 8);
        assert!(s.deepest(&r, &keys, &toks, 2).is_none());
        let mut other = toks.clone();
        other[9] = 99;
        let okeys = hash_blocks(&r, &other, 4, b"");
        assert_eq!(s.deepest(&r, &okeys, &other, 100).unwrap().position, 8);
        s.remove(&kept.key).unwrap();
        assert_eq!(s.deepest(&r, &keys, &toks, 9).unwrap().position, 3);
        s.check_invariants().unwrap();
    }
}
