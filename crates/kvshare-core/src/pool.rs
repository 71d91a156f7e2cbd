//! The fixed-size KV block pool: ids, ref counts, keys, token ids per block, LRU of cached
//! blocks, copy-on-write support. Python owns the KV arrays; this is only the bookkeeping.
//!
//! Every block is in exactly one state:
//! - `Free`: on the free list; no key, no tokens, not indexed. Never reachable from a table.
//! - `Used`: `ref_count > 0`, held by at least one block table. `ref_count > 1` = shared, never
//!   written in place (`append_tokens` refuses; the caller copies it with [`BlockPool::cow`]).
//! - `Cached`: `ref_count == 0` but its content is still findable (a registered full block, or a
//!   non-empty partial block reachable through [`BlockPool::extend_match`]); it sits in the LRU
//!   and is evicted lazily, from the LRU head, only when a block is needed and none is free.
//!
//! [`BlockPool::release`] processes a block table LAST block first, appending each block that
//! reaches ref 0 to the LRU tail, so a sequence's deep blocks are evicted before its (possibly
//! shared) prefix.

use crate::error::{CoreError, Result};
use crate::hash::{BlockKey, KeyMap};
use std::collections::HashMap;

pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockState {
    Free,
    Used,
    Cached,
}

impl BlockState {
    pub fn as_str(&self) -> &'static str {
        match self {
            BlockState::Free => "free",
            BlockState::Used => "used",
            BlockState::Cached => "cached",
        }
    }
}

/// Pool occupancy. `total == used + free + cached`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub total: usize,
    /// ref count > 0
    pub used: usize,
    /// on the free list (no content)
    pub free: usize,
    /// ref count 0 with content, evictable (the LRU's length)
    pub cached: usize,
    /// ref count > 1
    pub shared: usize,
    /// sum of token counts of used blocks
    pub tokens_held: usize,
}

#[derive(Clone, Debug)]
struct Block {
    ref_count: u32,
    /// Set only on the block that holds this key in `by_key` (a full, registered block).
    key: Option<BlockKey>,
    /// Key of the preceding full block (the chain root for a sequence's first block).
    parent: BlockKey,
    /// Token ids whose KV has been written, `len() <= block_size`.
    tokens: Vec<u32>,
    state: BlockState,
    prev: u32,
    next: u32,
}

/// See the module docs. Not thread-safe by itself; the binding wraps it in a Mutex.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Stack of free ids (pop from the end; initially yields 0, 1, 2, ...).
    free: Vec<BlockId>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    by_key: KeyMap<BlockId>,
    /// parent key -> every non-free block with that parent (full or partial, used or cached).
    children: KeyMap<Vec<BlockId>>,
    n_used: usize,
    n_shared: usize,
    tokens_held: usize,
}

fn invalid(msg: String) -> CoreError {
    CoreError::InvalidArgument(msg)
}

impl BlockPool {
    /// A pool of `n_blocks` blocks of `block_size` tokens each, all free.
    pub fn new(n_blocks: usize, block_size: usize) -> Result<BlockPool> {
        if block_size == 0 {
            return Err(invalid("block_size must be > 0".into()));
        }
        if n_blocks >= NIL as usize {
            return Err(invalid(format!("n_blocks {n_blocks} too large")));
        }
        let blocks = (0..n_blocks)
            .map(|_| Block {
                ref_count: 0,
                key: None,
                parent: BlockKey::default(),
                tokens: Vec::new(),
                state: BlockState::Free,
                prev: NIL,
                next: NIL,
            })
            .collect();
        Ok(BlockPool {
            block_size,
            blocks,
            free: (0..n_blocks as u32).rev().collect(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            by_key: KeyMap::default(),
            children: KeyMap::default(),
            n_used: 0,
            n_shared: 0,
            tokens_held: 0,
        })
    }

    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks an `allocate` could hand out now without failing: free + cached.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru_len
    }

    fn block(&self, id: BlockId) -> Result<&Block> {
        self.blocks.get(id as usize).ok_or_else(|| {
            invalid(format!(
                "unknown block id {id} (pool has {})",
                self.blocks.len()
            ))
        })
    }

    fn live_block(&self, id: BlockId) -> Result<&Block> {
        let b = self.block(id)?;
        if b.state == BlockState::Free {
            return Err(invalid(format!("block {id} is free")));
        }
        Ok(b)
    }

