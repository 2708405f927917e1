//! The paged KV cache's bookkeeping: which pages each sequence holds, how many holders each
//! page has, and which full pages hold which prompt prefix, so that a sequence starting with the
//! same tokens shares them instead of recomputing (prefix caching).
//!
//! A page is `page_size` positions of every layer's keys and values (the device memory lives in
//! [`super::Llama`], which hands its pool to the engine at load: the engine gives sequences their
//! pages, and the model reads each sequence's pages, its block table, from its [`KvCache`]). A full page's contents are a function of the tokens up to its end, so it is
//! indexed by a hash chained over those tokens; an indexed page is never written again while
//! indexed. Pages nobody holds stay indexed (and reusable) until their memory is needed.
//!
//! Where every layer attends through a sliding window, the pages a sequence's window has passed
//! are given back as it grows (`after_step`): the cache a long sequence holds stays one window.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// The KV cache of one sequence: its pages in position order and the tokens they hold.
#[derive(Debug, Default)]
pub struct KvCache {
    pub(crate) pages: Vec<u32>,
    tokens: Vec<u32>,
    /// Chained hash of each full page, in order.
    hashes: Vec<u64>,
    capacity: usize,
    /// The leading pages given back because no later token sees them (every layer's window has
    /// passed them). Their ids stay in `pages`, so positions keep their rows; nothing reads them.
    released: usize,
}

impl KvCache {
    pub(crate) fn new(capacity: usize) -> KvCache {
        KvCache {
            capacity,
            ..KvCache::default()
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// The most tokens this sequence may hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// The tokens whose keys and values are held, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub(crate) fn push_tokens(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }
}

/// What the pool holds, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageUsage {
    pub total: usize,
    /// Held by at least one sequence.
    pub used: usize,
    /// Held by none but still indexed for prefix reuse (evicted when needed).
    pub cached: usize,
}

impl PageUsage {
    pub fn free(&self) -> usize {
        self.total - self.used
    }
}

/// No page is left for a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the KV cache is full: {needed} more pages needed, {available} available")]
pub struct OutOfPages {
    pub needed: usize,
    pub available: usize,
}

#[derive(Debug)]
struct Indexed {
    hash: u64,
    /// The page's tokens, compared on lookup so a hash collision cannot share wrong contents.
    tokens: Box<[u32]>,
}

#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    /// Every layer's sliding window, where all of them slide: pages behind it are given back.
    window: Option<usize>,
    holders: Vec<u32>,
    index_entry: Vec<Option<Indexed>>,
    /// Unheld, unindexed pages.
    free: Vec<u32>,
    /// Unheld indexed pages by when they were released, oldest first: eviction order.
    cached: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    clock: u64,
    index: HashMap<u64, u32>,
}

impl PagePool {
    pub fn new(n_pages: usize, page_size: usize) -> PagePool {
        PagePool {
            page_size,
            window: None,
            holders: vec![0; n_pages],
            index_entry: (0..n_pages).map(|_| None).collect(),
            free: (0..n_pages as u32).rev().collect(),
            cached: BTreeMap::new(),
            released_at: vec![0; n_pages],
            clock: 0,
            index: HashMap::new(),
        }
    }

