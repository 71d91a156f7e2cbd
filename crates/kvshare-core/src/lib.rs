//! kvshare-core: the cache bookkeeping behind kvshare, with no Python in it.
//!
//! Python owns the KV arrays; this crate owns which block holds which tokens, who shares it,
//! what may be evicted, how many bytes are really held, and what is safely on disk.
//!
//! Modules (one concept each):
//! - [`hash`]: blake3 chain keys for full blocks and for arbitrary prefix positions.
//! - [`pool`]: the fixed-size block pool (ref counts, lookup by key, LRU of cached blocks, CoW).
//! - [`checkpoint`]: immutable `Arc`-shared recurrent-state snapshots and their store.
//! - [`ram_tier`]: content-addressed host-memory tier under a byte budget.
//! - [`disk`]: crash-safe on-disk store with a background writer.
//! - [`remote`]: the checksummed value format of the shared (Redis) tier.

pub mod checkpoint;
pub mod disk;
pub mod error;
pub mod hash;
pub mod pool;
pub mod ram_tier;
pub mod remote;

pub use error::{CoreError, Result};