    // ---- LRU (intrusive doubly linked list over block ids) ----

    fn lru_push_tail(&mut self, id: BlockId) {
        let tail = self.lru_tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
        }
        if tail == NIL {
            self.lru_head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.lru_tail = id;
        self.lru_len += 1;
    }

    fn lru_unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        self.lru_len -= 1;
    }

    // ---- index helpers ----

    fn children_remove(&mut self, parent: &BlockKey, id: BlockId) {
        if let Some(v) = self.children.get_mut(parent) {
            if let Some(pos) = v.iter().position(|&c| c == id) {
                v.swap_remove(pos);
            }
            if v.is_empty() {
                self.children.remove(parent);
            }
        }
    }

    /// Strip a non-free, unreferenced block of its content and indexes (not of its list links).
    fn forget_content(&mut self, id: BlockId) {
        let (parent, key) = {
            let b = &self.blocks[id as usize];
            (b.parent, b.key)
        };
        if let Some(k) = key {
            if self.by_key.get(&k) == Some(&id) {
                self.by_key.remove(&k);
            }
        }
        self.children_remove(&parent, id);
        let b = &mut self.blocks[id as usize];
        b.key = None;
        b.tokens.clear();
    }

    fn move_to_free_list(&mut self, id: BlockId) {
        self.forget_content(id);
        self.blocks[id as usize].state = BlockState::Free;
        self.free.push(id);
    }

    // ---- allocation ----

    /// A fresh block (ref 1, no tokens) whose parent is `parent`: a free block first, else the
    /// LRU-head cached block is evicted (its key leaves the index). `OutOfBlocks` when neither.
    pub fn allocate(&mut self, parent: BlockKey) -> Result<BlockId> {
        self.allocate_inner(parent, None)
    }

    fn allocate_inner(&mut self, parent: BlockKey, pinned: Option<BlockId>) -> Result<BlockId> {
        let id = if let Some(id) = self.free.pop() {
            id
        } else {
            let mut victim = self.lru_head;
            if victim != NIL && Some(victim) == pinned {
                victim = self.blocks[victim as usize].next;
            }
            if victim == NIL {
                return Err(CoreError::OutOfBlocks(format!(
                    "all {} blocks are in use ({} used, {} cached)",
                    self.blocks.len(),
                    self.n_used,
                    self.lru_len
                )));
            }
            self.lru_unlink(victim);
            self.forget_content(victim);
            victim
        };
        {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_count == 0 && b.tokens.is_empty() && b.key.is_none());
            b.state = BlockState::Used;
            b.ref_count = 1;
            b.parent = parent;
        }
        self.children.entry(parent).or_default().push(id);
        self.n_used += 1;
        Ok(id)
    }

    fn inc_ref(&mut self, id: BlockId) {
        if self.blocks[id as usize].state == BlockState::Cached {
            self.lru_unlink(id);
            let b = &mut self.blocks[id as usize];
            b.state = BlockState::Used;
            self.n_used += 1;
            self.tokens_held += b.tokens.len();
        }
        let b = &mut self.blocks[id as usize];
        b.ref_count += 1;
        if b.ref_count == 2 {
            self.n_shared += 1;
        }
    }

    fn dec_ref(&mut self, id: BlockId) {
        let bs = self.block_size;
        let b = &mut self.blocks[id as usize];
        b.ref_count -= 1;
        match b.ref_count {
            1 => self.n_shared -= 1,
            0 => {
                self.n_used -= 1;
                self.tokens_held -= b.tokens.len();
                let keep = b.key.is_some() || (!b.tokens.is_empty() && b.tokens.len() < bs);
                if keep {
                    b.state = BlockState::Cached;
                    self.lru_push_tail(id);
                } else {
                    self.move_to_free_list(id);
                }
            }
            _ => {}
        }
    }

    /// ref+1 on each id (a block table taking a share). A cached block leaves the LRU and is used
    /// again. All ids are checked first: on error nothing changes.
    pub fn acquire(&mut self, ids: &[BlockId]) -> Result<()> {
        for &id in ids {
            self.live_block(id)?;
        }
        for &id in ids {
            self.inc_ref(id);
        }
        Ok(())
    }

    /// Drop one reference per entry of a sequence's block table, LAST entry first. A block that
    /// reaches ref 0 goes to the LRU tail if it has a key or is a non-empty partial block, else
    /// to the free list (empty blocks, and full blocks never registered or whose key another
    /// block holds: their content is unreachable or redundant). All ids are checked first (unknown
    /// id, free block, more releases than references): on error nothing changes.
    pub fn release(&mut self, ids: &[BlockId]) -> Result<()> {
        let mut counts: HashMap<BlockId, u32> = HashMap::with_capacity(ids.len());
        for &id in ids {
            let b = self.block(id)?;
            let c = counts.entry(id).or_insert(0);
            *c += 1;
            if *c > b.ref_count {
                return Err(invalid(format!(
                    "double free: block {id} released {c} times but has ref count {}",
                    b.ref_count
                )));
            }
        }
        for &id in ids.iter().rev() {
            self.dec_ref(id);
        }
        Ok(())
    }

    /// Record `tokens` whose KV the caller has written into block `id`. Errors if the block is
    /// not held (ref 0), shared (ref > 1) or would exceed `block_size` tokens.
    pub fn append_tokens(&mut self, id: BlockId, tokens: &[u32]) -> Result<()> {
        let bs = self.block_size;
        let b = self.block(id)?;
        match b.ref_count {
            0 => return Err(invalid(format!("block {id} is not held (ref count 0)"))),
            1 => {}
            r => {
                return Err(invalid(format!(
                    "block {id} is shared (ref count {r}): copy it first"
                )))
            }
        }
        if b.tokens.len() + tokens.len() > bs {
            return Err(invalid(format!(
                "block {id} overflow: {} + {} tokens > block size {bs}",
                b.tokens.len(),
                tokens.len()
            )));
        }
        self.blocks[id as usize].tokens.extend_from_slice(tokens);
        self.tokens_held += tokens.len();
        Ok(())
    }

    /// Mark full, held block `id` with its chain key. If another block already holds `key`, that
    /// block stays in the index and its id is returned (the caller may swap to it: `acquire` it,
    /// `release` its own); otherwise `id` is returned. Registering the same key twice is a no-op.
    pub fn register(&mut self, id: BlockId, key: BlockKey) -> Result<BlockId> {
        let bs = self.block_size;
        let b = self.block(id)?;
        if b.ref_count == 0 {
            return Err(invalid(format!("block {id} is not held (ref count 0)")));
        }
        if b.tokens.len() != bs {
            return Err(invalid(format!(
                "block {id} is not full ({} of {bs} tokens)",
                b.tokens.len()
            )));
        }
        match b.key {
            Some(k) if k == key => return Ok(id),
            Some(k) => return Err(invalid(format!("block {id} is already registered as {k}"))),
            None => {}
        }
        if let Some(&other) = self.by_key.get(&key) {
            return Ok(other);
        }
        self.blocks[id as usize].key = Some(key);
        self.by_key.insert(key, id);
        Ok(id)
    }

    /// The block holding `key`, if any (peek).
    pub fn lookup(&self, key: &BlockKey) -> Option<BlockId> {
        self.by_key.get(key).copied()
    }

    /// Longest prefix of `keys` whose blocks are present (used or cached): their ids and the
    /// number of tokens they hold. A peek: no ref count or LRU change.
    pub fn match_prefix(&self, keys: &[BlockKey]) -> (Vec<BlockId>, usize) {
        let mut ids = Vec::new();
        for k in keys {
            match self.by_key.get(k) {
                Some(&id) => ids.push(id),
                None => break,
            }
        }
        let n = ids.len() * self.block_size;
        (ids, n)
    }

    /// [`BlockPool::match_prefix`] and [`BlockPool::acquire`] of the matched blocks in one step
    /// (no other caller can evict them in between when the pool sits behind a lock).
    pub fn acquire_prefix(&mut self, keys: &[BlockKey]) -> (Vec<BlockId>, usize) {
        let (ids, n) = self.match_prefix(keys);
        for &id in &ids {
            self.inc_ref(id);
        }
        (ids, n)
    }

    /// Among blocks (full or partial, used or cached) whose parent is `parent`, the one sharing
    /// the longest common token prefix with `next_tokens`, and that length (>= 1); ties go to the
    /// lowest id. Compares token ids only: per-block `extra` is not checked (see docs/cache.md).
    /// The caller copies it with [`BlockPool::cow`] (or acquires it when it may write it).
    pub fn extend_match(&self, parent: BlockKey, next_tokens: &[u32]) -> Option<(BlockId, usize)> {
        if next_tokens.is_empty() {
            return None;
        }
        let mut best: Option<(BlockId, usize)> = None;
        for &id in self.children.get(&parent)? {
            let toks = &self.blocks[id as usize].tokens;
            let n = toks
                .iter()
                .zip(next_tokens)
                .take_while(|(a, b)| a == b)
                .count();
            if n == 0 {
                continue;
            }
            best = match best {
                Some((bid, bn)) if bn > n || (bn == n && bid < id) => Some((bid, bn)),
                _ => Some((id, n)),
            };
        }
        best
    }

    /// Copy-on-write: a fresh block (ref 1) with the same parent as `src` and the first
    /// `n_tokens` token ids of `src` recorded. The caller copies the KV payload. `src` is not
    /// changed and is never the block evicted to make room, so the result is always != `src`.
    pub fn cow(&mut self, src: BlockId, n_tokens: usize) -> Result<BlockId> {
        let b = self.live_block(src)?;
        if n_tokens > b.tokens.len() {
            return Err(invalid(format!(
                "cow of block {src}: {n_tokens} tokens requested, it holds {}",
                b.tokens.len()
            )));
        }
        let parent = b.parent;
        let toks = b.tokens[..n_tokens].to_vec();
        let id = self.allocate_inner(parent, Some(src))?;
        self.blocks[id as usize].tokens = toks;
        self.tokens_held += n_tokens;
        Ok(id)
    }

    /// Evict every cached block to the free list (e.g. to reach an idle state in tests).
    /// Returns how many were evicted.
    pub fn evict_all_cached(&mut self) -> usize {
        let mut n = 0;
        while self.lru_head != NIL {
            let id = self.lru_head;
            self.lru_unlink(id);
            self.move_to_free_list(id);
            n += 1;
        }
        n
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.blocks.len(),
            used: self.n_used,
            free: self.free.len(),
            cached: self.lru_len,
            shared: self.n_shared,
            tokens_held: self.tokens_held,
        }
    }

    pub fn ref_count(&self, id: BlockId) -> Result<u32> {
        Ok(self.block(id)?.ref_count)
    }

    pub fn tokens(&self, id: BlockId) -> Result<&[u32]> {
        Ok(&self.block(id)?.tokens)
    }

    pub fn key(&self, id: BlockId) -> Result<Option<BlockKey>> {
        Ok(self.block(id)?.key)
    }

    /// Parent key of a non-free block.
    pub fn parent(&self, id: BlockId) -> Result<BlockKey> {
        Ok(self.live_block(id)?.parent)
    }

    pub fn state(&self, id: BlockId) -> Result<BlockState> {
        Ok(self.block(id)?.state)
    }

    /// Cached blocks from LRU head (evicted next) to tail.
    pub fn lru_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.lru_len);
        let mut c = self.lru_head;
        while c != NIL {
            out.push(c);
            c = self.blocks[c as usize].next;
        }
        out
    }

    /// Recompute everything from scratch and compare with the incremental state.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let n = self.blocks.len();
        let bs = self.block_size;
        let mut on_free = vec![false; n];
        for &id in &self.free {
            let i = id as usize;
            if i >= n {
                return Err(format!("free list holds unknown id {id}"));
            }
            if on_free[i] {
                return Err(format!("block {id} twice on the free list"));
            }
            on_free[i] = true;
        }
        let mut on_lru = vec![false; n];
        let mut c = self.lru_head;
        let mut prev = NIL;
        let mut lru_count = 0;
        while c != NIL {
            let i = c as usize;
            if i >= n || on_lru[i] {
                return Err(format!("LRU list broken at {c}"));
            }
            if self.blocks[i].prev != prev {
                return Err(format!("LRU prev link of {c} is wrong"));
            }
            on_lru[i] = true;
            lru_count += 1;
            prev = c;
            c = self.blocks[i].next;
        }
        if prev != self.lru_tail || lru_count != self.lru_len {
            return Err("LRU tail/length mismatch".into());
        }
        let (mut used, mut shared, mut tokens) = (0, 0, 0);
        for (i, b) in self.blocks.iter().enumerate() {
            let id = i as BlockId;
            if b.tokens.len() > bs {
                return Err(format!("block {id} holds {} > {bs} tokens", b.tokens.len()));
            }
            match b.state {
                BlockState::Free => {
                    if !on_free[i] || b.ref_count != 0 || b.key.is_some() || !b.tokens.is_empty() {
                        return Err(format!("free block {id} is inconsistent"));
                    }
                }
                BlockState::Used => {
                    if b.ref_count == 0 || on_free[i] || on_lru[i] {
                        return Err(format!("used block {id} is inconsistent"));
                    }
                    used += 1;
                    tokens += b.tokens.len();
                    if b.ref_count > 1 {
                        shared += 1;
                    }
                }
                BlockState::Cached => {
                    let content = b.key.is_some() || (!b.tokens.is_empty() && b.tokens.len() < bs);
                    if b.ref_count != 0 || !on_lru[i] || on_free[i] || !content {
                        return Err(format!("cached block {id} is inconsistent"));
                    }
                }
            }
            if b.state != BlockState::Free {
                let count = self
                    .children
                    .get(&b.parent)
                    .map_or(0, |v| v.iter().filter(|&&c| c == id).count());
                if count != 1 {
                    return Err(format!(
                        "block {id} appears {count} times in its parent's children"
                    ));
                }
            }
            if let Some(k) = b.key {
                if b.tokens.len() != bs {
                    return Err(format!("registered block {id} is not full"));
                }
                if self.by_key.get(&k) != Some(&id) {
                    return Err(format!("block {id}'s key is not indexed to it"));
                }
            }
        }
        for (k, &id) in &self.by_key {
            if self.blocks.get(id as usize).and_then(|b| b.key) != Some(*k) {
                return Err(format!("key index entry {k} -> {id} is stale"));
            }
        }
        let n_children: usize = self.children.values().map(|v| v.len()).sum();
        if n_children != n - self.free.len() {
            return Err("children index holds free or unknown blocks".into());
        }
        if self.children.values().any(|v| v.is_empty()) {
            return Err("empty children list kept".into());
        }
        if used != self.n_used || shared != self.n_shared || tokens != self.tokens_held {
            return Err(format!(
                "counters: used {used}/{} shared {shared}/{} tokens {tokens}/{}",
                self.n_used, self.n_shared, self.tokens_held
            ));
        }
        if used + self.free.len() + self.lru_len != n {
            return Err("used + free + cached != total".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{chain_key, root_key};

    fn root() -> BlockKey {
        root_key(b"m", "f16", 4, None)
    }

    #[test]
    fn alloc_fill_register_release_and_match() {
        let mut p = BlockPool::new(4, 4).unwrap();
        let r = root();
        let a = p.allocate(r).unwrap();
        p.append_tokens(a, &[1, 2, 3, 4]).unwrap();
        let ka = chain_key(&r, &[1, 2, 3, 4], b"");
        assert_eq!(p.register(a, ka).unwrap(), a);
        let b = p.allocate(ka).unwrap();
        p.append_tokens(b, &[5, 6]).unwrap();
        assert_eq!(p.stats().tokens_held, 6);
        assert_eq!(p.match_prefix(&[ka, r]), (vec![a], 4));
        p.release(&[a, b]).unwrap();
        // last block first
        assert_eq!(p.lru_order(), vec![b, a]);
        assert_eq!(p.stats().cached, 2);
        assert_eq!(p.extend_match(ka, &[5, 7]), Some((b, 1)));
        assert_eq!(p.extend_match(ka, &[9]), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn misuse_is_rejected() {
        let mut p = BlockPool::new(2, 4).unwrap();
        let r = root();
        assert!(matches!(
            p.acquire(&[7]),
            Err(CoreError::InvalidArgument(_))
        ));
        assert!(matches!(
            p.acquire(&[0]),
            Err(CoreError::InvalidArgument(_))
        ));
        let a = p.allocate(r).unwrap();
        assert!(p.append_tokens(a, &[1, 2, 3, 4, 5]).is_err());
        assert!(p.register(a, r).is_err(), "not full");
        p.acquire(&[a]).unwrap();
        assert!(p.append_tokens(a, &[1]).is_err(), "shared");
        assert!(p.release(&[a, a, a]).is_err(), "double free");
        assert_eq!(p.ref_count(a).unwrap(), 2, "failed release changed nothing");
        p.release(&[a, a]).unwrap();
        assert!(p.release(&[a]).is_err());
        let _ = p.allocate(r).unwrap();
        let _ = p.allocate(r).unwrap();
        assert!(matches!(p.allocate(r), Err(CoreError::OutOfBlocks(_))));
        p.check_invariants().unwrap();
    }
}