    /// The pool of a model whose every layer attends only to the last `window` positions.
    pub fn with_window(self, window: Option<usize>) -> PagePool {
        PagePool { window, ..self }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn usage(&self) -> PageUsage {
        PageUsage {
            total: self.holders.len(),
            used: self.holders.len() - self.free.len() - self.cached.len(),
            cached: self.cached.len(),
        }
    }

    /// Pages that could be handed out now (free or evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    /// Pages a sequence of `len` tokens needs.
    pub fn pages_for(&self, len: usize) -> usize {
        len.div_ceil(self.page_size)
    }

    /// Pages `kv` would still need to hold `len` tokens.
    pub fn pages_needed(&self, kv: &KvCache, len: usize) -> usize {
        self.pages_for(len).saturating_sub(kv.pages.len())
    }

    /// Tokens `kv` could grow by now: the rest of its pages and every page still available.
    pub fn room(&self, kv: &KvCache) -> usize {
        let room = (kv.pages.len() + self.available()) * self.page_size;
        room.min(kv.capacity()).saturating_sub(kv.len())
    }

    /// Gives `kv` its pages for `more` tokens after those it holds (all or nothing), so that a
    /// step of them cannot run out; none where they would pass its capacity (the model refuses
    /// that step, naming the context).
    pub fn reserve(&mut self, kv: &mut KvCache, more: usize) -> Result<(), OutOfPages> {
        match kv.len() + more {
            len if len > kv.capacity() => Ok(()),
            len => self.grow(kv, len),
        }
    }

    /// Gives `kv` pages for `len` tokens in all (all or nothing).
    pub fn grow(&mut self, kv: &mut KvCache, len: usize) -> Result<(), OutOfPages> {
        let needed = self.pages_for(len).saturating_sub(kv.pages.len());
        if needed > self.available() {
            return Err(OutOfPages {
                needed,
                available: self.available(),
            });
        }
        for _ in 0..needed {
            // available() counted every free and cached page, so this cannot run dry.
            let Some(page) = self.free.pop().or_else(|| self.evict_oldest()) else {
                return Err(OutOfPages { needed, available: 0 });
            };
            self.holders[page as usize] = 1;
            kv.pages.push(page);
        }
        Ok(())
    }

    fn evict_oldest(&mut self) -> Option<u32> {
        let (_, page) = self.cached.pop_first()?;
        if let Some(entry) = self.index_entry[page as usize].take() {
            self.index.remove(&entry.hash);
        }
        Some(page)
    }

    /// Makes `kv` (empty) hold the longest run of indexed full pages that begins `tokens`, never
    /// all of `tokens` (the last one must still run to give logits). Returns the tokens reused.
    pub fn share_prefix(&mut self, kv: &mut KvCache, tokens: &[u32]) -> usize {
        assert!(kv.is_empty(), "prefix sharing starts an empty sequence");
        let limit = tokens.len().saturating_sub(1).min(kv.capacity);
        let mut parent = 0;
        for chunk in tokens[..limit].chunks_exact(self.page_size) {
            let hash = chain_hash(parent, chunk);
            let Some(&page) = self.index.get(&hash) else { break };
            if self.index_entry[page as usize]
                .as_ref()
                .is_none_or(|e| *e.tokens != *chunk)
            {
                break;
            }
            if self.holders[page as usize] == 0 {
                self.cached.remove(&self.released_at[page as usize]);
            }
            self.holders[page as usize] += 1;
            kv.pages.push(page);
            kv.hashes.push(hash);
            kv.tokens.extend_from_slice(chunk);
            parent = hash;
        }
        kv.len()
    }

    /// After a step of `kv`: indexes its pages that have filled up since the last call, and gives
    /// back those every layer's window has passed (no later token reads them).
    pub fn after_step(&mut self, kv: &mut KvCache) {
        self.index_full_pages(kv);
        if let Some(window) = self.window {
            let first_visible = (kv.len() + 1).saturating_sub(window);
            let behind = (first_visible / self.page_size).min(kv.pages.len());
            while kv.released < behind {
                self.release(kv.pages[kv.released]);
                kv.released += 1;
            }
        }
    }

    /// Indexes the pages of `kv` that have filled up since the last call.
    fn index_full_pages(&mut self, kv: &mut KvCache) {
        let full = kv.len() / self.page_size;
        while kv.hashes.len() < full {
            let i = kv.hashes.len();
            let chunk = &kv.tokens[i * self.page_size..(i + 1) * self.page_size];
            let hash = chain_hash(kv.hashes.last().copied().unwrap_or(0), chunk);
            let page = kv.pages[i];
            // An identical page may already be indexed (computed by another sequence): keep that one.
            if !self.index.contains_key(&hash) && self.index_entry[page as usize].is_none() {
                self.index.insert(hash, page);
                self.index_entry[page as usize] = Some(Indexed {
                    hash,
                    tokens: chunk.into(),
                });
            }
            kv.hashes.push(hash);
        }
    }

    /// Shortens `kv` to at most `len` tokens and returns the length kept: less than `len` when
    /// the page `len` falls in is shared with another sequence (it cannot be written again, so
    /// it is given up and its tokens must be recomputed).
    /// Positions in pages given back behind a window are gone: a cut among them keeps nothing.
    pub fn truncate(&mut self, kv: &mut KvCache, len: usize) -> usize {
        let mut len = len.min(kv.len());
        if len > 0 && len / self.page_size < kv.released {
            len = 0;
        }
        let boundary = len / self.page_size;
        if !len.is_multiple_of(self.page_size) {
            let page = kv.pages[boundary] as usize;
            if self.holders[page] > 1 {
                len = boundary * self.page_size;
            } else if let Some(entry) = self.index_entry[page].take() {
                // Its later positions will be overwritten: it no longer holds that prefix.
                self.index.remove(&entry.hash);
            }
        }
        let keep = self.pages_for(len);
        for (i, page) in kv.pages.drain(keep..).enumerate().collect::<Vec<_>>() {
            if keep + i >= kv.released {
                self.release(page);
            }
        }
        kv.released = kv.released.min(keep);
        kv.tokens.truncate(len);
        kv.hashes.truncate(len / self.page_size);
        len
    }

    /// Releases every page of `kv`.
    pub fn free(&mut self, kv: &mut KvCache) {
        self.truncate(kv, 0);
    }

    fn release(&mut self, page: u32) {
        let holders = &mut self.holders[page as usize];
        *holders -= 1;
        if *holders == 0 {
            if self.index_entry[page as usize].is_some() {
                self.clock += 1;
                self.released_at[page as usize] = self.clock;
                self.cached.insert(self.clock, page);
            } else {
                self.free.push(page);
            }
        }
    }
}

fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(pool: &mut PagePool, tokens: &[u32]) -> KvCache {
        let mut kv = KvCache::new(1000);
        pool.grow(&mut kv, tokens.len()).unwrap();
        kv.push_tokens(tokens);
        pool.after_step(&mut kv);
        kv
    }

