//! The RAM tier: content-addressed block payloads and checkpoints in host memory under a byte
//! budget, evicted least recently used first, with *pinned* prefix entries.
//!
//! - Content addressed: a block payload is stored under its chain key, a checkpoint under its
//!   prefix key; putting a key that is present stores nothing (it only refreshes recency).
//! - Loading (`get_*`) copies out (or clones the checkpoint `Arc`) and leaves the entry in place.
//! - `held_bytes()` is exactly the sum of the payload sizes of the entries held, and never
//!   exceeds the budget. A checkpoint held here counts its full `data.len()` against the budget
//!   even if a sequence or the store also holds the same `Arc`; the process-wide
//!   [`CheckpointAccount`] is what dedupes a checkpoint's bytes across all holders.
//! - Blocks and checkpoints live in separate key spaces (a checkpoint at a block-aligned position
//!   has the same key as the block ending there) but share one recency order.
//!
//! Pinning (prefix entries: the state of a chat prompt up to its first user message, which every
//! session with the same tools and system prompt starts with). Entries are in one of two classes:
//! - eviction takes the least recently used *normal* entry, and reaches pinned entries only when
//!   no normal entry is left (an insert larger than the budget minus the pinned bytes);
//! - pinned bytes are bounded by a sub-budget, `pin_budget <= budget` (default half the budget,
//!   so conversation tails always keep at least the other half): pinning past it *demotes* the
//!   least recently used pinned entries to the normal class, where they age like any entry;
//! - `pin_blocks(keys)` pins a chain's leading held blocks and refreshes them deepest first,
//!   so the chain's first block is the most recent: demotion and eviction take a chain's deep
//!   blocks before its head, and what stays is always a usable prefix (`touch_blocks` does the
//!   same refresh without pinning).

mod recency;

use crate::checkpoint::{Checkpoint, CheckpointAccount, CheckpointStore};
use crate::error::{CoreError, Result};
use crate::hash::{BlockKey, KeyMap};
use recency::Recency;
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
    /// Pinned entries and their bytes (<= `pin_budget`).
    pub pinned: usize,
    pub pinned_bytes: u64,
    pub pin_budget: u64,
    /// Pinned entries moved back to the normal class to keep the pin budget.
    pub demotions: u64,
    /// Evictions that took a pinned entry (no normal entry was left); also in `evictions`.
    pub pinned_evictions: u64,
}

#[derive(Debug)]
pub struct RamTier {
    budget: u64,
    pin_budget: u64,
    blocks: KeyMap<Arc<[u8]>>,
    ckpts: CheckpointStore,
    recency: Recency,
    held: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    demotions: u64,
    pinned_evictions: u64,
}

impl RamTier {
    /// A tier of `budget_bytes`, half of which may be pinned (see [`RamTier::set_pin_budget`]).
    pub fn new(budget_bytes: u64, account: CheckpointAccount) -> RamTier {
        RamTier {
            budget: budget_bytes,
            pin_budget: budget_bytes / 2,
            blocks: KeyMap::default(),
            ckpts: CheckpointStore::new(account),
            recency: Recency::default(),
            held: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
            demotions: 0,
            pinned_evictions: 0,
        }
    }

