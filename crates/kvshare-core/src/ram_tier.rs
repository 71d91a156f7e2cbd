//! The RAM tier: content-addressed block payloads and checkpoints in host memory under a byte
//! budget, evicted least recently used first.
//!
//! - Content addressed: a block payload is stored under its chain key, a checkpoint under its
//!   prefix key; putting a key that is present stores nothing (it only refreshes recency).
//! - Loading (`get_*`) copies out (or clones the checkpoint `Arc`) and leaves the entry in place.
//! - `held_bytes()` is exactly the sum of the payload sizes of the entries held, and never
//!   exceeds the budget. A checkpoint held here counts its full `data.len()` against the budget
//!   even if a sequence or the store also holds the same `Arc`; the process-wide
//!   [`CheckpointAccount`] is what dedupes a checkpoint's bytes across all holders.
//! - Blocks and checkpoints live in separate key spaces (a checkpoint at a block-aligned position
//!   has the same key as the block ending there) but share one LRU.

use crate::checkpoint::{Checkpoint, CheckpointAccount, CheckpointStore};
use crate::error::{CoreError, Result};
use crate::hash::{BlockKey, KeyMap};
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EntryKind {
    Block,
    Checkpoint,
}

impl EntryKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            EntryKind::Block => "block",
            EntryKind::Checkpoint => "checkpoint",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RamStats {
    pub entries: usize,
    pub blocks: usize,
    pub checkpoints: usize,
    pub bytes: u64,
    pub budget: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

#[derive(Debug)]
struct BlockEntry {
    data: Arc<[u8]>,
    tick: u64,
}

#[derive(Debug)]
pub struct RamTier {
    budget: u64,
    blocks: KeyMap<BlockEntry>,
    ckpts: CheckpointStore,
    ckpt_ticks: KeyMap<u64>,
    /// recency tick -> entry; the first entry is the least recently used.
    lru: BTreeMap<u64, (EntryKind, BlockKey)>,
    next_tick: u64,
    held: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl RamTier {
    pub fn new(budget_bytes: u64, account: CheckpointAccount) -> RamTier {
        RamTier {
            budget: budget_bytes,
            blocks: KeyMap::default(),
            ckpts: CheckpointStore::new(account),
            ckpt_ticks: KeyMap::default(),
            lru: BTreeMap::new(),
            next_tick: 0,
            held: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    pub fn account(&self) -> &CheckpointAccount {
        self.ckpts.account()
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Sum of payload bytes of the entries held (<= budget).
    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    pub fn len(&self) -> usize {
        self.blocks.len() + self.ckpts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    fn touch(&mut self, kind: EntryKind, key: &BlockKey) {
        let t = self.tick();
        let old = match kind {
            EntryKind::Block => self
                .blocks
                .get_mut(key)
                .map(|e| std::mem::replace(&mut e.tick, t)),
            EntryKind::Checkpoint => self
                .ckpt_ticks
                .get_mut(key)
                .map(|o| std::mem::replace(o, t)),
        };
        if let Some(old) = old {
            self.lru.remove(&old);
            self.lru.insert(t, (kind, *key));
        }
    }

    fn check_fits(&self, what: &str, n: u64) -> Result<()> {
        if n > self.budget {
            return Err(CoreError::OverBudget(format!(
                "{what} of {n} bytes exceeds the RAM tier budget of {} bytes",
                self.budget
            )));
        }
        Ok(())
    }

    /// Evict LRU entries until `need` more bytes fit.
    fn make_room(&mut self, need: u64) {
        while self.held + need > self.budget {
            let Some((_, (kind, key))) = self.lru.pop_first() else {
                break;
            };
            match kind {
                EntryKind::Block => {
                    if let Some(e) = self.blocks.remove(&key) {
                        self.held -= e.data.len() as u64;
                    }
                }
                EntryKind::Checkpoint => {
                    self.ckpt_ticks.remove(&key);
                    if let Some(c) = self.ckpts.remove(&key) {
                        self.held -= c.data.len() as u64;
                    }
                }
            }
            self.evictions += 1;
        }
    }

    /// Store a block payload under `key` (copied once). Returns `false` if the key was already
    /// held (nothing stored; its recency is refreshed). `OverBudget` if the payload alone exceeds
    /// the budget; `InvalidArgument` if the key is held with a payload of another size.
    pub fn put_block(&mut self, key: BlockKey, data: &[u8]) -> Result<bool> {
        if let Some(e) = self.blocks.get(&key) {
            if e.data.len() != data.len() {
                return Err(CoreError::InvalidArgument(format!(
                    "block {key} is held with {} bytes, put with {}",
                    e.data.len(),
                    data.len()
                )));
            }
            self.touch(EntryKind::Block, &key);
            return Ok(false);
        }
        let n = data.len() as u64;
        self.check_fits("block", n)?;
        self.make_room(n);
        let t = self.tick();
        self.blocks.insert(
            key,
            BlockEntry {
                data: Arc::from(data),
                tick: t,
            },
        );
        self.lru.insert(t, (EntryKind::Block, key));
        self.held += n;
        Ok(true)
    }

    /// The payload of `key` without copying (counts a hit or miss, refreshes recency).
    pub fn get_block_shared(&mut self, key: &BlockKey) -> Option<Arc<[u8]>> {
        match self.blocks.get(key) {
            Some(e) => {
                let d = e.data.clone();
                self.hits += 1;
                self.touch(EntryKind::Block, key);
                Some(d)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// A copy of the payload of `key`; the entry stays.
    pub fn get_block(&mut self, key: &BlockKey) -> Option<Vec<u8>> {
        self.get_block_shared(key).map(|d| d.to_vec())
    }

    /// Copy the payload of `key` into `out` (which must have exactly its size). `Ok(false)` on a
    /// miss; the entry stays.
    pub fn get_block_into(&mut self, key: &BlockKey, out: &mut [u8]) -> Result<bool> {
        let Some(e) = self.blocks.get(key) else {
            self.misses += 1;
            return Ok(false);
        };
        if e.data.len() != out.len() {
            return Err(CoreError::InvalidArgument(format!(
                "block {key} holds {} bytes, destination has {}",
                e.data.len(),
                out.len()
            )));
        }
        out.copy_from_slice(&e.data);
        self.hits += 1;
        self.touch(EntryKind::Block, key);
        Ok(true)
    }

    /// Peek: no stats, no recency change.
    pub fn contains_block(&self, key: &BlockKey) -> bool {
        self.blocks.contains_key(key)
    }

    pub fn block_len(&self, key: &BlockKey) -> Option<usize> {
        self.blocks.get(key).map(|e| e.data.len())
    }

    pub fn remove_block(&mut self, key: &BlockKey) -> bool {
        match self.blocks.remove(key) {
            Some(e) => {
                self.lru.remove(&e.tick);
                self.held -= e.data.len() as u64;
                true
            }
            None => false,
        }
    }

    /// Number of leading `keys` whose block payloads are held (peek: no stats, no recency).
    pub fn match_prefix(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|k| self.blocks.contains_key(*k))
            .count()
    }

    /// Hold `ckpt` (an `Arc` clone, no byte copy). Returns `false` if its key was already held
    /// (the held one stays; recency refreshed). `OverBudget` if it alone exceeds the budget.
    pub fn put_checkpoint(&mut self, ckpt: Arc<Checkpoint>) -> Result<bool> {
        let key = ckpt.key;
        if self.ckpts.contains(&key) {
            self.touch(EntryKind::Checkpoint, &key);
            return Ok(false);
        }
        let n = ckpt.data.len() as u64;
        self.check_fits("checkpoint", n)?;
        self.make_room(n);
        let t = self.tick();
        self.ckpts.insert(ckpt);
        self.ckpt_ticks.insert(key, t);
        self.lru.insert(t, (EntryKind::Checkpoint, key));
        self.held += n;
        Ok(true)
    }

    /// The held checkpoint under `key` (counts a hit or miss, refreshes recency).
    pub fn get_checkpoint(&mut self, key: &BlockKey) -> Option<Arc<Checkpoint>> {
        match self.ckpts.get(key) {
            Some(c) => {
                self.hits += 1;
                self.touch(EntryKind::Checkpoint, key);
                Some(c)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// [`CheckpointStore::deepest`] over the checkpoints held here (a hit refreshes recency).
    pub fn deepest_checkpoint(
        &mut self,
        root: &BlockKey,
        block_keys: &[BlockKey],
        tokens: &[u32],
        max_position: u64,
    ) -> Option<Arc<Checkpoint>> {
        let found = self.ckpts.deepest(root, block_keys, tokens, max_position);
        match &found {
            Some(c) => {
                self.hits += 1;
                self.touch(EntryKind::Checkpoint, &c.key);
            }
            None => self.misses += 1,
        }
        found
    }

    /// The held checkpoints (any order; a peek: no stats, no recency).
    pub fn checkpoints(&self) -> impl Iterator<Item = &Arc<Checkpoint>> {
        self.ckpts.iter()
    }

    pub fn contains_checkpoint(&self, key: &BlockKey) -> bool {
        self.ckpts.contains(key)
    }

    pub fn remove_checkpoint(&mut self, key: &BlockKey) -> Option<Arc<Checkpoint>> {
        let c = self.ckpts.remove(key)?;
        if let Some(t) = self.ckpt_ticks.remove(key) {
            self.lru.remove(&t);
        }
        self.held -= c.data.len() as u64;
        Some(c)
    }

    /// Change the budget, evicting LRU entries until the held bytes fit.
    pub fn set_budget(&mut self, budget_bytes: u64) {
        self.budget = budget_bytes;
        self.make_room(0);
    }

    /// Drop every entry (not counted as evictions).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.ckpt_ticks.clear();
        self.lru.clear();
        let keys: Vec<BlockKey> = self.ckpts.iter().map(|c| c.key).collect();
        for k in keys {
            self.ckpts.remove(&k);
        }
        self.held = 0;
    }

    /// Entries from least to most recently used.
    pub fn lru_order(&self) -> Vec<(EntryKind, BlockKey)> {
        self.lru.values().copied().collect()
    }

    pub fn stats(&self) -> RamStats {
        RamStats {
            entries: self.len(),
            blocks: self.blocks.len(),
            checkpoints: self.ckpts.len(),
            bytes: self.held,
            budget: self.budget,
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
        }
    }

    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.ckpts.check_invariants()?;
        let block_bytes: u64 = self.blocks.values().map(|e| e.data.len() as u64).sum();
        let bytes = block_bytes + self.ckpts.unique_bytes();
        if bytes != self.held {
            return Err(format!("held {} != sum of entries {bytes}", self.held));
        }
        if self.held > self.budget {
            return Err(format!("held {} > budget {}", self.held, self.budget));
        }
        if self.lru.len() != self.len() || self.ckpt_ticks.len() != self.ckpts.len() {
            return Err("LRU does not list every entry exactly once".into());
        }
        for (t, (kind, key)) in &self.lru {
            let ok = match kind {
                EntryKind::Block => self.blocks.get(key).is_some_and(|e| e.tick == *t),
                EntryKind::Checkpoint => self.ckpt_ticks.get(key) == Some(t),
            };
            if !ok {
                return Err(format!("LRU entry {t} ({kind:?} {key}) is stale"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