    #[test]
    fn pages_are_handed_out_and_returned() {
        let mut pool = PagePool::new(4, 4);
        let mut a = filled(&mut pool, &[1, 2, 3, 4, 5]);
        assert_eq!(a.pages.len(), 2);
        assert_eq!(pool.usage().used, 2);
        let mut b = KvCache::new(1000);
        assert_eq!(
            pool.grow(&mut b, 12),
            Err(OutOfPages {
                needed: 3,
                available: 2
            })
        );
        assert!(b.pages.is_empty(), "all or nothing");
        pool.free(&mut a);
        // The full page stays indexed (cached); the partial one is free.
        assert_eq!(
            pool.usage(),
            PageUsage {
                total: 4,
                used: 0,
                cached: 1
            }
        );
        pool.grow(&mut b, 16).unwrap();
        assert_eq!(pool.usage().cached, 0, "cached pages are evicted when memory is needed");
    }

    #[test]
    fn a_repeated_prefix_shares_full_pages_but_never_the_last_token() {
        let mut pool = PagePool::new(8, 4);
        let prompt: Vec<u32> = (0..10).collect();
        let mut a = filled(&mut pool, &prompt);
        let mut b = KvCache::new(1000);
        assert_eq!(pool.share_prefix(&mut b, &prompt), 8);
        assert_eq!(b.pages, a.pages[..2]);
        assert_eq!(pool.usage().used, 3);
        // Exactly two pages long: only the first page is shared, the last token must run.
        let mut c = KvCache::new(1000);
        assert_eq!(pool.share_prefix(&mut c, &prompt[..8]), 4);
        // A different first page shares nothing, even if the second page's tokens match.
        let mut d = KvCache::new(1000);
        let other: Vec<u32> = [9, 9, 9, 9].into_iter().chain(4..10).collect();
        assert_eq!(pool.share_prefix(&mut d, &other), 0);
        // Released pages stay reusable after their holders are gone.
        for kv in [&mut a, &mut b, &mut c, &mut d] {
            pool.free(kv);
        }
        assert_eq!(pool.usage().used, 0);
        let mut e = KvCache::new(1000);
        assert_eq!(pool.share_prefix(&mut e, &prompt), 8);
        assert_eq!(pool.usage().cached, 0);
    }

    #[test]
    fn truncating_into_a_shared_page_gives_it_up() {
        let mut pool = PagePool::new(8, 4);
        let prompt: Vec<u32> = (0..9).collect();
        let mut a = filled(&mut pool, &prompt);
        let mut b = KvCache::new(1000);
        assert_eq!(pool.share_prefix(&mut b, &prompt), 8);
        assert_eq!(pool.truncate(&mut b, 6), 4, "page 1 is shared with a");
        assert_eq!(b.pages, a.pages[..1]);
        // a alone holds page 1 now: truncating into it keeps it but drops it from the index.
        assert_eq!(pool.truncate(&mut a, 6), 6);
        let mut c = KvCache::new(1000);
        assert_eq!(pool.share_prefix(&mut c, &prompt), 4);
    }

    #[test]
    fn pages_behind_every_window_are_given_back_and_never_kept_by_a_cut() {
        let mut pool = PagePool::new(8, 4).with_window(Some(6));
        let mut kv = KvCache::new(1000);
        for t in 0..12u32 {
            pool.grow(&mut kv, t as usize + 1).unwrap();
            kv.push_tokens(&[t]);
            pool.after_step(&mut kv);
        }
        // The next token (position 12) sees positions 7..=12: page 0 (0..4) is behind it, page 1
        // (4..8) is not.
        assert_eq!((kv.released, kv.pages.len()), (1, 3));
        assert_eq!(pool.usage().used, 2);
        // A cut inside the kept pages keeps them; one among the given-back positions keeps nothing.
        assert_eq!(pool.truncate(&mut kv, 10), 10);
        assert_eq!(pool.truncate(&mut kv, 2), 0);
        assert_eq!((kv.released, kv.pages.len(), pool.usage().used), (0, 0, 0));
    }
}