    pub fn account(&self) -> &CheckpointAccount {
        self.ckpts.account()
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn pin_budget(&self) -> u64 {
        self.pin_budget
    }

    /// Sum of payload bytes of the entries held (<= budget).
    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    /// Sum of payload bytes of the pinned entries (<= pin budget).
    pub fn pinned_bytes(&self) -> u64 {
        self.recency.pinned_bytes()
    }

    pub fn len(&self) -> usize {
        self.blocks.len() + self.ckpts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

    /// Drop the payload of an entry the recency order already let go of.
    fn drop_payload(&mut self, kind: EntryKind, key: &BlockKey) {
        let n = match kind {
            EntryKind::Block => self.blocks.remove(key).map(|d| d.len()),
            EntryKind::Checkpoint => self.ckpts.remove(key).map(|c| c.data.len()),
        };
        self.held -= n.unwrap_or(0) as u64;
    }

    /// Evict (normal entries first, then pinned ones) until `need` more bytes fit.
    fn make_room(&mut self, need: u64) {
        while self.held + need > self.budget {
            let Some(v) = self.recency.pop_victim() else {
                break;
            };
            self.drop_payload(v.kind, &v.key);
            self.evictions += 1;
            if v.pinned {
                self.pinned_evictions += 1;
            }
        }
    }

    /// Demote least recently used pinned entries until the pinned bytes fit the pin budget.
    fn enforce_pin_budget(&mut self) {
        while self.recency.pinned_bytes() > self.pin_budget {
            if self.recency.demote_oldest_pinned().is_none() {
                break;
            }
            self.demotions += 1;
        }
    }

    /// Store a block payload under `key` (copied once). Returns `false` if the key was already
    /// held (nothing stored; its recency is refreshed). `OverBudget` if the payload alone exceeds
    /// the budget; `InvalidArgument` if the key is held with a payload of another size.
    pub fn put_block(&mut self, key: BlockKey, data: &[u8]) -> Result<bool> {
        if let Some(e) = self.blocks.get(&key) {
            if e.len() != data.len() {
                return Err(CoreError::InvalidArgument(format!(
                    "block {key} is held with {} bytes, put with {}",
                    e.len(),
                    data.len()
                )));
            }
            self.recency.touch(EntryKind::Block, &key);
            return Ok(false);
        }
        let n = data.len() as u64;
        self.check_fits("block", n)?;
        self.make_room(n);
        self.blocks.insert(key, Arc::from(data));
        self.recency.insert(EntryKind::Block, key, n);
        self.held += n;
        Ok(true)
    }

    /// The payload of `key` without copying (counts a hit or miss, refreshes recency).
    pub fn get_block_shared(&mut self, key: &BlockKey) -> Option<Arc<[u8]>> {
        match self.blocks.get(key) {
            Some(d) => {
                let d = d.clone();
                self.hits += 1;
                self.recency.touch(EntryKind::Block, key);
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
        let Some(d) = self.blocks.get(key) else {
            self.misses += 1;
            return Ok(false);
        };
        if d.len() != out.len() {
            return Err(CoreError::InvalidArgument(format!(
                "block {key} holds {} bytes, destination has {}",
                d.len(),
                out.len()
            )));
        }
        out.copy_from_slice(d);
        self.hits += 1;
        self.recency.touch(EntryKind::Block, key);
        Ok(true)
    }

    /// Peek: no stats, no recency change.
    pub fn contains_block(&self, key: &BlockKey) -> bool {
        self.blocks.contains_key(key)
    }

    pub fn block_len(&self, key: &BlockKey) -> Option<usize> {
        self.blocks.get(key).map(|d| d.len())
    }

    pub fn remove_block(&mut self, key: &BlockKey) -> bool {
        match self.recency.remove(EntryKind::Block, key) {
            Some(_) => {
                self.drop_payload(EntryKind::Block, key);
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

    /// Refresh the leading held blocks of a chain (no stats), deepest first, so `keys[0]` ends
    /// up the most recent: eviction then takes the chain's deep blocks before its head.
    /// Returns how many leading keys are held.
    pub fn touch_blocks(&mut self, keys: &[BlockKey]) -> usize {
        let n = self.match_prefix(keys);
        for key in keys[..n].iter().rev() {
            self.recency.touch(EntryKind::Block, key);
        }
        n
    }

    /// Pin the leading held blocks of a chain (a prefix entry), refreshed as in
    /// [`RamTier::touch_blocks`]. A block larger than the whole pin budget is only refreshed.
    /// Then the pin budget is enforced (least recently used pins are demoted: other chains'
    /// first, then this chain's deepest blocks). Returns how many leading keys are pinned.
    pub fn pin_blocks(&mut self, keys: &[BlockKey]) -> usize {
        let n = self.match_prefix(keys);
        for key in keys[..n].iter().rev() {
            if self.blocks[key].len() as u64 <= self.pin_budget {
                self.recency.pin(EntryKind::Block, key);
            } else {
                self.recency.touch(EntryKind::Block, key);
            }
        }
        self.enforce_pin_budget();
        keys[..n]
            .iter()
            .take_while(|k| self.recency.is_pinned(EntryKind::Block, k))
            .count()
    }

    /// Pin a held checkpoint (refreshing it). Returns whether it is pinned afterwards (false if
    /// not held or larger than the pin budget).
    pub fn pin_checkpoint(&mut self, key: &BlockKey) -> bool {
        match self.ckpts.get(key) {
            Some(c) if c.data.len() as u64 <= self.pin_budget => {
                self.recency.pin(EntryKind::Checkpoint, key);
                self.enforce_pin_budget();
            }
            Some(_) => {
                self.recency.touch(EntryKind::Checkpoint, key);
            }
            None => return false,
        }
        self.recency.is_pinned(EntryKind::Checkpoint, key)
    }

    /// Move a pinned entry back to the normal class (keeping its recency). False if it was not
    /// pinned.
    pub fn unpin(&mut self, kind: EntryKind, key: &BlockKey) -> bool {
        self.recency.unpin(kind, key)
    }

    pub fn is_pinned(&self, kind: EntryKind, key: &BlockKey) -> bool {
        self.recency.is_pinned(kind, key)
    }

    /// Hold `ckpt` (an `Arc` clone, no byte copy). Returns `false` if its key was already held
    /// (the held one stays; recency refreshed). `OverBudget` if it alone exceeds the budget.
    pub fn put_checkpoint(&mut self, ckpt: Arc<Checkpoint>) -> Result<bool> {
        let key = ckpt.key;
        if self.ckpts.contains(&key) {
            self.recency.touch(EntryKind::Checkpoint, &key);
            return Ok(false);
        }
        let n = ckpt.data.len() as u64;
        self.check_fits("checkpoint", n)?;
        self.make_room(n);
        self.ckpts.insert(ckpt);
        self.recency.insert(EntryKind::Checkpoint, key, n);
        self.held += n;
        Ok(true)
    }

    /// The held checkpoint under `key` (counts a hit or miss, refreshes recency).
    pub fn get_checkpoint(&mut self, key: &BlockKey) -> Option<Arc<Checkpoint>> {
        match self.ckpts.get(key) {
            Some(c) => {
                self.hits += 1;
                self.recency.touch(EntryKind::Checkpoint, key);
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
                self.recency.touch(EntryKind::Checkpoint, &c.key);
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
        self.recency.remove(EntryKind::Checkpoint, key)?;
        let c = self.ckpts.remove(key)?;
        self.held -= c.data.len() as u64;
        Some(c)
    }

    /// Change the budget (the pin budget is lowered to it if larger), evicting until the held
    /// bytes fit.
    pub fn set_budget(&mut self, budget_bytes: u64) {
        self.budget = budget_bytes;
        self.pin_budget = self.pin_budget.min(budget_bytes);
        self.enforce_pin_budget();
        self.make_room(0);
    }

    /// Change the pin budget (capped at the budget), demoting pins until they fit.
    pub fn set_pin_budget(&mut self, pin_budget_bytes: u64) {
        self.pin_budget = pin_budget_bytes.min(self.budget);
        self.enforce_pin_budget();
    }

    /// Drop every entry (not counted as evictions).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.recency.clear();
        let keys: Vec<BlockKey> = self.ckpts.iter().map(|c| c.key).collect();
        for k in keys {
            self.ckpts.remove(&k);
        }
        self.held = 0;
    }

    /// Entries in eviction order: normal entries least recently used first, then pinned ones.
    pub fn lru_order(&self) -> Vec<(EntryKind, BlockKey)> {
        self.recency.eviction_order()
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
            pinned: self.recency.pinned_len(),
            pinned_bytes: self.recency.pinned_bytes(),
            pin_budget: self.pin_budget,
            demotions: self.demotions,
            pinned_evictions: self.pinned_evictions,
        }
    }

    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.ckpts.check_invariants()?;
        self.recency.check()?;
        let block_bytes: u64 = self.blocks.values().map(|d| d.len() as u64).sum();
        let bytes = block_bytes + self.ckpts.unique_bytes();
        if bytes != self.held {
            return Err(format!("held {} != sum of entries {bytes}", self.held));
        }
        if self.held > self.budget {
            return Err(format!("held {} > budget {}", self.held, self.budget));
        }
        if self.pin_budget > self.budget || self.recency.pinned_bytes() > self.pin_budget {
            return Err(format!(
                "pinned {} > pin budget {} (budget {})",
                self.recency.pinned_bytes(),
                self.pin_budget,
                self.budget
            ));
        }
        if self.recency.len() != self.len() {
            return Err("the recency order does not list every entry exactly once".into());
        }
        if self.recency.bytes_of(EntryKind::Block) != block_bytes
            || self.recency.bytes_of(EntryKind::Checkpoint) != self.ckpts.unique_bytes()
        {
            return Err("recency sizes differ from the payloads held".into());
        }
        for (kind, key) in self.recency.eviction_order() {
            let len = match kind {
                EntryKind::Block => self.blocks.get(&key).map(|d| d.len()),
                EntryKind::Checkpoint => self.ckpts.get(&key).map(|c| c.data.len()),
            };
            if len.map(|n| n as u64) != self.recency.size_of(kind, &key) {
                return Err(format!(
                    "recency lists {kind:?} {key} that is not held as such"
                ));
            }
        }
        Ok(())
    }
}
